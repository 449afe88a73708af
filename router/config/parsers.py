"""The parsers of the table settings: workers, discovery sources, models, arms, keys.

A worker comes from a TOML ``[[workers]]`` table or an admin API body (``worker_spec``),
or from ``ID=URL`` text (``--worker``, ``CACHE_ROUTER_WORKERS``: ``parse_worker``); a
discovery source from a table or ``dns://`` / ``srv://`` text (``discovery_spec``). Each
says which setting is wrong and why (``ConfigError``), before anything starts.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from index.groups import parse_groups
from index.wire import worker_id_error
from policies.experiments import Arm, parse_arm
from router.admission.core import TenantSpec
from router.config.settings import (
    DEFAULT_POOL,
    ROLES,
    ConfigError,
    DiscoverySpec,
    KubernetesSpec,
    ModelSpec,
    WorkerSpec,
)
from router.workers.dp import DP_FIELDS, MAX_DP_SIZE


def _model_spec(spec: Any, where: str) -> ModelSpec:
    spec = spec or {}
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{where} must be a table")
    for key in ("tokenizer", "base"):
        if spec.get(key) is not None and not isinstance(spec[key], str):
            raise ConfigError(f"{where}.{key} must be a string")
    return ModelSpec(tokenizer=spec.get("tokenizer"), base=spec.get("base"))


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


_TENANT_KEYS = frozenset(("weight", "tokens_per_second", "burst_tokens", "priority", "api_keys"))


def _tenants(value: Any, where: str) -> dict[str, TenantSpec]:
    """``[tenants.NAME]`` tables: ``weight``, ``tokens_per_second``, ``burst_tokens``,
    ``priority`` (the default of its requests), ``api_keys`` (whose requests are its)."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: tenants must be a table of tables")
    out: dict[str, TenantSpec] = {}
    owner: dict[str, str] = {}
    for name, raw in value.items():
        at = f"{where} tenants.{name}"
        if not isinstance(raw, Mapping) or not 0 < len(name) <= 128:
            raise ConfigError(f"{at}: a tenant is a table named by 1-128 characters")
        unknown = set(raw) - _TENANT_KEYS
        if unknown:
            raise ConfigError(f"{at}: unknown keys {sorted(unknown)}")
        numbers = {k: raw[k] for k in ("weight", "tokens_per_second", "burst_tokens") if k in raw}
        for key, number in numbers.items():
            if isinstance(number, bool) or not isinstance(number, int | float) or not number > 0:
                raise ConfigError(f"{at}: {key} must be a positive number")
        priority = raw.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ConfigError(f"{at}: priority must be an integer")
        keys = _api_keys(raw.get("api_keys", []), at)
        for key in keys:
            if owner.setdefault(key, name) != name:
                raise ConfigError(f"{at}: an API key of tenant {owner[key]!r} too")
        rate, burst = numbers.get("tokens_per_second"), numbers.get("burst_tokens")
        out[name] = TenantSpec(
            weight=float(numbers.get("weight", 1.0)),
            tokens_per_second=None if rate is None else float(rate),
            burst_tokens=None if burst is None else float(burst),
            priority=priority,
            api_keys=tuple(keys),
        )
    return out


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
    "tenants": _tenants,
}


def _arm_spec(raw: Any, where: str) -> Arm:
    try:
        return parse_arm(raw, where)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


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
    _known(table, _DISCOVERY_KEYS, "discovery", where)
    name = table.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,253}", name):
        raise ConfigError(f"{where}: name must be a DNS name, not {name!r}")
    rest = {k: v for k, v in table.items() if k != "name"}
    spec = DiscoverySpec(name=name.rstrip("."), **_typed(rest, where))
    if spec.record not in ("a", "srv"):
        raise ConfigError(f"{where}: record must be a (A/AAAA) or srv, not {spec.record!r}")
    _check_source(where, spec)
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
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def kubernetes_spec(raw: Any, where: str) -> KubernetesSpec:
    """A Kubernetes source from a TOML table or the string form (flag, env, TOML array):
    ``k8s://NAMESPACE?selector=app%3Dvllm&model=M&port=8000&...`` (``k8s://`` alone:
    the pod's own namespace), every key of ``KubernetesSpec`` as a query parameter."""
    if isinstance(raw, str):
        if not raw.startswith(K8S_SCHEME):
            raise ConfigError(f"{where}: {raw!r}: expected k8s://NAMESPACE?selector=...")
        url = urlsplit(raw)
        table: dict[str, Any] = dict(parse_qsl(url.query, keep_blank_values=True))
        if url.netloc:
            table["namespace"] = url.netloc
    elif isinstance(raw, Mapping):
        table = dict(raw)
    else:
        raise ConfigError(f"{where}: a kubernetes source is a string or a table")
    _known(table, _KUBERNETES_KEYS, "kubernetes", where)
    return _checked_kubernetes(KubernetesSpec(**_typed(table, where)), where)


def _checked_kubernetes(spec: KubernetesSpec, where: str) -> KubernetesSpec:
    selectors = (spec.selector, spec.prefill_selector, spec.decode_selector)
    if not any(selectors):
        raise ConfigError(f"{where}: a selector (or prefill_selector and decode_selector)")
    if bool(spec.prefill_selector) != bool(spec.decode_selector):
        raise ConfigError(f"{where}: prefill_selector and decode_selector go together")
    for text in selectors:
        if not _SELECTOR.fullmatch(text):
            raise ConfigError(f"{where}: {text!r} is not a label selector")
    if spec.namespace is not None and not _NAMESPACE.fullmatch(spec.namespace):
        raise ConfigError(f"{where}: namespace {spec.namespace!r} is not a namespace name")
    _check_source(where, spec)
    if not 1 <= spec.watch_timeout <= MAX_DISCOVERY_INTERVAL:
        raise ConfigError(f"{where}: watch_timeout must be in [1, {MAX_DISCOVERY_INTERVAL:g}] s")
    for name in ("token_file", "ca_file"):
        path = getattr(spec, name)
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"{where}: {name}: no such file {path}")
    return spec


def _check_source(where: str, spec: DiscoverySpec | KubernetesSpec) -> None:
    """What every discovery source's engines need: a port, a scheme, a block size, an
    interval within bounds."""
    if not 0 < spec.port < 65536:
        raise ConfigError(f"{where}: port {spec.port} is out of range")
    if spec.scheme not in ("http", "https"):
        raise ConfigError(f"{where}: scheme must be http or https")
    if spec.block_size is not None and spec.block_size <= 0:
        raise ConfigError(f"{where}: block_size must be positive")
    if not 0 < spec.interval <= MAX_DISCOVERY_INTERVAL:
        raise ConfigError(f"{where}: interval must be in (0, {MAX_DISCOVERY_INTERVAL:g}] s")


def _known(table: Mapping[str, Any], keys: frozenset[str], kind: str, where: str) -> None:
    unknown = set(table) - keys
    if unknown:
        raise ConfigError(f"{where}: unknown {kind} keys {sorted(unknown)}")


def _typed(table: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A discovery source's values typed as its spec declares them (every source shares
    these names): whole numbers for ports and block sizes (never a bool or a float),
    seconds as floats, the rest strings; a value left out (None) is the default."""
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
    return fields
