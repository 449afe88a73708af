"""The simulator and the mock engine: the real index, codec and policies on a virtual clock.

``cache-router replay`` is *trace replay* (a recorded request trace through the
simulator, per policy), not the gap-fill protocol nor an engine's replay socket.

    simulator, batch_engine, cache, request   discrete-event replay of a trace
    hybrid, pd                                a hybrid model's extra groups; PD pools
    trace_replay, report                      ``cache-router replay``; per-policy numbers
    forecast, tune                            ``cache-router forecast`` / ``tune``
    traces, synth, gen_trace                  trace formats; synthetic traces
    workload                                  a multi-turn chat workload over any OpenAI endpoint
    demo                                      ``cache-router demo``: the whole stack on one machine
    mock/                                     the mock engine (``cache-router mock-engine``) and
                                              the embedded nats-server demos and tests run on
"""
