"""A fake Kubernetes API server that answers TokenReviews, for the metadata service's pod
identity: a real HTTPS server on 127.0.0.1 (certificate from tests/tls_certs.py) that the
product's own `TokenReviewer` talks to, answering from a table of service-account tokens the
test mints, the way kube-apiserver answers them:

    api = FakeKubernetesAPI(pki, tmp_path).start()
    token = api.mint("system:serviceaccount:ns:ray", audiences=("pdcluster",),
                     pod=("ray-worker-0", "uid-0"), ttl_s=600)
    api.url, api.reviewer_token_file, api.reviews   # what the metadata service is given / did
    api.delete_pod("uid-0")                         # its pod's tokens stop authenticating

Only `POST /apis/authentication.k8s.io/v1/tokenreviews`, and only with the bearer token in
`reviewer_token_file` (the metadata service's own; any other: 401, like an unauthenticated
caller; `forbid_reviewer()`: 403, like one without system:auth-delegator). An unknown token,
one whose audiences miss every requested audience, an expired one, or one of a deleted pod:
`authenticated: false` with an error as kube-apiserver words it; otherwise the user (name,
uid, groups) with, for a pod-bound token, the pod's name and uid in `extra`, and the requested
audiences it is valid for.
"""

from __future__ import annotations

import base64
import json
import secrets
import ssl
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.tls_certs import Pki

REVIEW_PATH = "/apis/authentication.k8s.io/v1/tokenreviews"


@dataclass(frozen=True)
class ServiceAccountToken:
    username: str
    audiences: tuple[str, ...]
    expires_at: float
    pod_name: str = ""
    pod_uid: str = ""


def _b64(data: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


class FakeKubernetesAPI:
    def __init__(self, pki: Pki, folder: Path) -> None:
        self.pki = pki
        self.tokens: dict[str, ServiceAccountToken] = {}
        self.deleted_pods: set[str] = set()
        self.reviews: list[dict] = []  # every TokenReview request's spec, in order
        self.refused_callers = 0
        self._forbidden = False
        self._lock = threading.Lock()
        self.reviewer_token_file = str(folder / "reviewer-token")
        Path(self.reviewer_token_file).write_text(secrets.token_urlsafe(32) + "\n")
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "start() first"
        return f"https://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeKubernetesAPI:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.pki.server_cert, self.pki.server_key)
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        threading.Thread(target=self._server.serve_forever, daemon=True,
                         name="fake-k8s-api").start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def mint(self, username: str, audiences: tuple[str, ...] = ("pdcluster",),
             pod: tuple[str, str] | None = None, ttl_s: float = 600) -> str:
        """A JWT-shaped token (its claims as a projected token carries them; the signature is
        random: only this server can vouch for it) registered in the table."""
        exp = time.time() + ttl_s
        claims = {"aud": list(audiences), "exp": int(exp), "sub": username,
                  "iss": "https://kubernetes.default.svc.cluster.local"}
        if pod is not None:
            claims["kubernetes.io"] = {"pod": {"name": pod[0], "uid": pod[1]}}
        token = ".".join((_b64({"alg": "RS256", "kid": "fake"}), _b64(claims),
                          secrets.token_urlsafe(32)))
        with self._lock:
            self.tokens[token] = ServiceAccountToken(
                username, audiences, exp, *(pod if pod is not None else ("", "")))
        return token

    def delete_pod(self, pod_uid: str) -> None:
        with self._lock:
            self.deleted_pods.add(pod_uid)

    def forbid_reviewer(self) -> None:
        self._forbidden = True

    def status_of(self, token: str, requested: list[str]) -> dict:
        with self._lock:
            entry = self.tokens.get(token)
            deleted = entry is not None and entry.pod_uid in self.deleted_pods
        if entry is None:
            return {"user": {}, "error": "[invalid bearer token, square/go-jose: error in "
                    "cryptographic primitive]"}
        valid_for = [a for a in requested if a in entry.audiences] if requested else \
            list(entry.audiences)
        if not valid_for:
            return {"user": {}, "error": f"token audiences {list(entry.audiences)} is invalid "
                    f"for the target audiences {requested}"}
        if time.time() >= entry.expires_at:
            return {"user": {}, "error": "[invalid bearer token, service account token has "
                    "expired]"}
        if deleted:
            return {"user": {}, "error": f"pod {entry.pod_name!r} (uid {entry.pod_uid}) not "
                    "found"}
        user: dict = {"username": entry.username, "uid": secrets.token_hex(8),
                      "groups": ["system:serviceaccounts", "system:authenticated"]}
        if entry.pod_uid:
            user["extra"] = {"authentication.kubernetes.io/pod-name": [entry.pod_name],
                             "authentication.kubernetes.io/pod-uid": [entry.pod_uid]}
        return {"authenticated": True, "user": user, "audiences": valid_for}

    def answer(self, path: str, authorization: str, body: bytes) -> tuple[int, dict]:
        reviewer = Path(self.reviewer_token_file).read_text().strip()
        if authorization != f"Bearer {reviewer}":
            self.refused_callers += 1
            return 401, {"kind": "Status", "status": "Failure", "reason": "Unauthorized",
                         "code": 401}
        if self._forbidden:
            return 403, {"kind": "Status", "status": "Failure", "reason": "Forbidden",
                         "code": 403}
        if path != REVIEW_PATH:
            return 404, {"kind": "Status", "code": 404}
        request = json.loads(body)
        assert request["apiVersion"] == "authentication.k8s.io/v1", request
        assert request["kind"] == "TokenReview", request
        spec = request["spec"]
        self.reviews.append(spec)
        return 201, {**request, "status": self.status_of(spec.get("token", ""),
                                                         spec.get("audiences") or [])}


def _handler(api: FakeKubernetesAPI) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            code, reply = api.answer(self.path, self.headers.get("Authorization", ""), body)
            data = json.dumps(reply).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

    return Handler
