"""The node agent beside one engine: its ZMQ KV events -> NATS, prefetch hints -> the engine.

    main          ``cache-router agent``
    node          the I/O shell: engine ZMQ -> ``AgentCore`` -> NATS, and back
    core          the synchronous core: seq order, epochs, answers to gap fill
    engine_zmq    the engine's ZMQ wire, including its *engine replay* socket
    ring, mirror  recent batches as sent; what the engine's cache holds
    prefetch      hints from NATS to the engine without blocking the reader
    load          engine load from ``/metrics`` for ``<prefix>.load.<worker>``
"""
