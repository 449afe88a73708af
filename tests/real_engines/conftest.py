"""Fixtures of the real-engine tests: the tiny model and two vLLM engines.

Not part of the main suite (``norecursedirs`` in pyproject.toml): ``.ci/real_engines.sh``
makes the engine venv and runs ``python3 -m pytest tests/real_engines``. The engine
venv's python comes from ``CACHE_ROUTER_VLLM_PYTHON``; without it these tests fail
(never skip), saying how to make one.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_engine import HERE, Engine, engine_python, lora_flags, running


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model")
    subprocess.run([engine_python(), str(HERE / "make_model.py"), str(out)], check=True)
    return out


@pytest.fixture(scope="module")
def engines(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Engine]]:
    """Two engines: e0 with vLLM's bytes (sha256) block hashes on ipc://, e1 with its int
    form on tcp."""
    work = tmp_path_factory.mktemp("vllm")
    base = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
    python = engine_python()
    ints = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"
    lora = lora_flags(model_dir)
    out = [
        Engine("e0", python, model_dir, work, {**base, ints: "0"}, extra=lora),
        # tcp, bound by vLLM on loopback: the other way users configure it
        Engine("e1", python, model_dir, work, {**base, ints: "1"}, transport="tcp", extra=lora),
    ]
    with running(out):
        yield out


@pytest.fixture(scope="module")
def dp_engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """One engine with two data-parallel ranks (two engine cores, two KV caches), each
    publishing on its own port (tcp: vLLM offsets no ipc:// endpoint by rank)."""
    work = tmp_path_factory.mktemp("vllm-dp")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
    # vLLM's default bytes block hashes, which the native reader applies itself
    env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0"
    engine = Engine("d0", engine_python(), model_dir, work, env, transport="tcp", dp_size=2)
    with running([engine]):
        yield engine


@pytest.fixture(scope="module")
def sw_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model made hybrid: layer 0 attends over a 64-token sliding window."""
    out = tmp_path_factory.mktemp("sw-model")
    subprocess.run([engine_python(), str(HERE / "make_model.py"), str(out), "64"], check=True)
    return out


@pytest.fixture(scope="module")
def sw_engine(sw_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """Two KV-cache groups (vLLM: group 0 sliding window, group 1 full attention), which
    share the blocks: twice the blocks of one engine."""
    work = tmp_path_factory.mktemp("vllm-sw")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
    engine = Engine("s0", engine_python(), sw_model_dir, work, env, gpu_blocks=128)
    with running([engine]):
        yield engine
