"""Admission at the router: hold requests while the engines are full, in priority and
fair-share order, bind each to a worker when one has room, shed at once with a clear
answer what cannot be served in time (issue 31).

``core`` is plain and synchronous on an injected clock, shared by the router and the
simulator; ``fair`` holds the token counters and rate limits, ``capacity`` the engines'
learnt limits, ``stats`` the per-tenant, per-priority counts, ``gate`` the part on the
router's event loop (a request's tenant, priority, wait and answer).
"""
