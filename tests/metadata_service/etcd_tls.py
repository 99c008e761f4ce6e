"""A real etcd serving TLS with client-certificate auth, set up by `pdcluster metadata
etcd-setup` with a user confined to the metadata prefix (etcd_access.py).

    etcd = SecureEtcd(tmp_path / "etcd", make_pki(tmp_path / "pki")).start()
    etcd.setup()        # role + user + auth enable, through the real CLI
    etcd.etcdctl(...)   # as root over TLS
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pdcluster.core.tls import ClientTLS
from tests.metadata_service.helpers import EtcdProcess
from tests.tls_certs import Pki

REPO_ROOT = Path(__file__).resolve().parents[2]
PREFIX = "/pdcluster/metadata"
USER, PASSWORD, ROOT_PASSWORD = "pdcluster", "pd-etcd-pw-0123", "root-pw-4567"


class SecureEtcd(EtcdProcess):
    scheme = "https"

    def __init__(self, data_dir: Path, pki: Pki) -> None:
        super().__init__(data_dir)
        self.pki = pki
        self.folder = data_dir.parent
        self.auth_enabled = False

    @property
    def client_tls(self) -> ClientTLS:
        return ClientTLS(self.pki.ca, self.pki.client_cert, self.pki.client_key)

    def server_args(self) -> list[str]:
        return ["--cert-file", self.pki.server_cert, "--key-file", self.pki.server_key,
                "--client-cert-auth", "--trusted-ca-file", self.pki.client_ca]

    def etcdctl_args(self) -> list[str]:
        args = ["--cacert", self.pki.ca, "--cert", self.pki.client_cert,
                "--key", self.pki.client_key]
        return [*args, "--user", f"root:{ROOT_PASSWORD}"] if self.auth_enabled else args

    def secret_file(self, name: str, value: str) -> str:
        path = self.folder / name
        path.write_text(value + "\n")
        return str(path)

    def cli_args(self) -> list[str]:
        return ["--etcd", self.endpoint, "--etcd-tls-ca", self.pki.ca,
                "--etcd-tls-cert", self.pki.client_cert, "--etcd-tls-key", self.pki.client_key]

    def setup(self) -> subprocess.CompletedProcess[str]:
        """`pdcluster metadata etcd-setup` as root, through the real CLI."""
        proc = run_cli("metadata", "etcd-setup", *self.cli_args(), "--etcd-prefix", PREFIX,
                       "--etcd-user", USER,
                       "--etcd-password-file", self.secret_file("pw", PASSWORD),
                       "--root-password-file", self.secret_file("root-pw", ROOT_PASSWORD))
        assert proc.returncode == 0, proc.stderr[-2000:]
        self.auth_enabled = True
        return proc


def run_cli(*args: str, env_extra: dict[str, str] | None = None,
            timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDCLUSTER_CLUSTER_SECRET")}
    return subprocess.run([sys.executable, "-m", "pdcluster.cluster.cli", *args], cwd=REPO_ROOT,
                          env={**env, **(env_extra or {})}, capture_output=True, text=True,
                          timeout=timeout_s)
