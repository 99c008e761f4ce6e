"""A real `pdcluster serve` to attack: a process tree on 127.0.0.1 (local Ray, one prefill and
one decode node actor, the embedded metadata service, the router) with a cluster secret and
router API keys set, and what an attacker on the same network can learn of it: the nodes'
request and KV side-channel addresses (the test asks the metadata service for them with the
cluster's read credential; an attacker would scan the ports)."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openai

from pdcluster.core.credentials import SERVICE, ClusterSecret, CurveKeys, node_principal
from pdcluster.core.curve import secure_client
from tests.serve_process import start_serve, stop_serve, wait_until_answering

API_KEY = "sk-security-test"
BLOCK_SIZE = 16  # the own engine's nodes here
VLLM_BLOCK_SIZE = 32  # vLLM's CPU kernels take multiples of 32


@dataclass
class Served:
    proc: subprocess.Popen
    base_url: str
    metadata_address: str
    secret: ClusterSecret
    nodes: dict[str, dict[str, str]]  # role -> {"request_address", "kv_address", "node_id"}
    model_dir: str
    engine: str = "pdcluster"  # the nodes' engine: "pdcluster" or "vllm"

    @property
    def block_size(self) -> int:
        return VLLM_BLOCK_SIZE if self.engine == "vllm" else BLOCK_SIZE

    def stop(self) -> None:
        stop_serve(self.proc)


def start_served(model_dir: str, port: int, engine: str = "pdcluster") -> Served:
    secret = ClusterSecret.generate()
    env = {**os.environ, "PDCLUSTER_CLUSTER_SECRET": secret.to_text(),
           "PDCLUSTER_API_KEYS": API_KEY, "VLLM_LOGGING_LEVEL": "WARNING"}
    # Run it as a user would: whatever keeps Ray on the host must come from pdcluster itself.
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    block_size = VLLM_BLOCK_SIZE if engine == "vllm" else BLOCK_SIZE
    proc, ready = start_serve(["--engine", engine, "--model", model_dir, "--num-prefill", "1",
                               "--num-decode", "1", "--port", str(port), "--block-size",
                               str(block_size), "--kv-cache-gib",
                               "0.25" if engine == "vllm" else "0.05"], env)
    found = re.search(r"metadata service at (\S+?)\)", ready)
    if found is None:
        stop_serve(proc)
        raise RuntimeError(f"pdcluster serve named no metadata service: {ready}")
    served = Served(proc, f"http://127.0.0.1:{port}/v1", found.group(1), secret, {}, model_dir,
                    engine)
    served.nodes = _nodes(served)
    client = openai.OpenAI(base_url=served.base_url, api_key=API_KEY, max_retries=0,
                           timeout=120)
    wait_until_answering(client, Path(model_dir).name)
    return served


def _nodes(served: Served) -> dict[str, dict[str, str]]:
    from pdcluster.metadata_service.client import MetadataClient

    client = MetadataClient(served.metadata_address,
                            token=served.secret.metadata_token(SERVICE))
    deadline = time.monotonic() + 60
    while True:
        nodes = {_role(n.role): {"node_id": n.node_id, "request_address": n.request_address,
                                 "kv_address": n.kv_address, "kv_session": n.kv_session,
                                 "curve_public_key": n.curve_public_key}
                 for n in client.list_nodes()}
        if len(nodes) == 2 or time.monotonic() > deadline:
            client.close()
            return nodes
        time.sleep(0.2)


def _role(role: int) -> str:
    from pdcluster.proto import metadata_pb2 as pb

    return "prefill" if role == pb.PREFILL else "decode"


def server_key(served: Served, role: str) -> bytes:
    """The node's own public key, as the metadata service publishes it."""
    return served.nodes[role]["curve_public_key"].encode()


def router_member(served: Served) -> CurveKeys:
    """A router's key, registered with the router's credential (principal service): what a
    router (or a pod holding the router's credential) presents to nodes."""
    from pdcluster.metadata_service.client import MetadataClient

    keys = CurveKeys.generate()
    with MetadataClient(served.metadata_address,
                        token=served.secret.metadata_token(SERVICE)) as client:
        client.register_client(f"test-{secrets.token_hex(4)}", keys.public, 300)
    return keys


def node_member(served: Served, node_id: str, kv_address: str, kv_session: str,
                keys: CurveKeys) -> bytes:
    """Register node `node_id` (its own bootstrap credential, its own key and addresses): a
    decode pod as the cluster would have it, compromised or not. Returns the proof."""
    from pdcluster.metadata_service.client import MetadataClient, make_node_info

    token = served.secret.metadata_token(node_principal(node_id))
    # no request address: the router leaves it alone (it serves no generate requests)
    info = make_node_info(node_id, "decode", kv_address=kv_address, kv_session=kv_session,
                          curve_public_key=keys.public)
    with MetadataClient(served.metadata_address, token=token) as client:
        return client.register(info, 300).registration_secret


def key_directory(served: Served):
    """The registered keys (core.identity), as a node sees them."""
    from pdcluster.core.identity import Directory
    from pdcluster.metadata_service.client import MetadataClient
    from pdcluster.node.runtime import registered_peers

    client = MetadataClient(served.metadata_address, token=served.secret.metadata_token(SERVICE))
    return Directory(refresh=lambda: registered_peers(client), min_refresh_s=0.05)


def dealer(address: str, keys=None, server_key: bytes | None = None):
    """A DEALER to `address`: plaintext without `keys`; CURVE with `keys` (and the server key
    `server_key`, default: the keys' own public key, as cluster members use)."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        secure_client(sock, keys)
        if server_key is not None:
            sock.curve_serverkey = server_key
    sock.connect(address)
    return sock


def block_nbytes(model_dir: str, block_size: int = BLOCK_SIZE) -> int:
    """Bytes of one KV block of `model_dir` in float32 (the engine's block-contiguous
    layout: K and V of every layer)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * block_size * 4


class Memory:
    """An attacker's (or a test member's) Mooncake-registered buffer, to be written into."""

    def __init__(self, nbytes: int) -> None:
        from pdcluster.transfer.mooncake_engine import MooncakeConfig, MooncakeTransferEngine

        self.buf = np.zeros(nbytes, dtype=np.uint8)
        self.engine = MooncakeTransferEngine(MooncakeConfig())
        self.engine.register(self.buf.ctypes.data, nbytes)

    def addr(self, offset: int) -> int:
        return self.buf.ctypes.data + offset

    @property
    def touched(self) -> bool:
        return bool(self.buf.any())

    def close(self) -> None:
        self.engine.close()


def node_member_leave(served: Served, node_id: str, proof: bytes) -> None:
    """Deregister a member `node_member` registered (with its proof)."""
    from pdcluster.metadata_service.client import MetadataClient

    token = served.secret.metadata_token(node_principal(node_id))
    with MetadataClient(served.metadata_address, token=token) as client:
        client.deregister(node_id, proof)
