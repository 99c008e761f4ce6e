"""The prefix-pull side-channel message on the wire: round trip through the one codec, and
malformed requests rejected with `WireError` before any handler sees them."""

from __future__ import annotations

import pytest

from pdcluster.core import kv_transfer
from pdcluster.core.kv_transfer import PrefixPull, PrefixPullRequest
from pdcluster.core.wire import WireError

GOOD = PrefixPullRequest("pull-1", "r", "tcp://a:1", "127.0.0.1:2", 4096, block_size=4,
                         first_block=1, token_ids=list(range(12)),
                         dest_block_addrs=[8192, 12288], cache_salt="tenant-a")


def test_round_trip():
    assert kv_transfer.decode(kv_transfer.encode(GOOD)) == GOOD


@pytest.mark.parametrize("change", [
    {"dest_block_addrs": []},  # nothing asked
    {"dest_block_addrs": [8192]},  # tokens for one block more than asked
    {"dest_block_addrs": [8192, 0]},
    {"block_nbytes": 0},
    {"block_size": 0},
    {"first_block": -1},
    {"token_ids": list(range(11))},  # a partial block
    {"token_ids": ["not-an-int"] * 12},
    {"cache_salt": 5},
])
def test_malformed_pull_requests_are_rejected(change):
    fields = {f: getattr(GOOD, f) for f in GOOD.__dataclass_fields__}
    with pytest.raises(WireError):
        kv_transfer.decode(kv_transfer.encode(PrefixPullRequest(**{**fields, **change})))


@pytest.mark.parametrize("source, num_blocks", [("", 3), ("tcp://h:1", 0)])
def test_prefix_pull_needs_a_source_and_blocks(source, num_blocks):
    with pytest.raises(ValueError):
        PrefixPull(source, num_blocks)
