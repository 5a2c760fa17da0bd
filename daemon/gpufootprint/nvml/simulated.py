"""A simulated H200 behind the ``NvmlClient`` protocol, for ``gpufootprint demo``.

The demo runs where there is no GPU, yet a newcomer should see every panel a GPU
node fills: the NVML device line, utilisation, power, a priced GPU for the cost
engine. This client answers NVML's calls for one "NVIDIA H200 (simulated)":
memory used is what the demo's processes hold (read from the daemon's own
snapshot) plus the CUDA contexts' share, utilisation follows a slow wave, power
follows utilisation and energy integrates it. Per-process utilisation comes as the
driver gives it: one sample per process and sample period (``SAMPLE_PERIOD_US``),
only the newest after the caller's last seen, each process busy a share of the
device's utilisation (``busy``: pid -> share, all of it by default). Every value is labelled simulated
in its model name, so no one mistakes it for a measurement.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from gpufootprint.nvml.client import DeviceIdentity, MemoryInfo, NvmlCallError, ProcessBusy

H200_TOTAL_BYTES = 150_754_820_096  # what NVML reports for an H200 (141 GiB class)
CONTEXT_BYTES = 512 << 20  # per process: a CUDA context's device memory, outside CUPTI's records
IDLE_WATTS, MAX_WATTS = 90.0, 700.0
SAMPLE_PERIOD_US = 166_667  # the driver's per-process sample period (a sixth of a second)


class SimulatedNvml:
    """One simulated H200. ``held``: the bytes each process holds on it now (pid -> bytes)."""

    model = "NVIDIA H200 (simulated)"

    def __init__(self, held: Callable[[], dict[int, int]], *, clock: Callable[[], float] = time.monotonic,
                 period_s: float = 120.0, wall_us: Callable[[], int] = lambda: time.time_ns() // 1000,
                 busy: Callable[[int], float] | None = None) -> None:
        self._held = held
        self._wall_us = wall_us
        self._busy = busy
        self._samples: dict[int, ProcessBusy] = {}  # pid -> the driver's newest sample of it
        self._clock = clock
        self._period = period_s
        self._t0 = clock()
        self._last: float | None = None
        self._energy = 0.0
        self._up = False

    def _check(self, index: int) -> None:
        if not self._up:
            raise NvmlCallError("uninitialized")
        if index != 0:
            raise NvmlCallError("not_found", f"no gpu {index}")

    def init(self) -> None:
        self._up = True

    def shutdown(self) -> None:
        self._up = False

    def driver_version(self) -> str:
        return "simulated"

    def device_count(self) -> int:
        return 1

    def identity(self, index: int) -> DeviceIdentity:
        self._check(index)
        return DeviceIdentity(index, "GPU-00000000-0000-0000-0000-simulated000", self.model)

    def _used(self) -> int:
        held = self._held()
        return min(H200_TOTAL_BYTES, sum(held.values()) + CONTEXT_BYTES * len(held))

    def memory(self, index: int) -> MemoryInfo:
        self._check(index)
        used = self._used()
        reserved = 570 << 20  # driver and firmware
        return MemoryInfo(H200_TOTAL_BYTES, used, H200_TOTAL_BYTES - used - reserved, reserved)

    def memory_v1(self, index: int) -> MemoryInfo:
        self._check(index)
        used = self._used()
        return MemoryInfo(H200_TOTAL_BYTES, used, H200_TOTAL_BYTES - used, None)

    def processes(self, index: int) -> dict[int, int | None]:
        self._check(index)
        return {pid: b + CONTEXT_BYTES for pid, b in self._held().items()}

    def utilization(self, index: int) -> float:
        self._check(index)
        if not self._held():
            return 0.0
        phase = 2 * math.pi * (self._clock() - self._t0) / self._period
        return round(0.45 + 0.4 * math.sin(phase), 2)  # 5% to 85%: busy, then idle enough to advise

    def process_utilization(self, index: int, since_us: int) -> list[ProcessBusy]:
        self._check(index)
        held = self._held()
        period_end = self._wall_us() // SAMPLE_PERIOD_US * SAMPLE_PERIOD_US
        device = self.utilization(index)
        for pid in held:
            last = self._samples.get(pid)
            if last is None or last.ts_us < period_end:
                share = self._busy(pid) if self._busy is not None else 1.0
                self._samples[pid] = ProcessBusy(pid, period_end, round(min(1.0, device * share), 2))
        for pid in [p for p in self._samples if p not in held]:
            del self._samples[pid]  # the driver keeps no sample of a process that is gone
        return sorted((b for b in self._samples.values() if b.ts_us > since_us), key=lambda b: (b.ts_us, b.pid))

    def pcie_throughput(self, index: int) -> tuple[float, float]:
        u = self.utilization(index)
        return 2e9 * u, 0.5e9 * u

    def power_watts(self, index: int) -> float:
        return IDLE_WATTS + (MAX_WATTS - IDLE_WATTS) * self.utilization(index)

    def energy_joules(self, index: int) -> float:
        watts = self.power_watts(index)
        now = self._clock()
        if self._last is not None:
            self._energy += watts * max(0.0, now - self._last)
        self._last = now
        return self._energy

    def xid_events(self) -> list[tuple[int, int]]:
        if not self._up:
            raise NvmlCallError("uninitialized")
        return []
