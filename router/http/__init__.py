"""The HTTP face: the ASGI app and its lifecycle, ``cache-router serve`` and its processes.

``app`` (state, lifecycle, routes), ``serve`` / ``processes`` (uvicorn, N processes on one
port), ``guard`` (connection limits), ``edge`` / ``auth`` / ``fields`` (what a request must
pass), ``errors`` (the OpenAI error shape and its closed set of codes), ``openapi``,
``coalesce`` (one write per loop iteration), ``asgi`` (the ASGI types).
"""
