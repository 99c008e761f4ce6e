"""Metadata service room: the gRPC server holding the node registry (with leases), the global
block index ``block_hash -> nodes``, prefix queries and the node watch stream, over etcd or
in-memory (the embedded default) storage. Never imports torch, ray or ``engine``: it runs in
small CPU-only pods. See docs/metadata_service.md.

Modules: ``config`` (MetadataConfig), ``index`` (BlockIndex), ``service`` (the logic),
``store`` / ``etcd_store`` (backends), ``server`` (gRPC), ``client`` (sync + asyncio clients),
``publisher`` (the node side of the event protocol), ``errors``.
"""

from metadata_service.config import MetadataConfig
from metadata_service.errors import (
    InvalidBatch,
    MetadataAuthError,
    MetadataError,
    MetadataRequestError,
    MetadataUnavailable,
)
from metadata_service.index import BlockIndex

__all__ = [
    "BlockIndex",
    "InvalidBatch",
    "MetadataAuthError",
    "MetadataConfig",
    "MetadataError",
    "MetadataRequestError",
    "MetadataUnavailable",
]
