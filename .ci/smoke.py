"""Smoke test of a bare install (no extras): a mock engine and the router, one request.

CI runs it with a fresh venv's python from outside the repo, so the installed package is
what runs, with only the core dependencies. Every wait is bounded.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

from sim.mock.natsd import free_ports


def wait_ok(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"smoke: {url} not up after {timeout:.0f}s")
        time.sleep(0.2)


def main() -> int:
    engine_port, router_port = free_ports(2)
    cli = [sys.executable, "-m", "router.cli"]
    procs = [
        subprocess.Popen([*cli, "mock-engine", "--port", str(engine_port), "--speed", "100"]),
        subprocess.Popen(
            [
                *cli,
                "serve",
                "--port",
                str(router_port),
                "--worker",
                f"engine-0=http://127.0.0.1:{engine_port}",
            ]
        ),
    ]
    try:
        wait_ok(f"http://127.0.0.1:{engine_port}/health")
        wait_ok(f"http://127.0.0.1:{router_port}/health")
        request = {"model": "mock-model", "prompt": "hello there", "max_tokens": 4}
        body = json.dumps(request).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{router_port}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            out = json.loads(resp.read())
        assert resp.status == 200 and out["choices"][0]["text"], out
        print("smoke: ok", json.dumps(out["usage"]))
        return 0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    sys.exit(main())
