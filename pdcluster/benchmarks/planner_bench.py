"""Planner benchmark: `pdcluster bench planner [--json] [--quick]`.

A load step up and down against a live local cluster with the planner on (cluster/
planner_actor.py; decode nodes between 1 and `--max-decode`, nodes prefilling their own
prompts) and admission on (router/planning/admission.py), on a random tiny model (its tokens
are gibberish, its compute is real) through the router's HTTP API:

1. baseline: one client asks a fixed set of prompts in turn (each asked again hits the
   cache); its inter-token latency p90 as the router measures it (the planner's own
   figure, from its histogram's buckets) sets the ITL SLO (`--slo-factor` x it): the
   SLO one node meets at this load, on this machine, in this run.
2. step up: `--clients` clients at once, until the planner has started a node and the
   router sees it healthy (`scale_up_s`, from the step), then `--hold-s` more.
3. step down: one client again, `--think-s` between its requests, until the planner has
   retired a node (drain, hand-off, release) and for `--settle-s` after.

Reported: `scale_up_s`; `requests_lost` (any failure but a 429 shed); `shed` per phase
(admission's 429s: `shed_only_above_capacity` is true when none fell in the one-client
phases); `blocks_leaked` (blocks still held on the nodes once idle); the retired node's drain
and hand-off; and `hit_ratio_after_scale_in_over_before`: the cached share of the prompt set's
tokens asked once more right after the scale-in, over the same just before it (goal >= 0.9).

API: `run(args)`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import http.client
import json
import random
import tempfile
import threading
import time
from pathlib import Path

BLOCK_SIZE = 16


@dataclasses.dataclass(slots=True)
class _Tally:
    ok: int = 0
    shed: int = 0
    lost: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def hit_ratio(self) -> float:
        return round(self.cached_tokens / max(self.prompt_tokens, 1), 4)


class _Client:
    """Blocking /v1/completions calls over HTTP, tallied per phase."""

    def __init__(self, port: int, model: str, prompts: list[list[int]],
                 max_tokens: int) -> None:
        self.port, self.model, self.prompts, self.max_tokens = port, model, prompts, max_tokens

    def ask(self, prompt: list[int], tally: _Tally) -> None:
        """One streamed request (the router measures its inter-token latency)."""
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens,
                           "temperature": 0, "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                response.read()
                tally.shed += response.status == 429
                tally.lost += response.status != 429
                return
            usage = _stream_usage(response)
        except OSError:
            tally.lost += 1
            return
        finally:
            conn.close()
        if usage is None:  # the stream ended with an error event
            tally.lost += 1
            return
        tally.ok += 1
        tally.prompt_tokens += usage["prompt_tokens"]
        tally.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]

    def load(self, clients: int, until, tally: _Tally, think_s: float = 0.0) -> None:
        """`clients` threads asking the prompt set in turn, `think_s` apart, until `until()`
        is true."""
        def worker(offset: int) -> None:
            i = offset
            while not until():
                self.ask(self.prompts[i % len(self.prompts)], tally)
                i += 1
                time.sleep(think_s)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def _stream_usage(response) -> dict | None:
    """The usage of an SSE stream (its last chunk); None if an error event came instead."""
    usage = None
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            return None
        usage = chunk.get("usage") or usage
    return usage


def run(args: argparse.Namespace) -> dict:
    quick = args.quick
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or _tiny_model(tmp)
        rng = random.Random(0)
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(96, 160))]
                   for _ in range(6 if quick else 12)]
        return _bench(args, model, prompts, quick)


def _tiny_model(tmp: str) -> str:
    from pdcluster.engine.models.tiny_model import make_tiny_model

    return str(make_tiny_model(Path(tmp) / "tiny", preset="tiny"))


def _bench(args: argparse.Namespace, model: str, prompts: list[list[int]], quick: bool) -> dict:
    from pdcluster.cluster.config import ClusterConfig
    from pdcluster.cluster.planner_settings import PlannerSettings
    from pdcluster.cluster.ray_cluster import RayCluster

    settings = PlannerSettings(slo_ttft_s=30.0, slo_itl_ms=10_000.0, interval_s=1.0,
                               startup_s=5.0, min_prefill=0, max_prefill=0, min_decode=1,
                               max_decode=args.max_decode, down_cooldown_s=5.0,
                               down_window_s=5.0, rate_half_life_s=2.0, drain_timeout_s=60.0)
    config = ClusterConfig(model=model, num_prefill=0, num_decode=1, planner=settings,
                           engine={"block_size": BLOCK_SIZE, "num_kv_blocks": 1024},
                           node_cpus=0.5)
    cluster = RayCluster(config).start()
    try:
        return _phases(args, cluster, config, prompts, quick)
    finally:
        cluster.stop()


def _phases(args, cluster, config, prompts, quick: bool) -> dict:
    import ray

    from pdcluster.cluster.launch import router_config
    from pdcluster.router.planning.admission import AdmissionConfig

    loop, app = _start_router(dataclasses.replace(
        router_config(config, cluster.metadata_address, cluster.cluster_secret), port=0,
        node_timeout_s=10.0, load_interval_s=0.25,
        admission=AdmissionConfig(slo_ttft_s=args.slo_ttft_s)))
    try:
        from pdcluster.cluster.planner_signals import RouterWindow

        client = _Client(app.port, app.model_name, prompts, 16)
        base, window = _Tally(), RouterWindow()
        window.take(app.metrics.render().decode())
        for prompt in prompts * 2:  # the second pass hits the cache
            client.ask(prompt, base)
        # measured as the planner measures it: the router's decode time per token
        stats = window.take(app.metrics.render().decode())
        assert stats is not None and stats.itl_p90_s is not None, "no streamed token measured"
        itl = stats.itl_p90_s
        # the ITL SLO: what one node gives one client here, with room (`--slo-factor`)
        _set_itl_slo(cluster, itl * args.slo_factor)
        cluster.attach_router(f"http://127.0.0.1:{app.port}")
        figures = _step(args, cluster, app, client, quick)
        figures["baseline_itl_ms"] = round(itl * 1000, 2)
        figures["slo_itl_ms"] = round(itl * args.slo_factor * 1000, 2)
        figures["baseline"] = {"ok": base.ok, "shed": base.shed, "lost": base.lost}
        ray.get(cluster.planner.pause.remote(), timeout=120)  # no decision from here on
        status = ray.get(cluster.planner.status.remote(), timeout=30)
        figures["blocks_leaked"] = _leaked(status)
        figures["planner_events"] = [{k: e[k] for k in ("prefill", "decode", "reasons")}
                                     for e in status["events"]]
        figures["retired"] = status["retired"]
        figures["planner_last"] = status["last"]
        return figures
    finally:
        asyncio.run_coroutine_threadsafe(app.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)


def _set_itl_slo(cluster, slo_s: float) -> None:
    """The planner's ITL SLO, once the baseline measured it."""
    import ray

    ray.get(cluster.planner.set_slo_itl.remote(slo_s), timeout=30)


def _step(args, cluster, app, client: _Client, quick: bool) -> dict:
    up, down = _Tally(), _Tally()
    step_at = time.monotonic()
    scaled_at: list[float] = []

    def two_healthy() -> bool:
        healthy = sum(n.healthy for n in app.dispatcher.nodes.values())
        if healthy >= 2 and not scaled_at:
            scaled_at.append(time.monotonic())
        give_up = time.monotonic() - step_at > (60 if quick else 120)
        return give_up or bool(scaled_at and time.monotonic() - scaled_at[0] > args.hold_s)

    client.load(args.clients, two_healthy, up)
    before = _Tally()
    for prompt in client.prompts:
        client.ask(prompt, before)
    retired_at: list[float] = []

    def retired() -> bool:
        import ray

        status = ray.get(cluster.planner.status.remote(), timeout=30)
        if status["retired"] and not retired_at:
            retired_at.append(time.monotonic())
        give_up = time.monotonic() - step_at > (180 if quick else 400)
        return give_up or bool(retired_at)

    client.load(1, retired, down, args.think_s)
    after = _Tally()
    for prompt in client.prompts:
        client.ask(prompt, after)
    settle, settle_from = _Tally(), time.monotonic()
    client.load(1, lambda: time.monotonic() - settle_from > args.settle_s, settle,
                args.think_s)
    ratio = (round(after.hit_ratio() / before.hit_ratio(), 4) if before.hit_ratio() else None)
    lost = sum(t.lost for t in (up, before, down, after, settle))
    return {"scale_up_s": round(scaled_at[0] - step_at, 2) if scaled_at else None,
            "scaled_in": bool(retired_at), "requests_lost": lost,
            "requests_ok": sum(t.ok for t in (up, before, down, after, settle)),
            "shed": {"step_up": up.shed, "step_down": down.shed + settle.shed,
                     "probes": before.shed + after.shed},
            "shed_only_above_capacity": down.shed + settle.shed + before.shed + after.shed
            == 0,
            "hit_ratio_before_scale_in": before.hit_ratio(),
            "hit_ratio_after_scale_in": after.hit_ratio(),
            "hit_ratio_after_scale_in_over_before": ratio,
            "clients": args.clients}


def _leaked(status: dict) -> int:
    """Blocks held by requests on the nodes still serving, once idle."""
    import ray

    leaked = 0
    for role in ("prefill", "decode"):
        for node_id in status["serving"][role]:
            actor = ray.get_actor(f"pdcluster-{node_id}")
            deadline = time.monotonic() + 30
            state = _pool_state(ray, actor)
            while state["num_unfinished"] and time.monotonic() < deadline:
                time.sleep(0.2)
                state = _pool_state(ray, actor)
            leaked += state["num_held_blocks"]
    return leaked


def _pool_state(ray, actor) -> dict[str, int]:
    return dict(ray.get(actor.pool_state.remote(), timeout=30))


def _start_router(config):
    from pdcluster.router.api.server import RouterApp

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    app = RouterApp(config)
    asyncio.run_coroutine_threadsafe(app.start(), loop).result(60)
    deadline = time.monotonic() + 120
    while not any(n.healthy for n in app.dispatcher.nodes.values()):
        if time.monotonic() > deadline:
            raise RuntimeError("the router never saw a healthy node")
        time.sleep(0.1)
    return loop, app
