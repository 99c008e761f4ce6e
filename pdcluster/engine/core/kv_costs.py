"""`KVCostMeter`: what the engine measures for the router's pricing of KV it does not compute
(torch-free): its prefill rate, and, from the host and disk tiers' copy timers, each tier's
bandwidth and latency, reported as one `core.node_wire.KVCosts` with every load report.

The prefill rate is a moving average over steps that computed at least `MIN_PREFILL_TOKENS`
prompt tokens: tokens of the step over its seconds (decodes batched into the same step make
it a slight underestimate, which prices loads a little low: conservative for a tier whose
load costs a few percent of a recompute). Until one such step ran the meter reports nothing,
and the router prices with its fallback weights.

API: `KVCostMeter`, `CopyTimer` (a tier's timed copies: what `KVCostMeter.costs` is given).
"""

from __future__ import annotations

from collections import deque

from pdcluster.core.node_wire import KVCosts

MIN_PREFILL_TOKENS = 32
_ALPHA = 0.2  # weight of the newest step in the moving average
_SAMPLES = 64  # copies a CopyTimer fits over


class KVCostMeter:
    def __init__(self, kv_bytes_per_token: float) -> None:
        self.kv_bytes_per_token = kv_bytes_per_token
        self.prefill_tokens_per_s = 0.0

    def record_step(self, num_prefill_tokens: int, num_tokens: int, seconds: float) -> None:
        if num_prefill_tokens < MIN_PREFILL_TOKENS or seconds <= 0:
            return
        rate = num_tokens / seconds
        self.prefill_tokens_per_s = rate if not self.prefill_tokens_per_s else \
            (1 - _ALPHA) * self.prefill_tokens_per_s + _ALPHA * rate

    def costs(self, host: tuple[float, float] | None = None,
              disk: tuple[float, float] | None = None) -> KVCosts | None:
        """`host`, `disk`: the tier's (bytes/s, latency s); None without that tier."""
        if self.prefill_tokens_per_s <= 0:
            return None
        bandwidth, latency = host or (0.0, 0.0)
        disk_bandwidth, disk_latency = disk or (0.0, 0.0)
        return KVCosts(self.prefill_tokens_per_s, self.kv_bytes_per_token,
                       host_bytes_per_s=bandwidth, host_latency_s=latency,
                       disk_bytes_per_s=disk_bandwidth, disk_latency_s=disk_latency)


class CopyTimer:
    """Seconds per copy of n bytes, fitted as latency + bytes / bandwidth over the latest
    copies (least squares; one size only: no latency)."""

    def __init__(self) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=_SAMPLES)
        self.total_bytes = 0
        self.total_s = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self._samples.append((nbytes, seconds))
            self.total_bytes += nbytes
            self.total_s += seconds

    def fit(self) -> tuple[float, float]:
        """(bytes per second, latency in seconds); (0, 0) before any copy."""
        if not self._samples:
            return 0.0, 0.0
        n = len(self._samples)
        mean_b = sum(b for b, _ in self._samples) / n
        mean_s = sum(s for _, s in self._samples) / n
        var = sum((b - mean_b) ** 2 for b, _ in self._samples)
        slope = (sum((b - mean_b) * (s - mean_s) for b, s in self._samples) / var
                 if var > 0 else 0.0)
        if slope <= 0:
            return mean_b / mean_s, 0.0
        return 1.0 / slope, max(0.0, mean_s - slope * mean_b)
