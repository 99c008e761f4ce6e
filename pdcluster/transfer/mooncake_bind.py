"""Keep Mooncake's listeners on the configured host: Mooncake has no setting for it.

Mooncake 0.3.13 (and its main branch, read Nov 2026) opens two listeners per engine and binds
both to the wildcard address whatever it is told: the handshake/RPC port
(`findAvailableTcpPort`: INADDR_ANY) and the TCP transport's data port (`TcpContext`: a
dual-stack `[::]`). `MC_TCP_BIND_ADDRESS` only chooses the address it publishes, and
`local_hostname` only names the segment. Anyone who reaches the data port can read or write
every registered region, so this module redirects those binds: it points the `bind` import
slots of Mooncake's own shared objects (engine.so, libasio.so) at a function that swaps a
wildcard address for the configured host and then calls libc's `bind`. Binds to a specific
address pass through unchanged; nothing outside Mooncake's libraries is touched.

API:
- `pin_binds(library_dir, host) -> list[str]`: patch every loaded ELF object under
  `library_dir` that imports `bind`; idempotent (a later call only changes the host).
- `wildcard_listeners() -> set[tuple[str, int]]`: this process's TCP listeners on 0.0.0.0/::,
  from /proc (empty where /proc is missing). `MooncakeTransferEngine` checks it after
  initialising, so a Mooncake build this cannot patch fails loudly instead of listening
  everywhere.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import socket
import struct
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

_BIND = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32,
                         use_errno=True)
_LIBC = ctypes.CDLL(None, use_errno=True)
_BIND_ADDRESS = ctypes.cast(_LIBC.bind, ctypes.c_void_p).value
assert _BIND_ADDRESS is not None, "libc exports bind"
_REAL_BIND = _BIND(_BIND_ADDRESS)
# address family -> (offset, width) of the address in its sockaddr
_ADDRESS_FIELDS: dict[int, tuple[int, int]] = {socket.AF_INET: (4, 4), socket.AF_INET6: (8, 16)}
# ELF machine -> relocation types of a GOT slot (GLOB_DAT, JUMP_SLOT)
_GOT_RELOCATIONS = {62: (6, 7), 183: (1025, 1026)}  # x86-64, AArch64
_PROT_READ, _PROT_WRITE = 1, 2
_TCP_LISTEN = "0A"

_lock = threading.Lock()
_target: dict[int, bytes] = {}  # address family -> packed address that replaces a wildcard
_patched: set[str] = set()


def pin_binds(library_dir: str | os.PathLike[str], host: str) -> list[str]:
    """Make Mooncake's wildcard binds bind `host` (an IP literal or a resolvable name)."""
    targets = _targets_for(host)
    root = os.path.realpath(library_dir)
    done = []
    with _lock:
        _target.clear()
        _target.update(targets)
        for path in _loaded_objects(root):
            if path not in _patched:
                slots = _import_slots(path, b"bind")
                if slots:
                    _write_slots(path, slots)
                    _patched.add(path)
            if path in _patched:
                done.append(path)
    return done


def _targets_for(host: str) -> dict[int, bytes]:
    info = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    # a name with both kinds of address: IPv4, the kind Mooncake's sockets use unless
    # MC_USE_IPV6 is set (the engine sets it for an IPv6 literal)
    family, *_, sockaddr = min(info, key=lambda entry: entry[0] != socket.AF_INET)
    address = str(sockaddr[0])  # an IP literal for both families asked for
    packed = socket.inet_pton(family, address)
    if family == socket.AF_INET:
        # Mooncake's data listener is an IPv6 dual-stack socket: the v4-mapped form of the
        # host still accepts IPv4 peers, on that address only.
        return {socket.AF_INET: packed,
                socket.AF_INET6: socket.inet_pton(socket.AF_INET6, f"::ffff:{address}")}
    return {socket.AF_INET6: packed}  # an IPv4 wildcard bind stays: wildcard_listeners sees it


def _pinned_bind(fd: int, addr: int, addrlen: int) -> int:
    try:
        family = ctypes.c_uint16.from_address(addr).value
        offset, width = _ADDRESS_FIELDS.get(family, (0, 0))
        replacement = _target.get(family)
        if width and replacement and ctypes.string_at(addr + offset, width) == bytes(width):
            ctypes.memmove(addr + offset, replacement, width)
        return _REAL_BIND(fd, addr, addrlen)  # leaves bind's errno for the C caller
    except Exception:  # an exception must not let a C caller think the bind succeeded
        logger.exception("redirecting Mooncake's bind failed")
        ctypes.set_errno(errno.EADDRNOTAVAIL)
        return -1


_CALLBACK = _BIND(_pinned_bind)  # kept alive for the life of the process


def _loaded_objects(root: str) -> list[str]:
    paths = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith(root + os.sep) and parts[5] not in paths:
            paths.append(parts[5])
    return paths


def _import_slots(path: str, name: bytes) -> list[int]:
    """Offsets (from the load base) of the GOT slots through which `path` calls `name`."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:  # 64-bit little-endian only
        return []
    got_types = _GOT_RELOCATIONS.get(struct.unpack_from("<H", data, 0x12)[0], ())
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]
    slots = []
    for _, kind, _, _, offset, size, link, _, _, _ in sections:
        if kind != 4 or sections[link][1] != 11:  # SHT_RELA against SHT_DYNSYM
            continue
        symtab, strtab = sections[link][4], sections[sections[link][6]][4]
        for rel in range(offset, offset + size, 24):
            r_offset, r_info, _ = struct.unpack_from("<QQq", data, rel)
            if r_info & 0xFFFFFFFF not in got_types:
                continue
            st_name, = struct.unpack_from("<I", data, symtab + (r_info >> 32) * 24)
            start = strtab + st_name
            if data[start:data.index(b"\0", start)] == name:
                slots.append(r_offset)
    return slots


def _write_slots(path: str, slots: list[int]) -> None:
    maps = [line.split(maxsplit=5) for line in Path("/proc/self/maps").read_text().splitlines()]
    base = next((int(m[0].split("-")[0], 16) for m in maps
                 if len(m) == 6 and m[5] == path and int(m[2], 16) == 0), None)
    if base is None:
        raise OSError(f"{path} is not mapped at offset 0")
    page = os.sysconf("SC_PAGE_SIZE")
    callback = ctypes.cast(_CALLBACK, ctypes.c_void_p).value
    for slot in slots:
        address = base + slot
        start = address & ~(page - 1)
        writable = any(int(m[0].split("-")[0], 16) <= address < int(m[0].split("-")[1], 16)
                       and "w" in m[1] for m in maps)
        if not writable:  # a slot under RELRO: open it for the write, then close it again
            _mprotect(start, page, _PROT_READ | _PROT_WRITE, path)
        ctypes.c_void_p.from_address(address).value = callback
        if not writable:
            _mprotect(start, page, _PROT_READ, path)
    logger.debug("pinned %d bind slot(s) of %s", len(slots), path)


def _mprotect(start: int, length: int, prot: int, path: str) -> None:
    if _LIBC.mprotect(ctypes.c_void_p(start), ctypes.c_size_t(length), prot) != 0:
        raise OSError(ctypes.get_errno(), f"mprotect of a bind slot of {path} failed")


def wildcard_listeners() -> set[tuple[str, int]]:
    """(address, port) of this process's listening TCP sockets on a wildcard address."""
    found = set()
    inodes = _socket_inodes()
    for table, wildcard in (("tcp", "0.0.0.0"), ("tcp6", "::")):
        try:
            lines = Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            address, port = local.split(":")
            if state == _TCP_LISTEN and inode in inodes and not address.strip("0"):
                found.add((wildcard, int(port, 16)))
    return found


def _socket_inodes() -> set[str]:
    inodes: set[str] = set()
    fd_dir = Path("/proc/self/fd")
    try:
        entries = list(fd_dir.iterdir())
    except OSError:
        return inodes
    for entry in entries:
        try:
            target = os.readlink(entry)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes
