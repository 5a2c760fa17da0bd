"""Polls NVML at the cadence the sampler asks for, and keeps the result as state.

NVML calls can block (the PCIe throughput call samples a byte counter for
20 ms, twice per GPU), so the daemon runs the poller on its own thread
(``start_thread``) and the ingest thread only sets the wanted interval and reads
the latest immutable snapshot. Tests call ``poll`` directly.

Nothing NVML does can stop the daemon: a field the driver lacks is marked
unsupported (and not asked again), a lost GPU is marked down (and looked for
again every ``lost_retry_seconds``), any other failure is counted by reason.
``snapshot()`` is what the exporter reads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gpufootprint.config import NvmlConfig
from gpufootprint.nvml.client import DeviceIdentity, NvmlCallError, NvmlClient, ProcessBusy
from gpufootprint.snapshot import NvmlGpu, NvmlSnapshot

log = logging.getLogger(__name__)

T = TypeVar("T")
FIELDS = ("memory", "memory_reserved", "processes", "utilization", "process_utilization", "pcie", "power", "energy",
          "xid")
#: Per-process utilisation samples kept per (GPU, pid): at the driver's six a second, about three minutes;
#: launch windows come up to 600 s apart, so the advisor keeps those near a window's steps itself
#: (engines/runner.py).
BUSY_SAMPLES = 1024
#: A process with no new sample for this long is forgotten (it exited, or stopped running kernels).
BUSY_FORGET_US = 600_000_000
_CLOCK_NEAR_NS = 3600 * 10**9


class _Lost(Exception):
    pass


@dataclass
class _GpuState:
    identity: DeviceIdentity
    up: bool = True
    state: str = "ok"
    lost_at: float | None = None
    supported: dict[str, bool] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    processes: dict[int, int | None] = field(default_factory=dict)
    xid: Counter[int] = field(default_factory=Counter)
    pcie: deque[tuple[int, float, float]] = field(default_factory=deque)
    busy: dict[int, deque[tuple[int, float]]] = field(default_factory=dict)  # pid -> (ts ns, sm ratio)
    busy_seen_us: int = 0  # the newest sample's NVML timestamp: the next call asks for newer ones
    busy_view: dict[int, tuple[tuple[int, float], ...]] = field(default_factory=dict)  # immutable copies


class NvmlPoller:
    def __init__(self, client: NvmlClient | None, config: NvmlConfig | None = None, *,
                 monotonic: Callable[[], float] = time.monotonic,
                 wall_ns: Callable[[], int] = time.time_ns) -> None:
        self.client = client
        self.config = config or NvmlConfig()
        self._mono = monotonic
        self._wall_ns = wall_ns
        self.state = "unavailable"
        self.detail = "not started"
        self.driver: str | None = None
        self.gpus: list[_GpuState] = []
        self.errors: Counter[str] = Counter()
        self.polls = 0
        self.interval_s = self.config.max_poll_ms / 1000
        self._next_due = 0.0
        self._next_init = 0.0
        self._xid_supported: bool | None = None
        self._snap: NvmlSnapshot = self._build_snapshot()
        self._lock = threading.Lock()  # guards the PCIe sample deques against readers
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # --- lifecycle -------------------------------------------------------------------

    def start(self) -> bool:
        """Initialise NVML and list the GPUs; False (and a state) when it cannot."""
        ok = self._start()
        self._snap = self._build_snapshot()
        return ok

    def _start(self) -> bool:
        self._next_init = self._mono() + self.config.lost_retry_seconds
        if self.client is None or not self.config.enabled:
            self.state, self.detail = "unavailable", "NVML disabled or no client"
            return False
        try:
            self.client.init()
            self.driver = self.client.driver_version()
            count = self.client.device_count()
            gpus = []
            for i in range(count):
                try:
                    gpus.append(_GpuState(self.client.identity(i)))
                except NvmlCallError as exc:
                    self.errors[exc.reason] += 1
                    lost = _GpuState(DeviceIdentity(i, "", "unknown"), up=False, state="lost"
                                     if exc.reason == "gpu_lost" else "error", lost_at=self._mono())
                    gpus.append(lost)
            self.gpus = gpus
        except NvmlCallError as exc:
            self.errors[exc.reason] += 1
            self.state, self.detail = "unavailable", str(exc)
            log.warning("nvml unavailable: %s", exc)
            return False
        except Exception as exc:
            self.errors["unknown"] += 1
            self.state, self.detail = "error", f"{type(exc).__name__}: {exc}"
            log.exception("nvml start failed")
            return False
        self.state, self.detail = "ok", f"{len(self.gpus)} GPU(s), driver {self.driver}"
        log.info("nvml started %s", self.detail)
        return True

    def start_thread(self) -> None:
        """Poll on a thread of its own at ``interval_s`` (which the ingest tick keeps setting)."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="gpufootprint-nvml", daemon=True)
        self._thread.start()

    @property
    def threaded(self) -> bool:
        return self._thread is not None

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.maybe_poll()
            self._stop.wait(max(0.001, min(self.interval_s, self._next_due - self._mono())))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self.client is not None and self.state == "ok":
            try:
                self.client.shutdown()
            except Exception as exc:  # noqa: BLE001 - shutting down: nothing to do about it
                log.debug("nvml shutdown failed: %s", exc)
        self.state = "unavailable"

    # --- polling ------------------------------------------------------------------------

    def set_interval(self, wanted_s: float | None) -> None:
        """Follow the sampler: the fastest process's interval, clamped to the configured range."""
        lo, hi = self.config.min_poll_ms / 1000, self.config.max_poll_ms / 1000
        self.interval_s = hi if wanted_s is None else min(hi, max(lo, wanted_s))

    def next_due(self) -> float:
        return self._next_due

    def maybe_poll(self) -> bool:
        now = self._mono()
        if now < self._next_due:
            return False
        self._next_due = now + self.interval_s
        self.poll()
        return True

    def poll(self) -> None:
        """One poll of every GPU. Never raises."""
        if self.state != "ok":
            if self.client is not None and self.config.enabled and self._mono() >= self._next_init:
                self.start()
            if self.state != "ok":
                self._snap = self._build_snapshot()
                return
        self.polls += 1
        for gpu in self.gpus:
            try:
                self._poll_gpu(gpu)
            except _Lost:
                pass
            except Exception:
                self.errors["unknown"] += 1
                log.exception("nvml poll of gpu %d failed", gpu.identity.index)
        if self.config.xid_events:
            self._poll_xid()
        self._snap = self._build_snapshot()  # one reference swap: readers never see half a poll

    def _poll_gpu(self, gpu: _GpuState) -> None:
        assert self.client is not None
        c, i = self.client, gpu.identity.index
        if not gpu.up:
            if gpu.lost_at is not None and self._mono() - gpu.lost_at < self.config.lost_retry_seconds:
                return
            ident = self._field(gpu, "identity", lambda: c.identity(i))  # raises _Lost if still lost
            if ident is None:
                return
            log.info("nvml gpu %d is back", i)
            gpu.identity, gpu.up, gpu.state, gpu.lost_at = ident, True, "ok", None
        mem = None
        if gpu.supported.get("memory_reserved") is not False:
            mem = self._field(gpu, "memory_reserved", lambda: c.memory(i))
        if mem is None:
            mem = self._field(gpu, "memory", lambda: c.memory_v1(i))
        elif gpu.supported.get("memory") is None:
            gpu.supported["memory"] = True
        gpu.values["memory"] = mem
        procs = self._field(gpu, "processes", lambda: c.processes(i))
        gpu.processes = procs if procs is not None else {}
        gpu.values["utilization"] = self._field(gpu, "utilization", lambda: c.utilization(i))
        busy = self._field(gpu, "process_utilization", lambda: c.process_utilization(i, gpu.busy_seen_us))
        if busy:
            self._add_busy(gpu, busy)
        before = self._wall_ns()
        pcie = self._field(gpu, "pcie", lambda: c.pcie_throughput(i))
        gpu.values["pcie"] = pcie
        if pcie is not None:
            # The driver sampled over the call (20 ms per counter): date the sample at its middle.
            with self._lock:
                gpu.pcie.append(((before + self._wall_ns()) // 2, pcie[0], pcie[1]))
                while len(gpu.pcie) > self.config.pcie_samples:
                    gpu.pcie.popleft()
        gpu.values["power"] = self._field(gpu, "power", lambda: c.power_watts(i))
        gpu.values["energy"] = self._field(gpu, "energy", lambda: c.energy_joules(i))

    def _busy_offset_ns(self, ts_ns: int) -> int:
        """What turns NVML's sample time into wall-clock ns. The samples are documented as CPU timestamps
        in microseconds, which drivers take from the wall clock; should one count from boot instead
        (the monotonic clock), its samples are moved onto the wall clock rather than never matching a
        window."""
        wall = self._wall_ns()
        if abs(ts_ns - wall) < _CLOCK_NEAR_NS:
            return 0
        mono = time.monotonic_ns()
        return wall - mono if abs(ts_ns - mono) < _CLOCK_NEAR_NS else 0

    def _add_busy(self, gpu: _GpuState, samples: list[ProcessBusy]) -> None:
        changed = set()
        offset = self._busy_offset_ns(max(b.ts_us for b in samples) * 1000)
        for b in samples:
            q = gpu.busy.get(b.pid)
            if q is None:
                q = gpu.busy[b.pid] = deque(maxlen=BUSY_SAMPLES)
            if q and q[-1][0] >= b.ts_us * 1000 + offset:
                continue  # the driver's sample was seen already
            q.append((b.ts_us * 1000 + offset, b.sm_ratio))
            changed.add(b.pid)
            gpu.busy_seen_us = max(gpu.busy_seen_us, b.ts_us)
        for pid in changed:
            gpu.busy_view[pid] = tuple(gpu.busy[pid])
        old = [pid for pid, q in gpu.busy.items() if q[-1][0] < (gpu.busy_seen_us - BUSY_FORGET_US) * 1000 + offset]
        for pid in old:
            del gpu.busy[pid]
            gpu.busy_view.pop(pid, None)

    def _field(self, gpu: _GpuState, name: str, call: Callable[[], T]) -> T | None:
        if gpu.supported.get(name) is False:
            return None
        try:
            value = call()
        except NvmlCallError as exc:
            self.errors[exc.reason] += 1
            if exc.reason == "not_supported":
                gpu.supported[name] = False
                log.info("nvml gpu %d: %s not supported", gpu.identity.index, name)
                return None
            if exc.reason == "gpu_lost":
                if gpu.up:
                    log.warning("nvml gpu %d lost (%s)", gpu.identity.index, exc)
                gpu.up, gpu.state, gpu.lost_at = False, "lost", self._mono()
                gpu.values.clear()
                gpu.processes = {}
                raise _Lost from None
            return None
        if name != "identity":
            gpu.supported[name] = True
        return value

    def _poll_xid(self) -> None:
        if self.client is None or self._xid_supported is False:
            return
        try:
            events = self.client.xid_events()
        except NvmlCallError as exc:
            self.errors[exc.reason] += 1
            if exc.reason == "not_supported":
                self._xid_supported = False
                for g in self.gpus:
                    g.supported["xid"] = False
            return
        except Exception:  # noqa: BLE001
            self.errors["unknown"] += 1
            return
        self._xid_supported = True
        for g in self.gpus:
            g.supported.setdefault("xid", True)
        for index, xid in events:
            if 0 <= index < len(self.gpus):
                self.gpus[index].xid[xid] += 1
                log.warning("nvml gpu %d: Xid %d", index, xid)

    # --- output ---------------------------------------------------------------------------

    def pcie_samples(self, index: int) -> list[tuple[int, float, float]]:
        gpus = self.gpus
        if not 0 <= index < len(gpus):
            return []
        with self._lock:
            return list(gpus[index].pcie)

    def snapshot(self) -> NvmlSnapshot:
        """The state after the last poll (immutable; safe from any thread)."""
        return self._snap

    def _build_snapshot(self) -> NvmlSnapshot:
        gpus = []
        for g in self.gpus:
            mem = g.values.get("memory")
            pcie = g.values.get("pcie")
            gpus.append(NvmlGpu(
                index=g.identity.index, uuid=g.identity.uuid, model=g.identity.model, up=g.up, state=g.state,
                memory_total_bytes=mem.total if mem else None, memory_used_bytes=mem.used if mem else None,
                memory_reserved_bytes=mem.reserved if mem else None,
                utilization_ratio=g.values.get("utilization"),
                pcie_tx_bytes_per_second=pcie[0] if pcie else None,
                pcie_rx_bytes_per_second=pcie[1] if pcie else None,
                power_watts=g.values.get("power"), energy_joules=g.values.get("energy"),
                field_supported={k: v for k, v in g.supported.items() if k in FIELDS},
                xid_errors=dict(g.xid), processes=dict(g.processes), process_busy=dict(g.busy_view)))
        return NvmlSnapshot(state=self.state, detail=self.detail, driver_version=self.driver, gpus=tuple(gpus),
                            errors=dict(self.errors), poll_interval_s=self.interval_s)
