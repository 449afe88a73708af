"""The simulator and the mock engine: the real index, codec and policies on a virtual clock.

``cache-router replay`` is *trace replay* (a recorded request trace through the
simulator, per policy), not the gap-fill protocol nor an engine's replay socket.

    simulator, batch_engine, cache, request   discrete-event replay of a trace
    trace_replay, report                      ``cache-router replay``; per-policy numbers
    traces, synth, gen_trace                  trace formats; synthetic traces
    workload                                  a multi-turn chat workload over any OpenAI endpoint
    mock_engine                               ``cache-router mock-engine``: one vLLM-like server
    mock_openai, mock_responses, mock_pooling its HTTP API, shaped like vLLM's
    mock_scheduler, mock_text, mock_publisher its scheduler, text, and ZMQ KV events
"""
