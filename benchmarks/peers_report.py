"""The JSON result of `bench peers` from its raw repeats: medians with their spread, pdcluster's
ratios to each peer (of the medians, and the median of per-repeat ratios: repeats are
interleaved, so a pair shares the machine's state), greedy-token agreement, each engine's
efficiency against the machine's limits, the load every repeat ran under.

API: `summary(...)`, `ratios`, `paired_ratios`, `spread`, `greedy_match`, `efficiency`.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.model_counts import model_counts, prefill_flops
from benchmarks.peers_settings import PeerSettings
from benchmarks.peers_workloads import PeerSizes
from pdcluster.engine.models.model_config import ModelConfig

# pdcluster / peer per workload: (figure, ratio name); throughputs: higher is better,
# times: lower is better.
RATIOS = (("w1_tokens_per_s", "w1_throughput"), ("w2_ms_per_token", "w2_decode_ms"),
          ("w3_ttft_ms", "w3_ttft_ms"), ("w4_tokens_per_s", "w4_throughput"))


def summary(model: str, sizes: PeerSizes, settings: PeerSettings, per_repeat: dict,
            limits: list[dict], infos: dict, load: dict) -> dict:
    medians = {name: _medians(runs) for name, runs in per_repeat.items()}
    machine = {k: round(statistics.median(x[k] for x in limits), 1) for k in limits[0]}
    cfg = ModelConfig.from_pretrained(model)
    busy = sum(w["busy"] for windows in load["repeats"].values() for w in windows)
    result = {
        "model": Path(model).name, "threads": settings.threads, "sizes": sizes.to_dict(),
        "settings": settings.to_dict(), "machine": machine,
        "machine_spread": spread(limits), "engines": medians,
        "spread": {name: spread(runs) for name, runs in per_repeat.items()},
        "engine_info": infos, "model_counts": model_counts(cfg).to_dict(),
        "efficiency": {name: efficiency(cfg, figures, machine, sizes)
                       for name, figures in medians.items()},
        "load": {**load, "busy_windows": busy,
                 "flagged": busy > 0 or load["gate"]["busy_at_start"]},
    }
    ours = per_repeat["pdcluster"]
    for peer, key in (("vllm", "vs_vllm"), ("hf_sequential", "vs_hf_sequential"),
                      ("hf_batched", "vs_hf_batched")):
        if peer in medians:
            result[key] = ratios(medians["pdcluster"], medians[peer])
            result[f"{key}_paired"] = paired_ratios(ours, per_repeat[peer])
    if "vllm" in per_repeat:
        result["greedy_match_vllm"] = greedy_match(ours, per_repeat["vllm"])
    result["greedy_match_hf"] = greedy_match(ours, per_repeat["hf_sequential"])
    return result


def _figures(run: dict) -> dict[str, float]:
    return {k: v for k, v in run.items() if isinstance(v, float)}


def _medians(runs: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in runs), 2) for k in _figures(runs[0])}


def spread(runs: list[dict]) -> dict:
    """Per figure: min, max and (max - min) / median over the repeats."""
    out = {}
    for key in _figures(runs[0]):
        values = [r[key] for r in runs]
        median = statistics.median(values)
        width = (max(values) - min(values)) / median if median else None
        out[key] = {"min": round(min(values), 2), "max": round(max(values), 2),
                    "rel_spread": None if width is None else round(width, 3)}
    return out


def ratios(ours: dict, theirs: dict) -> dict:
    """pdcluster / peer per workload, of the medians."""
    return {short: round(ours[key] / theirs[key], 3) for key, short in RATIOS
            if key in ours and key in theirs and theirs[key]}


def paired_ratios(ours: list[dict], theirs: list[dict]) -> dict:
    """pdcluster / peer in each repeat (the two ran back to back), then median, min, max."""
    out = {}
    for key, short in RATIOS:
        values = [a[key] / b[key] for a, b in zip(ours, theirs, strict=True)
                  if key in a and key in b and b[key]]
        if values:
            out[short] = {"median": round(statistics.median(values), 3),
                          "min": round(min(values), 3), "max": round(max(values), 3)}
    return out


def greedy_match(ours: list[dict], theirs: list[dict]) -> dict:
    """Requests whose greedy tokens are equal (W1 of every repeat, up to the peer's subset,
    and W2's decode), and the earliest divergence among the rest."""
    pairs = []
    for a, b in zip(ours, theirs, strict=True):
        pairs += list(zip(a.get("w1_tokens", []), b.get("w1_tokens", []), strict=False))
        if "w2_tokens" in a and "w2_tokens" in b:
            pairs.append((a["w2_tokens"], b["w2_tokens"]))
    firsts = [next((i for i, (x, y) in enumerate(zip(p, q, strict=True)) if x != y), None)
              for p, q in pairs]
    diverged = [i for i in firsts if i is not None]
    return {"requests": len(pairs), "equal": len(pairs) - len(diverged),
            "first_divergence_min": min(diverged) if diverged else None}


def efficiency(cfg: ModelConfig, figures: dict, machine: dict, sizes: PeerSizes) -> dict:
    """Prefill FLOP/s (W3) against the matmul rate, decode weight bytes/s (W2) against the
    read bandwidth; only the figures the engine has."""
    counts = model_counts(cfg)
    result: dict = {}
    if figures.get("w3_ttft_ms", 0) > 0:
        flops = prefill_flops(counts, cfg, sizes.ttft_prompt_len)
        achieved = flops["total"] / (figures["w3_ttft_ms"] / 1e3) / 1e9
        result["prefill_gflops"] = round(achieved, 1)
        result["prefill_flops_vs_matmul"] = round(achieved / machine["matmul_gflops"], 3)
        result["prefill_attention_share"] = round(flops["attention"] / flops["total"], 3)
    if figures.get("w2_ms_per_token", 0) > 0:
        bytes_per_s = counts.decode_weight_bytes / (figures["w2_ms_per_token"] / 1e3)
        result["decode_gb_per_s"] = round(bytes_per_s / 1e9, 2)
        result["decode_read_bandwidth_use"] = round(bytes_per_s / 1e9 / machine["read_gb_per_s"],
                                                    3)
    return result
