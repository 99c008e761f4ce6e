"""Who listens where: the listening TCP sockets of a process tree, read from /proc (Linux).

    for sock in listening_sockets(proc.pid):        # the pid and all its descendants
        print(sock.address, sock.port, sock.pid, sock.name, sock.is_wildcard)

/proc/<pid>/net/tcp{,6} hold every socket of the pid's network namespace; a socket belongs to
the processes whose /proc/<pid>/fd links name its inode. A process that exits while it is read
is skipped. IPv4-mapped IPv6 addresses (a dual-stack socket bound to "::ffff:127.0.0.1") are
reported as the IPv4 address they accept.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
_TCP_LISTEN = "0A"
WILDCARDS = frozenset({"0.0.0.0", "::"})


@dataclass(frozen=True, slots=True)
class Listener:
    address: str  # "127.0.0.1", "0.0.0.0", "::", "::1"
    port: int
    pid: int
    name: str  # /proc/<pid>/comm
    cmdline: str

    @property
    def is_wildcard(self) -> bool:
        return self.address in WILDCARDS

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        cmdline = " ".join(self.cmdline.split())[:120]
        return f"{host}:{self.port} pid={self.pid} {self.name} ({cmdline})"


def process_tree(root_pid: int) -> list[int]:
    """`root_pid` and every live descendant, parents before children."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            ppid = _parent_pid(entry)
            if ppid is not None:
                children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [root_pid]
    while todo:
        pid = todo.pop(0)
        tree.append(pid)
        todo.extend(sorted(children.get(pid, [])))
    return tree


def listening_sockets(root_pid: int) -> list[Listener]:
    """The listening TCP sockets (IPv4 and IPv6) of `root_pid` and its descendants."""
    table = _listening_inodes(root_pid)
    found = []
    for pid in process_tree(root_pid):
        name, cmdline = _describe(pid)
        for inode in _socket_inodes(pid):
            if inode in table:
                address, port = table[inode]
                found.append(Listener(address, port, pid, name, cmdline))
    return sorted(found, key=lambda s: (s.pid, s.port))


def _parent_pid(proc_dir: Path) -> int | None:
    try:
        stat = (proc_dir / "stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses
    return int(stat.rsplit(")", 1)[1].split()[1])


def _listening_inodes(pid: int) -> dict[str, tuple[str, int]]:
    table = {}
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            lines = (PROC / str(pid) / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == _TCP_LISTEN:
                hex_address, hex_port = fields[1].split(":")
                table[fields[9]] = (_decode_address(hex_address, family), int(hex_port, 16))
    return table


def _decode_address(hex_address: str, family: int) -> str:
    raw = bytes.fromhex(hex_address)
    # the kernel prints each 32-bit word in host (little-endian) order
    packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(packed)
    if family == socket.AF_INET6 and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    fd_dir = PROC / str(pid) / "fd"
    try:
        entries = os.listdir(fd_dir)
    except OSError:
        return inodes
    for entry in entries:
        try:
            target = os.readlink(fd_dir / entry)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _describe(pid: int) -> tuple[str, str]:
    try:
        name = (PROC / str(pid) / "comm").read_text().strip()
        cmdline = (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "?", ""
    return name, cmdline.strip()
