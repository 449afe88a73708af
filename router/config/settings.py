"""Router configuration: one source of truth, layered defaults < TOML < env < flags.

The TOML file holds everything (workers, per-model tokenizers, experiment arms); the
``CACHE_ROUTER_*`` environment variables and the command-line flags override its scalar
settings, so containers and scripts can change one knob without writing a file. The
defaults run the demo with no file at all.

Settings are grouped in typed frozen sections (``HttpSettings``, ``NatsSettings``...);
each field carries its default, its bounds and its flag (``setting``), so the types,
the range checks and the ``--flags`` come from one place. ``RouterConfig`` is every
section at once, because the names stay flat where users meet them.

Example ``router.toml``::

    port = 8000
    nats_url = "nats://127.0.0.1:4222"
    policy = "cache_aware"
    admin_token = "secret"

    [[workers]]
    id = "w0"
    url = "http://127.0.0.1:9000"
    model = "llama"
    pool = "default"
    block_size = 16

    [[workers]]                       # a disaggregated pool: prefill and decode engines
    id = "p0"
    url = "http://127.0.0.1:9100"
    pool = "pd"
    role = "prefill"                  # or "decode"; "mixed" (the default) does both
    bootstrap_port = 8998             # SGLang prefill engines (pd_protocol = "sglang")

    [models.llama]
    tokenizer = "/models/llama"      # dir with tokenizer.json (+ tokenizer_config.json)

    [[arms]]                          # A/B experiment; omit for one policy
    name = "cache"
    policy = "cache_aware"
    weight = 0.5
    params = {}
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import typing
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar
from urllib.parse import parse_qsl, urlsplit

from index.backend import NATIVE
from index.groups import parse_groups
from index.wire import DEFAULT_PREFIX, worker_id_error
from policies.experiments import Arm, parse_arm
from router.workers.dp import DP_FIELDS, MAX_DP_SIZE, DpField

ENV_PREFIX = "CACHE_ROUTER_"
DEFAULT_POOL = "default"
# Policies that need neither prompt tokens nor the prefix index: what a gateway can run.
GATEWAY_POLICIES = frozenset(
    ("session_affinity", "round_robin", "random", "least_load", "power_of_two")
)


class ConfigError(ValueError):
    """The configuration cannot be used; the message says which setting and why."""


Transport = Literal["auto", "jetstream", "core"]
# Who reads core NATS events: the compiled core's own thread (router/events/native_reader.py)
# or nats-py on the event loop; auto: native wherever it can be (router.events.native_reader).
EventsReader = Literal["auto", "native", "python"]
# What an engine does in its pool: everything (today's engines), or one side of a
# prefill/decode-disaggregated pool (``router.pd.exchange``).
Role = Literal["mixed", "prefill", "decode"]
ROLES: tuple[str, ...] = typing.get_args(Role)
PdProtocol = Literal["vllm", "sglang"]
EppBodyMode = Literal["full_duplex_streamed", "buffered"]


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    id: str
    url: str
    model: str | None = None  # None: learnt from the engine's /v1/models
    pool: str = DEFAULT_POOL
    block_size: int | None = None  # None: the router's block_size
    role: Role = "mixed"
    bootstrap_port: int | None = None  # SGLang prefill engines; None: pd_bootstrap_port
    dp_size: int = 1  # data-parallel ranks, each its own KV cache (router/workers/dp.py)
    dp_field: DpField = "header"  # how the chosen rank reaches the engine
    # a hybrid model's KV-cache groups in group_idx order ("full,sliding_window:4096"),
    # for engines whose events do not name their kinds (index/groups.py); "": from events
    kv_groups: str = ""


@dataclass(frozen=True, slots=True)
class DiscoverySpec:
    """Engines behind one DNS name (``router.workers.discovery``), e.g. a Kubernetes headless
    service.

    ``record = "a"``: the name's A and AAAA records, each address one engine on ``port``;
    ``"srv"``: its SRV records, each target:port one engine. Every discovered engine gets
    ``model``, ``pool`` and ``block_size`` like a ``[[workers]]`` entry.
    """

    name: str
    record: str = "a"  # "a" (A + AAAA) or "srv"
    port: int = 8000  # the engines' port for A/AAAA records (SRV records carry their own)
    scheme: str = "http"
    model: str | None = None
    pool: str = DEFAULT_POOL
    block_size: int | None = None
    interval: float = 5.0  # seconds between resolutions
    nameserver: str | None = None  # HOST or HOST:PORT; None: the system's resolv.conf


@dataclass(frozen=True, slots=True)
class KubernetesSpec:
    """Pods of one namespace by label selector, watched (``router.workers.kubernetes``).

    ``prefill_selector`` and ``decode_selector`` find a disaggregated pool's two roles
    (``selector`` then finds mixed engines, and may be empty). Every engine found gets
    ``model``, ``pool`` and ``block_size`` like a ``[[workers]]`` entry; a pod's
    ``cache-router.io/*`` annotations may say its own worker id, port, DP size, model.
    """

    selector: str = ""
    namespace: str | None = None  # None: the service account's
    prefill_selector: str = ""
    decode_selector: str = ""
    port: int = 8000  # the engines' port, unless a pod's annotation says
    scheme: str = "http"
    model: str | None = None
    pool: str = DEFAULT_POOL
    block_size: int | None = None
    api_server: str | None = None  # None: https://$KUBERNETES_SERVICE_HOST:$..._PORT
    token_file: str | None = None  # None: the service account's
    ca_file: str | None = None  # None: the service account's (with api_server unset)
    watch_timeout: float = 300.0  # seconds a watch is asked to last
    interval: float = 2.0  # seconds between reaps, and a failed call's retry


@dataclass(frozen=True, slots=True)
class ModelSpec:
    tokenizer: str | None = None  # path to tokenizer.json or a dir holding it
    # A LoRA adapter of this base model (vLLM --lora-modules NAME=PATH; SGLang --lora-paths):
    # served where the base is, hashed under the adapter's name, the base's tokenizer.
    base: str | None = None


class Range(NamedTuple):
    low: float
    high: float
    low_open: bool = False  # the bound itself is not allowed (e.g. a timeout of 0)


S = TypeVar("S")
_DURATION = Range(0, 86_400.0, low_open=True)  # seconds; a day bounds every wait
_SECONDS = Range(0, 86_400.0)  # a duration where 0 means "off" or "at once"
_COUNT = Range(1, 1_000_000)


def setting(default: Any, bounds: Range | None = None, *, flag: str | None = None) -> Any:
    """A scalar setting: its default, the bounds of a number, and the ``--flag`` help if
    it has a flag (the flag names are a contract: scripts pass them)."""
    return field(default=default, metadata={"range": bounds, "flag": flag})


def table(factory: Callable[[], Any]) -> Any:
    """A table setting (workers, arms...): TOML only, parsed by its own function."""
    return field(default_factory=factory, metadata={"table": True})


# The sections: one concern each, frozen, typed. ``RouterConfig`` is all of them at once,
# since TOML keys, ``CACHE_ROUTER_*`` variables and flags are one flat namespace users
# script against (``port``, not ``http.port``); a module states the section it reads
# (``Upstream(cfg: UpstreamSettings)``) and mypy holds it to that.


@dataclass(frozen=True, kw_only=True)
class HttpSettings:
    """The client-facing listener: where, how much a client may send, how long it may
    take, and how long a shutdown waits for requests in flight."""

    host: str = setting("127.0.0.1", flag="listen address (default 127.0.0.1)")
    port: int = setting(8000, Range(1, 65_535), flag="listen port (default 8000)")
    max_body_bytes: int = setting(8 * 1024 * 1024, Range(0, 1 << 34, low_open=True))
    max_header_count: int = setting(100, _COUNT)
    # all request header names and values together
    max_header_bytes: int = setting(32 * 1024, Range(0, 1 << 30, low_open=True))
    body_timeout: float = setting(30.0, _DURATION)  # seconds a client may take to send a body
    header_timeout: float = setting(10.0, _DURATION)  # a request's first byte to its last header
    idle_timeout: float = setting(5.0, _DURATION)  # an idle keep-alive client connection
    max_connections: int | None = setting(None, Range(1, 1 << 20))  # None: from the fd limit
    drain_timeout: float = setting(30.0, _SECONDS)  # graceful shutdown: in-flight requests' time
    # TLS on the listener (router.http.tls): read again when the files change (renewals)
    tls_cert: str | None = setting(
        None, flag="TLS certificate chain (PEM) for the listener, reloaded when it changes"
    )
    tls_key: str | None = setting(None, flag="the TLS certificate's private key (PEM)")
    tls_client_ca: str | None = setting(None)  # clients must show a certificate it signed


@dataclass(frozen=True, kw_only=True)
class SecuritySettings:
    """Who may call what, and which credentials travel on to the engines."""

    admin_token: str | None = setting(None, flag="bearer token for /admin/* (off without it)")
    metrics_token: str | None = setting(None, flag="bearer token for /metrics (open without it)")
    api_keys: list[str] = table(list)  # empty: the public API is open
    forward_authorization: bool = setting(False)  # pass the client's Authorization to the engine


@dataclass(frozen=True, kw_only=True)
class LimitSettings:
    """Router-side caps on what one request may ask an engine for."""

    max_n: int = setting(128, _COUNT)  # largest "n" (choices per request)
    max_best_of: int = setting(128, _COUNT)  # largest "best_of" (candidates generated)
    # largest "top_logprobs" / completions "logprobs" (vLLM's)
    max_top_logprobs: int = setting(20, Range(0, 1 << 20))
    max_tokens: int = setting(1 << 20, Range(1, 1 << 31))  # largest max_(completion_)tokens


@dataclass(frozen=True, kw_only=True)
class UpstreamSettings:
    """Sending to engines: how long to wait, when to retry, when to stop trying one."""

    request_timeout: float = setting(600.0, _DURATION)  # for the engine's response headers
    stall_after: float = setting(5.0, _DURATION)  # a down engine this silent fails its requests
    connect_retries: int = setting(2, Range(0, 64))  # other workers tried when nothing reached one
    breaker_failures: int = setting(3, _COUNT)  # consecutive failures that open the breaker
    breaker_cooldown: float = setting(5.0, _SECONDS)  # seconds before a half-open trial request


@dataclass(frozen=True, kw_only=True)
class HealthSettings:
    """The health checker and the engines' load reports."""

    health_interval: float = setting(2.0, _DURATION)
    health_timeout: float = setting(1.0, _DURATION)
    unhealthy_after: int = setting(2, _COUNT)  # consecutive failed checks before a worker is down
    healthy_after: int = setting(1, _COUNT)  # consecutive good checks before it is back
    load_stale_after: float = setting(5.0, _DURATION)  # older engine load is ignored (and scraped)


@dataclass(frozen=True, kw_only=True)
class RoutingSettings:
    """How a request becomes a decision: blocks, the policy and its experiment arms."""

    block_size: int = setting(
        16, Range(0, 1 << 16, low_open=True), flag="engine KV block size in tokens (16)"
    )
    policy: str = setting("cache_aware", flag="routing policy (default cache_aware)")
    policy_params: dict[str, Any] = table(dict)
    experiment: str = setting("default")  # the salt of the arms' request split
    arms: list[Arm] = table(list)  # A/B arms; empty: one, ``policy``
    predict_ttl: float = setting(0.0, _SECONDS)  # a routed prefix counts as cached; 0: off
    # no x-session-id or user: the session key is a hash of the conversation's opening
    # (system messages and the first user message; router.routing.session_key)
    derive_session_key: bool = setting(True)
    max_index_blocks: int | None = setting(None, Range(1, 1 << 40))
    gateway: bool = setting(
        False,
        flag="region gateway: workers are cluster routers, policy session_affinity by default",
    )  # workers are cluster routers: no tokenizer, no index, no NATS


@dataclass(frozen=True, kw_only=True)
class PdSettings:
    """Prefill/decode-disaggregated pools (``router.pd.exchange``): the engines' wire protocol and
    the decode side's choice; pools of mixed workers never read these."""

    pd_protocol: PdProtocol = setting(
        "vllm", flag="disaggregated pools: vllm (KV-connector params) or sglang (bootstrap)"
    )
    pd_bootstrap_port: int = setting(8998, Range(1, 65_535))  # SGLang's default bootstrap port
    pd_local_prefill_tokens: int = setting(
        0,
        Range(0, 1 << 24),
        flag="disaggregated pools: the decode engine prefills itself below this many "
        "uncached tokens",
    )
    decode_policy: str = setting(
        "decode_load", flag="disaggregated pools: the decode side's policy (decode_load)"
    )
    # the prefill engines' instance of ``policy`` (without ``arms``; an arm has its own):
    # these over ``policy_params``, over the policy's prefill-side defaults
    # (``Policy.prefill_params``)
    prefill_params: dict[str, Any] = table(dict)


@dataclass(frozen=True, kw_only=True)
class TokenizerSettings:
    """Where each model's tokenizer is, when tokenizing leaves the event loop, and how
    much the pool it leaves for may hold (``router.tokens.pool``)."""

    tokenizer: str | None = setting(
        None, flag="tokenizer.json or its directory, for every model"
    )  # the default for models without their own
    models: dict[str, ModelSpec] = table(dict)
    # text left to encode (after the conversation prefix cache) over this goes to the pool
    offload_chars: int = setting(4096, Range(0, 1 << 34))
    tokenize_threads: int = setting(2, Range(1, 256))  # the thread pool's threads
    # processes that encode texts of 64K characters and more (router.tokens.pool), started at
    # the first: their ids, as Python ints, would hold the GIL 5-15 ms at 128K tokens. 0: off
    tokenize_processes: int = setting(2, Range(0, 256))
    # prompts the pool holds (waiting or being tokenized); one more is refused with 429
    tokenize_queue: int = setting(64, Range(1, 1 << 20))
    tokenize_timeout: float = setting(30.0, _DURATION)  # a prompt's wait for its tokens; then 503
    # /v1/completions text prompts go to the engine as the router's token ids (vLLM and
    # SGLang take ids there), so the engine does not tokenize them again; only for models
    # with a tokenizer (the fallback's ids are not the engine's). Off: bodies go unchanged.
    forward_token_ids: bool = setting(False)
    # the conversation prefix cache (router.tokens.prefix_cache): a chat's token ids and block
    # hashes up to its last cut point, so the next turn encodes only what is new; 64 MiB
    # keeps the newest turn of ~450 conversations of 32K tokens. 0: off
    prefix_cache_mb: int = setting(
        64, Range(0, 1 << 20), flag="MiB of chat prefixes kept tokenized and hashed (0: off)"
    )

    def tokenizer_for(self, model: str) -> str | None:
        spec = self.models.get(model)
        if spec and spec.tokenizer:
            return spec.tokenizer
        if spec and spec.base and spec.base != model:
            return self.tokenizer_for(spec.base)
        return self.tokenizer


@dataclass(frozen=True, kw_only=True)
class NatsSettings:
    """The NATS connection: where, under which prefix, with which credentials."""

    nats_url: str | None = setting(
        None, flag="NATS for KV events; omit to route on load alone"
    )  # None: no KV events, route on load alone
    subject_prefix: str = setting(DEFAULT_PREFIX, flag="NATS subject prefix (default kv)")
    nats_user: str | None = setting(None)
    nats_password: str | None = setting(None)
    nats_token: str | None = setting(None)
    nats_credentials: str | None = setting(None)  # a .creds file (JWT + nkey seed; needs nkeys)
    nats_tls_ca: str | None = setting(None)  # CA bundle; a tls:// url or any nats_tls_*: TLS on
    nats_tls_cert: str | None = setting(None)  # client certificate (mutual TLS), with nats_tls_key
    nats_tls_key: str | None = setting(None)


@dataclass(frozen=True, kw_only=True)
class ReplicaSettings:
    """Replicas: the event stream they all read and the load they share."""

    events_transport: Transport = setting(
        "auto",
        flag="KV events from the JetStream stream or live core NATS (auto: the stream if there)",
    )
    events_reader: EventsReader = setting(
        "auto",
        flag="who reads core NATS events: the native core's thread or nats-py (auto: native)",
    )
    events_stream: str = setting("KV_EVENTS")  # JetStream stream on <subject_prefix>.events.>
    events_max_age: float = setting(900.0, _DURATION)  # history kept (when this router creates it)
    events_max_bytes: int = setting(256 << 20, Range(0, 1 << 50, low_open=True))  # likewise
    blind_after: float = setting(2.0, _SECONDS)  # without the event feed, routing ignores hits
    replica_id: str | None = setting(
        None, flag="this replica's name among its peers (random)"
    )  # None: <host>-<pid>-<random>
    share_interval: float = setting(0.005, Range(0, 3_600.0))  # between messages to peers; 0: off
    peer_ttl: float = setting(3.0, _DURATION)  # a peer silent this long has its load dropped
    # router processes on one port (SO_REUSEPORT), each a replica of the others (router/
    # processes.py); more than 1 needs nats_url, where they share load and read events
    processes: int = setting(
        1, Range(1, 64), flag="router processes on the port, replicas over NATS (default 1)"
    )


@dataclass(frozen=True, kw_only=True)
class ObserveSettings:
    """What the router tells about itself beyond metrics."""

    tracing: bool = setting(
        False, flag="OpenTelemetry spans, exported as the OTEL_* variables say (tracing extra)"
    )  # exported as OTEL_* says (router/observe/tracing.py)
    audit_bound: float = setting(0.25, Range(0, 1.0, low_open=True))  # warn past this mismatch
    forecast_tracked: int = setting(2048, Range(0, 1 << 20))  # blocks the forecast samples; 0: off


@dataclass(frozen=True, kw_only=True)
class EppSettings:
    """The Endpoint Picker of a Gateway API inference gateway (``router.epp``): Envoy's
    ``ext_proc`` over gRPC, beside the HTTP listener."""

    epp_port: int | None = setting(
        None,
        Range(1, 65_535),
        flag="gRPC port of the Endpoint Picker (Envoy ext_proc) for a Gateway API "
        "inference gateway (off without it)",
    )
    # the request body mode of a gateway that does not say its own (Envoy before 1.34);
    # GIE's gateways run full_duplex_streamed
    epp_body_mode: EppBodyMode = setting("full_duplex_streamed")


@dataclass(frozen=True, kw_only=True)
class FleetSettings:
    """The engines: listed, or found behind DNS names or from the Kubernetes API."""

    workers: list[WorkerSpec] = table(list)
    discovery: list[DiscoverySpec] = table(list)  # DNS names of engines
    kubernetes: list[KubernetesSpec] = table(list)  # pods by label selector


@dataclass(frozen=True, kw_only=True)
class RouterConfig(
    HttpSettings,
    SecuritySettings,
    LimitSettings,
    UpstreamSettings,
    HealthSettings,
    RoutingSettings,
    PdSettings,
    TokenizerSettings,
    NatsSettings,
    ReplicaSettings,
    ObserveSettings,
    EppSettings,
    FleetSettings,
):
    """Every setting; built once by ``load_config`` (or directly, in tests), then read-only.

    The scalar fields' type hints are what TOML values, env text and flags are converted
    to (``Literal`` ones are choices); each field's ``setting`` bounds its number.
    """

    def section(self, kind: type[S]) -> S:
        """Only the settings of section ``kind``, for a part that needs nothing else."""
        return kind(**{f.name: getattr(self, f.name) for f in dataclasses.fields(kind)})  # type: ignore[arg-type]


SECTIONS: tuple[type, ...] = RouterConfig.__bases__


def _model_spec(spec: Any, where: str) -> ModelSpec:
    spec = spec or {}
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{where} must be a table")
    for key in ("tokenizer", "base"):
        if spec.get(key) is not None and not isinstance(spec[key], str):
            raise ConfigError(f"{where}.{key} must be a string")
    return ModelSpec(tokenizer=spec.get("tokenizer"), base=spec.get("base"))


class Scalar(NamedTuple):
    """What a scalar setting's type hint says: its type, choices, whether None is allowed."""

    kind: type
    optional: bool
    choices: tuple[str, ...] = ()


def _scalar(hint: Any) -> Scalar:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = len(args) < len(typing.get_args(hint))
    if typing.get_origin(hint) is Literal:
        return Scalar(str, False, tuple(args))
    if not args:
        return Scalar(hint, False)
    if len(args) == 1 and typing.get_origin(args[0]) is Literal:
        return Scalar(str, optional, tuple(typing.get_args(args[0])))
    (kind,) = args
    return Scalar(kind, optional)


_FIELDS = {f.name: f for f in dataclasses.fields(RouterConfig)}
_HINTS = typing.get_type_hints(RouterConfig)
TABLES = frozenset(name for name, f in _FIELDS.items() if f.metadata.get("table"))
SCALARS: dict[str, Scalar] = {name: _scalar(_HINTS[name]) for name in _FIELDS if name not in TABLES}
# Bounds of every numeric setting; None-valued ones (unset) are not checked.
RANGES: dict[str, Range] = {
    name: f.metadata["range"] for name, f in _FIELDS.items() if f.metadata.get("range")
}
# The settings with a ``--name-with-dashes`` flag and its help, section by section.
FLAGS: tuple[tuple[str, str], ...] = tuple(
    (f.name, f.metadata["flag"])
    for section in SECTIONS
    for f in dataclasses.fields(section)
    if f.metadata.get("flag")
)


def check_worker(spec: WorkerSpec, where: str) -> WorkerSpec:
    """``spec`` if its id is subject-safe and its url a plain http(s) origin."""
    problem = worker_id_error(spec.id)
    if problem is not None:
        raise ConfigError(f"{where}: {problem}")
    try:
        url = urlsplit(spec.url)
        url.port  # noqa: B018 - raises ValueError on a port that is not a number
    except ValueError as exc:
        raise ConfigError(f"{where}: worker {spec.id}: bad url {spec.url!r}: {exc}") from exc
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ConfigError(
            f"{where}: worker {spec.id}: url must be http:// or https:// with a host, "
            f"not {spec.url[:80]!r}"
        )
    if url.username is not None or url.query or url.fragment:
        raise ConfigError(
            f"{where}: worker {spec.id}: url must not carry credentials, a query or a fragment"
        )
    return spec


def parse_worker(text: str) -> WorkerSpec:
    """``ID=URL`` or ``ROLE:ID=URL`` (the ``--worker`` flag and ``CACHE_ROUTER_WORKERS``
    entries); ROLE is prefill, decode or mixed (a worker id cannot hold a ``:``)."""
    wid, sep, url = text.partition("=")
    role, colon, name = wid.partition(":")
    if not colon:
        role, name = "mixed", wid
    if not sep or not name.strip() or not url.strip():
        raise ConfigError(f"worker {text!r}: expected ID=URL or ROLE:ID=URL")
    role = role.strip()
    if role not in ROLES:
        raise ConfigError(f"worker {text!r}: role must be {', '.join(ROLES)}, not {role!r}")
    spec = WorkerSpec(id=name.strip(), url=url.strip().rstrip("/"), role=role)  # type: ignore[arg-type]
    return check_worker(spec, "--worker")


def _coerce(name: str, value: Any) -> Any:
    """``value`` (from TOML, env text or a flag) as the type of setting ``name``."""
    scalar = SCALARS[name]
    if value is None or (isinstance(value, str) and value == "" and scalar.optional):
        if not scalar.optional:
            raise ConfigError(f"{name} cannot be empty")
        return None
    try:
        if scalar.kind is bool:
            return _bool(value)
        if scalar.kind is int:
            if isinstance(value, bool):
                raise ValueError("bool")
            return int(value)
        if scalar.kind is float:
            return float(value)
        text = str(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: {value!r} is not a valid {scalar.kind.__name__}") from exc
    if scalar.choices and text not in scalar.choices:
        raise ConfigError(f"{name} must be {' or '.join(scalar.choices)}, not {text!r}")
    return text


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(value)


def worker_spec(raw: Any, where: str) -> WorkerSpec:
    """A worker from a TOML table or an admin API body."""
    if not isinstance(raw, Mapping) or not raw.get("id") or not raw.get("url"):
        raise ConfigError(f"{where}: a worker needs id and url")
    unknown = set(raw) - {
        "id", "url", "model", "pool", "block_size", "role", "bootstrap_port", "dp_size",
        "dp_field", "kv_groups",
    }  # fmt: skip
    if unknown:
        raise ConfigError(f"{where}: unknown worker keys {sorted(unknown)}")
    block = raw.get("block_size")
    if block is not None and (not isinstance(block, int) or block <= 0):
        raise ConfigError(f"{where}: block_size must be a positive int")
    role = raw.get("role", "mixed")
    if role not in ROLES:
        raise ConfigError(f"{where}: role must be {', '.join(ROLES)}, not {role!r}")
    port = raw.get("bootstrap_port")
    if port is not None and (
        not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536
    ):
        raise ConfigError(f"{where}: bootstrap_port must be a port number (1-65535)")
    dp_size = raw.get("dp_size", 1)
    if not isinstance(dp_size, int) or isinstance(dp_size, bool) or not 1 <= dp_size <= MAX_DP_SIZE:
        raise ConfigError(f"{where}: dp_size must be an int in [1, {MAX_DP_SIZE}]")
    dp_field = raw.get("dp_field", "header")
    if dp_field not in DP_FIELDS:
        raise ConfigError(f"{where}: dp_field must be {' or '.join(DP_FIELDS)}, not {dp_field!r}")
    kv_groups = raw.get("kv_groups", "")
    try:
        if not isinstance(kv_groups, str):
            raise ValueError('kv_groups must be a string like "full,sliding_window:4096"')
        parse_groups(kv_groups)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    for key in ("id", "url"):
        if not isinstance(raw[key], str):
            raise ConfigError(f"{where}: worker {key} must be a string")
    spec = WorkerSpec(
        id=raw["id"],
        url=raw["url"].rstrip("/"),
        model=raw.get("model"),
        pool=str(raw.get("pool") or DEFAULT_POOL),
        block_size=block,
        role=role,
        bootstrap_port=port,
        dp_size=dp_size,
        dp_field=dp_field,
        kv_groups=kv_groups,
    )
    return check_worker(spec, where)


def _params(key: str) -> Callable[[Any, str], dict[str, Any]]:
    """The parser of a policy parameters table (``policy_params``, ``prefill_params``)."""

    def parse(value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: {key} must be a table")
        return dict(value)

    return parse


def _workers(value: Any, where: str) -> list[WorkerSpec]:
    if not isinstance(value, list):
        raise ConfigError(f"{where}: workers must be an array of tables")
    return [worker_spec(w, f"{where} workers[{i}]") for i, w in enumerate(value)]


def _models(value: Any, where: str) -> dict[str, ModelSpec]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: models must be a table of tables")
    return {name: _model_spec(spec, f"{where} models.{name}") for name, spec in value.items()}


def _arms(value: Any, where: str) -> list[Arm]:
    if not isinstance(value, list):
        raise ConfigError(f"{where}: arms must be an array of tables")
    return [_arm_spec(a, f"{where} arms[{i}]") for i, a in enumerate(value)]


def _discovery(value: Any, where: str) -> list[DiscoverySpec]:
    if not isinstance(value, list):
        raise ConfigError(f"{where}: discovery must be an array (strings or tables)")
    return [discovery_spec(d, f"{where} discovery[{i}]") for i, d in enumerate(value)]


def _kubernetes(value: Any, where: str) -> list[KubernetesSpec]:
    if not isinstance(value, list):
        raise ConfigError(f"{where}: kubernetes must be an array (strings or tables)")
    return [kubernetes_spec(k, f"{where} kubernetes[{i}]") for i, k in enumerate(value)]


def _api_keys(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(k, str) and k for k in value):
        raise ConfigError(f"{where}: api_keys must be a list of non-empty strings")
    return list(value)


# How each table setting is read from TOML (``where`` names the file in errors).
TABLE_PARSERS: dict[str, Callable[[Any, str], Any]] = {
    "policy_params": _params("policy_params"),
    "prefill_params": _params("prefill_params"),
    "workers": _workers,
    "models": _models,
    "arms": _arms,
    "discovery": _discovery,
    "kubernetes": _kubernetes,
    "api_keys": _api_keys,
}


def _from_toml(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The settings a TOML document sets, converted and checked one by one."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in SCALARS:
            out[key] = _coerce(key, value)
        elif key in TABLE_PARSERS:
            out[key] = TABLE_PARSERS[key](value, where)
        else:
            raise ConfigError(f"{where}: unknown setting {key!r}")
    return out


def _arm_spec(raw: Any, where: str) -> Arm:
    try:
        return parse_arm(raw, where)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def load_config(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    extra_workers: list[str] | None = None,
    extra_discovery: list[str] | None = None,
) -> RouterConfig:
    """Build the config: defaults, then the TOML file, env ``CACHE_ROUTER_*``, ``overrides``.

    ``overrides`` are flag values (None means "not given"); ``extra_workers`` are
    ``ID=URL`` strings added after the file's workers (a repeated id replaces one);
    ``extra_discovery`` are ``--discover`` strings added after the file's and env's
    (``k8s://`` ones are Kubernetes sources, the others DNS names).
    A gateway whose policy no layer names gets ``session_affinity``, its natural one.
    """
    values: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        values.update(_from_toml(data, str(path)))
    env = os.environ if env is None else env
    for name in SCALARS:
        key = ENV_PREFIX + name.upper()
        if key in env:
            values[name] = _coerce(name, env[key])
    workers = [w for w in env.get(ENV_PREFIX + "WORKERS", "").split(",") if w.strip()]
    keys = [k.strip() for k in env.get(ENV_PREFIX + "API_KEYS", "").split(",") if k.strip()]
    if keys:
        values["api_keys"] = keys
    found = [d.strip() for d in env.get(ENV_PREFIX + "DISCOVER", "").split(",") if d.strip()]
    found += [d.strip() for d in extra_discovery or []]
    pods = [d for d in found if d.startswith(K8S_SCHEME)]  # the Kubernetes API's
    values["discovery"] = [
        *values.get("discovery", []),
        *(discovery_spec(d, "discover") for d in found if d not in pods),
    ]
    values["kubernetes"] = [
        *values.get("kubernetes", []),
        *(kubernetes_spec(d, "discover") for d in pods),
    ]
    for name, value in (overrides or {}).items():
        if value is not None:
            values[name] = _coerce(name, value)
    if values.get("gateway") and "policy" not in values:
        values["policy"] = "session_affinity"
    by_id = {w.id: w for w in values.get("workers", [])}
    for text in [*workers, *(extra_workers or [])]:
        spec = parse_worker(text)
        by_id[spec.id] = spec
    values["workers"] = list(by_id.values())
    cfg = RouterConfig(**values)
    validate(cfg)
    return cfg


def validate(cfg: RouterConfig) -> None:
    """Reject settings that cannot work, with the reason, before anything starts."""
    for name, bounds in RANGES.items():
        check_range(name, getattr(cfg, name), bounds)
    for name, scalar in SCALARS.items():
        value = getattr(cfg, name)
        if scalar.choices and value not in scalar.choices:
            raise ConfigError(f"{name} must be {' or '.join(scalar.choices)}, not {value!r}")
    for w in cfg.workers:
        check_worker(w, "workers")
    pool_of: dict[str, str] = {}
    block_of: dict[str, int] = {}
    for w in cfg.workers:
        if w.model is not None and pool_of.setdefault(w.model, w.pool) != w.pool:
            raise ConfigError(f"model {w.model} is served by pools {pool_of[w.model]} and {w.pool}")
        size = w.block_size or cfg.block_size
        if block_of.setdefault(w.pool, size) != size:
            raise ConfigError(f"pool {w.pool} mixes block sizes {block_of[w.pool]} and {size}")
    _validate_roles(cfg)
    if cfg.gateway:
        policies = {cfg.policy, *(a.policy for a in cfg.arms)} if cfg.arms else {cfg.policy}
        index_bound = sorted(policies - GATEWAY_POLICIES)
        if index_bound:
            raise ConfigError(
                f"gateway mode does not tokenize or index prompts; policy {index_bound} needs "
                f"them: use one of {', '.join(sorted(GATEWAY_POLICIES))}"
            )
        if cfg.nats_url:
            raise ConfigError("gateway mode takes no nats_url: it routes on sessions and load")
    for name in ("nats_credentials", "nats_tls_ca", "nats_tls_cert", "nats_tls_key"):
        path = getattr(cfg, name)
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"{name}: no such file {path}")
    if (cfg.nats_tls_cert is None) != (cfg.nats_tls_key is None):
        raise ConfigError("nats_tls_cert and nats_tls_key go together")
    for name in ("tls_cert", "tls_key", "tls_client_ca"):
        path = getattr(cfg, name)
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"{name}: no such file {path}")
    if cfg.tls_cert is None and (cfg.tls_key is not None or cfg.tls_client_ca is not None):
        raise ConfigError("tls_key and tls_client_ca need tls_cert")
    if cfg.epp_port is not None and cfg.epp_port == cfg.port:
        raise ConfigError(f"epp_port {cfg.epp_port} is the HTTP port: the EPP needs its own")
    names = [a.name for a in cfg.arms]
    if len(names) != len(set(names)):
        raise ConfigError("experiment arm names must be unique")
    _validate_replicas(cfg)


def pool_roles_error(pool: str, roles: AbstractSet[str]) -> str | None:
    """Why a pool with workers of ``roles`` cannot work, or None: a pool is mixed or
    disaggregated (prefill and decode engines), never both, since a mixed engine takes
    neither side's wire protocol."""
    if "mixed" in roles and len(roles) > 1:
        return f"pool {pool} mixes mixed workers with {'/'.join(sorted(roles - {'mixed'}))} ones"
    return None


def role_error(spec: WorkerSpec, protocol: PdProtocol) -> str | None:
    """Why a worker's role cannot be served: an SGLang prefill or decode engine with DP
    ranks reads its rank from the body (``routed_dp_rank``), never from vLLM's header, so
    a rank sent there would be lost and the index would match against the wrong cache."""
    sglang = protocol == "sglang" and spec.role != "mixed"
    if sglang and spec.dp_size > 1 and spec.dp_field == "header":
        return (
            f"worker {spec.id}: an SGLang {spec.role} worker with dp_size > 1 takes "
            'dp_field = "routed_dp_rank" (or "data_parallel_rank", its older name)'
        )
    return None


def _validate_roles(cfg: RouterConfig) -> None:
    roles: dict[str, set[str]] = {}
    for w in cfg.workers:
        roles.setdefault(w.pool, set()).add(w.role)
        if (error := role_error(w, cfg.pd_protocol)) is not None:
            raise ConfigError(error)
    for pool, found in roles.items():
        error = pool_roles_error(pool, found)
        if error is None and found == {"prefill"}:
            error = f"pool {pool} has prefill workers but no decode worker to answer"
        if error is not None:
            raise ConfigError(error)
    if cfg.gateway and any(w.role != "mixed" for w in cfg.workers):
        raise ConfigError("gateway mode routes to clusters: workers cannot have roles")


def check_range(name: str, value: float | None, bounds: Range) -> None:
    """ConfigError unless ``value`` (None: unset) lies within ``bounds``."""
    if value is None:
        return
    low, high, low_open = bounds
    if low_open and not value > low:  # NaN fails here too
        raise ConfigError(f"{name} must be positive, not {value!r}")
    if not low <= value:
        raise ConfigError(f"{name} must be at least {low:g}, not {value!r}")
    if not value <= high:
        raise ConfigError(f"{name} must be at most {high:g}, not {value!r}")


def native_reader_problem(cfg: RouterConfig) -> str | None:
    """Why the native event reader cannot read this config's events (None: it can). It
    speaks plain core NATS with no auth, user/password or a token; TLS and credentials
    files stay with nats-py. With the JetStream stream it takes the live events over once
    nats-py read the stream up to date (router.events.feed)."""
    if not NATIVE:
        return "the native core is not built (pip install -e . builds it)"
    from index import _native  # built: NATIVE

    if not hasattr(_native, "EventReader"):  # a build from before the reader
        return "the native core was built without it: rebuild (pip install -e .)"
    if not cfg.nats_url:
        return "it needs nats_url"
    if cfg.nats_credentials is not None:
        return "it cannot sign with a credentials file (nkeys): leave it to nats-py"
    if cfg.nats_tls_ca or cfg.nats_tls_cert:
        return "it speaks no TLS: leave it to nats-py"
    for url in cfg.nats_url.split(","):
        parts = urlsplit(url.strip())
        if parts.scheme not in ("nats", ""):
            return f"it speaks no {parts.scheme}:// (plain nats:// only)"
    return None


def _validate_replicas(cfg: RouterConfig) -> None:
    if not re.fullmatch(r"[A-Za-z0-9_-]+", cfg.events_stream):
        raise ConfigError(f"events_stream {cfg.events_stream!r}: letters, digits, - and _ only")
    if cfg.replica_id is not None and not re.fullmatch(r"[A-Za-z0-9_-]+", cfg.replica_id):
        raise ConfigError(f"replica_id {cfg.replica_id!r}: letters, digits, - and _ only")
    if cfg.events_reader == "native" and (problem := native_reader_problem(cfg)) is not None:
        raise ConfigError(f"events_reader = native: {problem}")
    if cfg.processes > 1 and not cfg.nats_url:
        raise ConfigError(
            f"processes = {cfg.processes} needs nats_url: without NATS each process would "
            "route on its own load and index, blind to the others"
        )
    if cfg.processes > 1 and cfg.share_interval <= 0:
        raise ConfigError(
            f"processes = {cfg.processes} needs share_interval > 0: the processes share "
            "their in-flight load over NATS"
        )


_DISCOVERY_KEYS = frozenset(f.name for f in dataclasses.fields(DiscoverySpec))
MAX_DISCOVERY_INTERVAL = 3600.0


def discovery_spec(raw: Any, where: str) -> DiscoverySpec:
    """A discovery source from a TOML table or the string form (flag, env, TOML array):

    ``dns://NAME:PORT?model=M&pool=P&block_size=B&interval=S&nameserver=H:P&scheme=https``
    for A/AAAA records, ``srv://NAME?...`` for SRV records.
    """
    if isinstance(raw, str):
        table = _discovery_url(raw, where)
    elif isinstance(raw, Mapping):
        table = dict(raw)
    else:
        raise ConfigError(f"{where}: a discovery source is a string or a table")
    unknown = set(table) - _DISCOVERY_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown discovery keys {sorted(unknown)}")
    name = table.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,253}", name):
        raise ConfigError(f"{where}: name must be a DNS name, not {name!r}")
    fields: dict[str, Any] = {"name": name.rstrip(".")}
    try:
        for key in sorted(_DISCOVERY_KEYS - {"name"}):
            value = table.get(key)
            if value is None:
                continue
            if key in ("port", "block_size"):
                if isinstance(value, bool | float):
                    raise ValueError(f"{key} must be an integer")
                value = int(value)
            elif key == "interval":
                value = float(value)
            else:
                value = str(value)
            fields[key] = value
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    spec = DiscoverySpec(**fields)
    if spec.record not in ("a", "srv"):
        raise ConfigError(f"{where}: record must be a (A/AAAA) or srv, not {spec.record!r}")
    if not 0 < spec.port < 65536:
        raise ConfigError(f"{where}: port {spec.port} is out of range")
    if spec.scheme not in ("http", "https"):
        raise ConfigError(f"{where}: scheme must be http or https")
    if spec.block_size is not None and spec.block_size <= 0:
        raise ConfigError(f"{where}: block_size must be positive")
    if not 0 < spec.interval <= MAX_DISCOVERY_INTERVAL:
        raise ConfigError(f"{where}: interval must be in (0, {MAX_DISCOVERY_INTERVAL:g}] s")
    return spec


def _discovery_url(text: str, where: str) -> dict[str, Any]:
    url = urlsplit(text)
    record = {"dns": "a", "srv": "srv"}.get(url.scheme)
    if record is None or not url.hostname:
        raise ConfigError(f"{where}: {text!r}: expected dns://NAME:PORT or srv://NAME")
    table: dict[str, Any] = {"name": url.hostname, "record": record}
    try:
        if url.port is not None:
            table["port"] = url.port
    except ValueError as exc:
        raise ConfigError(f"{where}: {text!r}: {exc}") from exc
    for key, value in parse_qsl(url.query, keep_blank_values=True):
        table[key] = value
    return table


K8S_SCHEME = "k8s://"
_KUBERNETES_KEYS = frozenset(f.name for f in dataclasses.fields(KubernetesSpec))
_SELECTOR = re.compile(r"[A-Za-z0-9_./=!,() -]*")  # a label selector's characters


def kubernetes_spec(raw: Any, where: str) -> KubernetesSpec:
    """A Kubernetes source from a TOML table or the string form (flag, env, TOML array):
    ``k8s://NAMESPACE?selector=app%3Dvllm&model=M&port=8000&...`` (``k8s://`` alone:
    the pod's own namespace), every key of ``KubernetesSpec`` as a query parameter."""
    if isinstance(raw, str):
        url = urlsplit(raw)
        if not raw.startswith(K8S_SCHEME):
            raise ConfigError(f"{where}: {raw!r}: expected k8s://NAMESPACE?selector=...")
        table: dict[str, Any] = dict(parse_qsl(url.query, keep_blank_values=True))
        if url.netloc:
            table["namespace"] = url.netloc
    elif isinstance(raw, Mapping):
        table = dict(raw)
    else:
        raise ConfigError(f"{where}: a kubernetes source is a string or a table")
    unknown = set(table) - _KUBERNETES_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown kubernetes keys {sorted(unknown)}")
    fields: dict[str, Any] = {}
    try:
        for key, value in table.items():
            if value is None:
                continue
            if key in ("port", "block_size"):
                if isinstance(value, bool | float):
                    raise ValueError(f"{key} must be an integer")
                value = int(value)
            elif key in ("interval", "watch_timeout"):
                value = float(value)
            else:
                value = str(value)
            fields[key] = value
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    spec = KubernetesSpec(**fields)
    selectors = (spec.selector, spec.prefill_selector, spec.decode_selector)
    if not any(selectors):
        raise ConfigError(f"{where}: a selector (or prefill_selector and decode_selector)")
    if bool(spec.prefill_selector) != bool(spec.decode_selector):
        raise ConfigError(f"{where}: prefill_selector and decode_selector go together")
    for text in selectors:
        if not _SELECTOR.fullmatch(text):
            raise ConfigError(f"{where}: {text!r} is not a label selector")
    if spec.namespace is not None and not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?",
                                                       spec.namespace):  # fmt: skip
        raise ConfigError(f"{where}: namespace {spec.namespace!r} is not a namespace name")
    if not 0 < spec.port < 65536:
        raise ConfigError(f"{where}: port {spec.port} is out of range")
    if spec.scheme not in ("http", "https"):
        raise ConfigError(f"{where}: scheme must be http or https")
    if spec.block_size is not None and spec.block_size <= 0:
        raise ConfigError(f"{where}: block_size must be positive")
    if not 0 < spec.interval <= MAX_DISCOVERY_INTERVAL:
        raise ConfigError(f"{where}: interval must be in (0, {MAX_DISCOVERY_INTERVAL:g}] s")
    if not 1 <= spec.watch_timeout <= MAX_DISCOVERY_INTERVAL:
        raise ConfigError(f"{where}: watch_timeout must be in [1, {MAX_DISCOVERY_INTERVAL:g}] s")
    for name in ("token_file", "ca_file"):
        path = getattr(spec, name)
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"{where}: {name}: no such file {path}")
    return spec
