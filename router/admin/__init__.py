"""The admin API under ``/admin/``, behind its bearer token: one module per path.

``api`` (the router that mounts them), ``common`` (what they share: dependencies, body
limits, the bearer check), ``workers``, ``index``, ``explain``, ``tokenize``, ``capacity``,
``experiments``.
"""
