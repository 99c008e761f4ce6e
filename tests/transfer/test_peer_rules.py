"""PeerRules (transfer.peer_rules), the side channel's per-principal checks, on their own: a
real key directory and worker state, the requester lookup a table the test fills."""

from __future__ import annotations

import time

from pdcluster.core.credentials import CurveKeys
from pdcluster.core.identity import MEMBER, Directory, Peer
from pdcluster.core.kv_transfer import XferAbort, XferRequest
from pdcluster.transfer.peer_rules import PeerRules
from pdcluster.transfer.worker_state import WorkerState

D0 = Peer("node/d0", CurveKeys.generate().public, "tcp://127.0.0.1:7000",
          "tcp://127.0.0.1:7100", "127.0.0.1:17100")
D1 = Peer("node/d1", CurveKeys.generate().public, "tcp://127.0.0.1:7001",
          "tcp://127.0.0.1:7101", "127.0.0.1:17101")


def make_rules(requesters: dict[str, str]) -> PeerRules:
    directory = Directory()
    for peer in (D0, D1):
        directory.grant(peer)
    state = WorkerState(None, 1.0, time.monotonic)  # type: ignore[arg-type]
    return PeerRules(directory, state, requesters.get)


def request(peer: Peer, reply_addr: str | None = None) -> XferRequest:
    return XferRequest("t-1", "r-1", reply_addr or peer.kv_address, peer.kv_session, 4096,
                       2, 0, [0x1000, 0x2000])


def test_an_abort_of_a_requested_transfer_comes_only_from_its_requester():
    rules = make_rules({"t-1": D0.kv_address})
    assert rules(XferAbort("t-1"), D0.principal) is None
    assert "did not request" in (rules(XferAbort("t-1"), D1.principal) or "")


def test_an_abort_before_any_request_releases_the_prefill_node():
    # a decode node that found the whole prompt cached never asks; its abort lets P go now
    rules = make_rules({})
    assert rules(XferAbort("t-1"), D1.principal) is None
    assert rules(XferAbort("t-1"), "node/stranger") == "the sender is no registered node"
    assert rules(XferAbort("t-1"), None) == "the sender is no registered node"
    assert rules(XferAbort("t-1"), MEMBER) is None  # the shared-key test mode


def test_a_request_names_its_senders_own_kv_address_and_session():
    rules = make_rules({})
    assert rules(request(D0), D0.principal) is None
    assert "reply address" in (rules(request(D0, D1.kv_address), D0.principal) or "")
    assert "reply address" in (rules(request(D1), D0.principal) or "")
