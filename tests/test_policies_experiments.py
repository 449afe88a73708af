"""A/B experiments: sticky per session key (across processes), weighted, validated."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from policies import POLICY_NAMES
from policies.cache_aware import CacheAware
from policies.dynamo_kv import DynamoKv
from policies.experiments import Arm, Experiment

CONFIG = [
    {"name": "ours", "policy": "cache_aware", "weight": 3},
    {"name": "dynamo", "policy": "dynamo_kv", "weight": 1, "params": {"temperature": 0.5}},
]


def test_from_config_builds_one_policy_per_arm() -> None:
    exp = Experiment.from_config(CONFIG, random.Random(0))
    assert [a.name for a in exp.arms] == ["ours", "dynamo"]
    assert exp.arms[1] == Arm("dynamo", "dynamo_kv", {"temperature": 0.5}, 1.0)
    dyn = exp.policy_for(exp.arms[1])
    assert isinstance(dyn, DynamoKv) and dyn.temperature == 0.5
    assert exp.policy_for("dynamo") is dyn  # one instance per arm, kept
    assert exp.policy_for("ours").name == "cache_aware"
    with pytest.raises(ValueError, match="no arm named"):
        exp.policy_for("nope")


def test_an_arm_may_name_the_decode_sides_policy() -> None:
    exp = Experiment.from_config(
        [
            {"name": "dec", "policy": "cache_aware", "decode_policy": "decode_load",
             "decode_params": {"kv_full": 0.8}},
            {"name": "rr", "policy": "round_robin", "decode_policy": "round_robin"},
            {"name": "plain", "policy": "cache_aware"},
        ]
    )  # fmt: skip
    dec = exp.decode_policy_for("dec")
    assert dec is not None and dec.name == "decode_load" and dec.kv_full == 0.8  # type: ignore[attr-defined]
    assert exp.decode_policy_for("dec") is dec  # one instance per arm, kept
    rr = exp.decode_policy_for(exp.arms[1])
    assert rr is not None and rr.name == "round_robin" and rr is not exp.policy_for("rr")
    assert exp.decode_policy_for("plain") is None  # the router's own decode policy
    assert exp.arms[2].decode_policy is None and exp.arms[2].decode_params == {}
    with pytest.raises(ValueError, match="no arm named"):
        exp.decode_policy_for("nope")


def test_the_prefill_side_has_its_own_instance_and_parameters() -> None:
    """A disaggregated pool's prefill engines get the policy's prefill-side defaults
    (``Policy.prefill_params``), then the arm's ``params``, then its ``prefill_params``;
    a mixed pool's instance keeps the plain defaults."""
    exp = Experiment.from_config(
        [
            {"name": "plain", "policy": "cache_aware"},
            {"name": "tuned", "policy": "cache_aware", "params": {"recompute_weight": 2.0}},
            {"name": "sided", "policy": "cache_aware", "params": {"recompute_weight": 2.0},
             "prefill_params": {"recompute_weight": 5.0, "tie_ms": 1.0}},
            {"name": "rr", "policy": "round_robin"},
        ]
    )  # fmt: skip
    mixed, prefill = exp.policy_for("plain"), exp.prefill_policy_for("plain")
    assert isinstance(mixed, CacheAware) and isinstance(prefill, CacheAware)
    assert prefill is not mixed and exp.prefill_policy_for("plain") is prefill  # kept
    plain = CacheAware()  # the constructor's defaults, whatever they are tuned to
    assert mixed.recompute_weight == plain.recompute_weight and mixed.place_slack_ms is None
    for key, value in CacheAware.prefill_params.items():
        assert getattr(prefill, key) == value
    assert CacheAware.prefill_params["running_discount"] != mixed.running_discount
    tuned = exp.prefill_policy_for("tuned")
    assert isinstance(tuned, CacheAware) and tuned.recompute_weight == 2.0
    assert tuned.place_slack_ms == CacheAware.prefill_params["place_slack_ms"]
    sided = exp.prefill_policy_for("sided")
    assert isinstance(sided, CacheAware) and (sided.recompute_weight, sided.tie_ms) == (5.0, 1.0)
    assert exp.policy_for("sided").recompute_weight == 2.0  # type: ignore[attr-defined]
    assert exp.arms[2].prefill_params == {"recompute_weight": 5.0, "tie_ms": 1.0}
    assert exp.prefill_policy_for("rr").name == "round_robin"  # no prefill-side defaults
    with pytest.raises(ValueError, match="no arm named"):
        exp.prefill_policy_for("nope")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ([], "at least one arm"),
        ([{"name": "a", "policy": "nope"}], "unknown policy"),
        ([{"name": "a", "policy": "random", "params": {"x": 1}}], "no parameter"),
        ([{"name": "a", "policy": "random", "wieght": 2}], "unknown key"),
        ([{"policy": "random"}], "missing key"),
        ([{"name": "a", "policy": "random", "weight": 0}], "weight must be > 0"),
        ([{"name": "a", "policy": "random", "weight": "heavy"}], "must be a number"),
        ([{"name": "a", "policy": "random"}, {"name": "a", "policy": "random"}], "duplicate"),
        (["random"], "expected a table"),
        ([{"name": "a", "policy": "random", "decode_policy": "nope"}], "unknown policy"),
        ([{"name": "a", "policy": "random", "decode_policy": 3}], "decode_policy must be"),
        ([{"name": "a", "policy": "random", "decode_params": {"x": 1}}], "without decode_policy"),
        ([{"name": "a", "policy": "random", "prefill_params": {"x": 1}}], "no parameter"),
        ([{"name": "a", "policy": "random", "prefill_params": 3}], "must be tables"),
        (
            [{"name": "a", "policy": "random", "decode_policy": "decode_load",
              "decode_params": {"kv_full": 2.0}}],
            "kv_full",
        ),
        (
            [{"name": "a", "policy": "random", "decode_policy": "decode_load",
              "decode_params": {"nope": 1}}],
            "decode_load",
        ),
    ],
)
def test_bad_config_is_a_clear_error(config: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Experiment.from_config(config)


def test_assignment_is_sticky_per_session_key() -> None:
    a = Experiment.from_config(CONFIG, random.Random(1))
    b = Experiment.from_config(CONFIG, random.Random(2))  # another replica
    for i in range(500):
        key = f"session-{i}"
        arm = a.assign(key)
        assert all(a.assign(key) is arm for _ in range(3))
        assert b.assign(key).name == arm.name


def test_hashed_assignment_follows_the_weights() -> None:
    exp = Experiment.from_config(CONFIG)
    counts = Counter(exp.assign(f"user{i}").name for i in range(20_000))
    assert counts["ours"] / 20_000 == pytest.approx(0.75, abs=0.015)


def test_requests_without_a_key_get_a_weighted_random_arm() -> None:
    exp = Experiment.from_config(CONFIG, random.Random(3))
    counts = Counter(exp.assign(None).name for _ in range(20_000))
    assert counts["ours"] / 20_000 == pytest.approx(0.75, abs=0.015)
    assert counts["dynamo"] > 0


def test_salt_reshuffles_assignment_independently() -> None:
    plain = Experiment.from_config(CONFIG)
    salted = Experiment.from_config(CONFIG, salt="exp-2")
    keys = [f"u{i}" for i in range(2000)]
    same = sum(plain.assign(k).name == salted.assign(k).name for k in keys)
    # independent draws agree with probability 0.75^2 + 0.25^2 = 0.625, not 1
    assert 0.55 < same / len(keys) < 0.70


def test_assignment_is_stable_across_processes() -> None:
    keys = [f"session-{i}" for i in range(200)]
    script = (
        "import json, sys\n"
        "from policies.experiments import Experiment\n"
        "cfg, keys = json.loads(sys.stdin.read())\n"
        "exp = Experiment.from_config(cfg)\n"
        "print(json.dumps([exp.assign(k).name for k in keys]))\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps([CONFIG, keys]),
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=60,
        check=True,
    )
    here = Experiment.from_config(CONFIG)
    assert json.loads(out.stdout) == [here.assign(k).name for k in keys]


def test_every_policy_can_be_an_arm() -> None:
    exp = Experiment.from_config([{"name": n, "policy": n} for n in POLICY_NAMES])
    assert {exp.policy_for(a).name for a in exp.arms} == set(POLICY_NAMES)
