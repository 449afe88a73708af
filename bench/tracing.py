"""What tracing costs the request path: off, on without export, on exporting OTLP/HTTP.

The canned engine and the keep-alive client of ``bench/proxy.py`` drive ``cache-router
serve`` in turn as: ``off`` (the default), ``on_unexported`` (``--tracing``,
``OTEL_TRACES_EXPORTER=none``: every span made, none sent), ``on_otlp`` (``--tracing``,
spans batched to an OTLP/HTTP endpoint, the canned server answering 200),
``on_otlp_sampled_1pct`` (the same with ``parentbased_traceidratio`` at 0.01) and, with
``--baseline-rev REV``, ``baseline``: the router as of that git revision (extracted with
``git archive``), to show that ``off`` costs nothing against code with no tracing hooks.
Latency at concurrency 1, then throughput and router CPU per request; each round runs
every target, starting with a different one, and medians are reported.

    python bench/tracing.py [--requests 4000] [--rounds 3] [--baseline-rev REV]

Prints one JSON object; never asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proxy import ROOT, measure, median_of, process, wait_http  # puts ROOT on sys.path

from sim.mock.natsd import free_port


@contextlib.contextmanager
def checkout(rev: str | None) -> Iterator[Path | None]:
    """The tree at ``rev`` in a temporary directory (None: no baseline)."""
    if rev is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="cr-baseline-") as tmp:
        archive = subprocess.run(
            ["git", "archive", rev], cwd=ROOT, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        yield Path(tmp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=4000, help="throughput phase requests")
    ap.add_argument("--latency-requests", type=int, default=1500)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--policy", default="cache_aware")
    ap.add_argument("--baseline-rev", help="git revision to compare 'off' with (no tracing)")
    args = ap.parse_args()

    engine_port = free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    serve = [
        sys.executable, "-m", "router.cli", "serve", "--port", "{port}",
        "--worker", f"w0={engine_url}", "--policy", args.policy, "--log-level", "error",
    ]  # fmt: skip
    otlp = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{engine_url}/v1/traces"}
    sampled = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"}
    with checkout(args.baseline_rev) as base:
        targets: dict[str, tuple[list[str], Path, dict[str, str]]] = {
            "off": (serve, ROOT, {}),
            "on_unexported": ([*serve, "--tracing"], ROOT, {"OTEL_TRACES_EXPORTER": "none"}),
            "on_otlp": ([*serve, "--tracing"], ROOT, otlp),
            "on_otlp_sampled_1pct": ([*serve, "--tracing"], ROOT, {**otlp, **sampled}),
        }
        if base is not None:
            targets = {"baseline": (serve, base, {}), **targets}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
        engine = [sys.executable, str(ROOT / "bench" / "proxy.py"), "--engine", str(engine_port)]
        with process(engine):
            wait_http(engine_port, "/health")
            names = list(targets)
            for r in range(args.rounds):
                # each round starts with another target: no target always runs first
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    cmd, cwd, env = targets[name]
                    port = free_port()
                    with process([a.format(port=port) for a in cmd], cwd, env) as proc:
                        wait_http(port, "/health")
                        time.sleep(0.5)
                        runs[name].append(measure(port, proc.pid, args))
    result: dict[str, object] = {
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "baseline_rev": args.baseline_rev,
        "cpu_count": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
    }
    meds = {name: median_of(r) for name, r in runs.items()}
    result.update(meds)
    off = meds["off"]
    result["ratios_over_off"] = {
        name: {
            key: meds[name][key] / off[key]
            for key in ("cpu_us_per_request", "requests_per_s", "p50_ms", "p99_ms")
            if off.get(key)
        }
        for name in meds
        if name != "off"
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
