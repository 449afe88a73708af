"""A real vLLM (PyPI's CPU build) engine as a subprocess, for the real-engine tests."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx
import orjson
import pytest

HERE = Path(__file__).parent
BLOCK = 32  # vLLM's CPU attention needs a multiple of 32
GPU_BLOCKS = 64  # 2048 tokens per engine: a few long prompts evict
MAX_LEN = 1024
MODEL = "tiny"
LORA = "my-lora"
START_TIMEOUT = 600.0  # seconds; a cold vLLM CPU start takes 1-3 min on 2 busy cores


# Ports handed out in this process: a run picked twice would collide when both bind.
_GIVEN: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_run(n: int) -> int:
    """The first of ``n`` consecutive free loopback ports (vLLM offsets ports by DP rank).

    Below the kernel's ephemeral range: vLLM binds its ports 20-60 s after they are picked,
    while other engines and clients open connections, and a port from that range can be
    given to one of them meanwhile (seen in CI: ``ZMQError: Address already in use`` on a
    replay port, session 8)."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(1000):
        first = rng.randrange(10_000, max(low - n, 10_001))
        run = range(first, first + n)
        if _GIVEN.intersection(run):
            continue
        socks = []
        try:
            for p in run:
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        _GIVEN.update(run)
        return first
    raise RuntimeError(f"no {n} consecutive free ports")


def free_engine_port() -> int:
    return free_run(1)


def lora_flags(model_dir: Path) -> tuple[str, ...]:
    lora = f"{LORA}={model_dir / 'lora'}"
    return ("--enable-lora", "--max-lora-rank", "8", "--lora-modules", lora)


def engine_python() -> str:
    python = os.environ.get("CACHE_ROUTER_VLLM_PYTHON")
    if not python or not Path(python).exists():
        pytest.fail(
            "CACHE_ROUTER_VLLM_PYTHON must name the python of a venv with vLLM's CPU "
            "build (bash .ci/real_engines.sh makes one)",
            pytrace=False,
        )
    return python


@dataclass
class Engine:
    """One ``vllm.entrypoints.openai.api_server`` process and its endpoints."""

    name: str
    python: str
    model_dir: Path
    workdir: Path
    env: dict[str, str]
    transport: Literal["ipc", "tcp"] = "ipc"
    dp_size: int = 1  # --data-parallel-size: rank r publishes on port P+r, replays on R+r
    extra: tuple[str, ...] = ()  # more vLLM flags
    gpu_blocks: int = GPU_BLOCKS  # shared by the KV-cache groups of a hybrid model
    port: int = field(default_factory=free_engine_port)
    events_port: int = 0
    replay_port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.events_port = self.events_port or free_run(self.dp_size)
        self.replay_port = self.replay_port or free_run(self.dp_size)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events(self) -> str:
        """The endpoint vLLM is given. vLLM binds its PUB socket only when the endpoint
        has ``*`` or ``::`` in it or is ipc://, and connects to any other. ipc:// keeps
        everything on this machine but takes no DP rank (vLLM offsets tcp ports only);
        for tcp, the IPv4-mapped form of 127.0.0.1 has ``::`` in it, so vLLM binds it,
        on loopback only (``tcp://*:P`` would listen on every interface)."""
        if self.transport == "ipc":
            return f"ipc://{self.workdir}/{self.name}.events"
        return f"tcp://[::ffff:127.0.0.1]:{self.events_port}"

    def events_of(self, rank: int = 0) -> str:
        """Where an agent subscribes to rank ``rank``'s events."""
        if self.transport == "ipc":
            assert rank == 0, "vLLM takes no DP rank on an ipc:// endpoint"
            return self.events
        return f"tcp://127.0.0.1:{self.events_port + rank}"

    def replay_of(self, rank: int = 0) -> str:
        return f"tcp://127.0.0.1:{self.replay_port + rank}"

    @property
    def replay(self) -> str:
        return self.replay_of(0)

    def command(self) -> list[str]:
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.events,
            "replay_endpoint": self.replay,
        }
        return [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", MODEL,
            "--load-format", "dummy", "--dtype", "float32",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--block-size", str(BLOCK), "--num-gpu-blocks-override", str(self.gpu_blocks),
            "--max-model-len", str(MAX_LEN), "--max-num-seqs", "8",
            "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--data-parallel-size", str(self.dp_size),
            "--kv-events-config", orjson.dumps(kv_events).decode(),
            *self.extra,
        ]  # fmt: skip

    def start(self) -> None:
        log = (self.workdir / f"{self.name}.log").open("ab")
        # its own process group: stop() must end the engine core too, or the old core,
        # exiting late, unlinks the ipc socket file the restarted engine just bound
        self.proc = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.workdir,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"vLLM {self.name} exited: see {self.log_tail()}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise AssertionError(f"vLLM {self.name} not up after {timeout} s: {self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None:
            group = self.proc.pid  # start_new_session: the group id is the leader's pid
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    os.killpg(group, 0)
                except ProcessLookupError:
                    break  # every process of the engine is gone
                self.proc.poll()
                time.sleep(0.2)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def log_tail(self) -> str:
        text = (self.workdir / f"{self.name}.log").read_text(errors="replace")
        return text[-3000:]


@contextlib.contextmanager
def running(engines: Sequence[Engine]) -> Iterator[None]:
    """Every engine started (all at once: their loads overlap), then ready; all stopped after."""
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready()
        yield
    finally:
        for e in engines:
            e.stop()
