"""`InstantNode`: a node server for the router benchmark that answers every request at once
(one TokenDelta with all its tokens), so that what is timed is the router.

Three modes, one socket each, as `pdcluster bench router` compares them in one run:
"plain" (no CURVE), "shared" (CURVE with one key pair for everyone: the shared-key mode) and
"identity" (what a node does: its own key pair, a key directory following the metadata
service's router keys, and per message the sender's principal looked up and checked — only a
router may send generate requests and load queries, node/server.py's rule).
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
    def __init__(self, mode: str, secret: ClusterSecret, metadata_address: str = "") -> None:
        assert mode in MODES, f"mode must be one of {MODES}"
        self.mode = mode
        self.keys = secret.curve_keys() if mode == "shared" else CurveKeys.generate()
        self.directory: Directory | None = None
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if mode == "identity":
            self.directory = _router_keys(metadata_address, secret)
            secure_server(self._socket, self.keys, self.directory)
        elif mode == "shared":
            secure_server(self._socket, self.keys)
        self.address = f"tcp://127.0.0.1:{self._socket.bind_to_random_port('tcp://127.0.0.1')}"
        self._rng = random.Random(len(self.address))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(50):
                continue
            identity, frame = self._socket.recv_multipart(copy=False)
            msg = decode(frame.bytes)
            if self.mode == "identity" and not is_router(
                    sender_principal(self._socket.context, frame)):
                continue  # a node refuses it (node/server.py); nobody here sends one
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
                continue
            self._socket.send_multipart([identity.bytes, encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._socket.close()
        if self.directory is not None:
            self.directory.close()
            forget_directory(self.directory)


def _router_keys(metadata_address: str, secret: ClusterSecret) -> Directory:
    """The routers' keys the metadata service vouches for, refreshed as a node's are."""
    from pdcluster.metadata_service.client import MetadataClient

    client = MetadataClient(metadata_address, token=secret.metadata_token(SERVICE),
                            timeout_s=30)

    def routers() -> list[Peer]:
        return [Peer(ROUTER_PREFIX + c.client_id, c.curve_public_key.encode())
                for c in client.list_clients()]

    return Directory(refresh=routers).follow(2.0)
