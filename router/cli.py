"""``cache-router`` command line: one subcommand per module, imported only when used.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``, so
``cache-router replay`` never pays for importing the HTTP stack and vice versa.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.util
import logging
import signal
import sys
from collections.abc import AsyncIterator

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("router.http.serve", "run the router (OpenAI-compatible proxy)"),
    "replay": ("sim.trace_replay", "replay a request trace through the simulator, per policy"),
    "gen-trace": ("sim.gen_trace", "write a seeded agent-shaped trace (chat, agent loops)"),
    "forecast": ("sim.forecast", "how much cache each tier needs: hit rate vs size on a trace"),
    "tune": ("sim.tune", "search cache_aware's parameters and the host tier size on a trace"),
    "mock-engine": ("sim.mock.engine", "run a mock vLLM-like engine"),
    "agent": ("agent.main", "run the node agent: engine ZMQ events -> NATS"),
    "doctor": (
        "router.observe.doctor",
        "check a running deployment: events, block size, tokenizer, hits",
    ),
    "demo": ("sim.demo", "run the whole stack on an embedded default and compare policies"),
    "streams": ("router.events.jetstream", "create the KV event stream or change its limits"),
}

# Command -> (the extra that installs what it needs, modules it needs beyond the core).
# A verb whose module imports one of these at load says so instead of a traceback, even
# for --help (tests/test_cli.py runs every verb's --help without the extras).
EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "demo": ("demo", ("openai",)),
    "replay": ("sim", ("numpy",)),
    "gen-trace": ("sim", ("numpy",)),
    "forecast": ("sim", ("numpy",)),
    "tune": ("sim", ("numpy",)),
}


def serve_until_signalled(
    service: contextlib.AbstractAsyncContextManager[object], level: str
) -> None:
    """Run ``service`` (an async context manager) until SIGINT or SIGTERM, then exit it."""
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise

    async def main() -> None:
        async with service, signalled() as stop:
            await stop.wait()

    asyncio.run(main())


@contextlib.asynccontextmanager
async def signalled() -> AsyncIterator[asyncio.Event]:
    """An event set by SIGINT or SIGTERM while the block runs."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        yield stop
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _usage() -> str:
    lines = ["usage: cache-router COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "cache-router COMMAND --help shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"cache-router: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    extra, needs = EXTRAS.get(name, ("", ()))
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"cache-router {name} needs {', '.join(missing)}: "
            f"pip install 'cache-router[{extra}]'",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"cache-router {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(rest)) or 0)


if __name__ == "__main__":
    sys.exit(main())
