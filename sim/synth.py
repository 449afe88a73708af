"""Small synthetic traces (tests, demos): conversations in plain JSONL, Mooncake lines."""

from __future__ import annotations

import json
import random
from pathlib import Path


def write_sessions(
    path: Path,
    *,
    sessions: int,
    turns: int,
    gap_ms: float,
    system_tokens: int = 64,
    turn_tokens: int = 48,
    output: int = 8,
    seed: int = 0,
) -> Path:
    """Conversations sharing one system prompt; turn k repeats turns 0..k-1 then adds one.

    Requests arrive every ``gap_ms``, sessions interleaved round by round.
    """
    rng = random.Random(seed)
    system = [rng.randrange(1, 50_000) for _ in range(system_tokens)]
    history = {s: list(system) for s in range(sessions)}
    lines = []
    t = 0.0
    for _turn in range(turns):
        for s in range(sessions):
            history[s] += [rng.randrange(1, 50_000) for _ in range(turn_tokens)]
            lines.append(
                {
                    "timestamp": t,
                    "token_ids": list(history[s]),
                    "output_length": output,
                    "session_id": f"s{s}",
                }
            )
            t += gap_ms
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def write_mooncake(path: Path, rows: list[tuple[float, int, int, list[int]]]) -> Path:
    """Mooncake lines from (timestamp, input_length, output_length, hash_ids)."""
    path.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": n, "output_length": m, "hash_ids": ids})
            + "\n"
            for t, n, m, ids in rows
        )
    )
    return path
