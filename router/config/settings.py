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
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, TypeVar

from index.wire import DEFAULT_PREFIX
from policies.experiments import Arm
from router.admission.core import TenantSpec
from router.workers.dp import DpField

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
    id: str  # its name in metrics, events (the agent's worker_id) and the admin API
    url: str  # the engine's http(s) origin
    model: str | None = None  # None: learnt from the engine's /v1/models
    pool: str = DEFAULT_POOL  # workers sharing a block size and an index
    block_size: int | None = None  # None: the router's block_size
    role: Role = "mixed"  # or one side of a disaggregated pool: prefill, decode
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

    name: str  # the DNS name
    record: str = "a"  # "a" (A + AAAA) or "srv"
    port: int = 8000  # the engines' port for A/AAAA records (SRV records carry their own)
    scheme: str = "http"  # or https
    model: str | None = None  # as a [[workers]] entry's
    pool: str = DEFAULT_POOL  # as a [[workers]] entry's
    block_size: int | None = None  # as a [[workers]] entry's
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
    max_body_bytes: int = setting(8 * 1024 * 1024, Range(0, 1 << 34, low_open=True))  # a body
    max_header_count: int = setting(100, _COUNT)  # headers in one request
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
    # a migratable stream silent this long on an engine that looks healthy moves on:
    # before its first token (per 8,192 prompt tokens: a 128K prompt's prefill gets 16x)
    # and after it (0: only request_timeout; router.forward.migrate)
    first_token_stall_after: float = setting(60.0, _SECONDS)
    token_stall_after: float = setting(30.0, _SECONDS)
    connect_retries: int = setting(2, Range(0, 64))  # other workers tried when nothing reached one
    # times one request moves to another engine when its engine breaks (0: never; a
    # stream continues with its text so far, a whole answer is sent again:
    # router.forward.migrate)
    migrate_max: int = setting(2, Range(0, 16))
    breaker_failures: int = setting(3, _COUNT)  # consecutive failures that open the breaker
    breaker_cooldown: float = setting(5.0, _SECONDS)  # seconds before a half-open trial request
    # https:// engines (router.http.tls.engine_tls): their certificates checked against
    # this CA bundle (None: the system's), the router's own shown when they ask (mutual
    # TLS), both followed on renewal; hostname checks off for engines addressed by IP
    engine_tls_ca: str | None = setting(None)
    engine_tls_cert: str | None = setting(None)
    engine_tls_key: str | None = setting(None)
    engine_tls_check_hostname: bool = setting(True)


@dataclass(frozen=True, kw_only=True)
class HealthSettings:
    """The health checker and the engines' load reports."""

    health_interval: float = setting(2.0, _DURATION)  # seconds between a worker's checks
    health_timeout: float = setting(1.0, _DURATION)  # a check's wait for its answer
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
    policy_params: dict[str, Any] = table(dict)  # the policy's keyword parameters
    experiment: str = setting("default")  # the salt of the arms' request split
    arms: list[Arm] = table(list)  # A/B arms; empty: one, ``policy``
    predict_ttl: float = setting(0.0, _SECONDS)  # a routed prefix counts as cached; 0: off
    # no x-session-id or user: the session key is a hash of the conversation's opening
    # (system messages and the first user message; router.routing.session_key)
    derive_session_key: bool = setting(True)
    # blocks a pool's index holds; past it the least recently matched go. None: no bound
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
    models: dict[str, ModelSpec] = table(dict)  # per model: its tokenizer or base model
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
    # chats go to engines that take token ids (vLLM's /inference/v1/generate, SGLang's chat
    # endpoint with input_ids; found by a probe per engine) as the router's ids, answered in
    # the chat shape, so the engine does not render and tokenize the conversation again
    # (router.forward.tokens_in); Responses requests too, to vLLM, answered in the Responses
    # shape (router.forward.responses_out). Off: as today
    chat_tokens_in: bool = setting(True)
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
    nats_user: str | None = setting(None)  # user and password auth, with nats_password
    nats_password: str | None = setting(None)  # with nats_user
    nats_token: str | None = setting(None)  # token auth
    nats_credentials: str | None = setting(None)  # a .creds file (JWT + nkey seed; needs nkeys)
    nats_tls_ca: str | None = setting(None)  # CA bundle; a tls:// url or any nats_tls_*: TLS on
    nats_tls_cert: str | None = setting(None)  # client certificate (mutual TLS), with nats_tls_key
    nats_tls_key: str | None = setting(None)  # the client certificate's key


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
class OverloadSettings:
    """Admission at the router (``router.admission``): while the engines are full,
    requests wait at the router in priority and fair-share order and are bound to a
    worker when one has room; what cannot be served in time is shed at once (429/503,
    ``Retry-After``). An engine never seen full holds nothing back, so the default (on)
    costs unsaturated traffic nothing but a few microseconds."""

    admission: bool = setting(True)  # off: every request goes to an engine at once
    queue_size: int = setting(
        1024, Range(1, 1 << 20), flag="requests held at the router at most (admission; 1024)"
    )
    queue_timeout: float = setting(
        10.0, _DURATION, flag="seconds a request may wait at the router before a 503 (10)"
    )
    engine_queue: int = setting(1, Range(0, 1 << 20))  # requests a full engine still gets
    engine_max_inflight: int | None = setting(None, _COUNT)  # a fixed engine limit; None: learnt
    # the engines' token budget of one step (vLLM --max-num-batched-tokens, SGLang
    # --chunked-prefill-size): requests waiting while an engine had this many prompt
    # tokens or more to prefill (not started, or started since its last report) wait
    # for compute, not for a slot, and teach admission no limit; 0: all waiting does
    # (docs/overload.md)
    engine_batch_tokens: int = setting(2048, Range(0, 1 << 30))
    # a share of a full engine's slots kept for tenants under their fair share and for
    # urgent requests (priority < 0); 0: none, every slot works (docs/overload.md)
    reserve_share: float = setting(0.0, Range(0, 0.9))
    # the engines run vLLM's --scheduling-policy priority (their waiting queue ordered by
    # the body's priority): a request below its tenant's default priority goes to a full
    # engine, one past its limit, instead of waiting at the router (docs/overload.md)
    engine_priority_scheduling: bool = setting(False)
    # a tenant's standing queue (its oldest waited longer than an engine takes to serve a
    # request) goes newest first; off: arrival order, each waits ~queue_timeout past
    # saturation (docs/overload.md)
    queue_lifo: bool = setting(True)
    # while a tenant over its share has a standing queue, idle slots are kept pool-wide for
    # tenants under their share and urgent requests, as many as their measured pace needs
    # (docs/overload.md)
    pool_reserve: bool = setting(False)
    priority_starve_after: float = setting(5.0, _DURATION)  # waited this long: its turn comes
    priority_starve_share: int = setting(8, Range(2, 1 << 20))  # one dispatch in this many then
    tenant_header: str = setting("x-tenant-id")  # names a request's tenant (after API keys)
    # a request's answer counted in its tokens when it sets no max_tokens
    expected_output_tokens: int = setting(256, Range(1, 1 << 31))
    tenants: dict[str, TenantSpec] = table(dict)  # [tenants.NAME] weight, limits, keys


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
    # the gateway's ext_proc message_timeout (Envoy's default: 200 ms; GIE's Envoy Gateway
    # manifests set 1000 s): in buffered mode a request held by admission is answered
    # before it (a 503 rather than the gateway's own failure); full-duplex streams have
    # no message timeout (Envoy), there the hold is bounded by queue_timeout alone
    epp_message_timeout: float = setting(0.2, _DURATION)


@dataclass(frozen=True, kw_only=True)
class FleetSettings:
    """The engines: listed, or found behind DNS names or from the Kubernetes API."""

    workers: list[WorkerSpec] = table(list)  # the engines, by id and url
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
    OverloadSettings,
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
