"""Is RDMA really usable on this machine? Mooncake falls back to TCP silently when asked for
RDMA without a device, so this module answers honestly: an InfiniBand/RoCE port in state
ACTIVE (sysfs) and a device that libibverbs can open."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

IB_SYSFS = Path("/sys/class/infiniband")


@functools.cache
def rdma_available() -> bool:
    """True only if an InfiniBand/RoCE device has an ACTIVE port and libibverbs can open it.
    Mooncake itself falls back to TCP silently, so this is the honest answer."""
    return has_active_ib_port(IB_SYSFS) and _ibverbs_opens_a_device()


def has_active_ib_port(sysfs_root: Path) -> bool:
    """Whether any <device>/ports/<n>/state under `sysfs_root` reads ACTIVE."""
    try:
        states = [p.read_text() for p in sysfs_root.glob("*/ports/*/state")]
    except OSError:
        return False
    return any("ACTIVE" in state for state in states)


def _ibverbs_opens_a_device() -> bool:
    try:
        lib = ctypes.CDLL("libibverbs.so.1")
    except OSError:
        return False
    lib.ibv_get_device_list.restype = ctypes.POINTER(ctypes.c_void_p)
    lib.ibv_get_device_list.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.ibv_open_device.restype = ctypes.c_void_p
    lib.ibv_open_device.argtypes = [ctypes.c_void_p]
    lib.ibv_close_device.argtypes = [ctypes.c_void_p]
    lib.ibv_free_device_list.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    num = ctypes.c_int(0)
    devices = lib.ibv_get_device_list(ctypes.byref(num))
    if not devices:
        return False
    try:
        for i in range(num.value):
            context = lib.ibv_open_device(devices[i])
            if context:
                lib.ibv_close_device(context)
                return True
        return False
    finally:
        lib.ibv_free_device_list(devices)
