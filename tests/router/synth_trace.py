"""A synthetic trace in the Mooncake format, unlike the shared one: multi-turn conversations
over a few shared system prompts, Poisson arrivals, turns of a conversation spaced out."""

from __future__ import annotations

import heapq
import json
import random
from pathlib import Path


def synthetic_trace(path: Path, num_conversations: int = 600, num_system_prompts: int = 4,
                    system_blocks: int = 6, seed: int = 0, rate_per_s: float = 6.0) -> Path:
    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    systems = [fresh(system_blocks) for _ in range(num_system_prompts)]
    events: list[tuple[float, int, dict]] = []
    clock = 0.0
    for conv in range(num_conversations):
        clock += rng.expovariate(rate_per_s)
        history = list(rng.choice(systems))
        at = clock
        for _ in range(rng.randint(1, 6)):
            history += fresh(rng.randint(1, 4))  # the new user message (and the last answer)
            input_length = len(history) * 512 - rng.randint(0, 511)
            row = {"timestamp": int(at * 1000), "input_length": input_length,
                   "output_length": rng.randint(20, 400), "hash_ids": list(history)}
            heapq.heappush(events, (at, conv, row))
            at += rng.uniform(5.0, 40.0)  # the user reads and types
    lines = [json.dumps(heapq.heappop(events)[2]) for _ in range(len(events))]
    path.write_text("\n".join(lines) + "\n")
    return path
