"""NVML's view of the process, for the ``untracked`` kind.

When CUDA was initialised before the probe, allocations made earlier are never
reported by CUPTI (records are not retroactive). NVML's per-process used memory
minus what CUPTI reports live is what the probe cannot see; the probe exports it
as the synthetic kind ``untracked``. NVML also counts the CUDA context itself,
which is part of the same blind spot.
"""

from __future__ import annotations

from typing import Any

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
