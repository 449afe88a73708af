"""Policies as plugins: a package installed beside the router adds a policy by name.

The example plugin (examples/policy-plugin) is installed with pip into a fresh virtual
environment (``--system-site-packages``, so the router's own dependencies are there and
nothing is downloaded), and a router started from that environment routes requests to
two mock engines with ``--policy longest_prefix``; the same router from the test's own
interpreter, where the plugin is not installed, refuses the name. The registry's rules
(the entry point's name is the class's, a plugin is a ``Policy``, a built-in name cannot
be taken) are held on plugins declared in a distribution made on the spot.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from policies import registry
from policies.base import Policy
from sim.mock.natsd import free_ports

# slow: their own CI step (`pytest -m slow`), kept out of the main suite's ~10 minutes
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "policy-plugin"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}  # the router under test, not an installed one


def _venv_with_the_plugin(tmp: Path) -> Path:
    """A virtual environment's python with the example plugin pip-installed into it."""
    venv = tmp / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
        check=True, timeout=300,
    )  # fmt: skip
    source = tmp / "policy-plugin"  # pip builds in the source tree: not in the repo's
    shutil.copytree(EXAMPLE, source)
    python = venv / "bin" / "python"
    subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", str(source)],
        check=True, timeout=300, env=ENV,
    )  # fmt: skip
    return python


def _wait(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{proc.args} exited with {proc.returncode}"
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


@pytest.fixture
def engines() -> Iterator[list[str]]:
    """Two mock engines, as worker specs ``ID=URL``."""
    ports = free_ports(2)
    procs = []
    for i, port in enumerate(ports):
        args = ["mock-engine", "--port", str(port), "--model", "m", "--worker-id", f"w{i}"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", *args, "--speed", "100"],
            env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        procs.append(proc)
    try:
        for proc, port in zip(procs, ports, strict=True):
            _wait(f"http://127.0.0.1:{port}/health", proc)
        yield [f"w{i}=http://127.0.0.1:{port}" for i, port in enumerate(ports)]
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)


def _serve(python: Path | str, port: int, workers: list[str]) -> subprocess.Popen[bytes]:
    args = [str(python), "-m", "router.cli", "serve", "--port", str(port)]
    args += ["--policy", "longest_prefix", "--admin-token", "t", "--log-level", "warning"]
    for w in workers:
        args += ["--worker", w]
    return subprocess.Popen(args, env=ENV, cwd=ROOT, stderr=subprocess.PIPE)


def test_an_installed_plugin_routes_requests(tmp_path: Path, engines: list[str]) -> None:
    python = _venv_with_the_plugin(tmp_path)
    (port,) = free_ports(1)
    router = _serve(python, port, engines)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait(f"{base}/health", router)
        chosen = set()
        for i in range(4):
            body = {"model": "m", "prompt": f"request {i} " * 40, "max_tokens": 4}
            resp = httpx.post(f"{base}/v1/completions", json=body, timeout=30.0)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"]
            chosen.add(resp.headers["x-cache-router-worker"])
        assert chosen <= {"w0", "w1"} and chosen
        explained = httpx.post(
            f"{base}/admin/explain", json={"model": "m", "prompt": "why " * 40},
            headers={"authorization": "Bearer t"}, timeout=30.0,
        ).json()  # fmt: skip
        assert explained["policy"] == "longest_prefix"
        assert explained["decision"]["reason"].startswith("longest_prefix: ")
        assert {w["worker_id"] for w in explained["workers"]} == {"w0", "w1"}
    finally:
        router.terminate()
        router.wait(timeout=30)


def test_without_the_plugin_the_name_is_refused(engines: list[str]) -> None:
    (port,) = free_ports(1)
    router = _serve(sys.executable, port, engines)  # this interpreter: no plugin installed
    _, err = router.communicate(timeout=60)
    assert router.returncode == 2
    assert b"unknown policy 'longest_prefix'" in err and b"cache_router.policies" in err


def _distribution(tmp: Path, entries: dict[str, str], module: str = "") -> None:
    """An installed distribution (its dist-info on ``sys.path``) declaring ``entries``."""
    info = tmp / "plugin_test-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plugin-test\nVersion: 1.0\n")
    lines = "".join(f"{k} = {v}\n" for k, v in entries.items())
    (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\n{lines}")
    if module:
        (tmp / "plugin_test_policies.py").write_text(module)


MODULE = '''
from policies.baselines import RoundRobin
from policies.base import Policy

class Spread(RoundRobin):
    name = "spread"
    def __init__(self, rng=None, *, every=1):
        super().__init__(rng)
        self.every = every

class Misnamed(RoundRobin):
    name = "another_name"

class NotAPolicy:
    name = "not_a_policy"
'''


def test_the_registry_finds_loads_and_checks_plugins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.syspath_prepend(str(tmp_path))
    _distribution(
        tmp_path,
        {
            "spread": "plugin_test_policies:Spread",
            "misnamed": "plugin_test_policies:Misnamed",
            "not_a_policy": "plugin_test_policies:NotAPolicy",
            "missing": "plugin_test_policies_gone:Nothing",
            "round_robin": "plugin_test_policies:Spread",  # a built-in name stays built-in
        },
        MODULE,
    )
    assert registry.plugin_names() == ("misnamed", "missing", "not_a_policy", "spread")
    assert registry.known_policies()[: len(registry.POLICY_NAMES)] == registry.POLICY_NAMES
    policy = registry.make_policy("spread", every=3)
    assert isinstance(policy, Policy) and type(policy).__name__ == "Spread"
    assert registry.policy_params("spread") == {"every": 1}
    assert type(registry.make_policy("round_robin")).__module__ == "policies.baselines"
    with pytest.raises(ValueError, match="names itself 'another_name'"):
        registry.make_policy("misnamed")
    with pytest.raises(ValueError, match=r"not a concrete policies\.base\.Policy"):
        registry.make_policy("not_a_policy")
    with pytest.raises(ValueError, match="failed to load"):
        registry.make_policy("missing")
    with pytest.raises(ValueError, match="has no parameter"):
        registry.make_policy("spread", nope=1)
    with pytest.raises(ValueError, match=r"unknown policy 'nowhere'.*cache_router\.policies"):
        registry.make_policy("nowhere")
