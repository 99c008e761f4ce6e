"""A child process running one engine with the real Mooncake transport, driven over a Pipe:
the "other node" in two-process connector tests. Commands are plain tuples; no model objects
cross the pipe."""

from __future__ import annotations

import multiprocessing as mp
import time

_CTX = mp.get_context("spawn")


def _transfer_params(kind: str | None, transfer_id: str, addr: str | None):
    from pdcluster.core.kv_transfer import RemoteDecode, RemotePrefill

    if kind == "decode":
        return RemoteDecode(transfer_id)
    if kind == "prefill":
        return RemotePrefill(transfer_id, addr)
    return None


def _block_bytes(engine, prompt: list[int]) -> list[bytes | None]:
    from pdcluster.core.hashing import hash_block_tokens

    hashes = hash_block_tokens(prompt, engine.config.block_size)
    blocks = [engine.block_pool.get_cached_block(h) for h in hashes]
    return [engine.kv_cache.block_bytes(b.block_id) if b else None for b in blocks]


def _head_copies(engine, prompt: list[int]) -> list[dict | None]:
    from pdcluster.core.hashing import hash_block_tokens
    from tests.transfer.tp_helpers import head_copies

    hashes = hash_block_tokens(prompt, engine.config.block_size)
    blocks = [engine.block_pool.get_cached_block(h) for h in hashes]
    return [head_copies(engine, b.block_id) if b else None for b in blocks]


def _media(engine, prompt: list[int]) -> list[str]:
    """Where each of the prompt's leading cached blocks is ("device" or "host")."""
    from pdcluster.core.hashing import hash_block_tokens
    from pdcluster.engine.core.kv_tiers import HostHit

    hashes = hash_block_tokens(prompt, engine.config.block_size)
    hits = engine.tiers.longest_prefix(hashes, include_disk=False)
    return ["host" if isinstance(hit, HostHit) else "device" for hit in hits]


def _leaks(engine) -> str | None:
    """The child's own leak check: None when every block is free and consistent."""
    from tests.helpers import assert_pool_clean

    try:
        assert_pool_clean(engine.block_pool)
    except AssertionError as err:
        return str(err)
    return None


def _handle(engine, conn, finished: dict, cmd: str, args: list) -> bool:
    """Run one command; False once the node should exit."""
    from pdcluster.engine import SamplingParams
    from tests.transfer.disagg import idle

    if cmd == "add":
        rid, prompt, max_tokens, kind, tid, addr = args
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(rid, prompt, params, kv_transfer=_transfer_params(kind, tid, addr))
    elif cmd == "result":
        conn.send(finished.get(args[0]))
    elif cmd == "idle":
        conn.send(idle(engine))
    elif cmd == "block_bytes":
        conn.send(_block_bytes(engine, args[0]))
    elif cmd == "head_copies":
        conn.send(_head_copies(engine, args[0]))
    elif cmd == "media":
        conn.send(_media(engine, args[0]))
    elif cmd == "stats":
        conn.send(engine.connector.worker.counters())
    elif cmd == "leaks":
        conn.send(_leaks(engine))
    elif cmd == "stop":
        engine.close()
        conn.send("stopped")
        return False
    return True


def _serve(model_dir: str, conn, timeout_s: float, rank_agent: str | None,
           options: dict) -> None:
    from pdcluster.engine.api import EngineFailure
    from pdcluster.transfer.transport import MooncakeTransport
    from tests.cluster_secret import TEST_CURVE
    from tests.transfer.disagg import make_engine
    from tests.transfer.tp_helpers import AgentTransport

    transport = MooncakeTransport(curve=TEST_CURVE) if rank_agent is None else \
        AgentTransport(rank_agent, curve=TEST_CURVE)
    engine = make_engine(model_dir, transport, timeout_s=timeout_s, **options)
    conn.send(engine.connector.worker.transport.reply_address)
    finished: dict[str, list[int]] = {}
    while True:
        while conn.poll():
            cmd, *args = conn.recv()
            if not _handle(engine, conn, finished, cmd, args):
                return
        try:
            outputs = engine.step()
        except EngineFailure:
            time.sleep(1.0)  # as a node does: in-flight transfers report their failure first
            raise
        for out in outputs:
            if out.finished:
                finished[out.request_id] = out.token_ids
        time.sleep(0.001)


class NodeProcess:
    """`options`: the engine's (e.g. tensor_parallel_size); `rank_agent`: the factory its
    other tensor-parallel ranks run instead of the real agent (tests/transfer/tp_helpers.py)."""

    def __init__(self, model_dir: str, timeout_s: float = 5.0, rank_agent: str | None = None,
                 **options) -> None:
        self.conn, child = _CTX.Pipe()
        self.process = _CTX.Process(target=_serve, args=(model_dir, child, timeout_s,
                                                         rank_agent, options),
                                    # a daemon cannot start the ranks of a TP engine
                                    daemon=options.get("tensor_parallel_size", 1) == 1)
        self.process.start()
        if not self.conn.poll(120):
            raise TimeoutError("node process did not start")
        self.address = self.conn.recv()

    def call(self, *cmd, timeout: float = 30.0):
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"node process did not answer {cmd[0]}")
        return self.conn.recv()

    def send(self, *cmd) -> None:
        self.conn.send(cmd)

    def wait_for(self, request_id: str, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = self.call("result", request_id)
            if result is not None:
                return result
            time.sleep(0.02)
        raise TimeoutError(f"{request_id} did not finish in the node process")

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def stop(self) -> None:
        if self.process.is_alive():
            self.call("stop")
            self.process.join(10)
