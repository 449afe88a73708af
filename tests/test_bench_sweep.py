"""bench/sweep.py's ``--params``: they reach ``cache_aware`` (and no baseline), each row
records them, a merge keeps them, and a misspelt one fails before anything runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

import sim.trace_replay
from sim.simulator import SimConfig, Simulation
from sim.traces import Trace

BENCH = Path(__file__).resolve().parent.parent / "bench" / "sweep.py"
PARAMS = {"recompute_share": 2.0, "tie_ms": 1.5}


def _sweep() -> Any:
    spec = importlib.util.spec_from_file_location("sweep", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sweep"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _row(setting: str, seed: int, params: dict[str, Any], results: dict[str, Any]) -> Any:
    return {"setting": f"{setting} s{seed}", "name": setting, "seed": seed, "requests": 1,
            "params": params, "results": results}  # fmt: skip


def test_params_reach_cache_aware_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sweep = _sweep()
    seen: dict[str, tuple[float, float] | None] = {}

    class Seen(Simulation):
        def __init__(self, trace: Trace, policy: str, config: SimConfig, **kw: Any) -> None:
            super().__init__(trace, policy, config, **kw)
            p = self.policy
            seen[policy] = (p.recompute_share, p.tie_ms) if policy == "cache_aware" else None
            assert policy == "cache_aware" or not kw.get("policy_params")

    monkeypatch.setattr(sim.trace_replay, "Simulation", Seen)
    monkeypatch.setitem(sweep.TRACES, "tiny", ("chat", 6))
    setting = sweep.Setting("tiny", workers=2, l1_blocks=512)
    policies = ["cache_aware", "least_load"]
    row = sweep.run_setting(setting, policies, tmp_path, 1, {"cache_aware": PARAMS})
    assert seen == {"cache_aware": (2.0, 1.5), "least_load": None}
    assert row["params"] == {"cache_aware": PARAMS}
    assert set(row["results"]) == set(policies)
    # without them, the defaults: the check above is not what cache_aware does anyway
    row = sweep.run_setting(setting, policies, tmp_path, 1)
    assert seen["cache_aware"] == (4.0, 0.25) and row["params"] == {}


def test_merge_keeps_the_params_of_the_rows_that_ran_with_them() -> None:
    sweep = _sweep()
    res = {"hit_rate": 0.5, "ttft_p90_ms": 10.0}
    rows = [
        _row("a", 0, {}, {"least_load": res}),
        _row("a", 0, {"cache_aware": PARAMS}, {"cache_aware": res}),
        _row("a", 1, {}, {"least_load": res}),
        _row("a", 1, {"cache_aware": PARAMS}, {"cache_aware": res}),
    ]
    joined = sweep.join(rows)
    assert [r["params"] for r in joined] == [{"cache_aware": PARAMS}] * 2
    assert sweep.aggregate(joined)[0]["params"] == {"cache_aware": PARAMS}
    # the defaults on one seed and PARAMS on the other: no mean of the two
    with pytest.raises(SystemExit, match="different --params"):
        sweep.aggregate(sweep.join([*rows[:3], _row("a", 1, {}, {"cache_aware": res})]))


@pytest.mark.parametrize(
    "argv",
    [
        ["--params", '{"recompute_wieght": 8}'],
        ["--params", "[8]"],
        ["--params", '{"recompute_weight": -1}'],
        ["--params", '{"tie_ms": 1}', "--policies", "least_load"],
    ],
)
def test_bad_params_fail_before_a_run(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = _sweep()

    def never(*_: Any, **__: Any) -> None:
        raise AssertionError("a setting ran")

    monkeypatch.setattr(sweep, "run_setting", never)
    with pytest.raises(SystemExit) as exc:
        sweep.main(argv)
    assert exc.value.code == 2
    assert "--params" in capsys.readouterr().err


def test_merge_refuses_one_policy_run_with_two_sets_of_params() -> None:
    """Two files with cache_aware on the same (setting, seed), once with the defaults and
    once with PARAMS: the merge used to keep whichever came last, silently."""
    sweep = _sweep()
    ours, theirs = {"hit_rate": 0.5, "ttft_p90_ms": 10.0}, {"hit_rate": 0.6, "ttft_p90_ms": 9.0}
    base = _row("a", 0, {}, {"cache_aware": ours, "least_load": ours})
    probe = _row("a", 0, {"cache_aware": PARAMS}, {"cache_aware": theirs})
    for rows in ([base, probe], [probe, base]):
        with pytest.raises(SystemExit, match=r"a s0: cache_aware ran with params"):
            sweep.join(rows)
    # the same parameters twice are one run; another policy's row joins as before
    joined = sweep.join([base, _row("a", 0, {}, {"cache_aware": ours, "dynamo_kv": theirs})])
    assert set(joined[0]["results"]) == {"cache_aware", "least_load", "dynamo_kv"}
    assert joined[0]["params"] == {}
