"""Publishes a node's KV block events to the metadata service from a background thread, so
a slow or absent metadata service never stalls the engine loop.

The engine thread hands each step's events to `put` (a queue append). The publisher thread
sends them in batches every `interval_s`, heartbeats every lease TTL / 3 (at once when the
node starts draining: `begin_drain`, so the index shows it), and re-registers when the lease
is gone. A batch that cannot be sent is dropped: the next one leaves a
sequence gap, which the service answers with a resync, and the node sends a snapshot — a
copy of its block-hash map taken at that moment. With no next batch (an idle node), the
thread sends that snapshot itself once the service answers again. Replaying later events
over a newer snapshot converges to the exact set, because each block's last event wins.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from pdcluster.core.events import KVEvent
from pdcluster.metadata_service.client import MetadataClient
from pdcluster.metadata_service.publisher import NodePublisher, SnapshotFn

logger = logging.getLogger(__name__)


class EventPublisherThread:
    def __init__(self, client: MetadataClient, info, snapshot_fn: SnapshotFn,
                 lease_ttl_s: int, interval_s: float) -> None:
        self.publisher = NodePublisher(client, info, snapshot_fn, lease_ttl_s)
        self.client = client
        self.interval_s = interval_s
        self.num_failures = 0
        # a batch failed to send and no later batch has shown the service the gap yet: a
        # snapshot is due, or the index would miss that batch while the node stays idle
        self._resync_due = False
        self._queue: queue.SimpleQueue[list[KVEvent]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._registered = threading.Event()
        self._heartbeat_now = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events")

    def start(self) -> EventPublisherThread:
        self._thread.start()
        return self

    def wait_registered(self, timeout_s: float) -> bool:
        return self._registered.wait(timeout_s)

    def put(self, events: list[KVEvent]) -> None:
        if events:
            self._queue.put(events)

    def begin_drain(self) -> None:
        """The node stopped taking requests: say so in the next heartbeat, sent now."""
        self.publisher.info.draining = True
        self._heartbeat_now.set()

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        self._thread.join(10)
        if deregister and self._registered.is_set():
            self._try(self.publisher.deregister)
        self.client.close()

    def _run(self) -> None:
        next_heartbeat = 0.0
        while not self._stop.is_set():
            if not self._registered.is_set():
                if not self._try(self.publisher.register):
                    self._stop.wait(1.0)
                    continue
                self._registered.set()
                next_heartbeat = time.monotonic() + self.publisher.lease_ttl_s / 3
            self._stop.wait(self.interval_s)
            batch = self._drain()
            if batch:
                self._resync_due = not self._try(self.publisher.publish, batch)
            elif self._resync_due:
                self._resync_due = not self._try(self.publisher.resync)
            if time.monotonic() >= next_heartbeat or self._heartbeat_now.is_set():
                self._heartbeat_now.clear()
                self._try(self.publisher.heartbeat)
                next_heartbeat = time.monotonic() + max(self.publisher.lease_ttl_s / 3, 0.2)

    def _drain(self) -> list[KVEvent]:
        batch: list[KVEvent] = []
        while True:
            try:
                batch.extend(self._queue.get_nowait())
            except queue.Empty:
                return batch

    def _try(self, call, *args) -> bool:
        try:
            call(*args)
            return True
        except Exception as exc:  # the service may be down: keep serving, resync later
            self.num_failures += 1
            logger.warning("metadata service: %s", exc)
            return False
