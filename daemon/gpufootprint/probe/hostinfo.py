"""Who the probe is: pid, process start time, host, cgroup/container, devices."""

from __future__ import annotations

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


def cuda_devices() -> tuple[list[dict[str, Any]], bool]:
    """The CUDA devices and whether any primary context was already active (CUDA started before us)."""
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
