"""Degradation advice: a smaller GPU, or FP16 and gradient checkpointing.

* ``smaller_gpu``: the GPU's utilisation stayed below ``low_utilization`` for
  ``low_utilization_seconds`` (every sample in that span, and the span fully
  covered: an unknown sample restarts the count). Given for each live process
  holding memory on that GPU.
* ``fp16_gradient_checkpointing``: the memory a process asked for (its window
  peak) is above ``memory_quota_ratio`` of its quota. The quota is the budget of
  a rule covering it (members' peaks summed against the budget), else the GPU's
  memory. Unknown utilisation or quota: no advice.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from gpufootprint.config import CostConfig, DegradationConfig
from gpufootprint.engines import inputs
from gpufootprint.engines.budgets import BudgetStatus
from gpufootprint.snapshot import PipelineSnapshot

SMALLER_GPU, FP16 = "smaller_gpu", "fp16_gradient_checkpointing"


@dataclass(frozen=True, slots=True)
class Advice:
    gpu: int
    pid: int
    advice: str
    reason: str


class DegradationTracker:
    """Keeps each GPU's recent utilisation samples; advises on each snapshot."""

    def __init__(self, cfg: DegradationConfig, cost: CostConfig | None = None) -> None:
        self.cfg = cfg
        self.cost = cost or CostConfig()
        self.util: dict[int, deque[tuple[float, float]]] = {}

    def evaluate(self, snap: PipelineSnapshot, budgets: tuple[BudgetStatus, ...] = ()) -> tuple[Advice, ...]:
        cfg = self.cfg
        now = snap.taken_at
        gpus = inputs.gpu_states(snap)
        out: dict[tuple[int, int, str], Advice] = {}
        for idx, gpu in gpus.items():
            hist = self.util.setdefault(idx, deque())
            if gpu.utilization_ratio is None:
                hist.clear()  # unknown: a sustained low period cannot be claimed across it
                continue
            if hist and now <= hist[-1][0]:
                continue
            hist.append((now, gpu.utilization_ratio))
            while len(hist) > 1 and hist[1][0] <= now - cfg.low_utilization_seconds:
                hist.popleft()
        holders: dict[int, list[int]] = {}
        for proc in snap.processes:
            if inputs.live(proc):
                for d in proc.devices:
                    if d.device_bytes > 0:
                        holders.setdefault(d.dev, []).append(proc.pid)
        for idx, hist in self.util.items():
            if not hist or now - hist[0][0] < cfg.low_utilization_seconds:
                continue
            peak = max(u for _, u in hist)
            if peak < cfg.low_utilization:
                for pid in holders.get(idx, []):
                    out[(idx, pid, SMALLER_GPU)] = Advice(idx, pid, SMALLER_GPU, (
                        f"GPU {idx} utilisation at most {peak:.0%} for {now - hist[0][0]:.0f} s "
                        f"(< {cfg.low_utilization:.0%} for {cfg.low_utilization_seconds:g} s)"))
        covered: set[int] = set()
        procs = {p.pid: p for p in snap.processes if inputs.live(p)}
        for st in budgets:
            if st.budget_bytes is None or not st.pids:
                continue
            members = [procs[pid] for pid in st.pids if pid in procs]
            covered.update(p.pid for p in members)
            requested = sum(d.window_peak_bytes for p in members for d in p.devices
                            if st.scope != "gpu" or str(d.dev) == st.name)
            if requested > cfg.memory_quota_ratio * st.budget_bytes:
                for p in members:
                    for d in p.devices:
                        if d.window_peak_bytes > 0 and (st.scope != "gpu" or str(d.dev) == st.name):
                            out.setdefault((d.dev, p.pid, FP16), Advice(d.dev, p.pid, FP16, (
                                f"{st.scope} {st.name} requested {requested} B, above "
                                f"{cfg.memory_quota_ratio:.0%} of its budget {st.budget_bytes} B")))
        for pid, proc in procs.items():
            if pid in covered:
                continue
            for d in proc.devices:
                total = inputs.gpu_total_bytes(gpus[d.dev], self.cost.memory_bytes, self.cost.default_model)
                if total and d.window_peak_bytes > cfg.memory_quota_ratio * total:
                    out[(d.dev, pid, FP16)] = Advice(d.dev, pid, FP16, (
                        f"requested {d.window_peak_bytes} B, above {cfg.memory_quota_ratio:.0%} of GPU {d.dev}'s "
                        f"{total} B"))
        return tuple(out[k] for k in sorted(out))
