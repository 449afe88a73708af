"""The mock stack: a vLLM-like engine, and the embedded nats-server demos and tests run on.

``engine`` (``cache-router mock-engine``), its ``scheduler`` and ``publisher`` (KV events),
the API shapes (``openai_api``, ``messages``, ``responses``, ``pooling``), ``pd`` (its side
of disaggregation), ``text`` (prompt tokens, generated text), ``natsd`` (nats-server).
"""
