"""Router configuration: TOML < env < flags, workers, arms, and clear errors."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from router.config import ConfigError, load_config
from router.http import serve

TOML = """
port = 9000
nats_url = "nats://127.0.0.1:4222"
policy = "round_robin"
block_size = 32
admin_token = "from-file"

[[workers]]
id = "a"
url = "http://127.0.0.1:9001/"
model = "llama"
pool = "p1"

[[workers]]
id = "b"
url = "http://127.0.0.1:9002"
model = "llama"
pool = "p1"
block_size = 32

[models.llama]
tokenizer = "/models/llama"

[[arms]]
name = "cache"
policy = "cache_aware"
weight = 3
params = { tie_ms = 0.5 }

[[arms]]
name = "rr"
policy = "round_robin"
"""


def test_layers_defaults_toml_env_flags(tmp_path):
    path = tmp_path / "router.toml"
    path.write_text(TOML)
    env = {"CACHE_ROUTER_PORT": "9100", "CACHE_ROUTER_ADMIN_TOKEN": "from-env"}
    cfg = load_config(path, env=env, overrides={"port": 9200, "policy": None})
    assert cfg.port == 9200  # flag beats env beats file
    assert cfg.admin_token == "from-env"
    assert cfg.policy == "round_robin"  # a flag left out does not override
    assert cfg.block_size == 32 and cfg.host == "127.0.0.1"  # file, then default
    assert [(w.id, w.url, w.pool) for w in cfg.workers] == [
        ("a", "http://127.0.0.1:9001", "p1"),
        ("b", "http://127.0.0.1:9002", "p1"),
    ]
    assert cfg.tokenizer_for("llama") == "/models/llama" and cfg.tokenizer_for("other") is None
    assert [(a.name, a.policy, a.weight, a.params) for a in cfg.arms] == [
        ("cache", "cache_aware", 3.0, {"tie_ms": 0.5}),
        ("rr", "round_robin", 1.0, {}),
    ]


def test_cli_flags_keep_their_names(tmp_path):
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(
        [
            "--host", "127.0.0.2", "--port", "8123", "--nats-url", "nats://127.0.0.1:1",
            "--worker", "w0=http://127.0.0.1:1", "--worker", "w1=http://127.0.0.1:2",
            "--block-size", "64", "--policy", "least_load", "--tokenizer", "/t",
            "--admin-token", "tok", "--subject-prefix", "kv2",
        ]
    )  # fmt: skip
    cfg = serve.config_from_args(args, env={})  # not the real environment: it may set any
    assert (cfg.host, cfg.port, cfg.nats_url, cfg.block_size) == (
        "127.0.0.2",
        8123,
        "nats://127.0.0.1:1",
        64,
    )
    assert (cfg.policy, cfg.tokenizer, cfg.admin_token, cfg.subject_prefix) == (
        "least_load",
        "/t",
        "tok",
        "kv2",
    )
    assert [(w.id, w.url, w.model) for w in cfg.workers] == [
        ("w0", "http://127.0.0.1:1", None),
        ("w1", "http://127.0.0.1:2", None),
    ]


def test_env_workers_and_no_file():
    cfg = load_config(None, env={"CACHE_ROUTER_WORKERS": "x=http://127.0.0.1:5,y=http://h:6"})
    assert [w.id for w in cfg.workers] == ["x", "y"]
    assert cfg.nats_url is None and cfg.policy == "cache_aware"


@pytest.mark.parametrize(
    ("toml", "env", "message"),
    [
        ("bogus = 1", {}, "unknown setting 'bogus'"),
        ("port = 'x'", {}, "port"),
        ("", {"CACHE_ROUTER_BLOCK_SIZE": "0"}, "block_size must be positive"),
        ("[[workers]]\nid = 'a'", {}, "needs id and url"),
        ("[[workers]]\nid = 'a'\nurl = 'ftp://x'", {}, "http://"),
        (
            "[[workers]]\nid='a'\nurl='http://x'\nblock_size=16\n"
            "[[workers]]\nid='b'\nurl='http://y'\nblock_size=32",
            {},
            "mixes block sizes",
        ),
        (
            "[[workers]]\nid='a'\nurl='http://x'\nmodel='m'\npool='p'\n"
            "[[workers]]\nid='b'\nurl='http://y'\nmodel='m'\npool='q'",
            {},
            "served by pools",
        ),
        ("[[arms]]\nname='a'", {}, "needs name and policy"),
        ("not toml [", {}, "router.toml"),
    ],
)
def test_bad_config_says_what_is_wrong(tmp_path, toml, env, message):
    path = tmp_path / "router.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=message):
        load_config(path, env=env)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.toml", env={})


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"CACHE_ROUTER_HEALTH_INTERVAL": "0"}, "health_interval must be positive"),
        ({"CACHE_ROUTER_HEALTH_TIMEOUT": "nan"}, "health_timeout must be positive"),
        ({"CACHE_ROUTER_UNHEALTHY_AFTER": "0"}, "unhealthy_after must be at least 1"),
        ({"CACHE_ROUTER_CONNECT_RETRIES": "-1"}, "connect_retries must be at least 0"),
        ({"CACHE_ROUTER_REQUEST_TIMEOUT": "1e12"}, "request_timeout must be at most"),
        ({"CACHE_ROUTER_PORT": "70000"}, "port must be at most 65535"),
        ({"CACHE_ROUTER_MAX_INDEX_BLOCKS": "0"}, "max_index_blocks must be at least 1"),
        ({"CACHE_ROUTER_EVENTS_TRANSPORT": "kafka"}, "events_transport must be auto or"),
        ({"CACHE_ROUTER_PORT": "eighty"}, "port: 'eighty' is not a valid int"),
        ({"CACHE_ROUTER_GATEWAY": "maybe"}, "gateway: 'maybe' is not a valid bool"),
    ],
)
def test_out_of_range_settings_are_refused_by_name(env, message):
    with pytest.raises(ConfigError, match=message):
        load_config(env=env)


def test_config_is_read_only_once_built():
    cfg = load_config(env={"CACHE_ROUTER_MAX_INDEX_BLOCKS": "", "CACHE_ROUTER_PORT": "81"})
    assert cfg.max_index_blocks is None and cfg.port == 81
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 82  # type: ignore[misc]


def test_a_gateway_without_a_policy_routes_on_sessions(tmp_path):
    path = tmp_path / "router.toml"
    path.write_text("gateway = true\n")
    assert load_config(path, env={}).policy == "session_affinity"
    assert load_config(env={"CACHE_ROUTER_GATEWAY": "1"}).policy == "session_affinity"
    assert load_config(path, env={"CACHE_ROUTER_POLICY": "least_load"}).policy == "least_load"


# The settings' names as users spell them (TOML keys; CACHE_ROUTER_<NAME> variables):
# a contract, written out so a rename or a lost setting fails here.
SCALAR_NAMES = """
admin_token audit_bound blind_after block_size body_timeout breaker_cooldown
breaker_failures connect_retries drain_timeout events_max_age events_max_bytes events_stream
events_reader events_transport experiment forecast_tracked forward_authorization gateway
header_timeout health_interval health_timeout healthy_after host idle_timeout load_stale_after
max_best_of max_body_bytes max_connections max_header_bytes max_header_count max_index_blocks max_n
max_tokens max_top_logprobs metrics_token nats_credentials nats_password nats_tls_ca
nats_tls_cert nats_tls_key nats_token nats_url nats_user offload_chars peer_ttl policy port
predict_ttl replica_id request_timeout share_interval stall_after subject_prefix tokenizer
tracing unhealthy_after pd_protocol pd_bootstrap_port pd_local_prefill_tokens decode_policy
tokenize_threads tokenize_queue tokenize_timeout forward_token_ids chat_tokens_in prefix_cache_mb
derive_session_key processes tokenize_processes
admission queue_size queue_timeout engine_queue engine_max_inflight engine_batch_tokens
reserve_share
engine_priority_scheduling queue_lifo pool_reserve
priority_starve_after priority_starve_share tenant_header expected_output_tokens
migrate_max epp_port epp_body_mode epp_message_timeout tls_cert tls_key tls_client_ca
first_token_stall_after token_stall_after
engine_tls_ca engine_tls_cert engine_tls_key engine_tls_check_hostname
""".split()  # noqa: SIM905
FLAG_NAMES = """
--host --port --nats-url --block-size --policy --tokenizer --admin-token --subject-prefix
--gateway --metrics-token --replica-id --events-transport --events-reader --tracing --pd-protocol
--pd-local-prefill-tokens --decode-policy --prefix-cache-mb --queue-size --queue-timeout
--epp-port --tls-cert --tls-key
""".split()  # noqa: SIM905


def _sample(name: str):
    """A value of setting ``name``'s type that its checks accept (not its default)."""
    from router.config import RANGES, SCALARS

    scalar = SCALARS[name]
    if scalar.choices:
        return scalar.choices[-1]
    if scalar.kind is bool:
        return True
    if scalar.kind is str:
        return "x1" if name not in ("nats_url",) else "nats://127.0.0.1:1"
    low, high, _ = RANGES[name]
    return scalar.kind(min(high, max(low, 0) + 1))


def test_every_setting_keeps_its_toml_key_and_env_variable(tmp_path):
    from router.config import SCALARS, TABLES

    assert sorted(SCALARS) == sorted(SCALAR_NAMES)
    assert sorted(TABLES) == [
        "api_keys", "arms", "discovery", "kubernetes", "models", "policy_params",
        "prefill_params", "tenants", "workers",
    ]  # fmt: skip
    for name in SCALAR_NAMES:
        if name.startswith(("nats_tls_", "tls_", "engine_tls_")) and name[-8:] != "hostname":
            continue  # must name a file: tests/test_security.py, test_tls.py, test_engine_tls.py
        if name == "nats_credentials":
            continue
        if name == "processes":
            continue  # more than 1 needs nats_url: covered by tests/test_processes.py
        value = _sample(name)
        path = tmp_path / "one.toml"
        text = str(value).lower() if isinstance(value, bool) else repr(value)
        path.write_text(f"{name} = {text}\n".replace("'", '"'))
        assert getattr(load_config(path, env={}), name) == value, name
        env = {"CACHE_ROUTER_" + name.upper(): str(value)}
        assert getattr(load_config(env=env), name) == value, name


def test_every_flag_keeps_its_spelling():
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    spelled = {s for a in parser._actions for s in a.option_strings}
    assert set(FLAG_NAMES) <= spelled
    for flag in FLAG_NAMES:
        name = flag[2:].replace("-", "_")
        if name.startswith("tls_"):
            continue  # must name a file: tests/test_tls.py gives them one
        value = _sample(name)
        argv = [flag] if isinstance(value, bool) else [flag, str(value)]
        cfg = serve.config_from_args(parser.parse_args(argv), env={})
        assert getattr(cfg, name) == value, flag


def test_sections_partition_the_settings():
    """Each setting lives in exactly one typed section, and a section can be taken out."""
    from router.config import SECTIONS, HealthSettings, RouterConfig

    names = [f.name for s in SECTIONS for f in dataclasses.fields(s)]
    assert len(names) == len(set(names))
    assert set(names) == {f.name for f in dataclasses.fields(RouterConfig)}
    cfg = RouterConfig(health_interval=3.0, port=81)
    assert isinstance(cfg, HealthSettings)
    assert cfg.section(HealthSettings) == HealthSettings(health_interval=3.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.section(HealthSettings).health_interval = 1.0  # type: ignore[misc]
