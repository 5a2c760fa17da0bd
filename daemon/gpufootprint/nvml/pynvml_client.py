"""The real NVML client on nvidia-ml-py, imported lazily (the daemon runs without it)."""

from __future__ import annotations

import logging
from typing import Any

from gpufootprint.nvml.client import DeviceIdentity, MemoryInfo, NvmlCallError, ProcessBusy

log = logging.getLogger(__name__)

_REASON_BY_CODE = {1: "uninitialized", 3: "not_supported", 4: "no_permission", 6: "not_found",
                   12: "not_found", 13: "not_supported", 15: "gpu_lost"}


def _reason(exc: BaseException) -> str:
    return _REASON_BY_CODE.get(getattr(exc, "value", -1), "unknown")


class PynvmlClient:
    def __init__(self) -> None:
        self._nv: Any = None
        self._handles: dict[int, Any] = {}
        self._events: Any = None
        self._util_call = 0  # which per-process utilisation call answers (process_utilization)

    def _call(self, fn: str, *args: Any) -> Any:
        if self._nv is None:
            raise NvmlCallError("uninitialized", "NVML is not initialised")
        try:
            return getattr(self._nv, fn)(*args)
        except NvmlCallError:
            raise
        except Exception as exc:  # noqa: BLE001 - NVMLError subclasses, ctypes errors
            raise NvmlCallError(_reason(exc), f"{fn}: {exc}") from None

    def _handle(self, index: int) -> Any:
        h = self._handles.get(index)
        if h is None:
            h = self._handles[index] = self._call("nvmlDeviceGetHandleByIndex", index)
        return h

    def init(self) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise NvmlCallError("not_found", f"nvidia-ml-py is not installed ({exc})") from None
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001
            raise NvmlCallError(_reason(exc), f"nvmlInit: {exc}") from None
        self._nv = pynvml
        self._handles.clear()

    def shutdown(self) -> None:
        if self._nv is None:
            return
        try:
            if self._events is not None:
                self._nv.nvmlEventSetFree(self._events)
            self._nv.nvmlShutdown()
        except Exception as exc:  # noqa: BLE001 - shutting down: nothing to do about it
            log.debug("nvml shutdown failed: %s", exc)
        self._nv, self._events = None, None
        self._handles.clear()

    def driver_version(self) -> str:
        v = self._call("nvmlSystemGetDriverVersion")
        return v.decode() if isinstance(v, bytes) else str(v)

    def device_count(self) -> int:
        return int(self._call("nvmlDeviceGetCount"))

    def identity(self, index: int) -> DeviceIdentity:
        h = self._handle(index)
        uuid, name = self._call("nvmlDeviceGetUUID", h), self._call("nvmlDeviceGetName", h)
        return DeviceIdentity(index, uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                              name.decode() if isinstance(name, bytes) else str(name))

    def memory(self, index: int) -> MemoryInfo:
        m = self._call("nvmlDeviceGetMemoryInfo", self._handle(index), self._nv.nvmlMemory_v2)
        return MemoryInfo(int(m.total), int(m.used), int(m.free), int(m.reserved))

    def memory_v1(self, index: int) -> MemoryInfo:
        m = self._call("nvmlDeviceGetMemoryInfo", self._handle(index))
        return MemoryInfo(int(m.total), int(m.used), int(m.free), None)

    def processes(self, index: int) -> dict[int, int | None]:
        procs = self._call("nvmlDeviceGetComputeRunningProcesses", self._handle(index))
        out: dict[int, int | None] = {}
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            out[int(p.pid)] = int(used) if isinstance(used, int) else None
        return out

    def utilization(self, index: int) -> float:
        return float(self._call("nvmlDeviceGetUtilizationRates", self._handle(index)).gpu) / 100.0

    def process_utilization(self, index: int, since_us: int) -> list[ProcessBusy]:
        # The v1 info call (driver 550 and later) first; the older call where it is missing. Both
        # answer NOT_FOUND (or, in some drivers, SUCCESS on the sizing call) when no sample is newer.
        h = self._handle(index)
        calls = ("nvmlDeviceGetProcessesUtilizationInfo", "nvmlDeviceGetProcessUtilization")
        for fn in calls[self._util_call:]:
            try:
                samples = getattr(self._nv, fn)(h, since_us)
            except AttributeError:
                self._util_call += 1
                continue
            except Exception as exc:  # noqa: BLE001 - NVMLError subclasses, ctypes errors
                code = getattr(exc, "value", -1)
                if code in (0, 6):  # SUCCESS on the sizing call, NOT_FOUND: no newer sample
                    return []
                if code in (2, 3, 13) and fn == calls[0]:  # INVALID_ARGUMENT, NOT_SUPPORTED, FUNCTION_NOT_FOUND
                    self._util_call = 1
                    continue
                raise NvmlCallError(_reason(exc), f"{fn}: {exc}") from None
            return [ProcessBusy(int(s.pid), int(s.timeStamp), min(1.0, max(0.0, float(s.smUtil) / 100.0)))
                    for s in samples]
        raise NvmlCallError("not_supported", "no per-process utilisation call in this nvidia-ml-py or driver")

    def pcie_throughput(self, index: int) -> tuple[float, float]:
        h = self._handle(index)
        tx = self._call("nvmlDeviceGetPcieThroughput", h, self._nv.NVML_PCIE_UTIL_TX_BYTES)
        rx = self._call("nvmlDeviceGetPcieThroughput", h, self._nv.NVML_PCIE_UTIL_RX_BYTES)
        return float(tx) * 1024.0, float(rx) * 1024.0  # NVML reports KB/s

    def power_watts(self, index: int) -> float:
        return float(self._call("nvmlDeviceGetPowerUsage", self._handle(index))) / 1000.0  # mW

    def energy_joules(self, index: int) -> float:
        return float(self._call("nvmlDeviceGetTotalEnergyConsumption", self._handle(index))) / 1000.0  # mJ

    def xid_events(self) -> list[tuple[int, int]]:
        nv = self._nv
        if nv is None:
            raise NvmlCallError("uninitialized")
        if self._events is None:
            self._events = self._call("nvmlEventSetCreate")
            registered = 0
            for i in range(self.device_count()):
                try:
                    h = self._handle(i)
                    self._call("nvmlDeviceRegisterEvents", h, nv.nvmlEventTypeXidCriticalError, self._events)
                    registered += 1
                except NvmlCallError:
                    continue
            if not registered:
                raise NvmlCallError("not_supported", "no device accepts Xid event registration")
        out: list[tuple[int, int]] = []
        for _ in range(64):  # drain, never block
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except Exception as exc:  # noqa: BLE001
                if getattr(exc, "value", None) == 10:  # NVML_ERROR_TIMEOUT: nothing pending
                    break
                raise NvmlCallError(_reason(exc), f"nvmlEventSetWait: {exc}") from None
            index = self._index_of(data.device)
            out.append((index, int(data.eventData)))
        return out

    def _index_of(self, handle: Any) -> int:
        try:
            return int(self._nv.nvmlDeviceGetIndex(handle))
        except Exception:  # noqa: BLE001
            return -1


def detect_gpu() -> tuple[bool, str]:
    """Is there an NVIDIA driver with at least one GPU? Imports pynvml lazily."""
    try:
        import pynvml
    except ImportError as exc:
        return False, f"nvidia-ml-py is not installed ({exc})"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError subclasses, or a missing library
        return False, f"NVML could not start ({exc})"
    try:
        count = pynvml.nvmlDeviceGetCount()
        driver = pynvml.nvmlSystemGetDriverVersion()
    except Exception as exc:  # noqa: BLE001
        return False, f"NVML started but could not list devices ({exc})"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001, S110 - the check's answer is already known; a failed shutdown changes nothing
            pass
    return count > 0, f"{count} GPU(s), driver {driver}"
