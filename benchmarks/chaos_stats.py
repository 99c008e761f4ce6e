"""Figures of one fault's load (benchmarks/chaos_load.py outcomes), as the chaos benchmark
reports them.

Phases, on the load's clock: *before* — requests finished before the fault began; *during*
— requests in flight at some moment of [fault start, fault end]; *after* — requests sent
after the fault ended. Recovery: `first_success_s`, from the fault's start to the first
completion of a request sent at or after it; `p99_recovered_s`, from the fault's start to
the first window of `window` consecutive requests (by send time, sent after the start)
whose p99 latency is within 2x the p99 before (None: never, or no baseline).

API: `summarize`, `quantile`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from benchmarks.chaos_load import Outcome


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile by the nearest-rank rule (NaN for no values)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _ms(value: float) -> float | None:
    return None if math.isnan(value) else round(value * 1e3, 1)


def _phase(outcomes: list[Outcome]) -> dict:
    latencies = [o.latency_s for o in outcomes]
    return {"n": len(outcomes), "p50_ms": _ms(quantile(latencies, 0.5)),
            "p99_ms": _ms(quantile(latencies, 0.99))}


def summarize(outcomes: list[Outcome], fault_start: float, fault_end: float,
              window: int = 8) -> dict:
    lost = [o for o in outcomes if not o.ok and not o.aborted]
    done = [o for o in outcomes if o.ok]
    before = [o for o in done if o.done < fault_start]
    during = [o for o in done if o.sent <= fault_end and o.done >= fault_start]
    after = [o for o in done if o.sent > fault_end]
    return {
        "sent": len(outcomes), "completed": len(done), "failed": len(lost),
        "aborted_by_client": sum(o.aborted for o in outcomes),
        "truncated": sum(o.truncated for o in outcomes),
        "failed_by_status": dict(Counter(str(o.status) for o in lost)),
        "failed_by_cause": dict(Counter(o.cause for o in lost)),
        "latency": {"before": _phase(before), "during": _phase(during),
                    "after": _phase(after)},
        "first_success_s": _first_success(done, fault_start),
        "p99_recovered_s": _p99_recovered(outcomes, before, fault_start, window),
    }


def _first_success(done: list[Outcome], fault_start: float) -> float | None:
    later = [o.done for o in done if o.sent >= fault_start]
    return round(min(later) - fault_start, 3) if later else None


def _p99_recovered(outcomes: list[Outcome], before: list[Outcome], fault_start: float,
                   window: int) -> float | None:
    if not before:
        return None
    limit = 2 * quantile([o.latency_s for o in before], 0.99)
    # a failed request counts as infinitely slow: a window holding one has not recovered
    later = sorted((o for o in outcomes if o.sent >= fault_start and not o.aborted),
                   key=lambda o: o.sent)
    for start in range(0, max(0, len(later) - window + 1)):
        chunk = later[start:start + window]
        latencies = [o.latency_s if o.ok else math.inf for o in chunk]
        if quantile(latencies, 0.99) <= limit:
            return round(chunk[0].sent - fault_start, 3)
    return None
