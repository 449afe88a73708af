"""One routed request to its engine and back.

``proxy`` (the hot path's handler), ``relay`` (what the proxy offers PD and passthrough:
the failure table, the client exchange, the dependencies, the relay protocol),
``passthrough`` (load-routed endpoints), ``upstream`` (the keep-alive engine client),
``hints`` (prefetch hints sent before the request).
"""
