"""Concurrent publishers and queriers, as threads and as processes, never corrupt the index:
afterwards it holds exactly every node's final block set, and its invariants hold."""

from __future__ import annotations

import multiprocessing
import random
import threading

import pytest

from pdcluster.metadata_service.client import MetadataClient
from pdcluster.metadata_service.server import ServerThread
from tests.metadata_service.helpers import make_chain, make_config, make_publisher

POOL = make_chain("conc", 64)
BATCHES = 120


def publish_randomly(address: str, node_id: str, seed: int) -> set[bytes]:
    """Random stores/evictions (with a deliberately lost batch) from one node."""
    rng = random.Random(seed)
    with MetadataClient(address) as client:
        publisher, node = make_publisher(client, node_id, ttl=30)
        for i in range(BATCHES):
            start = rng.randrange(0, 60)
            events = [node.store(POOL[start:start + rng.randint(1, 4)])]
            if rng.random() < 0.4 and node.cached:
                events.append(node.evict(rng.sample(sorted(node.cached), 2)
                                         if len(node.cached) > 1 else list(node.cached)))
            if i == BATCHES // 2:
                publisher.seq += 1  # lose one batch: forces a resync mid-run
            publisher.publish(events)
        return node.cached


def query_randomly(address: str, num_queries: int, seed: int) -> int:
    """Check every answer is well formed; returns how many were checked."""
    rng = random.Random(seed)
    with MetadataClient(address) as client:
        for _ in range(num_queries):
            chain = POOL[:rng.randint(1, 64)]
            matches = client.query(chain, include_zero=rng.random() < 0.5)
            assert all(0 <= n <= len(chain) for _, n in matches), matches
            assert matches == sorted(matches, key=lambda m: (-m[1], m[0])), matches
    return num_queries


def assert_exact(server: ServerThread, expected: dict[str, set[bytes]]) -> None:
    def read(service):
        service.index.check_invariants()
        return {n: set(service.index.node_blocks(n)) for n in service.index.node_ids}
    assert server.call(read) == expected


@pytest.fixture
def server():
    with ServerThread(make_config()) as srv:
        yield srv


def test_threads(server: ServerThread) -> None:
    results: dict[str, set[bytes]] = {}
    errors: list[BaseException] = []

    def run(fn, *args):
        try:
            value = fn(*args)
            if isinstance(value, set):
                results[args[1]] = value
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(publish_randomly, server.address, f"t{i}", i))
               for i in range(4)]
    threads += [threading.Thread(target=run, args=(query_randomly, server.address, 300, i))
                for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert_exact(server, results)


def test_processes(server: ServerThread) -> None:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        publishers = [pool.apply_async(publish_randomly, (server.address, f"p{i}", 10 + i))
                      for i in range(3)]
        querier = pool.apply_async(query_randomly, (server.address, 300, 99))
        results = {f"p{i}": job.get(timeout=120) for i, job in enumerate(publishers)}
        assert querier.get(timeout=120) == 300
    assert_exact(server, results)
