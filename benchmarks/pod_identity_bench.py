"""The price of pod identity: `python -m benchmarks.pod_identity_bench [--pings N]`.

A real metadata service with pod identity and the fake Kubernetes API of the tests
(tests/k8s_api.py: real HTTPS on 127.0.0.1). Times a node's token exchange (the service's
TokenReview over a new TLS connection, the checks, the issue), and a plain call (`Ping`)
authenticated with a bought pod token against the same call with a token derived from the
secret (the baseline), alternating per round. Prints one JSON object: medians and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from pdcluster.metadata_service.client import MetadataClient
from pdcluster.metadata_service.node_tokens import PodIdentityConfig
from pdcluster.metadata_service.server import ServerThread
from pdcluster.metadata_service.tokenreview import KubernetesAPI
from tests.cluster_secret import TEST_SECRET, node_token
from tests.k8s_api import FakeKubernetesAPI
from tests.metadata_service.helpers import make_config
from tests.tls_certs import make_pki

ACCOUNT = "system:serviceaccount:ns:ray"


def _p50_ping_us(address: str, token: str, pings: int) -> float:
    with MetadataClient(address, token=token) as client:
        client.ping()
        times = []
        for _ in range(pings):
            start = time.perf_counter()
            client.ping()
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pod_identity_bench")
    parser.add_argument("--exchanges", type=int, default=50)
    parser.add_argument("--pings", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="pod-identity-bench-"))
    api = FakeKubernetesAPI(make_pki(folder / "pki"), folder).start()
    identity = PodIdentityConfig(
        audience="aud", namespace="ns", service_account="ray",
        api=KubernetesAPI(url=api.url, token_file=api.reviewer_token_file, ca_file=api.pki.ca))
    config = make_config(cluster_secret=TEST_SECRET, pod_identity=identity,
                         node_allowlist={"prefill": frozenset({"p0"})})
    try:
        with ServerThread(config) as server, MetadataClient(server.address) as client:
            sa_token = api.mint(ACCOUNT, ("aud",), pod=("pod-0", "uid-0"))
            token = client.exchange_node_token(sa_token, "p0", "prefill").token
            exchanges = []
            for _ in range(args.exchanges):
                start = time.perf_counter()
                client.exchange_node_token(sa_token, "p0", "prefill")
                exchanges.append(time.perf_counter() - start)
            derived, bought = [], []
            for _ in range(args.rounds):
                derived.append(_p50_ping_us(server.address, node_token("p0"), args.pings))
                bought.append(_p50_ping_us(server.address, token, args.pings))
    finally:
        api.stop()
    print(json.dumps({
        "exchange_ms_p50": round(statistics.median(exchanges) * 1e3, 2),
        "ping_us_p50_derived_token": round(statistics.median(derived)),
        "ping_us_p50_pod_token": round(statistics.median(bought)),
        "pod_token_ratio": round(statistics.median(bought) / statistics.median(derived), 3)}))


if __name__ == "__main__":
    main()
