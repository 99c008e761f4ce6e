"""`Waker`: the node's side of waking vLLM's engine for a peer's prefix pull (pulls.py).

vLLM's engine core blocks on its input queue when it has no requests; a cheap utility call
(`AsyncLLM.is_sleeping`) makes it look again, and then ask the connector whether it has work.
The connector's worker announces a peer's pull on the handshake folder's `wake` socket; this
thread listens there and pokes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import zmq


class Waker:
    """Wakes vLLM's engine when the connector's worker announces a peer's pull: a thread on
    a PULL socket (the handshake folder's `wake`), poking twice — the announcement to the
    scheduler side travels on another socket and may land just after the first poke."""

    def __init__(self, address: str, poke: Callable[[], None]) -> None:
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._poke, self._stop = poke, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="vllm-wake")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            while self._sock.poll(0):
                self._sock.recv()
            self._poke()
            time.sleep(0.05)
            self._poke()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()
