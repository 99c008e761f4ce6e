"""`python -m benchmarks moe [--quick] [--device D]`: a mixture-of-experts step against an
equally sized dense one (a study behind docs/engine.md's MoE support).

Two random checkpoints of the engine bench's shape (hidden 512, 8 layers, 8 heads / 4 KV
heads): the dense `bench` preset (SwiGLU intermediate 1408) and a Mixtral with 8 experts of
intermediate 704, top-2 — the same active parameters per token (2 x 704 = 1408), so the same
matmul FLOPs; the MoE holds 4x the FFN weights. Timed with our engine only: prefill of one
512-token prompt, a batch-1 decode step and a batch-32 decode step (medians; the two models
alternate, best of 3 rounds). The ratios are the cost of routing, grouping tokens per expert
and the per-expert matmuls, and of reading 4x the FFN weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

NUM_EXPERTS, TOP_K, EXPERT_INTERMEDIATE = 8, 2, 704
ROUNDS = 3


def write_mixtral(out: Path, seed: int = 0) -> Path:
    """The dense bench checkpoint with every MLP replaced by 8 routed experts."""
    import torch
    from safetensors.torch import load_file, save_file

    from pdcluster.engine.models.tiny_model import make_tiny_model

    make_tiny_model(out, arch="mistral", seed=seed, preset="bench")
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
               num_local_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K,
               intermediate_size=EXPERT_INTERMEDIATE)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    weights = {k: v for k, v in load_file(out / "model.safetensors").items() if ".mlp." not in k}
    gen, hidden = torch.Generator().manual_seed(seed + 1), cfg["hidden_size"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.block_sparse_moe."
        weights[p + "gate.weight"] = torch.randn(NUM_EXPERTS, hidden, generator=gen) * 0.1
        for e in range(NUM_EXPERTS):
            for name, shape in (("w1", (EXPERT_INTERMEDIATE, hidden)),
                                ("w3", (EXPERT_INTERMEDIATE, hidden)),
                                ("w2", (hidden, EXPERT_INTERMEDIATE))):
                weights[f"{p}experts.{e}.{name}.weight"] = torch.randn(*shape, generator=gen) * 0.1
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _step_times(engine, prompts: list[list[int]], steps: int) -> tuple[float, float]:
    """(prefill seconds of the whole batch, median decode step seconds)."""
    from pdcluster.engine import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps + 1)
    for n, prompt in enumerate(prompts):
        engine.add_request(f"r{n}-{time.monotonic_ns()}", prompt, params)
    start = time.perf_counter()
    engine.step()  # every prompt fits one step's token budget
    prefill = time.perf_counter() - start
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return prefill, statistics.median(times)


def _measure(model_dir: str, device: str, steps: int) -> dict[str, float]:
    import random

    from pdcluster.engine import LLMEngine

    rng = random.Random(5)
    engine = LLMEngine.from_model(model_dir, device=device, dtype="float32", max_num_seqs=32,
                                  max_num_batched_tokens=2048, num_kv_blocks=256)
    _step_times(engine, [[rng.randrange(3, 32000) for _ in range(32)]], 2)  # warm-up
    prefill, b1 = _step_times(engine, [[rng.randrange(3, 32000) for _ in range(512)]], steps)
    batch = [[rng.randrange(3, 32000) for _ in range(32)] for _ in range(32)]
    _, b32 = _step_times(engine, batch, steps)
    return {"prefill_ms_512": prefill * 1e3, "decode_step_ms_b1": b1 * 1e3,
            "decode_step_ms_b32": b32 * 1e3}


def moe_vs_dense(tmp: str, device: str, steps: int) -> dict:
    from pdcluster.engine.models.tiny_model import make_tiny_model

    dense_dir = make_tiny_model(Path(tmp) / "dense", arch="mistral", seed=0, preset="bench")
    moe_dir = write_mixtral(Path(tmp) / "moe")
    # Alternate the two, best of ROUNDS: a shared, noisy CPU then hits both alike.
    runs: dict[str, list[dict[str, float]]] = {"dense": [], "moe": []}
    for _ in range(ROUNDS):
        runs["dense"].append(_measure(str(dense_dir), device, steps))
        runs["moe"].append(_measure(str(moe_dir), device, steps))
    dense, moe = ({k: min(r[k] for r in rs) for k in rs[0]} for rs in runs.values())
    result: dict[str, float] = {"moe_experts": NUM_EXPERTS, "moe_top_k": TOP_K}
    for key in dense:
        result[f"moe_{key}"] = round(moe[key], 2)
        result[f"dense_{key}"] = round(dense[key], 2)
        result[f"moe_vs_dense_{key.replace('_ms', '')}"] = round(moe[key] / dense[key], 2)
    return result


def run(args: argparse.Namespace) -> dict:
    """The comparison over the engine bench's number of decode steps (32; --quick 8)."""
    with tempfile.TemporaryDirectory(prefix="pdcluster-moe-") as tmp:
        return moe_vs_dense(tmp, args.device, 8 if args.quick else 32)
