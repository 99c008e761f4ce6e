"""Where pdcluster keeps what it writes outside a request: converted models, the peer
benchmarks' virtual environments, benchmark artefacts. Never next to the code (`__file__`),
which is read-only or shared once installed.

The root is `$PDCLUSTER_CACHE_DIR`, else `$XDG_CACHE_HOME/pdcluster`, else
`~/.cache/pdcluster`. The Makefile points it at the checkout's `.cache/`, so `make run` and
`make test` keep everything in the checkout.

API: `CACHE_ENV`, `cache_dir()`, `BUILTIN_MODEL_NAME`, `builtin_model_dir()`,
`private_dir()`, `UnsafeDirectory`.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

CACHE_ENV = "PDCLUSTER_CACHE_DIR"
# The built-in model's folder name, which is also the name the API serves it under
# (scripts/setup.sh converts it there).
BUILTIN_MODEL_NAME = "smollm2-135m-instruct"


def cache_dir() -> Path:
    """The cache root (not created here: each user makes the folder it writes)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pdcluster"


def builtin_model_dir() -> Path:
    """Where setup converts the built-in model (SmolLM2-135M-Instruct)."""
    return cache_dir() / BUILTIN_MODEL_NAME


class UnsafeDirectory(ValueError):
    """A folder meant for this user's eyes only is a link, someone else's, or writable by
    others (anyone who can write it can swap or plant what the process reads there)."""


def private_dir(path: str | os.PathLike[str]) -> Path:
    """`path` as a folder only this user can enter: created with mode 0700 (not the umask's
    mode; its parents with the usual mode), an existing one narrowed to 0700. Refuses
    (UnsafeDirectory) a symlink, a folder owned by another user, or one writable by group or
    others: a folder like that could have been prepared by someone else."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    # Checked on the opened folder (O_NOFOLLOW), not the name, so a swap after the check
    # cannot pass a link off as the folder.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise UnsafeDirectory(f"{path} is not a plain folder (a symlink?): {exc}") from exc
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise UnsafeDirectory(f"{path} belongs to uid {info.st_uid}, not to this user")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UnsafeDirectory(f"{path} is writable by group or others "
                                  f"(mode {stat.S_IMODE(info.st_mode):o}); use a folder only "
                                  "this user can write")
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path
