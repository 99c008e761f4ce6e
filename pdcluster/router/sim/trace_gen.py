"""Synthetic request traces with the prefix structure of real services, in the Mooncake trace
format (`timestamp` ms, `input_length`, `output_length`, `hash_ids`: one id per 512-token
block), generated from code and a seed rather than checked in as data.

Each generator stresses one thing a KV-aware policy must get right:

- `conversation`: a mimic of a real multi-turn chat trace (Mooncake's conversation trace:
  about 12,000 requests over an hour, ~12k input / ~340 output tokens on average). Every
  request starts with the same 512-token block; a conversation's later turns extend its
  earlier prompt (the previous prompt, the answer, the new message), with a long-tailed depth.
- `chat`: conversations of varying depth over a few hot system prompts (Zipf popularity).
- `system_prompts`: three very hot, long system prompts that every request starts with, and
  short one- or two-turn questions after them (a prefix everyone wants: herding bait).
- `agent`: tool/agent loops re-sending a long, growing context every few seconds (a shared
  tool-spec prefix, then the task, then each step's action and tool output).
- `rag`: a shared system prompt, a per-user prefix (profile / memory), then retrieved documents
  from a shared Zipf-popular pool, then the question. A document's blocks carry the same ids in
  every prompt, but after a divergent per-user prefix a chained-hash prefix cache cannot reuse
  them (its keys hash the whole prefix): only the same user's follow-ups hit past the user
  prefix. The replay and its `ideal` count those middle blocks as misses, honestly;
  `trace_stats` reports how much position-independent reuse was left on the table.
- `bursty`: chat sessions arriving by an on/off process (calm, then bursts six times as fast),
  so queues build up and the load term has real delay to weigh.
- `ramps`: a day compressed into an hour, for the planner (router/sim/planner_replay.py): the
  session rate ramps from a quarter of its peak up to the peak, holds, ramps down to 0.3,
  with three one-minute bursts at 2.5x on top; and the mix moves with it, from mostly
  document questions (long prompts, short answers: prefill-heavy) to mostly chat (short
  prompts, long answers: decode-heavy), so the right prefill : decode split moves too.

Ids: fresh ids come from one counter per trace, so equal ids mean equal content. Lengths:
a prompt's last block is partial (`input_length = blocks * 512 - U[0, 511]`), as in the
Mooncake trace. Rows are sorted by timestamp (ties keep generation order). Every generator is
deterministic in `seed`; `scale` multiplies the number of sessions at the same arrival rate
(the same load, a shorter trace), so tests run small copies of the same traffic.

API: `GENERATORS`, `generate(name, seed, scale) -> list[dict]`, `write_trace`, `trace_stats`,
`RateProfile` (a time-varying rate; `RAMPS_PROFILE` is the `ramps` trace's).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

BLOCK_TOKENS = 512
Row = dict


class _Trace:
    """Fresh block ids, a seeded RNG and the rows emitted so far."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self._next_id = 0
        self._rows: list[tuple[float, int, Row]] = []

    def fresh(self, num_blocks: int) -> list[int]:
        ids = list(range(self._next_id, self._next_id + num_blocks))
        self._next_id += num_blocks
        return ids

    def emit(self, at_s: float, hash_ids: list[int], output_length: int) -> None:
        input_length = len(hash_ids) * BLOCK_TOKENS - self.rng.randint(0, BLOCK_TOKENS - 1)
        row = {"timestamp": int(at_s * 1000), "input_length": input_length,
               "output_length": output_length, "hash_ids": list(hash_ids)}
        self._rows.append((at_s, len(self._rows), row))

    def rows(self) -> list[Row]:
        return [row for _, _, row in sorted(self._rows, key=lambda item: item[:2])]

    def blocks(self, median: float, sigma: float, most: int) -> int:
        """A long-tailed block count (lognormal), at least 1 and at most `most`."""
        return max(1, min(most, round(self.rng.lognormvariate(math.log(median), sigma))))

    def zipf(self, n: int, s: float) -> int:
        """An index in [0, n) with Zipf(s) popularity (0 the most popular)."""
        return self.rng.choices(range(n), cum_weights=_zipf_cum_weights(n, s))[0]


@functools.cache
def _zipf_cum_weights(n: int, s: float) -> tuple[float, ...]:
    return tuple(itertools.accumulate(1.0 / (k + 1) ** s for k in range(n)))


def _arrivals(trace: _Trace, num: int, rate_per_s: float) -> Iterator[float]:
    """`num` Poisson arrival times at `rate_per_s`."""
    clock = 0.0
    for _ in range(num):
        clock += trace.rng.expovariate(rate_per_s)
        yield clock


def _bursty_arrivals(trace: _Trace, num: int, rate_per_s: float) -> Iterator[float]:
    """`num` arrivals of an on/off process: calm periods (mean 60 s) at `rate_per_s`, bursts
    (mean 10 s) at six times that (a Markov-modulated Poisson process)."""
    clock, burst = 0.0, False
    switch_at = trace.rng.expovariate(1 / 60.0)
    for _ in range(num):
        clock += trace.rng.expovariate(rate_per_s * (6.0 if burst else 1.0))
        while clock >= switch_at:
            burst = not burst
            switch_at += trace.rng.expovariate(1 / (10.0 if burst else 60.0))
        yield clock


@dataclass(frozen=True, slots=True)
class RateProfile:
    """A time-varying rate: a multiplier of the peak rate, linear between `points` (fraction
    of the duration, multiplier), times `burst_gain` during each burst (start as a fraction of
    the duration, length in seconds)."""

    points: tuple[tuple[float, float], ...]
    bursts: tuple[tuple[float, float], ...] = ()
    burst_gain: float = 1.0

    def multiplier(self, fraction: float, at_s: float, duration_s: float) -> float:
        level = self.points[-1][1]
        for (f0, m0), (f1, m1) in zip(self.points, self.points[1:], strict=False):
            if f0 <= fraction <= f1:
                level = m0 + (m1 - m0) * (fraction - f0) / max(f1 - f0, 1e-12)
                break
        in_burst = any(start * duration_s <= at_s < start * duration_s + length_s
                       for start, length_s in self.bursts)
        return level * (self.burst_gain if in_burst else 1.0)

    @property
    def peak(self) -> float:
        return max(m for _, m in self.points) * max(self.burst_gain, 1.0)


def _profile_arrivals(trace: _Trace, duration_s: float, peak_rate_per_s: float,
                      profile: RateProfile) -> Iterator[float]:
    """Arrivals of a Poisson process whose rate follows `profile` (thinning: candidates at
    the highest rate, each kept with the profile's share of it)."""
    top = peak_rate_per_s * profile.peak
    clock = 0.0
    while True:
        clock += trace.rng.expovariate(top)
        if clock >= duration_s:
            return
        rate = peak_rate_per_s * profile.multiplier(clock / duration_s, clock, duration_s)
        if trace.rng.random() * top < rate:
            yield clock


def _conversation(trace: _Trace, start_s: float, prompt: list[int], turns: int,
                  gap_s: tuple[float, float], message: tuple[float, float, int],
                  output: tuple[int, int]) -> None:
    """One conversation: each turn sends the whole history (earlier prompts, answers) plus a
    new message, `gap_s` (lognormal median, sigma) after the previous turn."""
    history, at, last_output = list(prompt), start_s, 0
    for turn in range(turns):
        if turn:
            answer = trace.fresh(max(1, round(last_output / BLOCK_TOKENS)))
            history += answer + trace.fresh(trace.blocks(*message))
            at += trace.rng.lognormvariate(math.log(gap_s[0]), gap_s[1])
        last_output = trace.rng.randint(*output)
        trace.emit(at, history, last_output)


def _depth(trace: _Trace, mean: float, most: int) -> int:
    """A long-tailed conversation depth: geometric with `mean`, capped at `most`."""
    depth = 1
    while depth < most and trace.rng.random() > 1.0 / mean:
        depth += 1
    return depth


def conversation(seed: int = 0, scale: float = 1.0) -> list[Row]:
    """The held-out real chat trace's shape: ~12,000 requests in about an hour, one shared
    first block, conversations (mean depth 3, up to 40 turns) extending their prompts."""
    trace = _Trace(seed)
    shared = trace.fresh(1)
    for start in _arrivals(trace, round(6000 * scale), 1.7):
        prompt = shared + trace.fresh(trace.blocks(14, 0.9, 90))
        _conversation(trace, start, prompt, _depth(trace, 2.0, 40), gap_s=(45.0, 0.8),
                      message=(3.0, 1.0, 24), output=(40, 650))
    return trace.rows()


@dataclass(frozen=True, slots=True)
class _ChatShape:
    """Conversations over a few system prompts: their lengths (blocks) and Zipf exponent,
    the first message (lognormal median, sigma, most blocks), the depth (mean, most turns),
    the gap between turns (lognormal median s, sigma) and the output length range."""

    system_blocks: tuple[int, ...]
    zipf_s: float
    first_message: tuple[float, float, int]
    depth: tuple[float, int]
    gap_s: tuple[float, float]
    output: tuple[int, int]


def _chats(trace: _Trace, starts: Iterator[float], shape: _ChatShape) -> list[Row]:
    systems = [trace.fresh(n) for n in shape.system_blocks]
    for start in starts:
        system = systems[trace.zipf(len(systems), shape.zipf_s)]
        prompt = system + trace.fresh(trace.blocks(*shape.first_message))
        _conversation(trace, start, prompt, _depth(trace, *shape.depth), gap_s=shape.gap_s,
                      message=(1.5, 0.7, 12), output=shape.output)
    return trace.rows()


def chat(seed: int = 0, scale: float = 1.0) -> list[Row]:
    """Conversations of varying depth (mean 4) over five system prompts of Zipf popularity."""
    trace = _Trace(seed)
    return _chats(trace, _arrivals(trace, round(1500 * scale), 3.0),
                  _ChatShape((6, 4, 8, 3, 5), 1.2, (2, 0.8, 16), (4.0, 24), (20.0, 0.7),
                             (20, 500)))


def system_prompts(seed: int = 0, scale: float = 1.0) -> list[Row]:
    """Every request opens with one of three very hot system prompts (16, 12 and 8 blocks,
    60/30/10% of requests), then a short question; a third get one follow-up turn."""
    trace = _Trace(seed)
    systems = [trace.fresh(n) for n in (16, 12, 8)]
    for start in _arrivals(trace, round(4000 * scale), 12.0):
        system = trace.rng.choices(systems, (0.6, 0.3, 0.1))[0]
        turns = 2 if trace.rng.random() < 1 / 3 else 1
        _conversation(trace, start, system + trace.fresh(trace.blocks(1.5, 0.6, 6)), turns,
                      gap_s=(15.0, 0.6), message=(1.0, 0.5, 4), output=(20, 300))
    return trace.rows()


def agent(seed: int = 0, scale: float = 1.0) -> list[Row]:
    """Tool/agent loops: a tool-spec prefix (one of two frameworks), a task, then 3-40 steps a
    few seconds apart, each re-sending the whole context plus an action and a tool output."""
    trace = _Trace(seed)
    frameworks = [trace.fresh(10), trace.fresh(6)]
    for start in _arrivals(trace, round(800 * scale), 0.8):
        history = list(frameworks[trace.zipf(2, 1.0)]) + trace.fresh(trace.blocks(3, 0.7, 12))
        at = start
        for _ in range(2 + _depth(trace, 10.0, 38)):
            output = trace.rng.randint(30, 300)
            trace.emit(at, history, output)
            history += trace.fresh(1) + trace.fresh(trace.blocks(1.2, 1.0, 16))
            at += trace.rng.uniform(1.0, 6.0)  # the tool runs, then the agent calls again
    return trace.rows()


def rag(seed: int = 0, scale: float = 1.0) -> list[Row]:
    """Retrieval-augmented questions: system prompt, a per-user prefix, three documents from
    a shared pool of 300 (Zipf), the question. Within a user's session, half the questions
    follow up on the previous prompt (extending it), half retrieve afresh after the user's
    prefix."""
    trace = _Trace(seed)
    system = trace.fresh(2)
    documents = [trace.fresh(trace.rng.randint(3, 10)) for _ in range(300)]
    for start in _arrivals(trace, round(1500 * scale), 1.8):
        user = system + trace.fresh(trace.rng.randint(1, 2))
        history: list[int] = []
        at = start
        for question in range(_depth(trace, 2.5, 12)):
            if question and trace.rng.random() < 0.5:
                history += trace.fresh(1) + trace.fresh(1)  # the answer, the follow-up
            else:
                picked = {trace.zipf(len(documents), 1.1) for _ in range(3)}
                history = user + [i for d in sorted(picked) for i in documents[d]]
                history += trace.fresh(1)
            trace.emit(at, history, trace.rng.randint(50, 400))
            at += trace.rng.lognormvariate(math.log(20.0), 0.6)
    return trace.rows()


def bursty(seed: int = 0, scale: float = 1.0) -> list[Row]:
    """Chat sessions over four system prompts whose starts arrive in bursts (on/off)."""
    trace = _Trace(seed)
    return _chats(trace, _bursty_arrivals(trace, round(2000 * scale), 2.2),
                  _ChatShape((8, 5, 4, 6), 1.0, (2, 0.9, 20), (3.0, 16), (10.0, 0.7),
                             (20, 400)))


RAMPS_PROFILE = RateProfile(points=((0.0, 0.25), (0.12, 0.25), (0.4, 1.0), (0.6, 1.0),
                                     (0.85, 0.3), (1.0, 0.3)),
                             bursts=((0.25, 60.0), (0.5, 60.0), (0.75, 60.0)), burst_gain=2.5)


RAMPS_PEAK_SESSIONS_PER_S = 6.0


def ramps(seed: int = 0, scale: float = 1.0) -> list[Row]:
    """An hour (x scale) of sessions at a rate following `RAMPS_PROFILE` (peak
    `RAMPS_PEAK_SESSIONS_PER_S` new sessions/s), the share of document sessions falling from
    0.75 to 0.15 over the trace."""
    trace = _Trace(seed)
    duration_s = 3600.0 * scale
    systems = [trace.fresh(n) for n in (2, 3, 4, 2)]
    for start in _profile_arrivals(trace, duration_s, RAMPS_PEAK_SESSIONS_PER_S, RAMPS_PROFILE):
        system = systems[trace.zipf(len(systems), 1.0)]
        if trace.rng.random() < 0.75 - 0.6 * start / duration_s:
            document = trace.fresh(trace.blocks(10, 0.5, 30)) + trace.fresh(1)
            _conversation(trace, start, system + document, _depth(trace, 1.5, 6),
                          gap_s=(30.0, 0.6), message=(1.0, 0.5, 3), output=(40, 200))
        else:
            _conversation(trace, start, system + trace.fresh(trace.blocks(1.5, 0.7, 6)),
                          _depth(trace, 3.0, 20), gap_s=(20.0, 0.7), message=(1.0, 0.6, 4),
                          output=(200, 1200))
    return trace.rows()


GENERATORS: dict[str, Callable[[int, float], list[Row]]] = {
    "conversation": conversation, "chat": chat, "system_prompts": system_prompts,
    "agent": agent, "rag": rag, "bursty": bursty, "ramps": ramps,
}


def generate(name: str, seed: int = 0, scale: float = 1.0) -> list[Row]:
    """The rows of synthetic trace `name` (a key of `GENERATORS`)."""
    if name not in GENERATORS:
        raise ValueError(f"unknown synthetic trace {name!r}; choose from {sorted(GENERATORS)}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    return GENERATORS[name](seed, scale)


def write_trace(rows: list[Row], path: str | Path) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def trace_stats(rows: list[Row]) -> dict:
    """Size, load and reuse of a trace: `prefix_reuse` = blocks whose whole prefix appeared
    before (what a prefix cache can hit, one infinite cache); `content_reuse` = blocks whose
    id appeared before anywhere (what a position-independent cache could hit)."""
    prefixes: dict[tuple[int, int], int] = {}  # (parent prefix, block id) -> prefix
    seen_ids: set[int] = set()
    prefix_hits = content_hits = total = 0
    for row in rows:
        parent, leading = -1, True
        for block_id in row["hash_ids"]:
            known = prefixes.get((parent, block_id))
            leading = leading and known is not None
            prefix_hits += leading
            content_hits += block_id in seen_ids
            if known is None:
                known = prefixes[(parent, block_id)] = len(prefixes)
            parent = known
        total += len(row["hash_ids"])
        seen_ids.update(row["hash_ids"])
    duration_s = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000 if rows else 0.0
    return {"requests": len(rows), "duration_s": round(duration_s, 1),
            "mean_input_tokens": round(sum(r["input_length"] for r in rows) / max(len(rows), 1)),
            "mean_output_tokens": round(sum(r["output_length"] for r in rows)
                                        / max(len(rows), 1)),
            "prefix_reuse": round(prefix_hits / max(total, 1), 4),
            "content_reuse": round(content_hits / max(total, 1), 4)}
