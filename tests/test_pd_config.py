"""Pools with roles: prefill, decode and mixed workers in the TOML, env, flags and admin API."""

from __future__ import annotations

import argparse

import pytest

from router.config import ConfigError, RouterConfig, WorkerSpec, load_config
from router.http import serve
from router.http.app import make_experiment
from router.workers.registry import WorkerRegistry

PD_TOML = """
pd_protocol = "sglang"
pd_local_prefill_tokens = 64

[[workers]]
id = "p0"
url = "http://127.0.0.1:9001"
pool = "pd"
role = "prefill"
bootstrap_port = 9998

[[workers]]
id = "d0"
url = "http://127.0.0.1:9002"
pool = "pd"
role = "decode"

[[workers]]
id = "m0"
url = "http://127.0.0.1:9003"
"""


def test_roles_from_toml_with_pd_settings(tmp_path):
    path = tmp_path / "router.toml"
    path.write_text(PD_TOML)
    cfg = load_config(path, env={})
    roles = {w.id: (w.pool, w.role, w.bootstrap_port) for w in cfg.workers}
    assert roles == {
        "p0": ("pd", "prefill", 9998),
        "d0": ("pd", "decode", None),
        "m0": ("default", "mixed", None),
    }
    assert cfg.pd_protocol == "sglang" and cfg.pd_local_prefill_tokens == 64
    assert cfg.decode_policy == "decode_load" and cfg.pd_bootstrap_port == 8998


def test_arms_name_each_sides_policy_in_toml(tmp_path):
    path = tmp_path / "router.toml"
    path.write_text(
        PD_TOML
        + """
[[arms]]
name = "decode-rr"
policy = "cache_aware"
decode_policy = "round_robin"

[[arms]]
name = "tight-kv"
policy = "cache_aware"
decode_policy = "decode_load"
decode_params = { kv_full = 0.8 }
"""
    )
    cfg = load_config(path, env={})
    assert [(a.name, a.policy, a.decode_policy, dict(a.decode_params)) for a in cfg.arms] == [
        ("decode-rr", "cache_aware", "round_robin", {}),
        ("tight-kv", "cache_aware", "decode_load", {"kv_full": 0.8}),
    ]
    path.write_text(PD_TOML + '[[arms]]\nname = "a"\npolicy = "random"\ndecode_params = {x = 1}\n')
    with pytest.raises(ConfigError, match="without decode_policy"):
        load_config(path, env={})


def test_the_prefill_side_takes_its_own_parameters_in_toml(tmp_path):
    """``prefill_params`` go over ``policy_params`` on the prefill engines only."""
    path = tmp_path / "router.toml"
    path.write_text(
        "policy_params = { recompute_weight = 2.0 }\n"
        "prefill_params = { place_slack_ms = 100.0 }\n" + PD_TOML
    )
    cfg = load_config(path, env={})
    assert cfg.policy_params == {"recompute_weight": 2.0}
    assert cfg.prefill_params == {"place_slack_ms": 100.0}
    exp = make_experiment(cfg)
    prefill, mixed = exp.prefill_policy_for("cache_aware"), exp.policy_for("cache_aware")
    assert (prefill.recompute_weight, prefill.place_slack_ms) == (2.0, 100.0)  # type: ignore[attr-defined]
    assert (mixed.recompute_weight, mixed.place_slack_ms) == (2.0, None)  # type: ignore[attr-defined]
    path.write_text("prefill_params = 3\n" + PD_TOML)
    with pytest.raises(ConfigError, match="prefill_params must be a table"):
        load_config(path, env={})


def test_roles_from_env_and_flags():
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(
        ["--worker", "prefill:p1=http://127.0.0.1:9101", "--pd-protocol", "vllm",
         "--pd-local-prefill-tokens", "32", "--decode-policy", "power_of_two"]
    )  # fmt: skip
    env = {
        "CACHE_ROUTER_WORKERS": "decode:d1=http://127.0.0.1:9201,prefill:p0=http://127.0.0.1:9100",
        "CACHE_ROUTER_PD_PROTOCOL": "sglang",
    }
    cfg = serve.config_from_args(args, env=env)
    assert {w.id: w.role for w in cfg.workers} == {"d1": "decode", "p0": "prefill", "p1": "prefill"}
    assert cfg.pd_protocol == "vllm"  # the flag beats the env
    assert cfg.pd_local_prefill_tokens == 32 and cfg.decode_policy == "power_of_two"
    plain = load_config(env={"CACHE_ROUTER_WORKERS": "w0=http://127.0.0.1:9000"})
    assert plain.workers[0].role == "mixed"  # today's form is unchanged


@pytest.mark.parametrize(
    ("workers", "env", "message"),
    [
        ("chef:p0=http://127.0.0.1:1", {}, "role must be"),
        ("prefill:p0=http://127.0.0.1:1", {}, "no decode worker"),
        ("prefill:p0=http://127.0.0.1:1,w0=http://127.0.0.1:2", {}, "mixes mixed workers"),
        ("decode:d0=http://127.0.0.1:1", {"CACHE_ROUTER_PD_PROTOCOL": "nixl"}, "pd_protocol"),
        ("decode:d0=http://127.0.0.1:1", {"CACHE_ROUTER_PD_BOOTSTRAP_PORT": "0"}, "bootstrap"),
        ("decode:d0=http://127.0.0.1:1", {"CACHE_ROUTER_PD_LOCAL_PREFILL_TOKENS": "-1"}, "local"),
        ("decode:d0=http://127.0.0.1:1", {"CACHE_ROUTER_GATEWAY": "1"}, "gateway"),
    ],
)
def test_bad_roles_say_what_is_wrong(workers, env, message):
    with pytest.raises(ConfigError, match=message):
        load_config(env={"CACHE_ROUTER_WORKERS": workers, **env})


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('role = "both"', "role must be"),
        ("bootstrap_port = 70000", "bootstrap_port"),
    ],
)
def test_bad_worker_tables(tmp_path, extra, message):
    path = tmp_path / "r.toml"
    path.write_text(f'[[workers]]\nid = "d"\nurl = "http://127.0.0.1:1"\n{extra}\n')
    with pytest.raises(ConfigError, match=message):
        load_config(path, env={})


@pytest.mark.parametrize(
    ("protocol", "field"),
    [("vllm", "header"), ("sglang", "routed_dp_rank"), ("sglang", "data_parallel_rank")],
)
def test_prefill_and_decode_workers_take_dp_ranks(tmp_path, protocol, field):
    path = tmp_path / "r.toml"
    rows = [
        f'[[workers]]\nid = "{wid}"\nurl = "http://127.0.0.1:{port}"\nrole = "{role}"\n'
        f'dp_size = 2\ndp_field = "{field}"\n'
        for wid, port, role in (("p", 1, "prefill"), ("d", 2, "decode"))
    ]
    path.write_text(f'pd_protocol = "{protocol}"\n' + "".join(rows))
    cfg = load_config(path, env={})
    reg = WorkerRegistry(cfg)
    for spec in cfg.workers:
        reg.add(spec)
    assert sorted(reg.sources()) == ["d-dp0", "d-dp1", "p-dp0", "p-dp1"]
    assert {w.id: w.role for w in reg} == {"p": "prefill", "d": "decode"}
    if protocol == "sglang":  # SGLang reads the rank from the body: a header would be lost
        path.write_text(path.read_text().replace(field, "header"))
        with pytest.raises(ConfigError, match="routed_dp_rank"):
            load_config(path, env={})
        with pytest.raises(ValueError, match="routed_dp_rank"):  # the admin API's add too
            reg.add(WorkerSpec("d2", "http://127.0.0.1:3", role="decode", dp_size=2))


def test_registry_keeps_a_pool_mixed_or_disaggregated():
    reg = WorkerRegistry(RouterConfig())
    reg.add(WorkerSpec("p0", "http://127.0.0.1:1", pool="pd", role="prefill"))
    reg.add(WorkerSpec("d0", "http://127.0.0.1:2", pool="pd", role="decode"))
    with pytest.raises(ValueError, match="mixes mixed workers"):
        reg.add(WorkerSpec("m0", "http://127.0.0.1:3", pool="pd"))
    reg.add(WorkerSpec("m0", "http://127.0.0.1:3"))  # another pool is free to be mixed
    assert [w.describe(0.0)["role"] for w in reg] == ["prefill", "decode", "mixed"]
