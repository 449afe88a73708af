"""The router process: an OpenAI-compatible proxy that routes on the prefix index.

Request path: ``guard`` (connections) -> ``edge`` (headers, keys) -> ``proxy`` (the hot
path) -> ``routing`` (parse -> ``tokenize`` -> hashes -> match -> policy) -> ``upstream``
(engine connections). Event path: ``bus`` (NATS) -> ``feed`` / ``stream_reader``
(JetStream) -> ``events`` (gap fill over ``kv.replay``, load reports) -> ``index``.

    app, serve, cli     the ASGI app and its lifecycle; ``cache-router serve``; the CLI
    config              every setting: TOML < env < flags, typed and validated
    proxy, upstream     the hot path and its keep-alive engine client
    routing, gateway    the decision for one request; the same over cluster routers
    tokenize            request body -> the token ids the engine will see
    pools, workers      workers sharing a block size; the registry, health, draining
    load                per-worker in-flight load and engine reports
    edge, guard, auth   what a request must pass; connection limits; bearer tokens
    errors, asgi        the OpenAI error shape and the closed set of codes; ASGI types
    bus, events, feed   NATS; KV events and gap fill; where events come from
    jetstream, stream_reader   the event stream and its ordered reader
    hints, replicas     prefetch hints; load and marks shared between replicas
    discovery           engines found by DNS
    admin, metrics, openapi, tracing, capacity, ratelog   operating it
    natsd, demo         an embedded nats-server; ``cache-router demo``
"""
