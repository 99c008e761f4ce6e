"""The four workloads of `pdcluster bench peers`, shared by every engine measured.

Pure Python (no torch, no project imports): the peer drivers (benchmarks/peers_driver.py) run it
inside the peers' own venvs, so every engine is timed by the same code on the same token ids.
An engine is one function `generate(prompts, max_tokens) -> token ids per prompt` (greedy, EOS
ignored: lengths are exact):

- W1: `num_requests` prompts of `prompt_len` -> `output_len` tokens each, submitted at once;
  output tokens/s.
- W2: batch-1 decode ms/token: (time of prompt -> 1 + decode_tokens) minus (time of prompt -> 1),
  divided by decode_tokens, on fresh prompts of `decode_prompt_len` (so prefill cancels out and
  no engine needs a step-level hook).
- W3: TTFT of one fresh `ttft_prompt_len`-token prompt (generate 1 token).
- W4: W1's requests each behind one fresh `shared_prefix_len`-token prefix (prefix caching on).

Every repeat draws fresh ids (`make_workloads(sizes, repeat)`), so no engine hits a prefix cache
filled by an earlier repeat.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

WORKLOADS = ("w1", "w2", "w3", "w4")
_VOCAB = (3, 32000)  # ids drawn from here: inside every supported model's vocabulary

Generate = Callable[[list[list[int]], int], list[list[int]]]


@dataclass(frozen=True, slots=True)
class PeerSizes:
    num_requests: int = 32
    prompt_len: int = 256
    output_len: int = 64
    decode_prompt_len: int = 64
    decode_tokens: int = 64
    ttft_prompt_len: int = 2048
    shared_prefix_len: int = 1024
    repeats: int = 5
    hf_requests: int = 4  # HF one at a time runs W1 on this many requests (its rate is per request)

    def to_dict(self) -> dict:
        return asdict(self)


QUICK = PeerSizes(num_requests=8, prompt_len=64, output_len=16, decode_prompt_len=32,
                  decode_tokens=16, ttft_prompt_len=512, shared_prefix_len=256, repeats=1,
                  hf_requests=2)


def make_workloads(sizes: PeerSizes, repeat: int) -> dict:
    """The token ids of one repeat: a JSON-able dict every engine receives unchanged."""
    rng = random.Random(1000 + repeat)

    def ids(n: int) -> list[int]:
        return [rng.randrange(*_VOCAB) for _ in range(n)]

    prefix = ids(sizes.shared_prefix_len)
    return {
        "w1": [ids(sizes.prompt_len) for _ in range(sizes.num_requests)],
        "w2": [ids(sizes.decode_prompt_len) for _ in range(2)],
        "w3": ids(sizes.ttft_prompt_len),
        "w4": [prefix + ids(sizes.prompt_len) for _ in range(sizes.num_requests)],
        "warmup": [ids(16) for _ in range(2)],
    }


def measure(generate: Generate, work: dict, sizes: PeerSizes | dict,
            only: Iterable[str] = WORKLOADS, w1_requests: int | None = None) -> dict:
    """Time `generate` on one repeat's workloads (`only` picks which). `w1_requests` runs W1 on
    that many requests only (a sequential baseline). Returns the figures plus W1's tokens."""
    if isinstance(sizes, dict):
        sizes = PeerSizes(**sizes)
    only = set(only)
    generate(work["warmup"], 4)
    result: dict = {}
    if "w1" in only:
        prompts = work["w1"][:w1_requests]
        seconds, tokens = _timed(generate, prompts, sizes.output_len)
        result["w1_tokens_per_s"] = sum(map(len, tokens)) / seconds
        result["w1_tokens"] = tokens
    if "w2" in only:
        first, _ = _timed(generate, [work["w2"][0]], 1)
        full, tokens = _timed(generate, [work["w2"][1]], 1 + sizes.decode_tokens)
        result["w2_ms_per_token"] = max(full - first, 0.0) * 1e3 / sizes.decode_tokens
        result["w2_tokens"] = tokens[0]
    if "w3" in only:
        result["w3_ttft_ms"] = _timed(generate, [work["w3"]], 1)[0] * 1e3
    if "w4" in only:
        seconds, tokens = _timed(generate, work["w4"], sizes.output_len)
        result["w4_tokens_per_s"] = sum(map(len, tokens)) / seconds
    return result


def _timed(generate: Generate, prompts: list[list[int]], max_tokens: int):
    start = time.perf_counter()
    tokens = generate(prompts, max_tokens)
    seconds = time.perf_counter() - start
    if [len(t) for t in tokens] != [max_tokens] * len(prompts):
        raise RuntimeError(f"expected {max_tokens} tokens per prompt, got "
                           f"{sorted({len(t) for t in tokens})}")
    return seconds, tokens
