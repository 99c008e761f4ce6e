"""TLS for a gRPC client of the metadata service (and of etcd, for the metadata service): the
files a router or a node is given, and the channel credentials built from them. In `core`
because the router may not import `metadata_service` and both sides (router, nodes, the
service's own client library) need it.

    tls = ClientTLS(ca_file="ca.crt")                                  # server verified (TLS)
    tls = ClientTLS(ca_file="ca.crt", cert_file="c.crt", key_file="c.key")  # and mTLS
    credentials, options = tls.channel_credentials(), tls.channel_options()

`ClientTLS.from_fields(...)` is the one place configs (RouterConfig, NodeConfig, ClusterConfig)
validate their flat `metadata_tls_*` fields: all None means plaintext.

API: `ClientTLS`, `MetadataTLSFields`, `TLSFileError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict


class MetadataTLSFields(TypedDict):
    """The `metadata_tls_*` options, as the router's, a node's and a cluster's configs take
    them (keywords; `ClientTLS.from_fields` makes the client's TLS of them)."""

    metadata_tls_ca: str | None
    metadata_tls_cert: str | None
    metadata_tls_key: str | None
    metadata_tls_server_name: str | None


class TLSFileError(ValueError):
    """A certificate, key or CA file that cannot be read."""


@dataclass(frozen=True, slots=True)
class ClientTLS:
    ca_file: str  # PEM: the CA(s) the server's certificate must chain to
    cert_file: str | None = None  # PEM client certificate, for a server that requires one
    key_file: str | None = None
    server_name: str | None = None  # the name checked in the server's certificate

    def __post_init__(self) -> None:
        if not self.ca_file:
            raise ValueError("TLS to the metadata service needs a CA file")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("a client certificate needs both its cert and key files, or "
                             "neither")
        if self.server_name is not None and not self.server_name:
            raise ValueError("the TLS server name override must not be empty")

    @classmethod
    def from_fields(cls, ca: str | None, cert: str | None = None, key: str | None = None,
                    server_name: str | None = None) -> ClientTLS | None:
        """A config's `metadata_tls_ca/cert/key/server_name`: None when all are None."""
        if ca is None:
            if cert is not None or key is not None or server_name is not None:
                raise ValueError("metadata_tls_cert, metadata_tls_key and "
                                 "metadata_tls_server_name need metadata_tls_ca (TLS on)")
            return None
        return cls(ca, cert, key, server_name)

    def channel_credentials(self) -> Any:
        """`grpc.ChannelCredentials`: files are read now, so a bad path fails at start."""
        import grpc

        ca, chain, key = self.read_pem()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                            certificate_chain=chain)

    def read_pem(self) -> tuple[bytes, bytes | None, bytes | None]:
        """(CA, client certificate chain, client key) as PEM bytes; the last two None
        without a client certificate. `TLSFileError` names an unreadable file."""
        chain = key = None
        if self.cert_file is not None and self.key_file is not None:
            chain, key = _read(self.cert_file), _read(self.key_file)
        return _read(self.ca_file), chain, key

    def channel_options(self) -> list[tuple[str, object]]:
        if self.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TLSFileError(f"cannot read TLS file {path}: {exc.strerror or exc}") from exc
