"""`NodeServer`: one engine (`engine.api.NodeEngine`: the own engine or vLLM) served over the
node protocol (`core.node_wire`) on a ZMQ ROUTER socket — the request endpoint of a prefill or
decode node.

One thread owns both the engine and the socket (neither is thread-safe): it drains incoming
messages, runs an engine step when there is work, and sends each request's new tokens back
to the client that submitted it as `TokenDelta`s. The role of a node is not a mode of the
server: a request's `TransferSpec` says whether its KV comes from a prefill node
("remote_prefill") or goes to a decode node ("remote_decode"); without one the node serves
the request alone. A `PrefixSource` hint (global prefix reuse) becomes the engine's
`PrefixPull`: the node fetches the prompt's cached prefix from the named holder when that
saves enough blocks (docs/transfer.md). Refusals are `RequestError`s with a code, never a
dropped request.
`stop(drain=True)` stops admitting (new requests get "draining"), lets running requests and
pinned transfers finish, then exits.

Authentication: `curve` is the node's own CURVE key pair and `directory` the key directory
(core.identity) that says who each client key is; the socket is a CURVE server that admits
only keys the directory names (core.curve). Per message: generate requests and load queries
are served to routers only (a node's own key, or any other, gets "forbidden"), and an abort
only from the principal that submitted the request. Without a directory, `curve` is the
shared pair of the test mode (its holders may do everything); `curve=None` is plaintext, for
unit tests only.

A request whose admission needs slow work first (compiling its structured-output grammar:
`NodeEngine.prepare`) waits for it off this thread, parked in `node.admissions`; every other
request is served meanwhile, and it is refused if the work does not finish within
`prepare_timeout_s`.

An engine that is lost for good (`engine.api.EngineFailure`: a tensor-parallel rank died or
stalls) fails every request with "internal", refuses new ones, stops the loop and calls
`on_fatal(error)` on the server thread; a node actor exits there so that Ray restarts it.

`on_step` (optional) runs after every step on the server thread; nodes use it to hand the
engine's KV events (`NodeEngine.take_kv_events`) to their metadata publisher. `call(fn)` runs
`fn(engine)` on the server thread from any other thread (the engine is not thread-safe), then
`on_step`, and returns its result (e.g. `NodeEngine.reset_prefix_cache`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import zmq

from pdcluster.core.connections import PeerConnections
from pdcluster.core.credentials import CurveKeys
from pdcluster.core.curve import secure_server
from pdcluster.core.identity import MEMBER, Directory, is_router
from pdcluster.core.kv_transfer import (
    SOURCE_LOST,
    KVTransferParams,
    PrefixPull,
    RemoteDecode,
    RemotePrefill,
)
from pdcluster.core.node_wire import (
    MAX_FRAME_BYTES,
    AbortRequest,
    GenerateRequest,
    LoadQuery,
    LoadReport,
    NodeMessage,
    PrefillLost,
    PrefixSource,
    RequestError,
    TokenDelta,
    TransferSpec,
    decode,
    encode,
)
from pdcluster.core.throttle import Throttle
from pdcluster.core.wire import WireError
from pdcluster.engine.api import EngineFailure, NodeEngine
from pdcluster.engine.core.outputs import RequestOutput
from pdcluster.engine.core.pins import OverloadedError
from pdcluster.node.admissions import PREPARE_TIMEOUT_S, Admissions
from pdcluster.node.request_spans import RequestSpans

logger = logging.getLogger(__name__)
_IDLE_POLL_MS = 2
_IDLE_REFRESH_S = 0.5
# A frame larger than this is dropped by ZMQ before it is read (the peer is disconnected).
MAX_REQUEST_BYTES = MAX_FRAME_BYTES


@dataclass(slots=True)
class ServerStats:
    num_requests: int = 0
    num_refused: int = 0
    num_malformed: int = 0
    num_aborted: int = 0
    num_forbidden: int = 0  # messages refused for their sender's principal


def _bind(sock: zmq.Socket[bytes], host: str, port: int, span: int) -> int:
    """Bind the first free port of [port, port + span) (a fixed range a NetworkPolicy can
    admit the router to: several nodes of one pod take one each); port 0: any free port."""
    if not port:
        return sock.bind_to_random_port(f"tcp://{host}")
    for candidate in range(port, port + span):
        try:
            sock.bind(f"tcp://{host}:{candidate}")
            return candidate
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or candidate == port + span - 1:
                raise
    raise AssertionError("a span of at least one port was tried")


class NodeServer:
    def __init__(self, engine: NodeEngine, node_id: str, role: str, host: str = "127.0.0.1",
                 port: int = 0, on_step: Callable[[NodeEngine], None] | None = None, *,
                 curve: CurveKeys | None, directory: Directory | None = None,
                 port_span: int = 1,
                 on_fatal: Callable[[Exception], None] | None = None,
                 prepare_timeout_s: float = PREPARE_TIMEOUT_S) -> None:
        self.engine = engine
        self.node_id, self.role = node_id, role
        self.on_step = on_step
        self.on_fatal = on_fatal
        self.failure: Exception | None = None  # what lost the engine, if it is lost
        self.stats = ServerStats()
        self.spans = RequestSpans(node_id, role)  # each request's spans (core.tracing)
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a vanished client is not an error
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self._connections: PeerConnections | None = None
        try:
            if curve is not None:
                secure_server(self._socket, curve, directory)
                self._connections = PeerConnections(self._socket, directory)
            port = _bind(self._socket, host, port, port_span)
        except BaseException:  # a port in use: nothing of this server stays open
            self._close_sockets()
            raise
        self.address = f"tcp://{host}:{port}"
        self._owners: dict[str, bytes] = {}  # request id -> client identity
        self._submitters: dict[str, str] = {}  # request id -> the principal that submitted it
        self._prompt_lens: dict[str, int] = {}
        # requests whose grammar compiles off this thread (node/admissions.py)
        self._admissions = Admissions(prepare_timeout_s)
        self._calls: queue.SimpleQueue[tuple[Callable[[NodeEngine], Any], Future]] = \
            queue.SimpleQueue()
        self._forbid_log = Throttle()
        self._draining = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"node-{node_id}")

    def start(self) -> NodeServer:
        self._thread.start()
        return self

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def begin_drain(self) -> None:
        """Stop admitting: new requests are refused with "draining"; running ones go on."""
        self._draining.set()

    def stop(self, drain: bool = True, timeout_s: float = 30.0) -> bool:
        """Stop the server; with `drain`, first finish running requests and transfers.
        Returns False if draining timed out (remaining requests were aborted)."""
        self.begin_drain()
        deadline = time.monotonic() + timeout_s
        drained = True
        while drain and self._thread.is_alive() and self._busy():
            if time.monotonic() > deadline:
                drained = False
                break
            time.sleep(0.01)
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout_s)
        self._close_sockets()
        return drained

    def _close_sockets(self) -> None:
        if self._connections is not None:
            self._connections.close()
        self._socket.close()

    def call(self, fn: Callable[[NodeEngine], Any], timeout_s: float = 30.0) -> Any:
        """`fn(engine)` on the server thread, between steps; its result (or exception)."""
        if not self._thread.is_alive():
            raise RuntimeError(f"node {self.node_id} is not serving")
        future: Future = Future()
        self._calls.put((fn, future))
        return future.result(timeout_s)

    def _run_calls(self) -> None:
        while True:
            try:
                fn, future = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                future.set_result(fn(self.engine))
            except Exception as exc:  # the caller gets it; the loop goes on
                future.set_exception(exc)
            if self.on_step is not None:
                self.on_step(self.engine)

    def _busy(self) -> bool:
        return (self.engine.has_unfinished_requests() or self.engine.has_pinned_blocks()
                or len(self._admissions) > 0)

    # ---- the loop ---------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        last_step = time.monotonic()
        while not self._stop.is_set():
            runnable = self.engine.has_runnable_requests()
            if poller.poll(0 if runnable else _IDLE_POLL_MS):
                self._drain_socket()
            self._run_calls()
            self._admit_prepared()
            if self._busy():
                self._step()
                last_step = time.monotonic()
            elif self.on_step is not None and time.monotonic() - last_step > _IDLE_REFRESH_S:
                # An idle engine still changes (an engine in other processes reports its
                # last figures and events after its last output): keep on_step's view fresh.
                self.on_step(self.engine)
                last_step = time.monotonic()
        for request_id in list(self._owners):  # stopped without draining
            self.engine.abort_request(request_id)
        for parked in self._admissions.take_all():
            self._refuse(parked.identity, parked.msg.request_id, "draining",
                         "the node stopped")

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except EngineFailure as exc:
            self._lose_engine(exc)
            return
        except Exception:
            logger.exception("engine step failed on node %s", self.node_id)
            self._fail_all("internal", "the engine failed; see the node's log")
            return
        for out in outputs:
            self._send_delta_or_fail(out)
        if self.on_step is not None:
            self.on_step(self.engine)

    def _drain_socket(self) -> None:
        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.stats.num_malformed += 1
                continue
            try:
                msg = decode(frames[1].bytes)
            except WireError as exc:
                self.stats.num_malformed += 1
                logger.warning("node %s rejected a malformed message: %s", self.node_id, exc)
                continue
            self._dispatch(frames[0].bytes, self._principal(frames[1]), msg)

    def _principal(self, frame: zmq.Frame) -> str | None:
        if self._connections is None:
            return MEMBER  # plaintext: unit tests of this room only
        return self._connections.principal(frame)

    def _dispatch(self, identity: bytes, principal: str | None, msg: NodeMessage) -> None:
        """Each message type for the principals it is for: generate requests and load
        queries from routers only; an abort from the principal that submitted the request."""
        if isinstance(msg, GenerateRequest | LoadQuery) and not _may_submit(principal):
            self._forbid(principal, type(msg).__name__)
            if isinstance(msg, GenerateRequest):
                self._send(identity, RequestError(msg.request_id, "forbidden",
                                                  "only a router may send requests to a node"))
        elif isinstance(msg, GenerateRequest):
            self._on_generate(identity, principal, msg)
        elif isinstance(msg, AbortRequest):
            self._on_abort(principal, msg)
        elif isinstance(msg, LoadQuery):
            self._send(identity, self.load_report())
        elif isinstance(msg, PrefillLost):
            self._on_prefill_lost(identity, msg)
        else:
            self.stats.num_malformed += 1  # a reply type sent to a node

    def _on_abort(self, principal: str | None, msg: AbortRequest) -> None:
        dropped = self._admissions.drop(msg.request_id, principal)
        if dropped is not None:
            if dropped:
                self.stats.num_aborted += 1
            else:
                self._forbid(principal, "AbortRequest of another's request")
            return
        submitter = self._submitters.get(msg.request_id)
        if submitter is not None and submitter != principal:
            self._forbid(principal, "AbortRequest of another's request")
            return
        if self.engine.abort_request(msg.request_id):
            self.stats.num_aborted += 1
        self._forget(msg.request_id)

    def _forbid(self, principal: str | None, what: str) -> None:
        self.stats.num_forbidden += 1
        if self._forbid_log.ready():
            logger.warning("node %s refused a %s from %s (%d refusals not logged)",
                           self.node_id, what, principal or "an unknown key",
                           self._forbid_log.take_suppressed())

    # ---- requests ---------------------------------------------------------------------

    def _on_generate(self, identity: bytes, principal: str | None,
                     msg: GenerateRequest) -> None:
        if self.draining:
            self._refuse(identity, msg.request_id, "draining", "the node is shutting down")
            return
        try:
            pending = self.engine.prepare(msg.sampling)
        except (OverloadedError, ValueError) as exc:
            self._refuse(identity, msg.request_id, *_refusal(exc))
            return
        if pending is not None:  # admitted (or refused) by _admit_prepared
            self._admissions.park(identity, principal, msg, pending)
            return
        self._admit(identity, principal, msg)

    def _admit_prepared(self) -> None:
        for parked, error in self._admissions.take_due():
            if error is None:
                self._admit(parked.identity, parked.principal, parked.msg)
            else:
                self._refuse(parked.identity, parked.msg.request_id, "invalid_request", error)

    def _admit(self, identity: bytes, principal: str | None, msg: GenerateRequest) -> None:
        try:
            self.engine.submit(msg.request_id, msg.prompt_token_ids, msg.sampling,
                               cache_salt=msg.cache_salt,
                               kv_transfer=_transfer_params(msg.transfer),
                               prefix_pull=self._prefix_pull(msg.prefix_source))
        except (OverloadedError, ValueError) as exc:
            self._refuse(identity, msg.request_id, *_refusal(exc))
            return
        except Exception:  # a bug must cost this request, not the node's thread
            logger.exception("node %s could not admit request %s", self.node_id,
                             msg.request_id)
            self._refuse(identity, msg.request_id, "internal", "the node failed to admit it")
            return
        self.stats.num_requests += 1
        self.spans.begin(msg)
        self._owners[msg.request_id] = identity
        self._submitters[msg.request_id] = principal or ""
        self._prompt_lens[msg.request_id] = len(msg.prompt_token_ids)

    def _on_prefill_lost(self, identity: bytes, msg: PrefillLost) -> None:
        """Stop waiting for the KV of a request whose prefill node died (only its submitter
        may say so); the engine recomputes it, or fails it, at its next step."""
        if self._owners.get(msg.request_id) == identity:
            self.engine.kv_source_lost(msg.transfer_id, f"{SOURCE_LOST}: {msg.reason}")

    def _prefix_pull(self, source: PrefixSource | None) -> PrefixPull | None:
        if source is None or not self.engine.accepts_prefix_pulls:
            return None  # a hint: a node that cannot pull just computes
        return PrefixPull(source.kv_address, source.num_blocks, source.ticket)

    def _refuse(self, identity: bytes, request_id: str, code: str, message: str) -> None:
        self.stats.num_refused += 1
        self._send(identity, RequestError(request_id, code, message))

    def _send_delta_or_fail(self, out: RequestOutput) -> None:
        try:
            self._send_delta(out)
        except Exception:  # e.g. an output the wire cannot carry: this request alone fails
            logger.exception("node %s could not send the output of %s", self.node_id,
                             out.request_id)
            identity = self._owners.get(out.request_id)
            self.engine.abort_request(out.request_id)
            self._forget(out.request_id)
            if identity is not None:
                self._send(identity, RequestError(out.request_id, "internal",
                                                  "the node failed to send its output"))

    def _send_delta(self, out: RequestOutput) -> None:
        identity = self._owners.get(out.request_id)
        if identity is None:
            return  # aborted by its client
        num_new = len(out.new_token_ids)
        new_logprobs = None
        if out.logprobs is not None:
            new_logprobs = out.logprobs[len(out.logprobs) - num_new:]
        top_ids, top_values = _new_top_logprobs(out.top_logprobs, num_new)
        self.spans.delta(out.request_id, num_new)
        self._send(identity, TokenDelta(
            out.request_id, out.new_token_ids, out.finished, out.finish_reason, new_logprobs,
            self._prompt_lens.get(out.request_id, 0), out.num_cached_tokens, out.error,
            top_ids, top_values))
        if out.finished:
            self._forget(out.request_id)

    def _lose_engine(self, exc: EngineFailure) -> None:
        """The engine is lost for good (a tensor-parallel rank died or stalls): fail every
        request (the router migrates or recomputes them), refuse new ones, stop serving,
        and hand the error to `on_fatal` (a node actor exits there, so Ray restarts it)."""
        logger.error("node %s lost its engine: %s", self.node_id, exc)
        self.failure = exc
        self.begin_drain()
        self._fail_all("internal", f"the node's engine is lost ({exc}); the node restarts")
        self._stop.set()
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def _fail_all(self, code: str, message: str) -> None:
        for request_id, identity in list(self._owners.items()):
            self.engine.abort_request(request_id)
            self._send(identity, RequestError(request_id, code, message))
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self.spans.end(request_id)
        self._owners.pop(request_id, None)
        self._submitters.pop(request_id, None)
        self._prompt_lens.pop(request_id, None)

    def _send(self, identity: bytes, msg: NodeMessage) -> None:
        try:
            self._socket.send_multipart([identity, encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the client is gone or backed up: it will time out
            logger.warning("node %s could not reply to a client: %s", self.node_id, exc)

    def load_report(self) -> LoadReport:
        load = self.engine.load()
        return LoadReport(self.node_id, self.role, load.num_waiting, load.num_running,
                          load.num_free_blocks, load.num_blocks, load.num_queued_tokens,
                          self.draining, self.engine.kv_costs())


def _may_submit(principal: str | None) -> bool:
    return principal == MEMBER or is_router(principal)


def _new_top_logprobs(top: list[list[tuple[int, float]]] | None, num_new: int
                      ) -> tuple[list[list[int]] | None, list[list[float]] | None]:
    """The top-k alternatives of the last `num_new` tokens, as (ids, logprobs) lists. The
    first token of a remotely prefilled request arrives without its alternatives, so the
    list may be one short: the tokens it lacks (the oldest) get []."""
    if top is None:
        return None, None
    tail = top[max(0, len(top) - num_new):]
    tail = [[]] * (num_new - len(tail)) + tail
    return ([[i for i, _ in pairs] for pairs in tail],
            [[float(v) for _, v in pairs] for pairs in tail])


def _refusal(exc: Exception) -> tuple[str, str]:
    """The error code and message a request the engine turned down is refused with."""
    return ("overloaded" if isinstance(exc, OverloadedError) else "invalid_request", str(exc))


def _transfer_params(spec: TransferSpec | None) -> KVTransferParams | None:
    """The engine's transfer parameters (`core.node_wire.decode` has checked the kind, and
    that a remote prefill names its source)."""
    if spec is None:
        return None
    if spec.kind == "remote_prefill":
        assert spec.source_addr, "the wire refuses a remote_prefill without source_addr"
        return RemotePrefill(spec.transfer_id, spec.source_addr)
    return RemoteDecode(spec.transfer_id)
