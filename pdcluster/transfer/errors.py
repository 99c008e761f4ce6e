"""Typed exceptions of the transfer room's data plane.

`TransferError` is the one exception that callers of `transfer/` catch for a failed byte
move or an unreachable peer; `TransferTimeout` narrows it to "the peer did not finish in time".
Argument mistakes (mismatched lists, non-positive lengths) are `ValueError`, not these.
"""

from __future__ import annotations

from pdcluster.core.kv_transfer import MAX_ERROR_CHARS


class TransferError(RuntimeError):
    """A data-plane operation failed. `code` is the C return code when Mooncake gave one."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message if code is None else f"{message} (rc={code})")
        self.code = code


class TransferTimeout(TransferError):
    """A transfer did not complete within the transfer engine's timeout."""


def error_text(exc: Exception) -> str:
    """An exception as the `error` of an `XferDone` (capped on the wire: a long one is cut)."""
    return f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
