"""The router process: an OpenAI-compatible proxy that routes on the prefix index.

Request path: ``http`` (guard, edge checks, the app) -> ``forward`` (the proxy) ->
``routing`` (parse -> ``tokens`` -> hashes -> match -> policy) -> ``forward.upstream``
(engine connections), or ``pd`` for a disaggregated pool. Event path: ``events`` (NATS,
JetStream, the native reader, gap fill, ingest) -> ``index``.

    http       the ASGI app and its lifecycle, ``cache-router serve``, guards, errors
    admin      the admin API under ``/admin/``
    forward    one routed request to its engine and back (proxy, relay, upstream, hints)
    pd         prefill/decode disaggregation on the wire
    routing    the decision for one request; session keys; the API shapes
    tokens     request body -> token ids: the tokenizer, its pool, the prefix cache, media
    workers    the registry, health, load, DP ranks, LoRA, pools, discovery
    events     NATS, JetStream, the native reader, gap fill, the ingest thread, replicas
    observe    metrics, tracing, the hit audit, the capacity forecast, doctor, rate logs
    config     every setting: declared once, TOML < env < flags, checked
    cli        ``cache-router``: one verb per module, imported only when used

Imports point one way (tests/test_import_rules.py): nothing here imports ``sim``.
"""
