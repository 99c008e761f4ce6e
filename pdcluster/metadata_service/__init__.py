"""Metadata service room: the gRPC server holding the node registry (with leases), the global
block index ``block_hash -> nodes``, prefix queries and the node watch stream, over etcd or
in-memory (the embedded default) storage. Never imports torch, ray or ``engine``: it runs in
small CPU-only pods. See docs/metadata_service.md.

Modules: ``config`` (MetadataConfig), ``watch`` (the index that streams its changes; the
index itself is ``core.block_index``), ``service`` (the logic), ``store`` / ``etcd_store``
(backends), ``server`` (gRPC), ``client`` (sync + asyncio clients),
``publisher`` (the node side of the event protocol), ``errors``. Other rooms may import the
client library (``client``, ``publisher``, ``errors``) and nothing else; this package's
``__init__`` stays light so that importing the client never loads the index, the server or
the stores.
"""

from pdcluster.metadata_service.config import MetadataConfig
from pdcluster.metadata_service.errors import (
    InvalidBatch,
    MetadataAuthError,
    MetadataError,
    MetadataRequestError,
    MetadataUnavailable,
)

__all__ = [
    "InvalidBatch",
    "MetadataAuthError",
    "MetadataConfig",
    "MetadataError",
    "MetadataRequestError",
    "MetadataUnavailable",
]
