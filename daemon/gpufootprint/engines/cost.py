"""GPU cost: dollars by GPU time and by memory share, idle hours, unused memory.

``CostLedger`` is fed successive snapshots and accrues, for each interval
between two of them, the GPU's price x interval (price from the config's table,
matched on the GPU model) over the state of the *earlier* snapshot (what held
during the interval). Intervals longer than ``max_interval_seconds`` (a stalled
daemon) are not accrued. Every total only grows, so Grafana can ``rate()`` it.

Per GPU and interval ``dt`` with price ``P`` ($/s):

* time basis: with NVML utilisation ``u`` known, ``u * P * dt`` is shared among
  the processes holding memory on the GPU and ``(1-u) * P * dt`` is idle; with
  ``u`` unknown the holders share all of it. The share is by kernel time in the
  interval where kernel records came, else equal. No holder: all idle.
* memory basis: each holder pays ``bytes / M`` of ``P * dt`` (``M`` the GPU's
  memory, or the holders' sum when unknown); the rest is unallocated memory.
* unused memory: the part of a holder's memory-basis dollars for bytes held but
  not in use (allocator slack + stream-ordered pool headroom).

So per GPU: sum over processes (time) + idle == P x wall time, and sum over
processes (memory) + unallocated == P x wall time, up to float rounding.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

from gpufootprint.config import CostConfig
from gpufootprint.engines import inputs
from gpufootprint.snapshot import GpuState, PipelineSnapshot, ProcessSnapshot


@dataclass(frozen=True, slots=True)
class ProcessCost:
    pid: int
    dev: int
    source: str
    time_dollars: float
    memory_dollars: float
    unused_memory_dollars: float
    pod: str | None = None
    namespace: str | None = None


@dataclass(frozen=True, slots=True)
class GpuCost:
    gpu: int
    model: str | None
    dollars_per_hour: float | None  # None: no price for this model: nothing accrues
    wall_seconds: float
    idle_seconds: float
    idle_dollars: float
    attributed_time_dollars: float
    attributed_memory_dollars: float
    unallocated_memory_dollars: float


@dataclass(frozen=True, slots=True)
class CostTotals:
    processes: tuple[ProcessCost, ...]
    gpus: tuple[GpuCost, ...]

    def by_pod(self) -> dict[tuple[str | None, str | None], tuple[float, float]]:
        """(namespace, pod) -> (time dollars, memory dollars), over the processes still tracked."""
        out: dict[tuple[str | None, str | None], tuple[float, float]] = {}
        for p in self.processes:
            t, m = out.get((p.namespace, p.pod), (0.0, 0.0))
            out[(p.namespace, p.pod)] = (t + p.time_dollars, m + p.memory_dollars)
        return out


class CostLedger:
    """``started_at``: when the daemon started (wall clock). A GPU is priced from then on: the
    time before it was first seen, and any later time it is absent from snapshots (no process
    on it, no NVML), is idle time, so its wall time is the daemon's."""

    def __init__(self, cfg: CostConfig, started_at: float | None = None) -> None:
        self.cfg = cfg
        self.started_at = started_at
        self._known: dict[int, GpuState] = {}  # every GPU seen, as last seen
        self._prev: PipelineSnapshot | None = None
        self._proc: dict[tuple[int, int, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
        self._labels: dict[tuple[int, int, str], tuple[str | None, str | None]] = {}
        self._gpu: dict[int, list[float]] = defaultdict(lambda: [0.0] * 6)  # wall, idle s, idle $, time $, mem $, unalloc $
        self._gpu_model: dict[int, tuple[str | None, float | None]] = {}
        self._seen: dict[tuple[int, int, str], float] = {}  # last snapshot time each process was in

    def price(self, model: str | None) -> float | None:
        key = inputs.model_key(model, self.cfg.prices)
        return float(self.cfg.prices[key]) if key is not None else None

    def observe(self, snap: PipelineSnapshot) -> CostTotals:
        prev, self._prev = self._prev, snap
        if prev is not None:
            dt = snap.taken_at - prev.taken_at
            if 0 < dt <= self.cfg.max_interval_seconds:
                self._accrue(prev, snap, dt)
        gpus = inputs.gpu_states(snap)
        for idx, g in gpus.items():
            if idx not in self._known and self.started_at is not None:
                # First seen now: idle since the daemon started (no process was on it that we know of).
                self._idle(idx, g, snap.taken_at - self.started_at)
            self._known[idx] = dataclasses.replace(g, utilization_ratio=None)
        for idx, g in gpus.items():
            model = inputs.gpu_model(g, self.cfg.default_model)
            self._gpu_model[idx] = (model, self.price(model))
        for p in snap.processes:
            for d in p.devices:
                self._seen[(p.pid, d.dev, p.source)] = snap.taken_at
        for key in list(self._proc):
            # A process gone from snapshots for a while (past the pipeline's grace period)
            # has ended: its series end. A brief absence (an NVML-only process) keeps them.
            if snap.taken_at - self._seen.get(key, snap.taken_at) > self.cfg.forget_after_seconds:
                del self._proc[key]
                self._labels.pop(key, None)
                self._seen.pop(key, None)
        return self.totals()

    def _idle(self, idx: int, g: GpuState, dt: float) -> None:
        price = self.price(inputs.gpu_model(g, self.cfg.default_model))
        if price is None or dt <= 0:
            return
        acc = self._gpu[idx]
        dollars = price * dt / 3600.0
        acc[0] += dt
        acc[1] += dt
        acc[2] += dollars
        acc[5] += dollars

    def _accrue(self, prev: PipelineSnapshot, now: PipelineSnapshot, dt: float) -> None:
        kernel_now = {(p.pid, d.dev): d.kernel_seconds for p in now.processes for d in p.devices}
        feats = inputs.features_of(prev)
        states = inputs.gpu_states(prev)
        if self.started_at is not None:
            for idx, g in self._known.items():
                states.setdefault(idx, g)  # known before, absent now: idle, still priced
        for idx, g in states.items():
            model = inputs.gpu_model(g, self.cfg.default_model)
            price = self.price(model)
            if price is None:
                continue
            dollars = price * dt / 3600.0
            total = inputs.gpu_total_bytes(g, self.cfg.memory_bytes, self.cfg.default_model)
            holders: list[tuple[ProcessSnapshot, int, float, int]] = []  # proc, bytes, kernel s, unused bytes
            for p in prev.processes:
                if not inputs.live(p):
                    continue
                for d in p.devices:
                    if d.dev == idx and d.device_bytes > 0:
                        busy = max(0.0, kernel_now.get((p.pid, idx), d.kernel_seconds) - d.kernel_seconds)
                        unused = (inputs.allocator_slack_bytes(p, d, feats.get((p.pid, d.dev)))
                                  + inputs.pool_headroom_bytes(d))
                        holders.append((p, d.device_bytes, busy, unused))
            acc = self._gpu[idx]
            acc[0] += dt
            u = g.utilization_ratio
            busy_frac = 0.0 if not holders else (1.0 if u is None else min(1.0, max(0.0, u)))
            acc[1] += (1.0 - busy_frac) * dt
            acc[2] += (1.0 - busy_frac) * dollars
            busy_dollars = busy_frac * dollars
            kernel_sum = sum(h[2] for h in holders)
            mem_sum = sum(h[1] for h in holders)
            denom = max(total or 0, mem_sum)
            attributed_mem = 0.0
            for p, nbytes, busy, unused in holders:
                key = (p.pid, idx, p.source)
                self._labels[key] = (inputs.pod_of(p), inputs.namespace_of(p))
                share = busy / kernel_sum if kernel_sum > 0 else 1.0 / len(holders)
                t = busy_dollars * share
                m = dollars * nbytes / denom
                un = dollars * min(unused, nbytes) / denom
                row = self._proc[key]
                row[0] += t
                row[1] += m
                row[2] += un
                acc[3] += t
                attributed_mem += m
            acc[4] += attributed_mem
            acc[5] += dollars - attributed_mem

    def totals(self) -> CostTotals:
        procs = tuple(ProcessCost(pid, dev, src, v[0], v[1], v[2], *self._labels.get((pid, dev, src), (None, None)))
                      for (pid, dev, src), v in sorted(self._proc.items()))
        gpus = []
        for idx in sorted(set(self._gpu) | set(self._gpu_model)):
            a = self._gpu.get(idx, [0.0] * 6)
            model, price = self._gpu_model.get(idx, (None, None))
            gpus.append(GpuCost(idx, model, price, a[0], a[1], a[2], a[3], a[4], a[5]))
        return CostTotals(procs, tuple(gpus))
