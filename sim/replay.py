"""Old path of ``sim.trace_replay`` (``cache-router replay``), kept for code that imports it."""

from sim.trace_replay import add_arguments, engine_costs, plot, replay_trace, run

__all__ = ["add_arguments", "engine_costs", "plot", "replay_trace", "run"]
