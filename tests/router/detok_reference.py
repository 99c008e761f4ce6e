"""The detokenizer the router had before its window: the whole output decoded on every delta
(O(output) per delta), trailing U+FFFD held back, then the stop cut and hold-back. It is the
reference `IncrementalDetokenizer` must match delta for delta, and the baseline of
tests/router/detok_bench.py. Also: a byte-level BPE model folder built with `tokenizers`."""

from __future__ import annotations

import json
from pathlib import Path

from pdcluster.router.api.tokenizer import RouterTokenizer

REPLACEMENT = "\ufffd"
BYTE_LEVEL_CORPUS = [
    "Hello world, this is a test.", "Ünïcödé: café, naïve, straße, € and £.",
    "中文的文本，日本語のテキスト、한국어 텍스트.", "Emoji 😀🎉🚀 and symbols ∑∫√ ≠ ≤.",
    "def f(x):\n    return x * 2  # code\n", "Stop here. STOP. The end.",
]


class WholeDecodeDetokenizer:
    """Text deltas from decoding every id so far on each call."""

    def __init__(self, tokenizer: RouterTokenizer, stop: list[str]) -> None:
        self._tokenizer = tokenizer
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._emitted = 0
        self.stopped = False

    def add(self, token_ids: list[int], final: bool = False) -> str:
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        text = self._tokenizer.decode(self._ids)
        if not final:
            text = text.rstrip(REPLACEMENT)  # an incomplete UTF-8 character waits
        for stop in self._stop:
            at = text.find(stop, max(0, self._emitted - len(stop)))
            if at != -1:
                self.stopped = True
                text = text[:at]
        end = len(text) if final or self.stopped else max(self._emitted, len(text) - self._hold)
        delta = text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return delta


def write_byte_level_model(out: Path) -> Path:
    """A model folder whose tokenizer is a byte-level BPE (GPT-2 / Llama-3 / Qwen style)
    trained here on a few multilingual lines, with two special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(BYTE_LEVEL_CORPUS * 4, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    (out / "config.json").write_text(json.dumps({"eos_token_id": 0,
                                                 "max_position_embeddings": 1 << 16}))
    return out
