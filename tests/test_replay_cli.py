"""``cache-router replay``: the JSON contract, the plot, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from router.cli import main
from sim.synth import write_mooncake, write_sessions

CONTRACT = {
    "policy",
    "hit_rate",
    "ttft_mean_ms",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "prefill_load_max_over_mean",
}


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("replay") / "sessions.jsonl"
    return write_sessions(path, sessions=8, turns=3, gap_ms=20.0)


def test_json_to_stdout_has_the_contract_keys(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["replay", "--trace", str(trace), "--workers", "3", "--block-size", "16"]
    argv += ["--policies", "round_robin,cache_aware", "--json", "-", "--jobs", "1"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)  # exactly one JSON object, nothing else
    assert out["trace"] == str(trace)
    assert out["workers"] == 3
    assert 0 < out["ideal_hit_rate"] < 1
    assert [r["policy"] for r in out["results"]] == ["round_robin", "cache_aware"]
    for r in out["results"]:
        assert set(r) >= CONTRACT
        assert r["requests"] == 24
        assert 0 <= r["hit_rate"] <= out["ideal_hit_rate"] + 1e-12
        assert r["ttft_p50_ms"] <= r["ttft_p90_ms"] <= r["ttft_p99_ms"]


def test_subprocess_parallel_policies_file_output_and_plot(tmp_path: Path) -> None:
    """The installed entry point, two processes, a JSON file, a table and a PNG."""
    path = write_mooncake(
        tmp_path / "mooncake.jsonl",
        [(10.0 * i, 512 * (1 + i % 3) + 30, 4, list(range(i % 3 + 2))) for i in range(30)],
    )
    out, png = tmp_path / "out.json", tmp_path / "plot.png"
    cmd = [sys.executable, "-m", "router.cli", "replay", "--trace", str(path)]
    cmd += ["--workers", "2", "--policies", "random,dynamo_kv,sglang_cache_aware"]
    cmd += ["--json", str(out), "--plot", str(png), "--jobs", "2", "--l2-blocks", "64"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "ideal hit rate" in proc.stdout and "dynamo_kv" in proc.stdout
    assert proc.stderr == ""  # no progress bar when stderr is not a terminal
    result = json.loads(out.read_text())
    assert [r["policy"] for r in result["results"]] == ["random", "dynamo_kv", "sglang_cache_aware"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--policies", "round_robin,nope"], "unknown policy"),
        (["--workers", "0"], "--workers"),
        (["--limit", "0"], "--limit"),
        (["--engine-costs", '{"prefill_ms_per_tok": 1}'], "unknown EngineCosts field"),
        (["--engine-costs", '{"prefill_ms_per_token": 0}'], "must be > 0"),
        (["--engine-costs", "{nope"], "not a JSON object"),
        (["--engine-costs", "/no/such/costs.toml"], "no such file"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    trace: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main(["replay", "--trace", str(trace), *extra]) == 2
    err = capsys.readouterr().err
    assert "cache-router replay: error:" in err and message in err


def test_unreadable_trace_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hash_ids": "x"}\n')
    assert main(["replay", "--trace", str(bad)]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    assert main(["replay", "--trace", str(tmp_path / "missing.jsonl")]) == 2


def test_engines_can_run_slower_than_the_policies_assume(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--engine-costs changes the engines only: 2x slower prefill, same routing inputs."""
    base = ["replay", "--trace", str(trace), "--workers", "2", "--block-size", "16"]
    base += ["--policies", "round_robin", "--json", "-", "--jobs", "1"]
    assert main(base) == 0
    fast = json.loads(capsys.readouterr().out)
    costs = tmp_path / "slow.toml"
    costs.write_text("prefill_ms_per_token = 0.1\ndecode_ms_per_step = 12.0\n")
    assert main([*base, "--engine-costs", str(costs)]) == 0
    slow = json.loads(capsys.readouterr().out)
    assert slow["engine_costs"]["prefill_ms_per_token"] == 0.1
    assert fast["engine_costs"]["prefill_ms_per_token"] == 0.05
    f, s = fast["results"][0], slow["results"][0]
    assert s["hit_rate"] == f["hit_rate"]  # round_robin routes the same either way
    assert s["ttft_p50_ms"] > 1.5 * f["ttft_p50_ms"]
    assert (
        main([*base, "--engine-costs", '{"prefill_ms_per_token": 0.1, "decode_ms_per_step": 12}'])
        == 0
    )
    inline = json.loads(capsys.readouterr().out)["results"][0]
    assert inline["ttft_p50_ms"] == s["ttft_p50_ms"]
