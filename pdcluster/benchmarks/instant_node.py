"""`InstantNode`: a node server for the router benchmark that answers every request at once
(one TokenDelta with all its tokens), so that what is timed is the router.

Three modes, as `pdcluster bench router` compares them in one run: "plain" (no CURVE),
"shared" (CURVE with one key pair for everyone: the shared-key mode) and "identity" (what a
node does: its own key pair, a key directory following the metadata service's router keys,
and per message the sender's principal looked up and checked — only a router may send
generate requests and load queries, node/server.py's rule).

`endpoints` > 1 serves that many sockets from the one thread, each with its own address and
(in identity mode) its own key pair: a node id registers one endpoint, since the metadata
service refuses two live nodes sharing an address or a key. `address` and `keys` are the
first endpoint's.
"""

from __future__ import annotations

import random
import threading

import zmq

from pdcluster.core.credentials import SERVICE, ClusterSecret, CurveKeys
from pdcluster.core.curve import forget_directory, secure_server, sender_principal
from pdcluster.core.identity import ROUTER_PREFIX, Directory, Peer, is_router
from pdcluster.core.node_wire import (
    GenerateRequest,
    LoadQuery,
    LoadReport,
    TokenDelta,
    decode,
    encode,
)

MODES = ("plain", "shared", "identity")


class InstantNode:
    def __init__(self, mode: str, secret: ClusterSecret, metadata_address: str = "",
                 endpoints: int = 1) -> None:
        assert mode in MODES, f"mode must be one of {MODES}"
        self.mode = mode
        self.directory: Directory | None = (_router_keys(metadata_address, secret)
                                            if mode == "identity" else None)
        self.endpoints: list[tuple[str, CurveKeys]] = []
        self._sockets: list[zmq.Socket[bytes]] = []
        for _ in range(endpoints):
            keys = secret.curve_keys() if mode == "shared" else CurveKeys.generate()
            sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            if mode != "plain":
                secure_server(sock, keys, self.directory)
            port = sock.bind_to_random_port("tcp://127.0.0.1")
            self.endpoints.append((f"tcp://127.0.0.1:{port}", keys))
            self._sockets.append(sock)
        self.address, self.keys = self.endpoints[0]
        self._rng = random.Random(len(self.address))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self._sockets:
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(50):
                self._answer(sock)

    def _answer(self, sock: zmq.Socket[bytes]) -> None:
        identity, frame = sock.recv_multipart(copy=False)
        msg = decode(frame.bytes)
        if self.mode == "identity" and not is_router(
                sender_principal(sock.context, frame)):
            return  # a node refuses it (node/server.py); nobody here sends one
        reply: LoadReport | TokenDelta
        if isinstance(msg, LoadQuery):  # varied loads, so the policy has work to do
            queued = self._rng.randrange(500)
            reply = LoadReport("instant", "decode", 0, queued % 5, 1000 - queued, 1000,
                               queued)
        elif isinstance(msg, GenerateRequest):
            n = msg.sampling.max_tokens
            reply = TokenDelta(msg.request_id, [100 + i for i in range(n)], True, "length",
                               None, len(msg.prompt_token_ids), 0)
        else:
            return
        sock.send_multipart([identity.bytes, encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in self._sockets:
            sock.close()
        if self.directory is not None:
            self.directory.close()
            forget_directory(self.directory)


def _router_keys(metadata_address: str, secret: ClusterSecret) -> Directory:
    """The routers' keys the metadata service vouches for, refreshed as a node's are."""
    from pdcluster.metadata_service.client import MetadataClient

    client = MetadataClient(metadata_address, token=secret.metadata_token(SERVICE),
                            timeout_s=30)

    def routers() -> list[Peer]:
        return [Peer(ROUTER_PREFIX + c.client_id, c.curve_public_key.encode(),
                  ticket_key=c.ticket_public_key)
                for c in client.list_clients()]

    return Directory(refresh=routers).follow(2.0)
