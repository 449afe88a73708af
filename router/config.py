"""Router configuration: one source of truth, layered defaults < TOML < env < flags.

The TOML file holds everything (workers, per-model tokenizers, experiment arms); the
``CACHE_ROUTER_*`` environment variables and the command-line flags override its scalar
settings, so containers and scripts can change one knob without writing a file. The
defaults run the demo with no file at all.

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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple
from urllib.parse import parse_qsl, urlsplit

from index.wire import DEFAULT_PREFIX
from policies.experiments import Arm, parse_arm

ENV_PREFIX = "CACHE_ROUTER_"
DEFAULT_POOL = "default"
# Policies that need neither prompt tokens nor the prefix index: what a gateway can run.
GATEWAY_POLICIES = frozenset(
    ("session_affinity", "round_robin", "random", "least_load", "power_of_two")
)


class ConfigError(ValueError):
    """The configuration cannot be used; the message says which setting and why."""


Transport = Literal["auto", "jetstream", "core"]


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    id: str
    url: str
    model: str | None = None  # None: learnt from the engine's /v1/models
    pool: str = DEFAULT_POOL
    block_size: int | None = None  # None: the router's block_size


@dataclass(frozen=True, slots=True)
class DiscoverySpec:
    """Engines behind one DNS name (``router.discovery``), e.g. a Kubernetes headless service.

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
class ModelSpec:
    tokenizer: str | None = None  # path to tokenizer.json or a dir holding it
    # A LoRA adapter of this base model (vLLM --lora-modules NAME=PATH; SGLang --lora-paths):
    # served where the base is, hashed under the adapter's name, the base's tokenizer.
    base: str | None = None


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Every setting; built once by ``load_config`` (or directly, in tests), then read-only.

    The scalar fields' type hints are what TOML values, env text and flags are converted
    to (``Literal`` ones are choices); ``RANGES`` bounds the numbers.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    nats_url: str | None = None  # None: no KV events, route on load alone
    subject_prefix: str = DEFAULT_PREFIX
    block_size: int = 16
    policy: str = "cache_aware"
    policy_params: dict[str, Any] = field(default_factory=dict)
    tokenizer: str | None = None  # default for models without their own
    admin_token: str | None = None  # None: the admin API is disabled
    max_body_bytes: int = 8 * 1024 * 1024
    request_timeout: float = 600.0  # seconds to wait for the engine's response headers
    stall_after: float = 5.0  # a down engine silent this long fails the requests it holds
    connect_retries: int = 2  # other workers tried when nothing reached the engine
    audit_bound: float = 0.25  # hit audit: warn past this share of mismatched hit tokens
    predict_ttl: float = 0.0  # seconds a routed prefix counts as cached; 0 disables
    offload_chars: int = 4096  # prompts longer than this tokenize on the thread pool
    health_interval: float = 2.0
    health_timeout: float = 1.0
    unhealthy_after: int = 2  # consecutive failed checks before a worker is down
    healthy_after: int = 1  # consecutive good checks before it is back
    breaker_failures: int = 3  # consecutive request failures that open the breaker
    breaker_cooldown: float = 5.0  # seconds before a half-open trial request
    load_stale_after: float = 5.0  # engine load older than this is ignored (and scraped)
    drain_timeout: float = 30.0  # graceful shutdown: seconds in-flight requests may take
    max_index_blocks: int | None = None
    tracing: bool = False  # OpenTelemetry spans, exported as OTEL_* says (router/tracing.py)
    experiment: str = "default"
    forecast_tracked: int = 2048  # blocks per stack the online forecast samples; 0: off
    # -- the edge: gateway mode, limits, credentials --
    gateway: bool = False  # workers are cluster routers: no tokenizer, no index, no NATS
    api_keys: list[str] = field(default_factory=list)  # empty: the public API is open
    metrics_token: str | None = None  # None: /metrics is open (scrapers inside the network)
    max_n: int = 128  # largest "n" (choices per request) passed on to an engine
    max_best_of: int = 128  # largest "best_of" (candidates an engine generates)
    max_top_logprobs: int = 20  # largest "top_logprobs" / completions "logprobs" (vLLM's)
    max_tokens: int = 1 << 20  # largest max_tokens / max_completion_tokens
    forward_authorization: bool = False  # pass the client's Authorization to the engine
    max_header_count: int = 100
    max_header_bytes: int = 32 * 1024  # all request header names and values together
    body_timeout: float = 30.0  # seconds a client may take to send its request body
    header_timeout: float = 10.0  # seconds from a request's first byte to its last header
    idle_timeout: float = 5.0  # seconds an idle keep-alive client connection stays open
    max_connections: int | None = None  # client connections; None: from the fd limit
    nats_user: str | None = None
    nats_password: str | None = None
    nats_token: str | None = None
    nats_credentials: str | None = None  # a .creds file (JWT + nkey seed; needs nkeys)
    nats_tls_ca: str | None = None  # CA bundle; a tls:// url or any nats_tls_* turns TLS on
    nats_tls_cert: str | None = None  # client certificate (mutual TLS), with nats_tls_key
    nats_tls_key: str | None = None
    # -- replicas: the event stream and shared load --
    events_transport: Transport = "auto"  # "auto": the stream if the server has it
    events_stream: str = "KV_EVENTS"  # JetStream stream on <subject_prefix>.events.>
    events_max_age: float = 900.0  # seconds of history kept (when this router creates it)
    events_max_bytes: int = 256 << 20  # bytes of history kept (when this router creates it)
    blind_after: float = 2.0  # seconds without the event feed before routing ignores hits
    replica_id: str | None = None  # None: <host>-<pid>-<random>
    share_interval: float = 0.005  # seconds between load/prediction messages to peers; 0: off
    peer_ttl: float = 3.0  # a peer silent this long has its load dropped
    workers: list[WorkerSpec] = field(default_factory=list)
    discovery: list[DiscoverySpec] = field(default_factory=list)  # DNS names of engines
    models: dict[str, ModelSpec] = field(default_factory=dict)
    arms: list[Arm] = field(default_factory=list)  # A/B arms; empty: one, ``policy``

    def tokenizer_for(self, model: str) -> str | None:
        spec = self.models.get(model)
        if spec and spec.tokenizer:
            return spec.tokenizer
        if spec and spec.base and spec.base != model:
            return self.tokenizer_for(spec.base)
        return self.tokenizer


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


_TABLES = ("workers", "models", "arms", "policy_params", "api_keys", "discovery")
_HINTS = typing.get_type_hints(RouterConfig)
SCALARS: dict[str, Scalar] = {
    f.name: _scalar(_HINTS[f.name])
    for f in dataclasses.fields(RouterConfig)
    if f.name not in _TABLES
}


class Range(NamedTuple):
    low: float
    high: float
    low_open: bool = False  # the bound itself is not allowed (e.g. a timeout of 0)


_DURATION = Range(0, 86_400.0, low_open=True)  # seconds; a day bounds every wait
_COUNT = Range(1, 1_000_000)

# Bounds of every numeric setting; None-valued ones (unset) are not checked.
RANGES: dict[str, Range] = {
    "port": Range(1, 65_535),
    "block_size": Range(0, 1 << 16, low_open=True),
    "max_body_bytes": Range(0, 1 << 34, low_open=True),
    "request_timeout": _DURATION,
    "stall_after": _DURATION,
    "connect_retries": Range(0, 64),
    "predict_ttl": Range(0, 86_400.0),
    "audit_bound": Range(0, 1.0, low_open=True),
    "offload_chars": Range(0, 1 << 34),
    "health_interval": _DURATION,
    "health_timeout": _DURATION,
    "unhealthy_after": _COUNT,
    "healthy_after": _COUNT,
    "breaker_failures": _COUNT,
    "breaker_cooldown": Range(0, 86_400.0),
    "load_stale_after": _DURATION,
    "drain_timeout": Range(0, 86_400.0),
    "max_index_blocks": Range(1, 1 << 40),
    "forecast_tracked": Range(0, 1 << 20),
    "max_n": _COUNT,
    "max_best_of": _COUNT,
    "max_top_logprobs": Range(0, 1 << 20),
    "max_tokens": Range(1, 1 << 31),
    "max_header_count": _COUNT,
    "max_header_bytes": Range(0, 1 << 30, low_open=True),
    "body_timeout": _DURATION,
    "header_timeout": _DURATION,
    "idle_timeout": _DURATION,
    "max_connections": Range(1, 1 << 20),
    "events_max_age": _DURATION,
    "events_max_bytes": Range(0, 1 << 50, low_open=True),
    "blind_after": Range(0, 86_400.0),
    "share_interval": Range(0, 3_600.0),
    "peer_ttl": _DURATION,
}


# A worker id is one NATS subject token (``kv.events.<id>``): no ``.``, ``*``, ``>`` or
# space, which would subscribe on other workers' subjects, and short, since the server
# closes a client whose control line exceeds 4 KiB.
WORKER_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def check_worker(spec: WorkerSpec, where: str) -> WorkerSpec:
    """``spec`` if its id is subject-safe and its url a plain http(s) origin."""
    if not WORKER_ID.fullmatch(spec.id):
        shown = spec.id if len(spec.id) <= 40 else spec.id[:40] + "..."
        raise ConfigError(
            f"{where}: worker id {shown!r} must be 1 to 128 letters, digits, - or _ "
            "(it is a NATS subject token)"
        )
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
    """``ID=URL`` (the ``--worker`` flag and ``CACHE_ROUTER_WORKERS`` entries)."""
    wid, sep, url = text.partition("=")
    if not sep or not wid.strip() or not url.strip():
        raise ConfigError(f"worker {text!r}: expected ID=URL")
    return check_worker(WorkerSpec(id=wid.strip(), url=url.strip().rstrip("/")), "--worker")


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
    unknown = set(raw) - {"id", "url", "model", "pool", "block_size"}
    if unknown:
        raise ConfigError(f"{where}: unknown worker keys {sorted(unknown)}")
    block = raw.get("block_size")
    if block is not None and (not isinstance(block, int) or block <= 0):
        raise ConfigError(f"{where}: block_size must be a positive int")
    for key in ("id", "url"):
        if not isinstance(raw[key], str):
            raise ConfigError(f"{where}: worker {key} must be a string")
    spec = WorkerSpec(
        id=raw["id"],
        url=raw["url"].rstrip("/"),
        model=raw.get("model"),
        pool=str(raw.get("pool") or DEFAULT_POOL),
        block_size=block,
    )
    return check_worker(spec, where)


def _from_toml(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The settings a TOML document sets, converted and checked one by one."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in SCALARS:
            out[key] = _coerce(key, value)
        elif key == "policy_params":
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where}: policy_params must be a table")
            out[key] = dict(value)
        elif key == "workers":
            out[key] = [worker_spec(w, f"{where} workers[{i}]") for i, w in enumerate(value)]
        elif key == "models":
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where}: models must be a table of tables")
            out[key] = {
                name: _model_spec(spec, f"{where} models.{name}") for name, spec in value.items()
            }
        elif key == "arms":
            out[key] = [_arm_spec(a, f"{where} arms[{i}]") for i, a in enumerate(value)]
        elif key == "discovery":
            if not isinstance(value, list):
                raise ConfigError(f"{where}: discovery must be an array (strings or tables)")
            out[key] = [discovery_spec(d, f"{where} discovery[{i}]") for i, d in enumerate(value)]
        elif key == "api_keys":
            if not isinstance(value, list) or not all(isinstance(k, str) and k for k in value):
                raise ConfigError(f"{where}: api_keys must be a list of non-empty strings")
            out[key] = list(value)
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
    ``extra_discovery`` are ``--discover`` strings added after the file's and env's.
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
    found = [d for d in env.get(ENV_PREFIX + "DISCOVER", "").split(",") if d.strip()]
    found += extra_discovery or []
    values["discovery"] = [
        *values.get("discovery", []),
        *(discovery_spec(d.strip(), "discover") for d in found),
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
    names = [a.name for a in cfg.arms]
    if len(names) != len(set(names)):
        raise ConfigError("experiment arm names must be unique")
    _validate_replicas(cfg)


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


def _validate_replicas(cfg: RouterConfig) -> None:
    if not re.fullmatch(r"[A-Za-z0-9_-]+", cfg.events_stream):
        raise ConfigError(f"events_stream {cfg.events_stream!r}: letters, digits, - and _ only")
    if cfg.replica_id is not None and not re.fullmatch(r"[A-Za-z0-9_-]+", cfg.replica_id):
        raise ConfigError(f"replica_id {cfg.replica_id!r}: letters, digits, - and _ only")


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
