"""The simulator with the engines users run: DP ranks and hybrid KV-cache groups, each
against a router blind to them (the replay's comparison)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.cli import main
from sim.simulator import SimConfig, Simulation
from sim.synth import write_sessions
from sim.traces import Trace, load_trace

BS = 16
HYBRID = "full,sliding_window:64,mamba"


@pytest.fixture(scope="module")
def spaced(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Conversations one request at a time: nothing changes between a decision and the
    engine's lookup, so every promised hit must be delivered."""
    path = tmp_path_factory.mktemp("shapes") / "spaced.jsonl"
    return write_sessions(path, sessions=12, turns=4, gap_ms=2000.0, turn_tokens=40)


@pytest.fixture(scope="module")
def trace(spaced: Path) -> Trace:
    return load_trace(spaced, block_size=BS)


@pytest.fixture(scope="module")
def busy(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    """Conversations arriving together: the engine's own balancer spreads them over ranks."""
    path = tmp_path_factory.mktemp("shapes") / "busy.jsonl"
    write_sessions(path, sessions=24, turns=5, gap_ms=3.0, turn_tokens=40)
    return load_trace(path, block_size=BS)


def _run(trace: Trace, **kw: object) -> dict[str, float]:
    return Simulation(trace, "cache_aware", SimConfig(event_lag_ms=1.0, **kw)).run()  # type: ignore[arg-type]


def test_dp_ranks_routed_per_rank_deliver_what_they_promise(busy: Trace) -> None:
    aware = _run(busy, workers=2, dp_size=2, l1_blocks=200)
    blind = _run(busy, workers=2, dp_size=2, l1_blocks=200, dp_aware=False)
    assert aware["overpromised_share"] < 0.02
    assert aware["promised_hit_rate"] <= aware["hit_rate"] + 0.01
    # merged ranks: a prefix on one rank is "hit" by a request the engine puts on another
    assert blind["overpromised_share"] > 0.2
    assert blind["promised_hit_rate"] > blind["hit_rate"] + 0.05
    assert aware["ingest_errors"] == blind["ingest_errors"] == 0


def test_hybrid_groups_known_deliver_what_they_promise(trace: Trace) -> None:
    shape = {"workers": 2, "l1_blocks": 400, "kv_groups": HYBRID, "group_blocks": 60}
    aware = _run(trace, **shape)
    blind = _run(trace, **shape, groups_aware=False)
    assert aware["overpromised_share"] == 0
    assert aware["promised_hit_rate"] == pytest.approx(aware["hit_rate"]) and aware["hit_rate"] > 0
    # full attention alone promises hits the sliding-window and Mamba groups cannot give
    assert blind["overpromised_share"] > 0.3
    assert blind["promised_hit_rate"] > 2 * blind["hit_rate"]
    assert aware["ingest_errors"] == blind["ingest_errors"] == 0


def test_replay_blind_arms(spaced: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--trace", str(spaced), "--workers", "2", "--block-size", str(BS)]
    argv += ["--policies", "cache_aware", "--json", "-", "--jobs", "1", "--event-lag-ms", "1"]
    argv += ["--kv-groups", HYBRID, "--group-blocks", "60", "--l1-blocks", "400"]
    assert main([*argv, "--blind", "groups"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_groups"] == HYBRID and out["blind"] == "groups"
    names = [r["policy"] for r in out["results"]]
    assert names == ["cache_aware", "cache_aware (groups-blind)"]
    aware, blind = out["results"]
    assert aware["overpromised_share"] < blind["overpromised_share"]
    assert main([*argv, "--blind", "dp"]) == 2  # needs --dp-size >= 2
    assert "--dp-size" in capsys.readouterr().err
