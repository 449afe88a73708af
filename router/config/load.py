"""Loading: defaults < TOML file < ``CACHE_ROUTER_*`` environment < flags, then checked.

Scalars convert from each layer's form (TOML values, env text, flag values) to their
declared type (``router.config.settings``); tables come from TOML through their parsers
(``router.config.parsers``), workers, API keys and discovery sources also from the
environment and flags.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from router.config.checks import validate
from router.config.parsers import (
    K8S_SCHEME,
    TABLE_PARSERS,
    discovery_spec,
    kubernetes_spec,
    parse_worker,
)
from router.config.settings import ENV_PREFIX, SCALARS, ConfigError, RouterConfig


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
