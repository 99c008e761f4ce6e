"""Structured output: the sampler masks every token a request's grammar does not allow, so its
output matches the grammar whatever the model's logits — valid JSON even from a random model.

The grammar library is `llguidance` (docs/engine.md has the measurements that chose it over
`xgrammar` and `outlines-core`: compiling a schema takes milliseconds rather than hundreds,
which matters because compilation runs when the engine admits a request, on the node's one
thread). `core.sampling.GuidedDecoding` kinds: `json_object` (any JSON object),
`json_schema`, `regex`, `choice` (a JSON list of strings) and `grammar` (Lark, or GBNF as
llama.cpp writes it). JSON is compact (no free whitespace between tokens), so a model cannot
spend its whole budget on blanks.

`GrammarCompiler` (one per engine): compiles a (kind, spec) once into a validated matcher
(LRU cache) and hands each request a copy; a malformed spec raises `ValueError` naming
`guided`, which refuses that request alone at admission. The llguidance view of the
vocabulary (~0.5-1 s to build) is made at the first guided request. `compile_async` compiles
on the compiler's own thread (llguidance releases the GIL while it compiles): a 64 KiB schema
takes ~0.5 s, which the node's serving thread must not spend — it admits the request once
the future is done, or refuses it past its deadline (node/admissions.py). At most
`MAX_COMPILING` distinct grammars wait for that thread (`OverloadedError` beyond).

`StructuredOutput` (the sampler's): each request's matcher, kept in step with its output
tokens lazily (tokens sampled elsewhere, e.g. a prefill node's first token, are consumed
before the next mask); `mask` writes `-inf` into the disallowed logits of every guided row of
a batch at once; `accept` feeds it the sampled token and says whether the grammar has ended
(nothing but EOS could follow), which finishes the request. The mask covers the model's
(possibly padded) vocabulary: ids the tokenizer does not have are never allowed.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdcluster.core.sampling import GuidedDecoding
from pdcluster.core.types import ReqId
from pdcluster.engine.core.pins import OverloadedError
from pdcluster.engine.core.request import Request

if TYPE_CHECKING:  # llguidance itself loads at the first guided request
    from llguidance import LLExecutor, LLMatcher, LLTokenizer
    from llguidance._lib import JsonCompileOptions  # its stub declares it; not re-exported

logger = logging.getLogger(__name__)
_CACHE_SIZE = 256
MAX_COMPILING = 16
_MAX_ERROR_CHARS = 500
_COMPACT_JSON: JsonCompileOptions = {"whitespace_flexible": False}
_ANY_OBJECT = '{"type": "object"}'


class GrammarError(ValueError):
    """A guided request's grammar failed (refused a token, or left none allowed)."""


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = max(vocab_size, len(tokenizer))
        self.eos_token_ids = list(eos_token_ids) or [tokenizer.eos_token_id]
        self._lltokenizer: LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the cache and `_compiling`, shared with the thread
        self._tokenizer_lock = threading.Lock()
        self._compiling: dict[tuple[str, str], Future[None]] = {}
        self._pool: ThreadPoolExecutor | None = None

    @property
    def mask_words(self) -> int:
        """int32 words of one row's bitmask."""
        return (self.vocab_size + 31) // 32

    def check(self, guided: GuidedDecoding) -> None:
        """Compile `guided` (into the cache): `ValueError` naming `guided` if it does not."""
        self._compiled(guided)

    def matcher(self, guided: GuidedDecoding) -> LLMatcher:
        """A fresh matcher for `guided`, at its start."""
        return self._compiled(guided).deep_copy()

    def compile_async(self, guided: GuidedDecoding) -> Future[None] | None:
        """Compile `guided` into the cache on the compiler's thread: None when it is there
        already, else a future that fails with `check`'s ValueError. `OverloadedError` when
        `MAX_COMPILING` grammars wait already."""
        key = (guided.kind, guided.spec)
        with self._lock:
            if key in self._cache:
                return None
            future = self._compiling.get(key)
            if future is not None:
                return future
            if len(self._compiling) >= MAX_COMPILING:
                raise OverloadedError(f"{MAX_COMPILING} grammars are compiling already")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
            future = self._pool.submit(self.check, guided)
            self._compiling[key] = future
        future.add_done_callback(lambda _: self._done_compiling(key))
        return future

    def _done_compiling(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._compiling.pop(key, None)

    def _compiled(self, guided: GuidedDecoding) -> LLMatcher:
        key = (guided.kind, guided.spec)
        with self._lock:
            pristine = self._cache.get(key)
            if pristine is not None:
                self._cache.move_to_end(key)
                return pristine
        pristine = self._compile(guided)
        with self._lock:
            self._cache[key] = pristine
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return pristine

    def _compile(self, guided: GuidedDecoding) -> LLMatcher:
        import llguidance

        try:
            grammar = _grammar_text(guided)
        except ValueError as exc:
            raise ValueError(f"guided ({guided.kind}): {_short(str(exc))}") from None
        limits = llguidance.LLParserLimits(verbose_errors=False)
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise ValueError(f"guided ({guided.kind}): {_short(matcher.get_error())}")
        return matcher

    def _tokenizer(self) -> LLTokenizer:
        with self._tokenizer_lock:
            if self._lltokenizer is None:
                import llguidance.hf

                try:
                    self._lltokenizer = llguidance.hf.from_tokenizer(
                        self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
                except ValueError as exc:  # a slow (Python) tokenizer
                    raise ValueError(f"guided decoding is not available for this model's "
                                     f"tokenizer: {exc}") from None
            return self._lltokenizer


def _grammar_text(guided: GuidedDecoding) -> str:
    """The llguidance grammar of a (kind, spec)."""
    from llguidance import LLMatcher, grammar_from

    if guided.kind == "json_object":
        return LLMatcher.grammar_from_json_schema(_ANY_OBJECT, defaults=_COMPACT_JSON)
    if guided.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(guided.spec, defaults=_COMPACT_JSON)
    if guided.kind == "regex":
        return LLMatcher.grammar_from_regex(guided.spec)
    if guided.kind == "choice":
        choices = json.loads(guided.spec)
        return LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, choices)))
    return grammar_from("grammar", guided.spec)


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= _MAX_ERROR_CHARS else message[:_MAX_ERROR_CHARS] + "..."


@dataclass(slots=True)
class _Guided:
    matcher: LLMatcher
    num_consumed: int = 0  # output tokens the matcher has seen


class StructuredOutput:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._states: dict[ReqId, _Guided] = {}
        self._executor: LLExecutor | None = None
        self._shifts = torch.arange(32, dtype=torch.int32)

    def forget(self, request_id: ReqId) -> None:
        self._states.pop(request_id, None)

    def mask(self, logits: torch.Tensor, rows: list[int], requests: list[Request]
             ) -> dict[int, str]:
        """Mask the disallowed tokens of rows `rows` (whose requests are `requests`) in
        `logits`. Returns {row: error} for rows whose grammar failed; their logits are left
        as they were (the sampler fails those requests alone)."""
        failed: dict[int, str] = {}
        live: list[tuple[int, _Guided]] = []
        for row, req in zip(rows, requests, strict=True):
            try:
                live.append((row, self._synced(req)))
            except ValueError as exc:  # GrammarError, or a spec that no longer compiles
                failed[row] = str(exc)
        if live:
            bitmask = self._fill([state.matcher for _, state in live])
            self._apply(logits, [row for row, _ in live], bitmask)
        return failed

    def accept(self, req: Request, token_id: int) -> bool:
        """Feed the sampled token to the request's matcher; True when the grammar has ended
        (nothing but EOS may follow), which finishes the request. `GrammarError` if the
        grammar refuses it."""
        state = self._states[req.request_id]
        if state.matcher.is_stopped():
            return True  # ended on a token this node did not sample: this one ends it
        if not state.matcher.consume_token(token_id):
            raise GrammarError(f"structured output: {_short(state.matcher.get_error())}")
        state.num_consumed += 1
        return state.matcher.is_stopped()

    def is_accepting(self, req: Request) -> bool:
        return self._states[req.request_id].matcher.is_accepting()

    def _synced(self, req: Request) -> _Guided:
        state = self._states.get(req.request_id)
        if state is None:
            guided = req.params.guided
            assert guided is not None, "only a guided request is masked"
            state = _Guided(self.compiler.matcher(guided))
            self._states[req.request_id] = state
        new = req.output_token_ids[state.num_consumed:]
        if new and not state.matcher.is_stopped():
            state.matcher.consume_tokens(new)  # a refusal leaves it in its error state
        state.num_consumed = req.num_output_tokens
        if state.matcher.is_error():
            raise GrammarError(f"structured output: {_short(state.matcher.get_error())}")
        return state

    def _fill(self, matchers: list[LLMatcher]) -> torch.Tensor:
        """[len(matchers), words] int32 bitmask, computed by llguidance's thread pool."""
        import llguidance

        words = self.compiler.mask_words
        bitmask = torch.zeros((len(matchers), words), dtype=torch.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        self._executor.unsafe_compute_mask_ptr(
            [(m, k) for k, m in enumerate(matchers)], bitmask.data_ptr(), words * 4,
            len(matchers))
        return bitmask

    def _apply(self, logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
        """One batched op: unpack the bits and fill -inf where a bit is 0."""
        vocab = logits.shape[-1]
        bits = (bitmask[:, :, None] >> self._shifts) & 1
        allowed = bits.view(len(rows), -1)[:, :vocab].bool().to(logits.device)
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
