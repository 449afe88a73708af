"""What the router hears over NATS: KV events, gap fill, load reports, replicas.

``bus`` (the connection), ``jetstream`` / ``stream_reader`` (the event stream and its
ordered reader), ``feed`` (where events come from), ``native_reader`` (the compiled core's
own subscriber), ``consumer`` (``EventSync``: sequence, gap fill, load reports),
``ingest_thread`` (batches applied off the event loop), ``replicas`` (shared load and marks).
"""
