"""NVML's view of the process, for the ``untracked`` kind.

When CUDA was initialised before the probe, allocations made earlier are never
reported by CUPTI (records are not retroactive). NVML's per-process used memory
minus what CUPTI reports live is what the probe cannot see; the probe exports it
as the synthetic kind ``untracked``. NVML also counts the CUDA context itself,
which is part of the same blind spot.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from gpufootprint.probe.livetable import LiveTable
from gpufootprint.records import MEMORY_DTYPE

_state: dict[str, Any] = {}


def nvml_used_bytes(pid: int, devices: list[dict[str, Any]]) -> dict[int, int] | None:
    """{cuda device index: bytes NVML says ``pid`` uses}; None when NVML is unavailable."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        if not _state.get("init"):
            pynvml.nvmlInit()
            _state["init"] = True
        out: dict[int, int] = {}
        for info in devices:
            bus = info.get("pci_bus_id")
            try:
                handle = (pynvml.nvmlDeviceGetHandleByPciBusId(bus) if bus
                          else pynvml.nvmlDeviceGetHandleByIndex(info["index"]))
                procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except pynvml.NVMLError:
                continue
            for p in procs:
                if p.pid == pid and p.usedGpuMemory is not None:
                    out[int(info["index"])] = int(p.usedGpuMemory)
        return out
    except Exception:  # noqa: BLE001 - NVML missing or broken: no untracked figure
        return None


def untracked_records(table: LiveTable, used: Mapping[int, int], ts: int, pid: int) -> np.ndarray:
    """MEMORY records that set each device's untracked figure to NVML's ``used`` minus what the
    table holds resident (never below zero), stamped ``ts``."""
    return np.concatenate([table.untracked_records(dev, max(0, nbytes - table.resident_bytes_now(dev)), ts, pid)
                           for dev, nbytes in used.items()] or [np.zeros(0, dtype=MEMORY_DTYPE)])
