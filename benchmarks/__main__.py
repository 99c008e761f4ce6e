"""`python -m benchmarks NAME [--json] [--quick] ...`: the harnesses of this folder, run from
the repository root with the project's venv, by the same conventions as `pdcluster bench` (a
table, then one JSON object as the last line of stdout; --model resolved the same way).

  chaos    faults under load on a local served cluster, nothing lost (`make bench-chaos`)
  peers    the engine against vLLM (CPU), transformers, llama.cpp (`make bench-peers`)
  vllm     vLLM as the nodes' engine against vLLM offline (`make bench-vllm`)
  moe      a MoE step against an equally sized dense one
  mla      MLA decode, absorbed vs expanded, and KV bytes per token
  grammar  structured-output grammar libraries on one tokenizer
  attention  paged decode attention on a GPU: the engine's kernel, its floor, FlashInfer
  vllm-helpers  vLLM's compiled helpers on the CPU, compiled against eager

API: `main(argv) -> int` (exit status), `HARNESSES`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Callable

from benchmarks.chaos_args import add_chaos_args
from pdcluster.cluster.cli import format_table
from pdcluster.cluster.cli_common import (
    DEVICES,
    UsageError,
    formatter,
    require_device,
    resolve_model_arg,
)

AddArgs = Callable[[argparse.ArgumentParser], None]


def _regress_args(parser: argparse.ArgumentParser) -> None:
    from benchmarks.engine_regress import add_args

    add_args(parser)


def _peers_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=2,
                        help="CPU threads of every engine measured (and of the machine limits)")
    parser.add_argument("--model", default=None,
                        help="model folder (default: the built-in model under the cache folder, "
                        "$PDCLUSTER_CACHE_DIR/smollm2-135m-instruct)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="interleaved repeats per workload, medians and spread reported "
                        "(default 5; --quick 1)")
    parser.add_argument("--max-load", type=float, default=None,
                        help="refuse to start above this 1-minute load average (default: "
                        "cores - threads + 0.5, at least 0.5)")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                        help="wait up to this long for the load average to drop first")
    parser.add_argument("--allow-busy", action="store_true",
                        help="run on a busy machine anyway, flagging the result")
    parser.add_argument("--no-preload", action="store_true",
                        help="no allocator preload for any engine (default: what each "
                        "project advises)")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="also run llama.cpp if its venv (peers/llamacpp in the cache folder) "
                        "is installed")
    parser.add_argument("--install-llama-cpp", action="store_true",
                        help="build llama-cpp-python into its venv first if missing (a source "
                        "build: tens of minutes on 2 cores)")


def _vllm_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="model folder (default: the built-in model under the cache folder)")


def _moe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=DEVICES, default="cpu", help="where to run")


def _grammar_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="a folder with a HF tokenizer")
    parser.add_argument("--vocab", type=int, default=None,
                        help="the model's (padded) vocabulary size; default the tokenizer's")
    parser.add_argument("--tokens", type=int, default=300, help="tokens generated per library")


# name -> (module of benchmarks/ with `run(args) -> dict`, description, its own options)
HARNESSES: dict[str, tuple[str, str, AddArgs]] = {
    "chaos": ("chaos_bench", "Faults under load on a local served cluster (Ray, the metadata "
              "service and the router as real processes): nodes killed, an abort storm, the "
              "metadata service stalled and restarted, etcd restarted, a node restarted under "
              "its id, a churn soak; per fault requests lost, latency before/during/after, "
              "recovery, leaked KV blocks and whether the index is exact again within a lease "
              "TTL.", add_chaos_args),
    "regress": ("engine_regress", "The engine on CPU against an earlier revision of itself: bench "
                "peers' four workloads, both in one run (--baseline REV).", _regress_args),
    "peers": ("peers_bench", "The engine against vLLM's CPU build (installed into its own venv "
              "under .cache/peers on first use), transformers generate and optionally "
              "llama.cpp, on the real model and the same token ids, all from one settings "
              "object, with the machine's matmul, copy and read limits, in the same run.",
              _peers_args),
    "vllm": ("vllm_bench", "vLLM as the nodes' engine: N x (256 -> 64) through the router of a "
             "`serve --engine vllm` cluster against vLLM's offline LLM on the same token ids "
             "and threads, the own engine's cluster beside it, and TTFT of a 2,048-token "
             "prompt disaggregated vs colocated (same run).", _vllm_args),
    "moe": ("moe_step", "A mixture-of-experts step against an equally sized dense one (same "
            "active parameters per token): prefill and decode step times, and their ratios.",
            _moe_args),
    "mla": ("mla_decode", "MLA decode absorbed vs expanded (one DeepSeek-V2-Lite-shaped layer) "
            "and KV bytes per token against an equal dense model.", lambda _: None),
    "grammar": ("grammar_bench", "Structured-output grammar libraries (llguidance, xgrammar, "
                "outlines-core, those installed) on one tokenizer: compile times and the "
                "per-token mask cost against the same run's argmax.", _grammar_args),
    "vllm-helpers": ("vllm_helpers", "vLLM's torch.compile'd helpers on this CPU, compiled "
                     "against eager (what pdcluster's vLLM workers run on the CPU): the first "
                     "call and the later calls' median per helper and size.", lambda _: None),
    "attention": ("attention_bench", "Paged decode attention on a CUDA device: the engine's "
                  "Triton kernel against the KV bytes it reads / the copy rate, gather + SDPA, "
                  "and FlashInfer's and FlashAttention's paged kernels where installed.",
                  lambda _: None),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", formatter_class=formatter,
        description="pdcluster's harnesses and studies (from a checkout; not installed). Each "
        "prints one JSON object as the last line of stdout.")
    parser.add_argument("--log-level", default="WARNING",
                        choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="logging level")
    names = parser.add_subparsers(dest="harness", metavar="NAME", required=True)
    for name, (module, description, add_args) in HARNESSES.items():
        sub = names.add_parser(name, help=description.split(":")[0].split(" (")[0],
                               description=description, formatter_class=formatter)
        sub.set_defaults(module=module)
        sub.add_argument("--json", action="store_true", help="print only the JSON line")
        sub.add_argument("--quick", action="store_true", help="smaller sizes, for smoke tests")
        add_args(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if getattr(args, "device", None):
            require_device(args.device)
        if getattr(args, "model", None):
            args.model = resolve_model_arg(args.model)
        result = importlib.import_module(f"benchmarks.{args.module}").run(args)
    except UsageError as exc:
        print(f"python -m benchmarks {args.harness}: error: {exc}", file=sys.stderr)
        return 2
    if not args.json:
        print(format_table(result))
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
