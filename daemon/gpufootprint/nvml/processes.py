"""One process's GPU memory as NVML reports it, for the probe's ``untracked`` kind (probe/untracked.py).

The probe runs inside a workload that may have no NVML at all: pynvml is imported at the first call,
and any failure is no figure (None), never an exception into the workload.
"""

from __future__ import annotations

from typing import Any

_state: dict[str, Any] = {}


def used_bytes_by_device(pid: int, devices: list[dict[str, Any]]) -> dict[int, int] | None:
    """{cuda device index: bytes NVML says ``pid`` uses} over ``devices`` (each with its ``index`` and, where
    known, its ``pci_bus_id``); None when NVML cannot be read. A device NVML cannot answer for is left out."""
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
