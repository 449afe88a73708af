"""docker-compose.yml stays valid, and every command in it is one this project runs.

Docker is not on these machines, so the file is checked here: YAML that follows the
compose structure, services whose dependencies exist, and each ``cache-router``
command parsed by the very argument parser the CLI uses (the other tests run those
commands for real).
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest
import yaml

from router.cli import COMMANDS

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def _commands() -> list[tuple[str, list[str]]]:
    return [
        (name, svc["command"])
        for name, svc in SERVICES.items()
        if svc.get("build") and isinstance(svc.get("command"), list)
    ]


def test_structure() -> None:
    assert "nats" in SERVICES and "-js" in SERVICES["nats"]["command"]
    for name, svc in SERVICES.items():
        assert svc.get("image") or svc.get("build"), name
        for dep in svc.get("depends_on", []):
            assert dep in SERVICES, f"{name} depends on unknown {dep}"
    assert (ROOT / "Dockerfile").exists()
    assert len(_commands()) >= 9  # router + 4 engines + 4 agents


@pytest.mark.parametrize(("service", "command"), _commands(), ids=lambda v: str(v)[:20])
def test_every_command_parses_with_the_real_cli(service: str, command: list[str]) -> None:
    sub, *rest = command
    assert sub in COMMANDS, f"{service}: unknown subcommand {sub}"
    parser = argparse.ArgumentParser(prog=f"cache-router {sub}", exit_on_error=False)
    importlib.import_module(COMMANDS[sub][0]).add_arguments(parser)
    parser.parse_args(rest)  # raises on an unknown or malformed flag


def test_router_workers_point_at_engine_services() -> None:
    router = SERVICES["router"]["command"]
    workers = [a.split("=", 2) for a in router if a.startswith("--worker=")]
    for _, wid, url in workers:
        assert wid in SERVICES and f"//{wid}:" in url
