"""A stateful NVML fake with named scenarios (gpustat's per-scenario fixtures, as a class).

Scenarios:
* ``healthy``: two H200s, driver 580, every field, processes with used memory.
* ``field_unsupported``: PCIe, power, energy, per-process utilisation and Xid events are not supported.
* ``gpu_lost``: GPU 1 falls off the bus at poll ``lose_at`` (every call on it fails with gpu_lost)
  and comes back after ``recover()``.
* ``other_driver``: driver 470: no v2 memory call (no reserved), used memory per process hidden.
* ``no_driver``: nvmlInit fails (library not found).
"""

from __future__ import annotations

from gpufootprint.nvml.client import DeviceIdentity, MemoryInfo, NvmlCallError, ProcessBusy

GIB = 1 << 30
SCENARIOS = ("healthy", "field_unsupported", "gpu_lost", "other_driver", "no_driver")


class FakeNvml:
    def __init__(self, scenario: str = "healthy", *, gpus: int = 2, lose_at: int = 3) -> None:
        assert scenario in SCENARIOS, scenario
        self.scenario = scenario
        self.n = gpus
        self.lose_at = lose_at
        self.initialised = False
        self.calls = 0
        self.memory_calls = 0
        self.lost: set[int] = set()
        self.used = [10 * GIB + i for i in range(gpus)]
        self.procs: list[dict[int, int]] = [{} for _ in range(gpus)]
        self.energy = [1000.0 * (i + 1) for i in range(gpus)]
        self.pending_xid: list[tuple[int, int]] = []
        self.unsupported_calls = 0
        self.util = [0.42] * gpus
        # per GPU: the driver's per-process samples (pid, ts_us, ratio), as it keeps them
        self.busy: list[list[ProcessBusy]] = [[] for _ in range(gpus)]

    # --- test controls ------------------------------------------------------------
    def add_process(self, gpu: int, pid: int, used: int) -> None:
        self.procs[gpu][pid] = used

    def set_utilization(self, gpu: int, ratio: float) -> None:
        self.util[gpu] = ratio

    def add_busy(self, gpu: int, pid: int, ts_us: int, ratio: float) -> None:
        """The driver took a per-process sample: ``pid`` ran kernels ``ratio`` of the period ending ``ts_us``."""
        self.busy[gpu].append(ProcessBusy(pid, ts_us, ratio))

    def set_used(self, gpu: int, used: int) -> None:
        self.used[gpu] = used

    def lose(self, gpu: int) -> None:
        self.lost.add(gpu)

    def recover(self) -> None:
        self.lost.clear()

    def raise_xid(self, gpu: int, xid: int) -> None:
        self.pending_xid.append((gpu, xid))

    # --- NvmlClient -----------------------------------------------------------------
    def _check(self, index: int) -> None:
        self.calls += 1
        if not self.initialised:
            raise NvmlCallError("uninitialized")
        if not 0 <= index < self.n:
            raise NvmlCallError("not_found", f"no gpu {index}")
        if index in self.lost:
            raise NvmlCallError("gpu_lost", f"gpu {index} fell off the bus")

    def _unsupported(self, what: str) -> None:
        self.unsupported_calls += 1
        raise NvmlCallError("not_supported", what)

    def init(self) -> None:
        if self.scenario == "no_driver":
            raise NvmlCallError("not_found", "libnvidia-ml.so.1 not found")
        self.initialised = True

    def shutdown(self) -> None:
        self.initialised = False

    def driver_version(self) -> str:
        return "470.57.02" if self.scenario == "other_driver" else "580.159.04"

    def device_count(self) -> int:
        return self.n

    def identity(self, index: int) -> DeviceIdentity:
        self._check(index)
        return DeviceIdentity(index, f"GPU-fake-{index:04d}", "NVIDIA H200")

    def memory(self, index: int) -> MemoryInfo:
        self._check(index)
        self.memory_calls += 1
        if self.scenario == "gpu_lost" and self.memory_calls >= self.lose_at * self.n:
            self.lost.add(1)
            if index == 1:
                raise NvmlCallError("gpu_lost", "gpu 1 fell off the bus")
        if self.scenario == "other_driver":
            self._unsupported("nvmlDeviceGetMemoryInfo_v2")
        total = 141 * GIB
        return MemoryInfo(total, self.used[index], total - self.used[index] - (512 << 20), 512 << 20)

    def memory_v1(self, index: int) -> MemoryInfo:
        self._check(index)
        total = 141 * GIB
        return MemoryInfo(total, self.used[index], total - self.used[index], None)

    def processes(self, index: int) -> dict[int, int | None]:
        self._check(index)
        if self.scenario == "other_driver":
            return {pid: None for pid in self.procs[index]}
        return dict(self.procs[index])

    def utilization(self, index: int) -> float:
        self._check(index)
        return self.util[index]

    def process_utilization(self, index: int, since_us: int) -> list[ProcessBusy]:
        self._check(index)
        if self.scenario == "field_unsupported":
            self._unsupported("per-process utilisation")
        # like the driver: only samples newer than the caller's last seen, and only the newest per process
        newest: dict[int, ProcessBusy] = {}
        for b in self.busy[index]:
            if b.ts_us > since_us and (b.pid not in newest or b.ts_us > newest[b.pid].ts_us):
                newest[b.pid] = b
        return sorted(newest.values(), key=lambda b: b.ts_us)

    def pcie_throughput(self, index: int) -> tuple[float, float]:
        self._check(index)
        if self.scenario == "field_unsupported":
            self._unsupported("pcie")
        return 1024.0 * 1000, 1024.0 * 2000

    def power_watts(self, index: int) -> float:
        self._check(index)
        if self.scenario == "field_unsupported":
            self._unsupported("power")
        return 123.5

    def energy_joules(self, index: int) -> float:
        self._check(index)
        if self.scenario == "field_unsupported":
            self._unsupported("energy")
        self.energy[index] += 10.0
        return self.energy[index]

    def xid_events(self) -> list[tuple[int, int]]:
        if not self.initialised:
            raise NvmlCallError("uninitialized")
        if self.scenario == "field_unsupported":
            self._unsupported("xid events")
        out, self.pending_xid = self.pending_xid, []
        return out
