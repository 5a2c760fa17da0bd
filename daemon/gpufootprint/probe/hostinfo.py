"""Who the probe is: pid, process start time, host, cgroup/container, devices."""

from __future__ import annotations

import ctypes
import os
import re
import socket
import sys
from typing import Any

_CONTAINER_ID = re.compile(r"([0-9a-f]{64})")


def process_start_time(pid: int | None = None) -> int | None:
    """Start time in clock ticks since boot (/proc/PID/stat field 22): tells pid reuse apart."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat", "rb") as fh:
            data = fh.read().decode(errors="replace")
        return int(data[data.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def cgroup() -> tuple[str | None, str | None]:
    try:
        with open("/proc/self/cgroup") as fh:
            text = fh.read()
    except OSError:
        return None, None
    line = text.strip().splitlines()[-1] if text.strip() else ""
    path = line.split(":", 2)[-1] if line else None
    m = _CONTAINER_ID.search(text)
    return path, (m.group(1) if m else None)


#: What ``cuDeviceGetCount`` answers before ``cuInit``.
CUDA_ERROR_NOT_INITIALIZED = 3

#: The driver library once this process has loaded it (kept: ``dlopen`` would walk the search path again at
#: every heartbeat, and take a reference each time).
_driver: list[Any] = []


def cuda_started() -> bool | None:
    """Whether CUDA's driver is initialised in this process, asked without loading or initialising it:
    True once ``cuInit`` succeeded, False while nobody called it (or no driver is loaded here), None when
    it ran and failed (no device visible, a broken driver): nothing will start later.

    ``cuInit`` reads ``CUDA_VISIBLE_DEVICES`` (and ``CUDA_DEVICE_ORDER``, MPS's settings, ...) once, when it
    runs. A probe started with the interpreter that called it before the workload would fix what the
    workload sees before its own code set them (``os.environ["CUDA_VISIBLE_DEVICES"] = rank`` at the top
    of a training script), so the probe asks only a driver the process has already loaded
    (``RTLD_NOLOAD``), and ``cuDeviceGetCount`` answers NOT_INITIALIZED until someone called ``cuInit``."""
    try:
        if not _driver:
            _driver.append(ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY))
        count = ctypes.c_int(0)
        rc = int(_driver[0].cuDeviceGetCount(ctypes.byref(count)))
    except (OSError, AttributeError):
        return False  # not loaded here (so not started), or not a CUDA driver
    if rc == 0:
        return True
    return False if rc == CUDA_ERROR_NOT_INITIALIZED else None


def started_cuda_devices() -> tuple[list[dict[str, Any]], bool]:
    """``cuda_devices()`` if CUDA has started in this process; else nothing, and CUDA not started
    (the sender looks again once it has: ``cuda_started``)."""
    if cuda_started() is not True:
        return [], False
    return cuda_devices()


def cuda_devices() -> tuple[list[dict[str, Any]], bool]:
    """The CUDA devices and whether any primary context was already active (CUDA started before us).
    Calls ``cuInit``: only once the workload has started CUDA (``started_cuda_devices``)."""
    devices: list[dict[str, Any]] = []
    active = False
    try:
        from cuda.bindings import driver

        if int(driver.cuInit(0)[0]) != 0:
            return devices, False
        err, n = driver.cuDeviceGetCount()
        for i in range(n if int(err) == 0 else 0):
            err, dev = driver.cuDeviceGet(i)
            if int(err):
                continue
            info: dict[str, Any] = {"index": i}
            err, name = driver.cuDeviceGetName(128, dev)
            if int(err) == 0:
                info["name"] = name.split(b"\0", 1)[0].decode(errors="replace")
            err, bus = driver.cuDeviceGetPCIBusId(64, dev)
            if int(err) == 0:
                info["pci_bus_id"] = bus.split(b"\0", 1)[0].decode() if isinstance(bus, bytes) else str(bus)
            err, total = driver.cuDeviceTotalMem(dev)
            if int(err) == 0:
                info["total_bytes"] = int(total)
            err, _flags, is_active = driver.cuDevicePrimaryCtxGetState(dev)
            if int(err) == 0 and is_active:
                active = True
            devices.append(info)
    except Exception:  # noqa: BLE001, S110 - no cuda-bindings or no driver: no devices
        pass
    return devices, active


def hello(pid: int, versions: dict[str, Any], devices: list[dict[str, Any]], cuda_before: bool) -> dict[str, Any]:
    from gpufootprint import __version__

    path, container = cgroup()
    return {
        "pid": pid,
        "start_time": process_start_time(pid),
        "host": socket.gethostname(),
        "cgroup": path,
        "container_id": container,
        "argv": [os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python", *sys.argv[1:6]],
        "probe_version": __version__,
        "versions": versions,
        "devices": devices,
        "cuda_initialised_before_probe": cuda_before,
    }
