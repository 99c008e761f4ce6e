"""A small Mooncake-format trace for the live trace benchmark's test: multi-turn sessions
sharing a system prompt, each turn extending the session's previous prompt."""

from __future__ import annotations

import json
from pathlib import Path


def write_session_trace(path: Path, num_sessions: int = 6, num_turns: int = 6,
                        gap_ms: int = 60, output_length: int = 8) -> Path:
    """Turn t of session s: the shared 2-block system prompt, then t + 1 session blocks.
    Requests arrive turn by turn, every `gap_ms`."""
    rows = []
    for turn in range(num_turns):
        for session in range(num_sessions):
            hash_ids = [0, 1] + [1000 + 100 * session + k for k in range(turn + 1)]
            rows.append({"timestamp": len(rows) * gap_ms, "input_length": len(hash_ids) * 512,
                         "output_length": output_length, "hash_ids": hash_ids})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
