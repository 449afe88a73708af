"""bench/sweep.py's ``--params``: they reach ``cache_aware`` (and no baseline), each row
records them, a merge keeps them, and a misspelt one fails before anything runs."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from typing import Any

import orjson
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


# -- judge: the targets and the Pareto column ---------------------------------------------


def _res(hit: float, p90: float) -> dict[str, float]:
    return {"hit_rate": hit, "ttft_p90_ms": p90}


def test_judge_weighs_each_measure_against_its_own_best_other() -> None:
    """The best other on hit rate and the best other on p90 are two policies here, and
    least_load is neither: each ratio must be taken against the right one."""
    sweep = _sweep()
    row = {"results": {
        "cache_aware": _res(0.60, 9.0),
        "sglang_cache_aware": _res(0.58, 12.0),  # the best other hit rate, a slow p90
        "power_of_two": _res(0.30, 7.5),  # the best other p90, a poor hit rate
        "least_load": _res(0.20, 10.0),
    }}  # fmt: skip
    j = sweep.judge(row)
    assert (j["best_hit_other"], j["best_p90_other"]) == ("sglang_cache_aware", "power_of_two")
    assert j["hit_minus_best_other"] == pytest.approx(0.02)
    assert j["p90_over_best_other"] == pytest.approx(1.2)
    assert j["p90_over_least_load"] == pytest.approx(0.9)
    # hit rate above every other's but p90 above power_of_two's: not Pareto-best, and
    # 1.2x is past the 1.1x target; never above 1.5x least_load's
    assert (j["pareto"], j["target_p90"], j["target_hit"], j["target_never_collapse"]) == (
        False,
        False,
        True,
        True,
    )


# (cache_aware, the others, what judge says: pareto, target_p90, target_hit, collapse)
VERDICTS = {
    "best on both": (_res(0.6, 9.0), {"a": _res(0.5, 10.0), "b": _res(0.55, 12.0)},
                     (True, True, True, True)),
    "tied on both: Pareto-best": (_res(0.5, 10.0), {"a": _res(0.5, 10.0)},
                                  (True, True, True, True)),
    "tied hit, p90 a hair worse": (_res(0.5, 10.1), {"a": _res(0.5, 10.0)},
                                   (False, True, True, True)),
    "faster, hit a hair lower": (_res(0.499, 9.0), {"a": _res(0.5, 10.0)},
                                 (False, True, True, True)),
    "p90 1.1x the best other's": (_res(0.5, 11.0), {"a": _res(0.5, 10.0)},
                                  (False, True, True, True)),
    "p90 past 1.1x": (_res(0.5, 11.2), {"a": _res(0.5, 10.0)}, (False, False, True, True)),
    "hit 1 point under": (_res(0.49, 9.0), {"a": _res(0.50, 10.0)},
                          (False, True, True, True)),
    "hit 1 point under, other rates": (_res(0.71, 9.0), {"a": _res(0.72, 10.0)},
                                       (False, True, True, True)),
    "hit past 1 point under": (_res(0.489, 9.0), {"a": _res(0.50, 10.0)},
                               (False, True, False, True)),
    "p90 1.5x least_load's": (_res(0.9, 15.0), {"least_load": _res(0.1, 10.0)},
                              (False, False, True, True)),
    "p90 past 1.5x least_load's": (_res(0.9, 15.1), {"least_load": _res(0.1, 10.0)},
                                   (False, False, True, False)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(VERDICTS))
def test_judge_verdicts_at_and_past_each_threshold(case: str) -> None:
    """Each threshold is inclusive (">= best - 1 point", "<= 1.1x", "<= 1.5x", and ties
    are Pareto-best) and a step past it misses."""
    ours, others, want = VERDICTS[case]
    j = _sweep().judge({"results": {"cache_aware": ours, **others}})
    got = (j["pareto"], j["target_p90"], j["target_hit"], j["target_never_collapse"])
    assert got == want


def test_judge_never_the_worst_p90() -> None:
    """Issue 31's target: the worst p90 of the setting fails it even when every ratio
    target holds (against one other, the best is also the worst)."""
    judge = _sweep().judge
    j = judge({"results": {"cache_aware": _res(0.5, 10.5), "least_load": _res(0.5, 10.0)}})
    assert j["target_p90"] and not j["target_not_worst"]
    j = judge({"results": {"cache_aware": _res(0.5, 10.5), "least_load": _res(0.5, 10.0),
                           "random": _res(0.1, 11.0)}})  # fmt: skip
    assert j["target_not_worst"]


def test_judge_without_least_load_has_no_collapse_ratio() -> None:
    j = _sweep().judge({"results": {"cache_aware": _res(0.5, 99.0), "random": _res(0.1, 1.0)}})
    assert j["p90_over_least_load"] is None and j["target_never_collapse"]


def test_merged_results_are_judged_per_seed_and_on_the_means(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--merge`` of a baseline file and a cache_aware file: each joined row judged, the
    setting judged on the means, the Pareto column counting the seeds cache_aware was
    Pareto-best on, and a seed only one file has left out of both."""
    sweep = _sweep()
    win, lose = _res(0.6, 10.0), _res(0.5, 12.0)
    ours = [(0, win), (1, lose), (2, win), (3, win)]
    theirs = [(0, lose), (1, win), (2, lose)]  # seed 3's baselines did not run
    files = []
    for name, runs, policy in (("ours", ours, "cache_aware"), ("theirs", theirs, "least_load")):
        path = tmp_path / f"{name}.json"
        rows = [_row("a", seed, {}, {policy: res}) for seed, res in runs]
        path.write_bytes(orjson.dumps({"rows": rows}))
        files.append(str(path))
    table = tmp_path / "sweep.md"
    assert sweep.main(["--merge", *files, "--markdown", str(table)]) == 0
    out = orjson.loads(capsys.readouterr().out)
    judged = {r["seed"]: r.get("judge") for r in out["rows"]}
    assert {s: j["pareto"] for s, j in judged.items() if j} == {0: True, 1: False, 2: True}
    assert judged[3] is None  # cache_aware alone: nothing to judge against
    [setting] = out["settings"]
    assert setting["seeds"] == [0, 1, 2] and setting["pareto_seeds"] == 2
    assert setting["results"]["cache_aware"]["hit_rate"] == pytest.approx(17 / 30)
    j = setting["judge"]
    assert j["pareto"] and j["target_p90"] and j["target_hit"] and j["target_never_collapse"]
    assert j["p90_over_least_load"] == pytest.approx((32 / 3) / (34 / 3))
    line = next(x for x in table.read_text().splitlines() if x.startswith("| a |"))
    assert "| yes (2/3) | 4/4 |" in line
    assert "Pareto-best on 1 of 1" in table.read_text()


def test_a_mooncake_e2e_slice_is_bench_e2e_s_own_at_the_seeds_offset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the simulator replays what bench/e2e.py sends: its ``scaled`` rows from its
    # ``load_rows`` at --offset, a hash block the same 32 tokens wherever it recurs
    sweep = _sweep()
    lines = [
        {"timestamp": 1000 * i, "input_length": 1000 + 512 * (i % 3), "output_length": 40,
         "hash_ids": [0, 100 + i % 2, 200 + i]}
        for i in range(40)
    ]  # fmt: skip
    (tmp_path / "conversation_trace.jsonl").write_text(
        "".join(orjson.dumps(x).decode() + "\n" for x in lines)
    )
    monkeypatch.setattr(sweep, "DATA", tmp_path)
    monkeypatch.setitem(sweep.E2E_SLICES, "conv-e2e", ("conversation", 10, 5))
    out = sweep._e2e_slice("conv-e2e", 2, tmp_path / "slice.jsonl")  # offset 10 + 2 * 5
    rows = [orjson.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 20  # the 40 - 20 lines left, each fits
    assert rows[0]["timestamp"] == 0 and rows[1]["timestamp"] == 1000
    # 2024, 1000, 1512 tokens over 16, within aiperf's (2 * 32, 3 * 32]
    assert [len(r["token_ids"]) for r in rows[:3]] == [96, 65, 95]
    assert rows[0]["output_length"] == 3  # 40 / 16, rounded up
    # the first block (hash 0) is the same 32 tokens in every prompt, the second in
    # every other one, the third in none
    assert all(r["token_ids"][:32] == rows[0]["token_ids"][:32] for r in rows)
    assert rows[0]["token_ids"][32:64] == rows[2]["token_ids"][32:64]
    assert rows[0]["token_ids"][32:64] != rows[1]["token_ids"][32:64]
    with pytest.raises(SystemExit):  # before the file's first line
        monkeypatch.setitem(sweep.E2E_SLICES, "syn-e2e", ("synthetic", 10, -5))
        sweep._e2e_slice("syn-e2e", 3, tmp_path / "none.jsonl")


def test_admission_only_runs_every_policy_admitted_under_its_own_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sweep = _sweep()
    seen: dict[str, bool] = {}

    class Seen(Simulation):
        def __init__(self, trace: Trace, policy: str, config: SimConfig, **kw: Any) -> None:
            super().__init__(trace, policy, config, **kw)
            seen[policy] = config.admission is not None

    monkeypatch.setattr(sim.trace_replay, "Simulation", Seen)
    monkeypatch.setitem(sweep.TRACES, "tiny", ("chat", 6))
    setting = sweep.Setting("tiny", workers=2, l1_blocks=512)
    policies = ["cache_aware", "least_load"]
    row = sweep.run_setting(
        setting, policies, tmp_path, 1, None, sweep.AdmissionSettings(), only_admitted=True
    )
    assert seen == {"cache_aware": True, "least_load": True}
    assert set(row["results"]) == set(policies) and "shed" in row["results"]["cache_aware"]
    assert sweep.judge(row)["best_p90_other"] == "least_load"


def test_the_e2e_agent_slice_spreads_sessions_where_none_has_ended(tmp_path: Path) -> None:
    """``--grid e2e`` on fresh seed 648 (bench/e2e.py's 100-request agent slice, two
    engines of 256 pages, x1.5, ``cpu``): requests per session counted over the sessions
    that started made them look ~5 requests long where they run 10-20, so the holder of
    a 6-block tool prompt was spared the session bound and took 5 of 7 sessions, and
    its cache held about half their histories. Counted over the sessions that ended the
    bound holds (3 and 4) and the hits return."""
    sweep = _sweep()
    setting = dataclasses.replace(sweep.FAMILIES["e2e"][0], seed=648)
    trace = sweep._trace(setting, tmp_path)
    config = SimConfig(workers=2, l1_blocks=256, seed=648, engine_seed=648, max_num_seqs=8,
                       costs=sweep.EngineCosts.from_config(sweep.COSTS["cpu"]))  # fmt: skip
    firsts = _session_starts([r.router_hashes.tolist() for r in trace.requests])
    assert len(firsts) == 7

    def run(params: dict[str, Any]) -> tuple[float, list[int]]:
        sim = Simulation(trace, "cache_aware", config, policy_params=params)
        report = sim.run()
        on = [r.worker for r in sim.requests if r.idx in firsts]
        return report["hit_rate"], [on.count(0), on.count(1)]

    # the count alone (the later bounds, ``young_bound`` and ``fit_cache``, off: they too
    # keep the holder from 5 of 7)
    alone = {"young_bound": False, "fit_cache": False}
    hit, split = run(alone)
    old_hit, old_split = run({**alone, "ended_turns": False})
    assert sorted(old_split) == [2, 5]
    assert sorted(split) == [3, 4]
    assert hit >= old_hit + 0.05  # 0.864 against 0.749
    # and with every bound (the defaults)
    hit, split = run({})
    assert sorted(split) == [3, 4] and hit >= old_hit + 0.05


def _session_starts(prompts: list[list[int]]) -> set[int]:
    """The requests that start a session: those sharing no more than the tool prompt
    (8 blocks of 32 tokens, at most) with any earlier prompt."""
    out = set()
    for i, mine in enumerate(prompts):
        best = 0
        for theirs in prompts[:i]:
            k = 0
            while k < min(len(mine), len(theirs)) and mine[k] == theirs[k]:
                k += 1
            best = max(best, k)
        if best <= 8:
            out.add(i)
    return out
