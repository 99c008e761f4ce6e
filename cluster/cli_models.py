"""`pdcluster convert-gguf`: turn a GGUF file into a Hugging Face model folder (float32
safetensors, config, generation config, tokenizer and chat template) that `serve`,
`generate` and `router serve` load like any checkpoint. `serve --model x.gguf` does the same
into a cache on its own; this command names the folder (scripts/setup.sh uses it for the
built-in model). The engine is imported inside the handler: `--help` stays torch-free."""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster.cli_common import UsageError, add_command


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
    from engine.gguf import GGUFError, convert_gguf

    try:
        out = convert_gguf(args.gguf_file, args.out_dir)
    except GGUFError as exc:
        raise UsageError(str(exc)) from exc
    print(out)
    return 0
