"""Which node may send which side-channel message: the connector worker's `authorize`, run
on the side channel's receive thread with each decoded message and its sender's principal
(core.identity) before the worker handles it.

- `XferRequest` / `PrefixPullRequest`: the reply address and the destination session must be
  the requester's own registered KV address and transfer-engine session, so no member can make
  a node write KV into a third node (a confused deputy) or send its replies elsewhere.
- `XferDone`: only from the node the transfer or pull was asked of (its registered KV
  address is the one the receive went to), so no member can complete another's transfer.
- `XferAbort`: only from the node that requested the transfer or pull being served here.
  Before any request came (a decode node that found the whole prompt in its own cache lets
  the prefill node go without asking), from any registered node: the transfer id is the
  router's random uuid, known only to the router and the two nodes it paired.
The node itself (its own key: a vLLM node telling its connector that a source is lost) and
the shared-key test mode's principal (`MEMBER`) may send anything; a key that names no
registered node may send nothing.

API: `PeerRules(directory, state, requester_of, own_key)`, called as `rules(msg, principal)`.
"""

from __future__ import annotations

from collections.abc import Callable

from pdcluster.core.identity import MEMBER, Directory, node_id_of
from pdcluster.core.kv_transfer import (
    PrefixPullRequest,
    SideChannelMessage,
    TransferId,
    XferAbort,
    XferDone,
    XferRequest,
)
from pdcluster.transfer.worker_state import WorkerState


class PeerRules:
    def __init__(self, directory: Directory, state: WorkerState,
                 requester_of: Callable[[TransferId], str | None],
                 own_key: bytes | None = None) -> None:
        self._directory = directory
        self._state = state
        self._requester_of = requester_of  # lock held: the reply address of a served request
        self._own_key = own_key

    def __call__(self, msg: SideChannelMessage, principal: str | None) -> str | None:
        if principal == MEMBER or (self._own_key is not None and principal is not None and
                                   principal == self._directory.principal_of(self._own_key)):
            return None
        peer = (self._directory.peer(principal) if principal is not None
                and node_id_of(principal) else None)
        if peer is None or principal is None:
            return "the sender is no registered node"
        if isinstance(msg, XferRequest | PrefixPullRequest):
            if msg.reply_addr != peer.kv_address or msg.dest_session != peer.kv_session:
                return ("its reply address or destination is not the requester's registered "
                        "KV address and transfer-engine session")
            return None
        with self._state.lock:
            if isinstance(msg, XferDone):
                recv = self._state.recvs.get(msg.transfer_id)
                if recv is not None and recv.source_addr != peer.kv_address:
                    return "an XferDone from a node this transfer was not asked of"
            elif isinstance(msg, XferAbort):
                requester = self._requester_of(msg.transfer_id)
                if requester is not None and requester != peer.kv_address:
                    return "an XferAbort from a node that did not request this transfer"
        return None
