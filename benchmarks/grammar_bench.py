"""Grammar libraries for structured output, measured on one tokenizer:
`python -m benchmarks grammar --model FOLDER [--vocab N] [--tokens N] [--json]`.

For each of `llguidance`, `xgrammar` and `outlines-core` that imports here, in one run:
- `tokenizer_s`: building the library's view of the vocabulary (once per engine);
- `compile_schema_ms`: compiling a sample JSON schema (nested object, array, pattern,
  bounds) into a matcher, caches off; `compile_json_ms`: "any JSON object";
- `mask_us_p50` / `mask_us_p99`: filling the next-token bitmask, per token, along a
  generation driven by random logits under the mask (the work a constrained row adds to
  every decode step), over `--tokens` tokens or until the grammar ends;
- `*_vs_argmax`: each time over the same run's `torch.argmax` of one logits row (the
  sampler's own per-row work), so the figure is a ratio that holds on a noisy machine.
Compact JSON (no free whitespace) for every library, as the engine compiles it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # its stub declares it; not re-exported

T = TypeVar("T")
SCHEMA = json.dumps({
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                 "maxItems": 3},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 16},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"}},
    "required": ["name", "age", "address", "active"], "additionalProperties": False})


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def _unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = (bitmask.view(-1)[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.bool().view(-1)[:vocab]


def _drive(fill: Callable[[], torch.Tensor], accept: Callable[[int], object],
           done: Callable[[], bool], vocab: int, tokens: int) -> list[float]:
    """Per-token fill times along a random-logits generation under the mask."""
    gen = torch.Generator().manual_seed(0)
    times: list[float] = []
    for _ in range(tokens):
        if done():
            break
        logits = torch.randn(vocab, generator=gen)
        started = time.perf_counter()
        allowed = fill()
        times.append(time.perf_counter() - started)
        logits[~_unpack(allowed, vocab) if allowed.dtype == torch.int32 else ~allowed] = -1e9
        accept(int(logits.argmax()))
    return times


def bench_llguidance(tokenizer, vocab: int, tokens: int) -> dict:
    import llguidance
    import llguidance.hf
    from llguidance import LLMatcher

    lltok, init_s = _timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab))
    compact: JsonCompileOptions = {"whitespace_flexible": False}

    def matcher(schema: str) -> LLMatcher:
        m = LLMatcher(lltok, LLMatcher.grammar_from_json_schema(schema, defaults=compact))
        assert not m.is_error(), m.get_error()
        return m

    m, compile_s = _timed(lambda: matcher(SCHEMA))
    _, json_s = _timed(lambda: matcher('{"type": "object"}'))
    mask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)

    def fill() -> torch.Tensor:
        m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        return mask

    times = _drive(fill, m.consume_token, m.is_stopped, vocab, tokens)
    return {"tokenizer_s": round(init_s, 3), "compile_schema_ms": _ms(compile_s),
            "compile_json_ms": _ms(json_s), "times": times}


def bench_xgrammar(tokenizer, vocab: int, tokens: int) -> dict:
    import xgrammar as xgr

    def init():
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        return xgr.GrammarCompiler(info, cache_enabled=False)

    compiler, init_s = _timed(init)
    compiled, compile_s = _timed(
        lambda: compiler.compile_json_schema(SCHEMA, any_whitespace=False))
    _, json_s = _timed(lambda: compiler.compile_json_schema('{"type": "object"}',
                                                            any_whitespace=False))
    m = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)

    def fill() -> torch.Tensor:
        m.fill_next_token_bitmask(mask, 0)
        return mask

    times = _drive(fill, m.accept_token, m.is_terminated, vocab, tokens)
    return {"tokenizer_s": round(init_s, 3), "compile_schema_ms": _ms(compile_s),
            "compile_json_ms": _ms(json_s), "times": times}


def bench_outlines_core(tokenizer, vocab: int, tokens: int) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    def init():
        by_string: dict[str, list[int]] = {}
        for piece, token_id in tokenizer.get_vocab().items():
            if token_id != tokenizer.eos_token_id:
                by_string.setdefault(piece, []).append(token_id)
        return Vocabulary(tokenizer.eos_token_id, by_string)

    vocabulary, init_s = _timed(init)
    index, compile_s = _timed(lambda: Index(build_regex_from_schema(SCHEMA), vocabulary))
    guide = Guide(index)

    def fill() -> torch.Tensor:
        allowed = torch.zeros(vocab, dtype=torch.bool)
        allowed[guide.get_tokens()] = True
        return allowed

    times = _drive(fill, guide.advance, guide.is_finished, vocab, min(tokens, 40))
    return {"tokenizer_s": round(init_s, 3), "compile_schema_ms": _ms(compile_s),
            "compile_json_ms": None, "times": times}


LIBRARIES = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar,
             "outlines_core": bench_outlines_core}


def argmax_us(vocab: int, repeats: int = 2000) -> float:
    row = torch.randn(1, vocab)
    started = time.perf_counter()
    for _ in range(repeats):
        torch.argmax(row, dim=-1)
    return (time.perf_counter() - started) / repeats * 1e6


def run(args: argparse.Namespace) -> dict:
    """Every library that imports here, on `args.model`'s tokenizer."""
    from transformers import AutoTokenizer

    model, vocab, tokens = args.model, args.vocab, args.tokens
    tokenizer = AutoTokenizer.from_pretrained(model)
    vocab = vocab or len(tokenizer)
    baseline = argmax_us(vocab)
    result: dict = {"model": model, "vocab": vocab, "argmax_us": round(baseline, 2)}
    for name, bench in LIBRARIES.items():
        try:
            figures = bench(tokenizer, vocab, tokens)
        except ImportError:
            result[name] = "not installed"
            continue
        times = sorted(t * 1e6 for t in figures.pop("times"))
        p50, p99 = statistics.median(times), times[int(0.99 * (len(times) - 1))]
        figures.update(num_tokens=len(times), mask_us_p50=round(p50, 1),
                       mask_us_p99=round(p99, 1), mask_p50_vs_argmax=round(p50 / baseline, 2))
        result[name] = figures
    return result
