"""The OpenAI response shapes, built from each choice's state (pure functions, no I/O).

`Choice` accumulates one sample's stream: text through the detokenizer (stop strings cut),
token ids, logprobs and top-k alternatives, finish reason. From it:

- completions `logprobs`: `{tokens, token_logprobs, top_logprobs: [{token text: logprob}],
  text_offset}` (the chosen token is always in its top_logprobs map, as in vLLM);
- chat `logprobs`: `{content: [{token, logprob, bytes, top_logprobs: [{token, logprob,
  bytes}]}]}` (top_logprobs holds the k alternatives asked for);
- bodies (`completion_body`, `chat_body`) and SSE chunks (`chunk`), with `usage`.

With `return_tokens_as_token_ids` a token is shown as "token_id:N".

API: `Choice`, `completion_logprobs`, `chat_logprobs`, `message`, `chunk`, `usage`,
`rank_best`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdcluster.core.node_wire import TokenDelta
from pdcluster.router.api.detokenizer import IncrementalDetokenizer
from pdcluster.router.api.tokenizer import RouterTokenizer
from pdcluster.router.api.tools import ToolChoice, parse_tool_calls
from pdcluster.router.errors import NodeFailure


@dataclass(slots=True)
class Choice:
    """One choice's stream so far."""

    detok: IncrementalDetokenizer
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_values: list[list[float]] = field(default_factory=list)
    num_cached: int = 0
    finish_reason: str | None = None

    def absorb(self, delta: TokenDelta) -> str:
        """Take one delta; returns the new text safe to show. A node's abort or error
        raises `NodeFailure`."""
        self.token_ids += delta.token_ids
        self.num_cached = max(self.num_cached, delta.num_cached_tokens)
        self.logprobs += delta.logprobs or []
        self.top_ids += delta.top_token_ids or []
        self.top_values += delta.top_logprobs or []
        text = self.detok.add(delta.token_ids, final=delta.finished)
        self.text += text
        if self.detok.stopped:
            self.finish_reason = "stop"
        elif delta.finished:
            self.finish_reason = "stop" if delta.finish_reason == "stop" else "length"
            if delta.finish_reason in ("abort", "error"):
                raise NodeFailure("internal", delta.error or "the node aborted the request")
        return text

    @property
    def cumulative_logprob(self) -> float:
        return sum(self.logprobs)

    def logprob(self, i: int) -> float | None:
        """Token i's logprob (None if the node sent none for it)."""
        return self.logprobs[i] if i < len(self.logprobs) else None

    def alternatives(self, i: int) -> list[tuple[int, float]]:
        """Token i's top-k (id, logprob) pairs, best first ([] if unknown)."""
        if i >= len(self.top_ids):
            return []
        return list(zip(self.top_ids[i], self.top_values[i], strict=True))


def rank_best(choices: list[Choice], n: int) -> list[Choice]:
    """best_of: the n choices of highest cumulative logprob, best first (vLLM)."""
    return sorted(choices, key=lambda c: c.cumulative_logprob, reverse=True)[:n]


def _shown(tokenizer: RouterTokenizer, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else tokenizer.token_text(token_id)


def completion_logprobs(tokenizer: RouterTokenizer, choice: Choice, start: int, end: int,
                        offset: int, as_ids: bool) -> dict:
    """Completions' logprobs of tokens [start, end); `offset`: the text offset of the first."""
    tokens, offsets, tops = [], [], []
    for i in range(start, end):
        text = _shown(tokenizer, choice.token_ids[i], as_ids)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        top = {text: choice.logprob(i)}
        for tid, value in choice.alternatives(i):
            top.setdefault(_shown(tokenizer, tid, as_ids), value)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [choice.logprob(i) for i in range(start, end)],
            "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer: RouterTokenizer, choice: Choice, start: int, end: int,
                  as_ids: bool) -> dict:
    """Chat's logprobs of tokens [start, end)."""
    content = []
    for i in range(start, end):
        top = [_entry(_shown(tokenizer, tid, as_ids), value)
               for tid, value in choice.alternatives(i)]
        entry = _entry(_shown(tokenizer, choice.token_ids[i], as_ids), choice.logprob(i))
        content.append({**entry, "top_logprobs": top})
    return {"content": content}


def _entry(token: str, logprob: float | None) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def message(choice: Choice, tools: ToolChoice | None, fmt: str) -> tuple[dict, str | None]:
    """The chat message of a finished choice and its finish reason; with tools, a parsed
    call becomes `tool_calls` and finish_reason "tool_calls"."""
    if tools is None or tools.mode == "none":
        return {"role": "assistant", "content": choice.text}, choice.finish_reason
    content, calls = parse_tool_calls(choice.text, tools, fmt)
    if not calls:
        return {"role": "assistant", "content": choice.text}, choice.finish_reason
    return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"


def usage(num_prompt: int, choices: list[Choice]) -> dict:
    generated = sum(len(c.token_ids) for c in choices)
    cached = max((c.num_cached for c in choices), default=0)
    return {"prompt_tokens": num_prompt, "completion_tokens": generated,
            "total_tokens": num_prompt + generated,
            "prompt_tokens_details": {"cached_tokens": cached}}


def chunk(request_id: str, model: str, chat: bool, choices: list[dict]) -> dict:
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": request_id, "object": kind, "created": now_s(), "model": model,
            "choices": choices}


def now_s() -> int:
    return int(time.time())
