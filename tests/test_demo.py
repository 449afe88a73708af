"""The one-command demo, end to end: real nats-server, mock engines, agents, router."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import psutil
import pytest

# slow: their own CI step (`pytest -m slow`), kept out of the main suite's ~10 minutes
pytestmark = pytest.mark.slow


def test_demo_compares_policies_and_reports_what_the_engines_cached() -> None:
    """The demo works end to end for both policies. Which one wins is timing on a live
    stack under CI load: that claim is proved in the seeded simulator instead
    (tests/test_demo_claim.py, the same workload shape)."""
    flags = [
        "--json",
        "--engines",
        "3",
        "--sessions",
        "6",
        "--turns",
        "4",
        "--concurrency",
        "3",
        "--speed",
        "4",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "demo", *flags],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    report = json.loads(out.stdout)
    by_policy = {r["policy"]: r for r in report["results"]}
    assert set(by_policy) == {"round_robin", "cache_aware"}
    for r in by_policy.values():
        assert r["requests"] == 6 * 4 and r["errors"] == 0
        assert r["ttft_p50_ms"] > 0
        # the router's capacity forecast of the same traffic
        f = r["forecast"]
        assert f["pool_blocks"] > 0 and 0 < f["ceiling_hit_rate"] <= 1
        assert 0 <= f["predicted_routed_hit_rate"] <= f["ceiling_hit_rate"] + 1e-9
        # every session opens with the same system prompt: whichever engine a turn lands
        # on has served it before, so the engines must report cached tokens under any
        # policy, and never more than the prompts held
        assert 0 < r["hit_rate"] <= 1, r
        assert 1 / 3 <= r["max_worker_share"] <= 1, r  # 24 turns over 3 engines


def test_demo_serve_prints_its_parts_and_leaves_nothing_running(tmp_path: Path) -> None:
    stderr = (tmp_path / "stderr").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "demo", "--serve", "--engines", "2"],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    try:
        assert proc.stdout is not None
        raw = [proc.stdout.readline() for _ in range(4)]
        assert all(raw), f"demo --serve stopped early: {(tmp_path / 'stderr').read_text()}"
        lines = [json.loads(line) for line in raw]
        assert "router" in lines[0]
        assert [line["engine"] for line in lines[1:3]] == ["engine-0", "engine-1"]
        assert lines[3] == {"ready": True}
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 5  # nats-server, 2 engines, 2 agents, router
        client = openai.OpenAI(base_url=lines[0]["router"] + "/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model="mock-model", messages=[{"role": "user", "content": "hello"}], max_tokens=4
        )
        assert reply.choices[0].message.content
        for engine in lines[1:3]:
            assert httpx.get(engine["url"] + "/health").status_code == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        assert not [c for c in children if c.is_running() and c.status() != "zombie"]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)


def test_demo_runs_a_disaggregated_pool_in_either_protocol() -> None:
    """``demo --pd``: prefill and decode mock engines behind the router; the hit rate is
    the prefill engines' own (a decode engine reports its transferred prompt as cached)."""
    for protocol in ("vllm", "sglang"):
        flags = ["--json", "--pd", protocol, "--engines", "2", "--sessions", "3", "--turns", "3"]
        flags += ["--concurrency", "3", "--speed", "4", "--policies", "cache_aware"]
        out = subprocess.run(
            [sys.executable, "-m", "router.cli", "demo", *flags],
            capture_output=True,
            text=True,
            timeout=240,
            check=True,
        )
        report = json.loads(out.stdout)
        assert report["pd"] == protocol
        (r,) = report["results"]
        assert r["requests"] == 9 and r["errors"] == 0
        assert 0 < r["hit_rate"] < r["client_cached_rate"] <= 1, r
