"""The workload of the live trace benchmark (benchmarks/trace_bench.py): a slice of a Mooncake
trace turned into token-id prompts, and what `pdcluster replay` predicts for the same slice.

Trace rows (JSON lines): `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (one
id per 512-token block; equal ids at equal positions are equal prefix blocks). Scaled down so
the run fits a small CPU machine:

- every trace block id becomes `tokens_per_block` deterministic token ids (a function of the
  id alone, so equal ids give equal tokens in every request), and a prompt is its blocks in
  order plus one token unique to the request: the node always computes a prompt's last token,
  so without it a fully repeated prompt could never hit on its last block, which the replay
  counts as a hit; `input_length` is not used beyond the blocks;
- output lengths are capped at `max_output_tokens`;
- arrival times are the trace's, relative to the slice's first request, times `time_scale`
  (below 1: a denser load).

API: `Workload`, `TraceRequest`, `load_workload`, `predict_hit_ratios`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512  # the Mooncake trace's block size
_FIRST_TOKEN_ID = 10  # below it: special tokens of the usual vocabularies
_REPLAY_NAMES = {"kv": "kv", "round_robin": "round-robin", "least_loaded": "least-loaded"}


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    prompt: list[int]
    max_tokens: int
    num_blocks: int  # trace blocks


@dataclass(frozen=True, slots=True)
class Workload:
    rows: list[dict]  # the slice's trace rows, timestamps scaled
    requests: list[TraceRequest]
    tokens_per_block: int

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0


def block_tokens(hash_id: int, tokens_per_block: int, vocab_size: int) -> list[int]:
    """The token ids standing for one trace block: deterministic in the id."""
    rng = random.Random(hash_id * 1_000_003 + tokens_per_block)
    return [rng.randrange(_FIRST_TOKEN_ID, vocab_size) for _ in range(tokens_per_block)]


def load_workload(path: str | Path, offset: int, limit: int, tokens_per_block: int,
                  time_scale: float, max_output_tokens: int, vocab_size: int) -> Workload:
    lines = [ln for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.strip()]
    rows = [json.loads(ln) for ln in lines[offset:offset + limit]]
    if not rows:
        raise ValueError(f"no trace rows in [{offset}, {offset + limit}) of {path}")
    start_ms = rows[0]["timestamp"]
    blocks: dict[int, list[int]] = {}
    scaled, requests = [], []
    for i, row in enumerate(rows):
        arrival_s = (row["timestamp"] - start_ms) / 1000.0 * time_scale
        prompt = []
        for hash_id in row["hash_ids"]:
            if hash_id not in blocks:
                blocks[hash_id] = block_tokens(hash_id, tokens_per_block, vocab_size)
            prompt += blocks[hash_id]
        prompt.append(random.Random(-1 - offset - i).randrange(_FIRST_TOKEN_ID, vocab_size))
        max_tokens = max(1, min(int(row["output_length"]), max_output_tokens))
        requests.append(TraceRequest(arrival_s, prompt, max_tokens, len(row["hash_ids"])))
        scaled.append({**row, "timestamp": round(arrival_s * 1000.0, 3)})
    return Workload(scaled, requests, tokens_per_block)


def predict_hit_ratios(workload: Workload, num_nodes: int, cache_trace_blocks: int,
                       policies: tuple[str, ...], global_reuse_min_tokens: int,
                       device_blocks: int | None = None, host_blocks: int = 0) -> dict:
    """`pdcluster replay` (router.sim.replay) on the same slice, arrival times and node count:
    per policy its `hit_ratio` (local hits, host-tier hits included), `reuse_ratio` (with
    pulled blocks) and `work_imbalance`, plus the slice's `ideal_hit_ratio`. The pull threshold
    is the live router's, in trace blocks; `device_blocks` / `host_blocks` per node, in trace
    blocks, model KV tiers (replay's `--device-blocks` / `--host-blocks`)."""
    from pdcluster.router.routing.policy import PolicyConfig
    from pdcluster.router.sim import replay

    requests = replay.parse_trace(workload.rows)
    config = replay.ReplayConfig(num_nodes=num_nodes,
                                 cache_blocks=max(cache_trace_blocks, num_nodes),
                                 device_blocks=device_blocks, host_blocks=host_blocks)
    min_blocks = -(-global_reuse_min_tokens // workload.tokens_per_block)  # ceil
    pconf = PolicyConfig(block_size=TRACE_BLOCK_TOKENS,
                         global_reuse_min_tokens=min_blocks * TRACE_BLOCK_TOKENS)
    predicted: dict = {"ideal_hit_ratio": replay.ideal_hit_ratio(requests)}
    for policy in policies:
        stats = replay.replay(requests, _REPLAY_NAMES[policy], config, pconf)
        predicted[policy] = {k: stats[k] for k in ("hit_ratio", "reuse_ratio",
                                                   "work_imbalance")}
    return predicted
