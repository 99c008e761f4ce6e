"""vLLM's `AsyncLLM`, built so that a failed build leaves nothing behind.

`AsyncLLM.__init__` starts the engine-core and worker processes and opens its ZMQ sockets
before it builds its stat loggers (and more): when a later part raises, the half-built
object is left to the garbage collector with those processes running, and collecting its
ZMQ context can block the collecting thread for good (`Context.term` waits on sockets that
are still open). Seen in a test process: every test after a failed start hung at a random
allocation. Here a failed build shuts down what it had started, as `AsyncLLM.shutdown` does
(it tolerates a half-built object), before the error goes on.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.engine.async_llm import AsyncLLM


class NodeAsyncLLM(AsyncLLM):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            self.shutdown()
            raise
