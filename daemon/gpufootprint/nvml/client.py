"""The boundary to NVML: a small protocol the poller talks to, and its error.

The real implementation (``pynvml_client``) imports pynvml lazily; tests pass a
stateful fake with named scenarios. Every method may raise ``NvmlCallError``
with a reason the poller turns into a state and a metric:

* ``not_supported``: the device or driver lacks the field (it is not asked again),
* ``gpu_lost``: the GPU fell off the bus (the device is marked down, retried later),
* ``no_permission``, ``uninitialized``, ``not_found``, ``unknown``: counted, field left empty.

PIDs are host PIDs: NVML reports the processes of every container on the node
by their pid in the host's pid namespace. Matching them with probes (which
report ``SO_PEERCRED`` pids of the daemon's namespace) only works when the daemon
runs in the host pid namespace (Kubernetes: ``hostPID: true``; Docker:
``--pid=host``). Otherwise NVML's processes appear with ``source="nvml"`` beside
the probe's series.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

REASONS = ("not_supported", "gpu_lost", "no_permission", "uninitialized", "not_found", "unknown")


class NvmlCallError(Exception):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason if reason in REASONS else "unknown"


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    total: int
    used: int
    free: int
    reserved: int | None  # only the v2 call (driver >= 510 or so) reports it


@dataclass(frozen=True, slots=True)
class ProcessBusy:
    """One of NVML's per-process utilisation samples: the share of the driver's last sample period
    (ending at ``ts_us``, CPU wall clock in microseconds) in which one or more kernels of ``pid``
    ran on the GPU."""

    pid: int
    ts_us: int
    sm_ratio: float  # 0..1


@dataclass(frozen=True, slots=True)
class DeviceIdentity:
    index: int
    uuid: str
    model: str


class NvmlClient(Protocol):
    def init(self) -> None: ...

    def shutdown(self) -> None: ...

    def driver_version(self) -> str: ...

    def device_count(self) -> int: ...

    def identity(self, index: int) -> DeviceIdentity: ...

    def memory(self, index: int) -> MemoryInfo:
        """Memory with ``reserved`` (v2); a client without v2 raises not_supported."""
        ...

    def memory_v1(self, index: int) -> MemoryInfo: ...

    def processes(self, index: int) -> dict[int, int | None]:
        """Compute processes on the device: host pid -> used bytes (None when the driver hides it)."""
        ...

    def utilization(self, index: int) -> float:
        """GPU busy ratio 0..1 over the driver's last sample period."""
        ...

    def process_utilization(self, index: int, since_us: int) -> list[ProcessBusy]:
        """NVML's per-process utilisation samples stamped after ``since_us`` (an empty list when
        there are none: the driver returns one only for a process that ran kernels in its period)."""
        ...

    def pcie_throughput(self, index: int) -> tuple[float, float]:
        """(tx, rx) bytes per second over the driver's last 20 ms sample."""
        ...

    def power_watts(self, index: int) -> float: ...

    def energy_joules(self, index: int) -> float:
        """Energy since the driver was loaded."""
        ...

    def xid_events(self) -> list[tuple[int, int]]:
        """(device index, Xid) of critical-error events since the last call; never blocks."""
        ...
