"""Which node may send which side-channel message: the connector worker's `authorize`, run
on the side channel's receive thread with each decoded message and its sender's principal
(core.identity) before the worker handles it.

- `XferRequest` / `PrefixPullRequest`: the reply address and the destination session must be
  the requester's own registered KV address and transfer-engine session, so no member can make
  a node write KV into a third node (a confused deputy) or send its replies elsewhere.
- `PrefixPullRequest` also needs the router's ticket for exactly that pull (core.pull_ticket):
  signed by a router the directory names, for this holder and the requesting node, unexpired,
  for the chain the request's own tokens and salt make. A pull without one is answered at
  once as failed (`refuse_pull`: no blocks, no count) and refused.
- `XferDone`: only from the node the transfer or pull was asked of (its registered KV
  address is the one the receive went to), so no member can complete another's transfer.
- `XferAbort`: only from the node that requested the transfer or pull being served here.
  Before any request came (a decode node that found the whole prompt in its own cache lets
  the prefill node go without asking), from any registered node: the transfer id is the
  router's random uuid, known only to the router and the two nodes it paired.
The node itself (its own key: a vLLM node telling its connector that a source is lost) and
the shared-key test mode's principal (`MEMBER`) may send anything; a key that names no
registered node may send nothing.

API: `PeerRules(directory, state, requester_of, own_key, refuse_pull)`, called as
`rules(msg, principal)`; `pull_refusal`.
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
from pdcluster.core.pull_ticket import check_ticket
from pdcluster.transfer.worker_state import WorkerState


class PeerRules:
    def __init__(self, directory: Directory, state: WorkerState,
                 requester_of: Callable[[TransferId], str | None],
                 own_key: bytes | None = None,
                 refuse_pull: Callable[[PrefixPullRequest], None] | None = None) -> None:
        self._directory = directory
        self._state = state
        self._requester_of = requester_of  # lock held: the reply address of a served request
        self._own_key = own_key
        self._refuse_pull = refuse_pull  # answers a pull refused for its ticket

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
            if isinstance(msg, PrefixPullRequest):
                return self._check_ticket(msg, principal)
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

    def _check_ticket(self, msg: PrefixPullRequest, principal: str) -> str | None:
        own = None if self._own_key is None else self._directory.principal_of(self._own_key,
                                                                               wait=False)
        reason = pull_refusal(msg, self._directory, node_id_of(own), node_id_of(principal))
        if reason is None:
            return None
        if self._refuse_pull is not None:
            self._refuse_pull(msg)
        return f"prefix pull refused: {reason}"


def pull_refusal(msg: PrefixPullRequest, directory: Directory, holder: str | None,
                 puller: str | None) -> str | None:
    """Why `holder` may not serve pull `msg` to `puller` (core.pull_ticket), None if it may."""
    if holder is None or puller is None:
        return "this node or the requester has no node id"
    ticket = msg.ticket
    signer = None if ticket is None else directory.peer(ticket.router)
    return check_ticket(ticket, None if signer is None else signer.ticket_key, holder=holder,
                        puller=puller, token_ids=msg.token_ids, block_size=msg.block_size,
                        num_blocks=msg.first_block + len(msg.dest_block_addrs),
                        cache_salt=msg.cache_salt, lora_id=msg.lora_id)
