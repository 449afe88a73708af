"""Who serves what: the registry, health, load, DP ranks, LoRA adapters, pools, discovery.

``registry`` (workers, health, draining), ``load`` (in flight and engine reports), ``dp``,
``lora``, ``pools`` (workers sharing a block size), ``discovery`` (engines found by DNS).
"""
