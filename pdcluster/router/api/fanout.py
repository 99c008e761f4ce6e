"""Several samples of one prompt (`n` / `best_of`), with the prompt prefilled once.

Sample 0 goes where the policy placed the request. Once its first token arrives, its decode
node holds the prompt's full blocks in its prefix cache, so the other samples are sent to that
same node with a local prefill (no prefill node, no pull): each finds the prompt cached and
computes only the last partial block. Deltas of all samples come out of one iterator, as
`(sample index, delta)` in arrival order. A sample ends when its node finishes it or when the
consumer calls `close_sample` (a stop string); leaving the iterator aborts everything still
running (each sample's own `execute` cleanup). Each sample migrates on its own if its node is
lost (router.routing.migration).

API: `run_samples`, `SampleRun`, `local_placement`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import replace

from pdcluster.core.node_wire import GenerateRequest, TokenDelta
from pdcluster.router.routing.dispatch import Dispatcher, Placement
from pdcluster.router.routing.migration import execute_migrating

_END = object()


def local_placement(placement: Placement) -> Placement:
    """The same decode node, prefilling locally (no prefill node, no prefix pull)."""
    decision = replace(placement.decision, prefill_node=None, reason="local_prefill",
                       prefix_source=None, prefix_source_blocks=0)
    return replace(placement, decision=decision)


class SampleRun:
    """The merged deltas of `samples` (see the module docstring). Use as an async context
    manager; iterate `deltas()`."""

    def __init__(self, dispatcher: Dispatcher, placement: Placement,
                 samples: list[GenerateRequest]) -> None:
        self._dispatcher, self._placement, self._samples = dispatcher, placement, samples
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: dict[int, asyncio.Task] = {}
        self._iterator: AsyncGenerator | None = None

    async def __aenter__(self) -> SampleRun:
        return self

    async def __aexit__(self, *exc) -> None:
        if self._iterator is not None:  # a lone sample's stream is aborted here
            await self._iterator.aclose()
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close_sample(self, index: int) -> None:
        """Stop sample `index` early (its node request is aborted; a lone sample is aborted
        when the consumer leaves `deltas`)."""
        task = self._tasks.get(index)
        if task is not None:
            task.cancel()

    def deltas(self) -> AsyncIterator[tuple[int, TokenDelta]]:
        """The samples' deltas; closed (and what runs aborted) on leaving the run."""
        self._iterator = self._deltas()
        return self._iterator

    async def _deltas(self) -> AsyncGenerator[tuple[int, TokenDelta]]:
        if len(self._samples) == 1:  # the common case: no task, no queue
            stream = execute_migrating(self._dispatcher, self._placement, self._samples[0])
            async with aclosing(stream):
                async for delta in stream:
                    yield 0, delta
            return
        self._start(0, self._placement)
        running, started_rest = 1, len(self._samples) == 1
        while running:
            index, item = await self._queue.get()
            if item is _END:
                running -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            if not started_rest:
                started_rest = True
                others = local_placement(self._placement)
                for i in range(1, len(self._samples)):
                    self._start(i, others)
                running += len(self._samples) - 1
            yield index, item

    def _start(self, index: int, placement: Placement) -> None:
        deltas = execute_migrating(self._dispatcher, placement, self._samples[index])
        self._tasks[index] = asyncio.create_task(self._pump(index, deltas))

    async def _pump(self, index: int, deltas: AsyncGenerator[TokenDelta, None]) -> None:
        try:
            async with aclosing(deltas):
                async for delta in deltas:
                    self._queue.put_nowait((index, delta))
        except asyncio.CancelledError:
            self._queue.put_nowait((index, _END))
            raise
        except Exception as exc:  # the consumer raises it
            self._queue.put_nowait((index, exc))
            return
        self._queue.put_nowait((index, _END))
