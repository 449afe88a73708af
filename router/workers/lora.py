"""LoRA adapters: which engines have one loaded, and which could load it.

A request for an adapter is served only by an engine that has it: vLLM lists its loaded
adapters in ``/v1/models`` (each with the base model as ``parent``), so the registry
re-reads that list every few health checks and a worker's ``models`` are its base model
plus the adapters it lists. When no engine lists an adapter the config names (``[models.X]
base = ...``), the base model's engines take it, those with a free adapter slot first:
llm-d's adapter affinity, read from vLLM's ``vllm:lora_requests_info`` gauge
(``running_lora_adapters``, ``waiting_lora_adapters``, ``max_lora`` labels).

Each adapter has its own prefix space in the index (``index.hashing``: its name is in
the root of every chain), so a base-model prefix never counts for the adapter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from router.workers.load import labels_of

MODELS_EVERY = 5  # health checks between two reads of an engine's /v1/models
_INFO = re.compile(r"^vllm:lora_requests_info\{([^}]*)\}", re.M)
MAX_ADAPTERS = 4096  # names kept per engine: no engine serves more; bounds a bad scrape


@dataclass(frozen=True, slots=True)
class LoraSlots:
    """An engine's adapters in use and its adapter capacity, as it last reported them."""

    running: frozenset[str]
    waiting: frozenset[str]
    max_loras: int

    def can_take(self, adapter: str) -> bool:
        """Whether ``adapter`` runs here without evicting another one."""
        active = self.running | self.waiting
        return adapter in active or len(active) < self.max_loras


def parse_lora_info(text: str) -> LoraSlots | None:
    """``vllm:lora_requests_info`` from a ``/metrics`` scrape (None: not reported).

    vLLM adds one series per change; the last one is the current state."""
    found = _INFO.findall(text)
    if not found:
        return None
    labels = labels_of(found[-1])
    try:
        max_loras = int(labels.get("max_lora", ""))
    except ValueError:
        return None

    def names(key: str) -> frozenset[str]:
        parts = [n for n in labels.get(key, "").split(",") if n][:MAX_ADAPTERS]
        return frozenset(parts)

    return LoraSlots(names("running_lora_adapters"), names("waiting_lora_adapters"), max_loras)
