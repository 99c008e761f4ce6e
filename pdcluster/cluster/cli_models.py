"""The model commands of `pdcluster`:

  make-tiny-model OUT_DIR    a small random HF-format model with a real tokenizer (tests)
  convert-gguf GGUF OUT_DIR  a GGUF file as an HF folder (float32 safetensors, config,
                             generation config, tokenizer, chat template) that `serve`,
                             `generate` and `router serve` load like any checkpoint;
                             `--model x.gguf` does the same into a cache on its own, this names
                             the folder (scripts/setup.sh uses it for the built-in model)
  generate --model DIR|GGUF  the engine offline on one prompt

The engine is imported inside the handlers: `--help` stays torch-free.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pdcluster.cluster.cli_common import (
    DEVICES,
    DTYPES,
    UsageError,
    add_command,
    config_errors_as_usage,
    require_device,
    resolve_model_arg,
)

# Mirrors engine.models.tiny_model.ARCHS / PRESETS; repeated here so that --help never imports
# torch.
TINY_ARCHS = ("llama", "qwen2", "mistral")
TINY_PRESETS = ("tiny", "bench")


def parse_token_ids(text: str) -> list[int]:
    """Parse "1,2,3" into [1, 2, 3]; argparse reports a bad value as a usage error."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expected comma-separated token ids, e.g. 1,2,3")
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"token ids must be >= 0: {text!r}")
    return ids


def add_make_tiny_model(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "make-tiny-model",
        "Build a small random-weight HF-format model (safetensors + a real SentencePiece "
        "tokenizer) for tests and the default run. Needs no network.",
        _cmd_make_tiny_model,
    )
    parser.add_argument("out_dir", metavar="OUT_DIR", help="folder to write the model into")
    parser.add_argument("--arch", choices=TINY_ARCHS, default="llama", help="model family")
    parser.add_argument("--seed", type=int, default=0, help="seed for the random weights")
    parser.add_argument(
        "--preset",
        choices=TINY_PRESETS,
        default="tiny",
        help="size: 'tiny' for tests, 'bench' for benchmarks",
    )


def add_generate(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "generate",
        "Generate a completion for one prompt with the local engine (no cluster).",
        _cmd_generate,
    )
    parser.add_argument("--model", required=True,
                        help="HF-format model folder, or a GGUF file (converted once into "
                        "a cache)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (tokenized with the model's tokenizer)")
    prompt.add_argument(
        "--prompt-ids",
        type=parse_token_ids,
        metavar="IDS",
        help='prompt as comma-separated token ids, e.g. "1,2,3"',
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=0, help="0 means no top-k cut")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: unseeded)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and KV dtype")
    parser.add_argument("--device", choices=DEVICES, default="cpu", help="where to run")
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV cache blocks (default: the engine sizes the cache itself)",
    )
    parser.add_argument("--block-size", type=int, default=None,
                        help="tokens per KV block (default: 16; 32 with --engine vllm)")
    parser.add_argument("--engine", choices=("pdcluster", "vllm"), default="pdcluster",
                        help="the project's own engine, or vLLM (`make setup-vllm`)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="split the model over this many ranks (processes the engine "
                        "starts, one GPU each on CUDA)")


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from pdcluster.engine.models.tiny_model import make_tiny_model

    path = make_tiny_model(args.out_dir, arch=args.arch, seed=args.seed, preset=args.preset)
    print(path)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    require_device(args.device)
    model = resolve_model_arg(args.model)
    if args.engine == "vllm":
        return _generate_with_vllm(args, model)
    from pdcluster.engine import LLM, SamplingParams

    extra = {} if args.num_blocks is None else {"num_kv_blocks": args.num_blocks}
    started = time.perf_counter()
    with config_errors_as_usage():
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
        llm = LLM(
            model,
            dtype=args.dtype,
            device=args.device,
            block_size=args.block_size or 16,
            tensor_parallel_size=args.tensor_parallel_size,
            **extra,
        )
    loaded = time.perf_counter()
    prompt = args.prompt if args.prompt is not None else args.prompt_ids
    out = llm.generate([prompt], params)[0]
    done = time.perf_counter()
    print(f"prompt: {prompt}")
    print(f"output: {out.text}")
    print(
        f"generated {len(out.token_ids)} tokens in {done - loaded:.3f} s "
        f"(model load {loaded - started:.3f} s)",
        file=sys.stderr,
    )
    return 0


def _generate_with_vllm(args: argparse.Namespace, model: str) -> int:
    from pdcluster.core.sampling import SamplingSpec

    try:
        from pdcluster.vllm_backend.offline import generate
    except ImportError as exc:
        raise UsageError(f"--engine vllm needs vLLM (`make setup-vllm`): {exc}") from exc
    extra = {} if args.num_blocks is None else {"num_kv_blocks": args.num_blocks}
    spec = SamplingSpec(max_tokens=args.max_tokens, temperature=args.temperature,
                        top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    prompt = args.prompt if args.prompt is not None else args.prompt_ids
    started = time.perf_counter()
    with config_errors_as_usage():
        token_ids, text = generate(model, prompt, spec, dtype=args.dtype, device=args.device,
                                   block_size=args.block_size or 32,
                                   tensor_parallel_size=args.tensor_parallel_size, **extra)
    print(f"prompt: {prompt}")
    print(f"output: {text}")
    print(f"generated {len(token_ids)} tokens with vLLM in {time.perf_counter() - started:.3f} s "
          "(engine start included)", file=sys.stderr)
    return 0




def add_convert_gguf(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "convert-gguf",
        "Convert a GGUF model file (Llama, Mistral or Qwen2 architecture) into an HF-format "
        "folder: weights dequantized to float32, tokenizer and chat template from the file's "
        "metadata. Needs the `gguf` and `accelerate` packages; no network.",
        _cmd_convert_gguf,
    )
    parser.add_argument("gguf_file", metavar="GGUF", help="the .gguf file")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="folder to create (must not exist)")


def _cmd_convert_gguf(args: argparse.Namespace) -> int:
    if Path(args.out_dir).exists():
        raise UsageError(f"{args.out_dir} already exists")
    from pdcluster.engine.models.gguf import GGUFError, convert_gguf

    try:
        out = convert_gguf(args.gguf_file, args.out_dir)
    except GGUFError as exc:
        raise UsageError(str(exc)) from exc
    print(out)
    return 0
