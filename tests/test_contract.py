"""What users script against, held to a checked-in list (tests/contract/*.json).

CLI verbs and their flags, TOML keys with their ``CACHE_ROUTER_*`` variables and flags
(read from the config's declarations), other ``CACHE_ROUTER_*`` variables the code reads,
HTTP routes (from the app), metric names (from the registry). Moving code around must not
drop one: a name that disappears fails ``test_nothing_users_script_against_is_gone``. A new
name fails ``test_the_contract_lists_everything`` until it is listed, on purpose:
``python3 tests/test_contract.py --write`` rewrites the lists, and the diff is the review.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONTRACT = ROOT / "tests" / "contract"


def cli() -> dict[str, Any]:
    """Verb -> its options (every spelling) and positionals."""
    from router.cli import COMMANDS

    out: dict[str, Any] = {}
    for verb, (module, _) in COMMANDS.items():
        parser = argparse.ArgumentParser(prog=f"cache-router {verb}")
        importlib.import_module(module).add_arguments(parser)
        options = sorted(s for a in parser._actions for s in a.option_strings)
        positionals = [a.dest for a in parser._actions if not a.option_strings]
        out[verb] = {"options": options, "positionals": positionals}
    return out


def config() -> dict[str, Any]:
    """TOML key -> its environment variable and flag (None: TOML only or no flag)."""
    from router import config as c
    from router.http import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    flag_of = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    flags = dict(c.FLAGS)
    settings: dict[str, Any] = {
        name: {"env": c.ENV_PREFIX + name.upper(), "flag": flag_of[name] if name in flags else None}
        for name in sorted(c.SCALARS)
    }
    for name in sorted(c.TABLES):
        settings[name] = {"env": None, "flag": None}
    # the tables that also come from the environment and flags (router.config.load_config)
    settings["workers"] = {"env": "CACHE_ROUTER_WORKERS", "flag": flag_of["worker"]}
    settings["api_keys"]["env"] = "CACHE_ROUTER_API_KEYS"
    settings["discovery"] = {"env": "CACHE_ROUTER_DISCOVER", "flag": flag_of["discover"]}
    found = set()
    for pkg in ("router", "index", "sim", "agent", "policies"):
        for path in (ROOT / pkg).rglob("*.py"):
            found |= set(re.findall(r"\bCACHE_ROUTER_[A-Z][A-Z_]*[A-Z]\b", path.read_text()))
    listed = {s["env"] for s in settings.values()}
    return {"settings": settings, "other_env": sorted(found - listed)}


def http() -> list[str]:
    """``METHOD path`` of every route: the raw handlers and FastAPI's (admin included)."""
    from router.config import load_config
    from router.http.app import build_app

    app = build_app(load_config(env={}, extra_workers=["w=http://127.0.0.1:9"]))
    routes = {f"POST {path}" for path in app.hot}
    for path, ops in app.api.openapi()["paths"].items():
        routes |= {f"{method.upper()} {path}" for method in ops}
    for route in app.api.routes:
        for method in getattr(route, "methods", None) or ():
            if method != "HEAD":
                routes.add(f"{method} {route.path}")  # type: ignore[attr-defined]
    return sorted(routes)


def metrics() -> dict[str, str]:
    """Metric family name -> its type, as a scrape shows them."""
    from prometheus_client.parser import text_string_to_metric_families

    from router.config import load_config
    from router.http.app import build_app
    from router.http.processes import merge_metrics

    app = build_app(load_config(env={}, extra_workers=["w=http://127.0.0.1:9"]))
    out = {f.name: f.type for f in app.state.metrics.registry.collect()}
    merged = merge_metrics({0: None}).decode()
    out |= {f.name: f.type for f in text_string_to_metric_families(merged)}
    return dict(sorted(out.items()))


def current() -> dict[str, Any]:
    return {"cli": cli(), "config": config(), "http": http(), "metrics": metrics()}


def _missing(old: Any, new: Any, where: str = "") -> list[str]:
    """What ``old`` lists that ``new`` lacks or states otherwise."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key, value in old.items():
            if key not in new:
                out.append(f"{where}{key}: gone")
            else:
                out += _missing(value, new[key], f"{where}{key}.")
        return out
    if isinstance(old, list) and isinstance(new, list):
        return [f"{where}{item}: gone" for item in old if item not in new]
    return [] if old == new else [f"{where[:-1]}: {old!r} -> {new!r}"]


def _snapshot() -> dict[str, Any]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(CONTRACT.glob("*.json"))}


def test_nothing_users_script_against_is_gone() -> None:
    gone = _missing(_snapshot(), current())
    assert not gone, "\n".join(gone)


def test_the_contract_lists_everything() -> None:
    new = _missing(current(), _snapshot())
    assert not new, "not in tests/contract (python3 tests/test_contract.py --write):\n" + "\n".join(
        new
    )


def test_the_comparison_sees_a_dropped_flag() -> None:
    old = {"cli": {"serve": {"options": ["--port", "--host"]}}, "http": ["GET /health"]}
    new = {"cli": {"serve": {"options": ["--host"]}}, "http": []}
    assert _missing(old, new) == ["cli.serve.options.--port: gone", "http.GET /health: gone"]
    assert _missing({"m": {"a": "counter"}}, {"m": {"a": "gauge"}}) == [
        "m.a: 'counter' -> 'gauge'"
    ]


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python3 tests/test_contract.py --write")
    CONTRACT.mkdir(exist_ok=True)
    for name, value in current().items():
        (CONTRACT / f"{name}.json").write_text(json.dumps(value, indent=1) + "\n")
