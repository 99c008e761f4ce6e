"""The chaos benchmark's load: a bounded open-loop stream of requests to the router's HTTP API.

`LoadSpec` fixes the rate and the count: request i leaves at `i / rate` seconds whatever the
state of the earlier ones (open loop, so a fault shows up as latency and errors, not as a
quieter client). With `after_side_s`, a load with a fault beside it goes on at its rate past
`count` until that long after the fault has ended: a fault slower than its estimate (a node
restart on a busy machine) still has requests sent after it.

Prompts are token ids (`/v1/completions`): most start with one of a few shared prefixes, so
prefill nodes hit their prefix cache, decode nodes receive KV from them and nodes pull
prefixes from each other; with `unique=True` every prompt is new (cache churn).
Every other request streams. With `abort_after_s=(lo, hi)` the client disconnects from a
share (`abort_share`) of the requests after a random delay in that range (the abort storm).

Each request ends as an `Outcome`: completed, failed (HTTP status and a short cause),
truncated (a stream that delivered tokens and then broke off) or aborted on purpose; a stream
also keeps when its first token came (`first_token`). With
`token_ids=True` it also keeps the token ids it received (asked for as logprobs shown as
"token_id:N"), for tests that compare a fault's replies with a reference.

API: `LoadSpec`, `Outcome`, `run_load`, `make_prompts`, `prompt_stream`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

_FIRST_TOKEN_ID = 10  # below it: special tokens of the usual vocabularies
_CAUSE_CHARS = 60


@dataclass(frozen=True, slots=True)
class LoadSpec:
    rate: float  # requests per second
    count: int
    max_tokens: int = 16
    num_prefixes: int = 4
    prefix_tokens: int = 64
    suffix_tokens: int = 24
    unique: bool = False
    abort_after_s: tuple[float, float] | None = None
    abort_share: float = 1.0  # of the requests, those the client walks away from
    timeout_s: float = 120.0
    seed: int = 0
    token_ids: bool = False  # keep each reply's token ids (Outcome.token_ids)
    after_side_s: float | None = None  # with a fault: send on until this long after it ends

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.count < 1:
            raise ValueError("the load needs rate > 0 and count >= 1")

    @property
    def duration_s(self) -> float:
        return self.count / self.rate


@dataclass(slots=True)
class Outcome:
    index: int
    stream: bool
    sent: float  # seconds since the load started
    done: float = 0.0
    ok: bool = False
    status: int = 0  # HTTP status; 0: no response
    cause: str = ""  # why it failed ("" when ok)
    truncated: bool = False
    aborted: bool = False  # the client disconnected on purpose
    tokens: int = 0
    token_ids: list[int] | None = None  # with LoadSpec.token_ids
    first_token: float | None = None  # a stream's first token, on the load's clock

    @property
    def latency_s(self) -> float:
        return self.done - self.sent


def make_prompts(spec: LoadSpec, vocab_size: int) -> list[list[int]]:
    """The load's first `spec.count` prompts."""
    return list(itertools.islice(prompt_stream(spec, vocab_size), spec.count))


def prompt_stream(spec: LoadSpec, vocab_size: int) -> Iterator[list[int]]:
    """The load's prompts, one per request, without end (seeded by `spec.seed`)."""
    rng = random.Random(spec.seed)

    def tokens(n: int, r: random.Random) -> list[int]:
        return [r.randrange(_FIRST_TOKEN_ID, vocab_size) for _ in range(n)]

    prefixes = [tokens(spec.prefix_tokens, random.Random(1000 + p))
                for p in range(spec.num_prefixes)]
    while True:
        if spec.unique:
            yield tokens(spec.prefix_tokens + spec.suffix_tokens, rng)
        else:
            yield prefixes[rng.randrange(spec.num_prefixes)] + tokens(spec.suffix_tokens, rng)


def _abort_stream(spec: LoadSpec) -> Iterator[float | None]:
    """Per request: after how many seconds the client walks away (None: never)."""
    rng = random.Random(spec.seed + 1)
    while True:
        yield (rng.uniform(*spec.abort_after_s)
               if spec.abort_after_s and rng.random() < spec.abort_share else None)


async def run_load(base_url: str, model: str, spec: LoadSpec, vocab_size: int,
                   on_start: Callable[[float], Awaitable[None]] | None = None) -> list[Outcome]:
    """Send the whole load and wait for every request; `on_start(t0)` (the fault) runs
    beside it, from the moment the first request leaves (`time.monotonic()` = t0)."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.monotonic()
        side = asyncio.ensure_future(on_start(t0)) if on_start is not None else None
        side_ended: list[float] = []
        if side is not None:
            side.add_done_callback(lambda _: side_ended.append(time.monotonic()))

        after_side_s = spec.after_side_s if side is not None else None

        def more(index: int) -> bool:
            return index < spec.count or after_side_s is not None and (
                not side_ended or time.monotonic() < side_ended[0] + after_side_s)

        requests = []
        for index, (prompt, abort_s) in enumerate(zip(prompt_stream(spec, vocab_size),
                                                      _abort_stream(spec), strict=True)):
            if index >= spec.count and after_side_s is None:
                break
            await asyncio.sleep(max(0.0, t0 + index / spec.rate - time.monotonic()))
            if not more(index):
                break
            requests.append(asyncio.ensure_future(
                _one(session, base_url, model, spec, index, prompt, t0, abort_s)))
        outcomes = await asyncio.gather(*requests)
        if side is not None:
            await side
    return list(outcomes)


async def _one(session, base_url: str, model: str, spec: LoadSpec, index: int,
               prompt: list[int], t0: float, abort_after_s: float | None) -> Outcome:
    stream = index % 2 == 0
    out = Outcome(index, stream, time.monotonic() - t0)
    body = {"model": model, "prompt": prompt, "max_tokens": spec.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": stream}
    if spec.token_ids:
        body.update(logprobs=0, return_tokens_as_token_ids=True)
        out.token_ids = []
    call = _stream(session, base_url, body, out, t0) if stream else _plain(session, base_url,
                                                                             body, out)
    try:
        await asyncio.wait_for(call, abort_after_s if abort_after_s else spec.timeout_s)
    except TimeoutError:
        if abort_after_s:  # the storm: this client walks away (the connection closes)
            out.aborted, out.cause = True, ""
        else:
            out.ok, out.cause = False, "client timeout"
    except Exception as exc:  # aiohttp's errors have no common base worth naming
        out.ok, out.cause = False, _cause(f"{type(exc).__name__}: {exc}")
    out.done = time.monotonic() - t0
    return out


async def _plain(session, base_url: str, body: dict, out: Outcome) -> None:
    async with session.post(f"{base_url}/v1/completions", json=body) as reply:
        out.status = reply.status
        data = await reply.json(content_type=None)
    if reply.status != 200:
        out.cause = _cause(_error_text(data))
        return
    out.tokens = data["usage"]["completion_tokens"]
    out.ok = out.tokens > 0
    _keep_ids(out, data["choices"][0])


async def _stream(session, base_url: str, body: dict, out: Outcome, t0: float) -> None:
    async with session.post(f"{base_url}/v1/completions", json=body) as reply:
        out.status = reply.status
        if reply.status != 200:
            out.cause = _cause(_error_text(await reply.json(content_type=None)))
            return
        finished = False
        async for raw in reply.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                out.cause = _cause(_error_text(chunk))
                out.truncated = out.tokens > 0
                return
            for choice in chunk.get("choices") or ():
                out.tokens += 1 if choice.get("text") is not None else 0
                if out.tokens and out.first_token is None:
                    out.first_token = time.monotonic() - t0
                finished = finished or choice.get("finish_reason") is not None
                _keep_ids(out, choice)
    out.ok = finished
    if not finished:
        out.cause, out.truncated = "stream ended without a finish", out.tokens > 0


def _keep_ids(out: Outcome, choice: dict) -> None:
    """The choice's token ids (logprobs' tokens, "token_id:N"), when the load keeps them."""
    if out.token_ids is not None and choice.get("logprobs"):
        out.token_ids.extend(int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"])


def _error_text(data) -> str:
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error.get("type") or error)
    return str(error or data)


def _cause(text: str) -> str:
    return text[:_CAUSE_CHARS]
