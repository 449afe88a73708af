"""The decision for one request: parse -> tokens -> hashes -> match -> policy.

``decide`` (the ``Router``), ``session_key``, ``affinity`` (Responses-API ids), the API
shapes (``responses``, ``messages``), ``gateway`` (cluster routers as workers).
"""
