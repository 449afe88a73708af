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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from index.wire import DEFAULT_PREFIX

ENV_PREFIX = "CACHE_ROUTER_"
DEFAULT_POOL = "default"
# Policies that need neither prompt tokens nor the prefix index: what a gateway can run.
GATEWAY_POLICIES = frozenset(
    ("session_affinity", "round_robin", "random", "least_load", "power_of_two")
)


class ConfigError(ValueError):
    """The configuration cannot be used; the message says which setting and why."""


@dataclass(slots=True)
class WorkerSpec:
    id: str
    url: str
    model: str | None = None  # None: learnt from the engine's /v1/models
    pool: str = DEFAULT_POOL
    block_size: int | None = None  # None: the router's block_size


@dataclass(slots=True)
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


@dataclass(slots=True)
class ModelSpec:
    tokenizer: str | None = None  # path to tokenizer.json or a dir holding it


@dataclass(slots=True)
class ArmSpec:
    name: str
    policy: str
    weight: float = 1.0
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RouterConfig:
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
    connect_retries: int = 2  # other workers tried when nothing reached the engine
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
    experiment: str = "default"
    # -- the edge: gateway mode, limits, credentials --
    gateway: bool = False  # workers are cluster routers: no tokenizer, no index, no NATS
    api_keys: list[str] = field(default_factory=list)  # empty: the public API is open
    metrics_token: str | None = None  # None: /metrics is open (scrapers inside the network)
    max_n: int = 128  # largest "n" (choices per request) passed on to an engine
    max_header_count: int = 100
    max_header_bytes: int = 32 * 1024  # all request header names and values together
    body_timeout: float = 30.0  # seconds a client may take to send its request body
    nats_user: str | None = None
    nats_password: str | None = None
    nats_token: str | None = None
    nats_credentials: str | None = None  # a .creds file (JWT + nkey seed; needs nkeys)
    nats_tls_ca: str | None = None  # CA bundle; a tls:// url or any nats_tls_* turns TLS on
    nats_tls_cert: str | None = None  # client certificate (mutual TLS), with nats_tls_key
    nats_tls_key: str | None = None
    # -- replicas: the event stream and shared load --
    events_transport: str = "auto"  # "jetstream", "core" or "auto" (stream if the server has it)
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
    arms: list[ArmSpec] = field(default_factory=list)

    def tokenizer_for(self, model: str) -> str | None:
        spec = self.models.get(model)
        return spec.tokenizer if spec and spec.tokenizer else self.tokenizer


_SCALARS = {
    f.name: f
    for f in dataclasses.fields(RouterConfig)
    if f.name not in ("workers", "models", "arms", "policy_params", "api_keys", "discovery")
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
    kind = str(_SCALARS[name].type)
    if value is None or (isinstance(value, str) and value == "" and "None" in kind):
        if "None" not in kind:
            raise ConfigError(f"{name} cannot be empty")
        return None
    try:
        if kind.startswith("bool"):
            return _bool(value)
        if kind.startswith("int"):
            if isinstance(value, bool):
                raise ValueError("bool")
            return int(value)
        if kind.startswith("float"):
            return float(value)
        return str(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: {value!r} is not a valid {kind}") from exc


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


def _apply_toml(cfg: RouterConfig, data: Mapping[str, Any], where: str) -> None:
    for key, value in data.items():
        if key in _SCALARS:
            setattr(cfg, key, _coerce(key, value))
        elif key == "policy_params":
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where}: policy_params must be a table")
            cfg.policy_params = dict(value)
        elif key == "workers":
            cfg.workers = [worker_spec(w, f"{where} workers[{i}]") for i, w in enumerate(value)]
        elif key == "models":
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where}: models must be a table of tables")
            cfg.models = {
                name: ModelSpec(tokenizer=(spec or {}).get("tokenizer"))
                for name, spec in value.items()
            }
        elif key == "arms":
            cfg.arms = [_arm_spec(a, f"{where} arms[{i}]") for i, a in enumerate(value)]
        elif key == "discovery":
            if not isinstance(value, list):
                raise ConfigError(f"{where}: discovery must be an array (strings or tables)")
            cfg.discovery = [
                discovery_spec(d, f"{where} discovery[{i}]") for i, d in enumerate(value)
            ]
        elif key == "api_keys":
            if not isinstance(value, list) or not all(isinstance(k, str) and k for k in value):
                raise ConfigError(f"{where}: api_keys must be a list of non-empty strings")
            cfg.api_keys = list(value)
        else:
            raise ConfigError(f"{where}: unknown setting {key!r}")


def _arm_spec(raw: Any, where: str) -> ArmSpec:
    if not isinstance(raw, Mapping) or not raw.get("name") or not raw.get("policy"):
        raise ConfigError(f"{where}: an arm needs name and policy")
    weight = raw.get("weight", 1.0)
    if not isinstance(weight, int | float) or weight <= 0:
        raise ConfigError(f"{where}: weight must be a positive number")
    params = raw.get("params", {})
    if not isinstance(params, Mapping):
        raise ConfigError(f"{where}: params must be a table")
    return ArmSpec(str(raw["name"]), str(raw["policy"]), float(weight), dict(params))


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
    """
    cfg = RouterConfig()
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        _apply_toml(cfg, data, str(path))
    env = os.environ if env is None else env
    for name in _SCALARS:
        key = ENV_PREFIX + name.upper()
        if key in env:
            setattr(cfg, name, _coerce(name, env[key]))
    workers = [w for w in env.get(ENV_PREFIX + "WORKERS", "").split(",") if w.strip()]
    keys = [k.strip() for k in env.get(ENV_PREFIX + "API_KEYS", "").split(",") if k.strip()]
    cfg.api_keys = keys or cfg.api_keys
    found = [d for d in env.get(ENV_PREFIX + "DISCOVER", "").split(",") if d.strip()]
    found += extra_discovery or []
    cfg.discovery += [discovery_spec(d.strip(), "discover") for d in found]
    for name, value in (overrides or {}).items():
        if value is not None:
            setattr(cfg, name, _coerce(name, value))
    by_id = {w.id: w for w in cfg.workers}
    for text in [*workers, *(extra_workers or [])]:
        spec = parse_worker(text)
        by_id[spec.id] = spec
    cfg.workers = list(by_id.values())
    validate(cfg)
    return cfg


def validate(cfg: RouterConfig) -> None:
    """Reject settings that cannot work, with the reason, before anything starts."""
    if cfg.block_size <= 0:
        raise ConfigError("block_size must be positive")
    if not 0 < cfg.port < 65536:
        raise ConfigError(f"port {cfg.port} is out of range")
    if cfg.max_body_bytes <= 0:
        raise ConfigError("max_body_bytes must be positive")
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
    for name in ("max_n", "max_header_count", "max_header_bytes"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name} must be positive")
    if cfg.body_timeout <= 0:
        raise ConfigError("body_timeout must be positive")
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


def _validate_replicas(cfg: RouterConfig) -> None:
    if cfg.events_transport not in ("auto", "jetstream", "core"):
        raise ConfigError(
            f"events_transport must be auto, jetstream or core, not {cfg.events_transport!r}"
        )
    if not re.fullmatch(r"[A-Za-z0-9_-]+", cfg.events_stream):
        raise ConfigError(f"events_stream {cfg.events_stream!r}: letters, digits, - and _ only")
    if cfg.replica_id is not None and not re.fullmatch(r"[A-Za-z0-9_-]+", cfg.replica_id):
        raise ConfigError(f"replica_id {cfg.replica_id!r}: letters, digits, - and _ only")
    for name in ("events_max_age", "events_max_bytes", "peer_ttl"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name} must be positive")
    for name in ("blind_after", "share_interval"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name} must not be negative")


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
    spec = DiscoverySpec(name=name.rstrip("."))
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
            setattr(spec, key, value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc
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
