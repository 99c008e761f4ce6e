"""A node's event publisher whose batch fails to reach the metadata service (stalled,
restarting) resends its whole block set once the service answers again, even when no later
batch comes to reveal the gap: an idle node's index entry must not stay wrong."""

from __future__ import annotations

import time

from pdcluster.core.events import BlockStored
from pdcluster.metadata_service.client import MetadataClient, make_node_info
from pdcluster.metadata_service.errors import MetadataError
from pdcluster.metadata_service.server import ServerThread
from pdcluster.node.events import EventPublisherThread
from tests.metadata_service.helpers import make_chain, make_config, wait_until

CHAIN = make_chain("resync", 4)


class FlakyClient(MetadataClient):
    """The real client, whose first `fail_publishes` publishes never reach the service."""

    def __init__(self, address: str, fail_publishes: int) -> None:
        super().__init__(address)
        self.fail_publishes = fail_publishes

    def publish(self, *args, **kwargs):
        if self.fail_publishes:
            self.fail_publishes -= 1
            raise MetadataError("the service did not answer in time")
        return super().publish(*args, **kwargs)


def test_a_lost_batch_is_resent_as_a_snapshot_when_nothing_follows() -> None:
    cached: set[bytes] = set()
    with ServerThread(make_config()) as server, MetadataClient(server.address) as reader:
        client = FlakyClient(server.address, fail_publishes=1)
        thread = EventPublisherThread(client, make_node_info("p0", "prefill", epoch=3),
                                      lambda: list(cached), lease_ttl_s=5,
                                      interval_s=0.02).start()
        try:
            assert thread.wait_registered(10)
            cached.update(CHAIN)
            thread.put([BlockStored(tuple(CHAIN), None, 16)])  # the only batch: it is lost
            wait_until(lambda: reader.query(CHAIN) == [("p0", 4)], timeout_s=10,
                       what="the lost blocks to reach the index")
            assert thread.num_failures == 1 and thread.publisher.num_resyncs >= 1
            time.sleep(0.2)  # and nothing more is sent once it is exact
            assert thread.publisher.num_resyncs == 1
        finally:
            thread.stop()
