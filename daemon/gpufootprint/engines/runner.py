"""All engines on one snapshot: what the daemon calls each tick.

``Engines.step(snapshot)`` returns one frozen ``EngineOutputs``: decisions to
export, actions to send, advice that is new since the last step (to log). It
keeps the engines' small state (trends, the cost ledger, kernel statistics
cached while a process's kernel window is unchanged) and does no I/O.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpufootprint.config import Config
from gpufootprint.engines.budgets import BudgetAction, BudgetStatus, BudgetTracker
from gpufootprint.engines.busy import BusyEstimate, busy_over, samples_near
from gpufootprint.engines.cost import CostLedger, CostTotals
from gpufootprint.engines.degradation import Advice, DegradationTracker
from gpufootprint.engines.graph import (
    GraphDecision,
    GraphPolicy,
    advise,
    busy_samples,
    compute_launch_stats,
    compute_stats,
    reuse_since,
)
from gpufootprint.engines.kernels import StreamKernelStats
from gpufootprint.engines.launches import LaunchStats
from gpufootprint.engines.leaks import LeakStatus, LeakTracker
from gpufootprint.snapshot import PipelineSnapshot


@dataclass(frozen=True, slots=True)
class EngineOutputs:
    taken_at: float
    graph: tuple[GraphDecision, ...] = ()
    budgets: tuple[BudgetStatus, ...] = ()
    budget_actions: tuple[BudgetAction, ...] = ()  # to send now
    budget_action_counts: Mapping[tuple[str, str, str], int] = field(default_factory=dict)
    leaks: tuple[LeakStatus, ...] = ()
    new_leaks: tuple[LeakStatus, ...] = ()  # became suspect in this step (log them)
    degradation: tuple[Advice, ...] = ()
    new_degradation: tuple[Advice, ...] = ()  # appeared in this step (log them)
    cost: CostTotals | None = None


EMPTY_OUTPUTS = EngineOutputs(taken_at=0.0)


class Engines:
    def __init__(self, config: Config, started_at: float | None = None) -> None:
        """``started_at``: the daemon's start (wall clock): the cost ledger prices GPUs from then."""
        self.config = config
        self.policy = GraphPolicy.from_config(config.graph_advisor)
        self.budgets = BudgetTracker(config.budgets, config.cost)
        self.leaks = LeakTracker(config.leaks)
        self.degradation = DegradationTracker(config.degradation, config.cost)
        self.cost = CostLedger(config.cost, started_at)
        # per pid: (its kernel array, their statistics, where the steady part starts for the reuse ratio)
        self._stats: dict[int, tuple[np.ndarray, dict[tuple[int, int], StreamKernelStats], int | None]] = {}
        # per pid, likewise, with where the steady part of the calls starts (reuse_since)
        self._launch_stats: dict[int, tuple[np.ndarray, LaunchStats | None, int | None]] = {}
        # per (pid, GPU): NVML's busy samples near the steps of its launch windows. The poller keeps about
        # three minutes of samples and windows back off to 600 s apart: without these a window's lower
        # bound, and a verdict that needs it, would go a few minutes after each window.
        self._busy_near: dict[tuple[int, int], tuple[tuple[int, float], ...]] = {}
        # per (pid, GPU), what the last step worked out from NVML's samples and the window spans, with the
        # two objects it came from: the poller replaces a process's samples only when it polls them (about
        # once a second) and a process's spans only change with its launch calls, so most steps reuse it
        # (the kept samples near the windows, the samples the advisor reads, its busy estimate)
        self._busy_memo: dict[tuple[int, int], tuple[object, object, tuple[tuple[int, float], ...],
                                                      tuple[tuple[int, float], ...], BusyEstimate | None]] = {}
        self._suspects: set[tuple[int, int]] = set()
        self._advice: set[tuple[int, int, str]] = set()

    def step(self, snap: PipelineSnapshot) -> EngineOutputs:
        cfg = self.config
        graph: tuple[GraphDecision, ...] = ()
        if cfg.graph_advisor.enabled:
            stats: dict[int, dict[tuple[int, int], StreamKernelStats]] = {}
            since: dict[int, int | None] = {}
            for proc in snap.processes:
                arr = proc.recent_kernels
                if arr is None:
                    continue
                cached = self._stats.get(proc.pid)
                if cached is None or cached[0] is not arr:
                    cached = (arr, compute_stats(arr, self.policy), reuse_since(arr))
                    self._stats[proc.pid] = cached
                stats[proc.pid], since[proc.pid] = cached[1], cached[2]
            for pid in set(self._stats) - set(stats):
                del self._stats[pid]
            launches: dict[int, LaunchStats | None] = {}
            for proc in snap.processes:
                api = proc.recent_launches
                if api is None or proc.pid not in stats or stats[proc.pid]:
                    continue  # kernel records decide where there are any
                held = self._launch_stats.get(proc.pid)
                if held is None or held[0] is not api:
                    held = (api, compute_launch_stats(api, self.policy), reuse_since(api))
                    self._launch_stats[proc.pid] = held
                launches[proc.pid] = held[1]
            for pid in set(self._launch_stats) - set(launches):
                del self._launch_stats[pid]
            busy, estimates = self._busy_for(snap, launches)
            graph = advise(snap, self.policy, stats=stats, since=since, launches=launches, busy=busy,
                           launch_since={pid: held[2] for pid, held in self._launch_stats.items()},
                           estimates=estimates if self.policy.gpu_busy else None)
        budgets: tuple[BudgetStatus, ...] = ()
        actions: tuple[BudgetAction, ...] = ()
        if cfg.budgets.enabled:
            budgets, actions = self.budgets.evaluate(snap)
        leaks: tuple[LeakStatus, ...] = ()
        new_leaks: tuple[LeakStatus, ...] = ()
        if cfg.leaks.enabled:
            leaks = self.leaks.evaluate(snap)
            suspects = {(s.pid, s.dev) for s in leaks if s.suspect}
            new_leaks = tuple(s for s in leaks if s.suspect and (s.pid, s.dev) not in self._suspects)
            self._suspects = suspects
        advice: tuple[Advice, ...] = ()
        new_advice: tuple[Advice, ...] = ()
        if cfg.degradation.enabled:
            advice = self.degradation.evaluate(snap, budgets)
            keys = {(a.gpu, a.pid, a.advice) for a in advice}
            new_advice = tuple(a for a in advice if (a.gpu, a.pid, a.advice) not in self._advice)
            # Remembered while the process is in the snapshot at all, not only while the advice
            # stands: a workload that restarts under the same pid (the demo's loop, a restarted
            # container in hostPID) drops its advice for a moment and gets it back; that is no
            # change to log again.
            present = {p.pid for p in snap.processes}
            self._advice = keys | {k for k in self._advice if k[1] in present}
        cost = self.cost.observe(snap) if cfg.cost.enabled else None
        return EngineOutputs(
            taken_at=snap.taken_at, graph=graph, budgets=budgets, budget_actions=actions,
            budget_action_counts=dict(self.budgets.action_counts), leaks=leaks, new_leaks=new_leaks,
            degradation=advice, new_degradation=new_advice, cost=cost)


    def _busy_for(self, snap: PipelineSnapshot, launches: Mapping[int, LaunchStats | None]
                  ) -> tuple[dict[tuple[int, int], tuple[tuple[int, float], ...]],
                             dict[tuple[int, int], BusyEstimate | None]]:
        """The snapshot's busy samples, with those near each launch window's steps that the poller has
        since dropped added back (kept only while the steps are among the retained records), and the busy
        estimate over each process's spans from them.

        Runs at every snapshot for every process with launch windows: it bisects (``samples_near``), and a
        process whose samples and spans are the same objects as at the last step gets the last step's
        results (they are a fixed point: what was kept then already holds every sample near the spans)."""
        busy = busy_samples(snap)
        near: dict[tuple[int, int], tuple[tuple[int, float], ...]] = {}
        estimates: dict[tuple[int, int], BusyEstimate | None] = {}
        memo: dict[tuple[int, int], tuple[object, object, tuple[tuple[int, float], ...],
                                          tuple[tuple[int, float], ...], BusyEstimate | None]] = {}
        for pid, ls in launches.items():
            if ls is None or not ls.spans:
                continue
            key = (pid, ls.dev)
            current = busy.get(key, ())
            held = self._busy_memo.get(key)
            if held is not None and held[0] is current and held[1] is ls.spans:
                memo[key] = held
                if held[2]:
                    near[key] = held[2]
                if held[3] is not current:
                    busy[key] = held[3]  # with the samples kept near the windows in front
                estimates[key] = held[4]
                continue
            # what was kept before, then what the poller holds now: the same sample once, in time order
            found: dict[int, tuple[int, float]] = {}
            for r in samples_near(self._busy_near.get(key, ()), ls.spans) + samples_near(current, ls.spans):
                found.setdefault(r[0], r)
            kept = tuple(found[t] for t in sorted(found))
            read = tuple(current)
            if kept:
                near[key] = kept
                # the poller's samples are the newest, in time order: what it dropped comes before its first
                first = current[0][0] if current else None
                older = kept if first is None else kept[:bisect.bisect_left(kept, first, key=lambda r: r[0])]
                if older:
                    read = older + read
                    busy[key] = read
            estimates[key] = busy_over(read, ls.spans)
            memo[key] = (current, ls.spans, kept, read, estimates[key])
        self._busy_near = near
        self._busy_memo = memo
        return busy, estimates


def engine_report(out: EngineOutputs) -> dict[str, Any]:
    """The outputs as plain JSON (``GET /api/engines``): every decision with its reasons.

    Infinite ratios (a zero budget in use) become null, since JSON has no infinity.
    """
    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {str(k): clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    def rows(items: tuple[Any, ...]) -> list[Any]:
        return [clean(dataclasses.asdict(x)) for x in items]

    report: dict[str, Any] = {
        "taken_at": out.taken_at, "graph": rows(out.graph), "budgets": rows(out.budgets),
        "budget_actions_total": [{"scope": s, "name": n, "action": a, "count": c}
                                 for (s, n, a), c in sorted(out.budget_action_counts.items())],
        "leaks": rows(out.leaks), "degradation": rows(out.degradation)}
    if out.cost is not None:
        report["cost"] = {"processes": rows(out.cost.processes), "gpus": rows(out.cost.gpus),
                          "pods": [{"namespace": ns, "pod": pod, "time_dollars": t, "memory_dollars": m}
                                   for (ns, pod), (t, m) in sorted(out.cost.by_pod().items(), key=str)]}
    return report
