"""Cross-field checks: settings that are each valid but cannot work together.

Bounds and choices are checked here too for a config built directly (tests do), the
pools' roles (mixed or disaggregated, never both), the gateway's limits, the NATS files,
the replicas' names and what ``processes`` > 1 needs.
"""

from __future__ import annotations

import re
from collections.abc import Set as AbstractSet
from pathlib import Path
from urllib.parse import urlsplit

from index.backend import NATIVE
from router.config.parsers import check_worker
from router.config.settings import (
    GATEWAY_POLICIES,
    RANGES,
    SCALARS,
    ConfigError,
    PdProtocol,
    Range,
    RouterConfig,
    WorkerSpec,
)

# settings naming a file that must exist when set (credentials, certificates, CA bundles)
_FILES = (
    "nats_credentials", "nats_tls_ca", "nats_tls_cert", "nats_tls_key",
    "tls_cert", "tls_key", "tls_client_ca", "engine_tls_ca", "engine_tls_cert", "engine_tls_key",
)  # fmt: skip


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
    for name in _FILES:
        path = getattr(cfg, name)
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"{name}: no such file {path}")
    if (cfg.nats_tls_cert is None) != (cfg.nats_tls_key is None):
        raise ConfigError("nats_tls_cert and nats_tls_key go together")
    if cfg.tls_cert is None and (cfg.tls_key is not None or cfg.tls_client_ca is not None):
        raise ConfigError("tls_key and tls_client_ca need tls_cert")
    if cfg.engine_tls_cert is None and cfg.engine_tls_key is not None:
        raise ConfigError("engine_tls_key needs engine_tls_cert")
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
