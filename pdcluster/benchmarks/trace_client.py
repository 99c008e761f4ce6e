"""The client side of `bench trace` (benchmarks/trace_bench.py): waiting for a fresh router to
be ready, sending each trace request at its arrival time as a streaming /v1/completions call,
timing its first token and its end, and the per-policy client figures (TTFT and end-to-end
p50/p90, output tokens/s, completed and failed requests).

API: `wait_ready`, `timed_request`, `client_figures`.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

from pdcluster.benchmarks.trace_workload import TraceRequest


async def wait_ready(session, base: str, num_nodes: int, timeout_s: float = 60.0) -> None:
    """Until the router sees every node healthy and follows the metadata service's index, and
    the index is empty (the warm-up's blocks and the previous policy's are forgotten)."""
    deadline = time.monotonic() + timeout_s
    while True:
        async with session.get(f"{base}/health") as reply:
            body = await reply.json()
        healthy = sum(n["healthy"] for n in body["nodes"].values())
        metadata = body.get("metadata") or {}
        # an empty index: the previous run's blocks are gone (the caches were reset)
        if healthy == num_nodes and metadata.get("mirror_in_sync") \
                and metadata.get("mirror_blocks") == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"router not ready after {timeout_s} s: {body}")
        await asyncio.sleep(0.1)


async def timed_request(session, base: str, model: str, req: TraceRequest, t0: float,
                         timeout_s: float) -> dict:
    """Send at its arrival time; TTFT = first streamed chunk with a choice."""
    await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    try:
        return await asyncio.wait_for(_stream(session, base, body, sent), timeout_s)
    except (TimeoutError, OSError, ValueError) as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


async def _stream(session, base: str, body: dict, sent: float) -> dict:
    ttft, tokens, done = None, 0, False
    async with session.post(f"{base}/v1/completions", json=body) as reply:
        if reply.status != 200:
            return {"ok": False, "error": f"HTTP {reply.status}: {await reply.text()}"}
        async for raw in reply.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return {"ok": False, "error": str(chunk["error"])}
            if chunk.get("choices") and ttft is None:
                ttft = time.perf_counter() - sent
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if not done or ttft is None:
        return {"ok": False, "error": "the stream ended early"}
    return {"ok": True, "ttft_s": ttft, "e2e_s": time.perf_counter() - sent,
            "output_tokens": tokens}


def client_figures(results: list[dict], wall_s: float) -> dict:
    ok = [r for r in results if r["ok"]]
    errors = sorted({r["error"] for r in results if not r["ok"]})[:3]
    figures = {"completed": len(ok), "failed": len(results) - len(ok), "wall_s": round(wall_s, 2),
               "output_tokens_per_s": round(sum(r["output_tokens"] for r in ok) / wall_s, 1)}
    for name in ("ttft", "e2e"):
        values = sorted(r[f"{name}_s"] for r in ok)
        figures[f"{name}_p50_ms"] = round(_quantile(values, 0.5) * 1e3, 1)
        figures[f"{name}_p90_ms"] = round(_quantile(values, 0.9) * 1e3, 1)
    if errors:
        figures["errors"] = errors
    return figures


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]
