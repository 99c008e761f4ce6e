"""Pull tickets: a router's signed permission for one prefix pull (torch-free).

A holder writes its cached KV into a peer's memory only for a pull the router arranged. The
router that places a request with a `PrefixSource` signs a `PullTicket` naming the request,
the node that pulls (`puller`), the node it pulls from (`holder`), the chain (its length in
blocks and a digest of its tokens, block size, cache salt and LoRA: `chain_digest`) and an
expiry (wall-clock seconds). The puller forwards it in its `PrefixPullRequest`; the holder
recomputes the digest from the request's own tokens and salt and serves the pull only if
the ticket verifies (`check_ticket`). So a member cannot start its own pull to learn how much
of a tenant's prompt a holder caches, replay a ticket for another chain or holder, or keep
one past its expiry.

Signatures are Ed25519 under a key pair each router process makes at start (`TicketSigner`):
the public half is registered with the metadata service beside the router's CURVE key, so a
holder needs nothing secret to verify, and a compromised node can verify tickets but never
mint one. The digest is independent of the engine's block-hash scheme (own engine or vLLM,
any seed), so the transfer worker checks it without the engine.

API: `PullTicket`, `TicketSigner`, `chain_digest`, `check_ticket`, `ticket_to_dict`,
`ticket_from_dict`.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Annotated, Any

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from pdcluster.core.types import MAX_ID_CHARS
from pdcluster.core.wire import MaxLen

# Long enough for a request to wait in a node's queue before its pull starts; short enough
# that a ticket a member kept is soon useless. Wall clock: router and nodes must agree within
# CLOCK_SKEW_S (NTP keeps them far closer).
DEFAULT_TICKET_TTL_S = 120.0
CLOCK_SKEW_S = 5.0
PUBLIC_KEY_BYTES = 32
_SIGNATURE_BYTES = 64
_DIGEST_BYTES = 32
_DOMAIN = b"pdcluster pull ticket v1\0"
Id = Annotated[str, MaxLen(MAX_ID_CHARS)]


@dataclass(frozen=True, slots=True)
class PullTicket:
    router: Id  # the signer's principal ("router/<client id>"): whose public key verifies
    request_id: Id
    puller: Id  # node ids
    holder: Id
    num_blocks: int  # the chain's length: blocks [0, num_blocks) of the prompt
    digest: Annotated[bytes, MaxLen(_DIGEST_BYTES)]  # chain_digest of those blocks
    expires_at: float  # wall-clock seconds (time.time())
    signature: Annotated[bytes, MaxLen(_SIGNATURE_BYTES)] = b""

    def signed_bytes(self) -> bytes:
        return _DOMAIN + msgpack.packb([self.router, self.request_id, self.puller, self.holder,
                                        self.num_blocks, self.digest, self.expires_at])


def chain_digest(token_ids: Sequence[int], block_size: int, num_blocks: int,
                 cache_salt: str | None, lora_id: int | None) -> bytes:
    """What names the blocks [0, num_blocks) of a prompt to a holder: their tokens and the
    extra keys every block hash includes (salt, LoRA), and the block size that cuts them."""
    tokens = token_ids[:num_blocks * block_size]
    head = msgpack.packb([block_size, num_blocks, cache_salt, lora_id, len(tokens)])
    return hashlib.sha256(head + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


class TicketSigner:
    """One router process's ticket key (never exported); `public_key` is registered with the
    metadata service as the router's `ticket_public_key`."""

    def __init__(self, router: str, ttl_s: float = DEFAULT_TICKET_TTL_S) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.router, self.ttl_s = router, ttl_s
        self._key = Ed25519PrivateKey.generate()
        self.public_key = self._key.public_key().public_bytes_raw()

    def sign(self, request_id: str, puller: str, holder: str, token_ids: Sequence[int],
             block_size: int, num_blocks: int, cache_salt: str | None,
             lora_id: int | None = None, now: float | None = None) -> PullTicket:
        expires_at = (time.time() if now is None else now) + self.ttl_s
        ticket = PullTicket(self.router, request_id, puller, holder, num_blocks,
                            chain_digest(token_ids, block_size, num_blocks, cache_salt,
                                         lora_id), expires_at)
        return replace(ticket, signature=self._key.sign(ticket.signed_bytes()))


def check_ticket(ticket: PullTicket | None, public_key: bytes | None, *, holder: str,
                 puller: str, token_ids: Sequence[int], block_size: int, num_blocks: int,
                 cache_salt: str | None, lora_id: int | None, now: float | None = None
                 ) -> str | None:
    """Why the pull `ticket` came with may not be served by `holder` to `puller`, or None if
    it may. `public_key`: the registered ticket key of `ticket.router` (None: unknown)."""
    if ticket is None:
        return "no ticket"
    if not public_key or len(public_key) != PUBLIC_KEY_BYTES:
        return f"no ticket key registered for {ticket.router!r}"
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(ticket.signature,
                                                              ticket.signed_bytes())
    except InvalidSignature:
        return "bad signature"
    if ticket.holder != holder or ticket.puller != puller:
        return "the ticket names another holder or puller"
    if (time.time() if now is None else now) > ticket.expires_at + CLOCK_SKEW_S:
        return "expired"
    if ticket.num_blocks != num_blocks or ticket.digest != chain_digest(
            token_ids, block_size, num_blocks, cache_salt, lora_id):
        return "the ticket is for another chain"
    return None


def ticket_to_dict(ticket: PullTicket) -> dict[str, Any]:
    """The ticket as plain values (vLLM's kv_transfer_params carry it this way)."""
    return {f.name: getattr(ticket, f.name) for f in fields(PullTicket)}


def ticket_from_dict(values: dict[str, Any]) -> PullTicket:
    return PullTicket(**{f.name: values[f.name] for f in fields(PullTicket)})
