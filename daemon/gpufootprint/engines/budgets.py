"""Memory budgets per process, pod, namespace or GPU: use, trend, opt-in actions.

A rule names a scope and a name (a pid, a pod, a namespace, a GPU index, or
``*`` for each one seen) and a budget in bytes or as a fraction of the GPU
memory its members use. Every evaluation gives the bytes used (GPU-resident
bytes of the live member processes), the utilisation, and the predicted time to
exhaustion from the least-squares slope of use over the trend window.

Actions are opt-in per rule and are only *returned* here (the daemon sends them
as CONTROL frames, counts and logs them):

* ``soft_action``: ``torch_empty_cache`` to every member probe when use reaches
  ``soft_fraction`` of the budget, at most once per cooldown per process;
* ``hard_action``: ``torch_memory_fraction`` once per member process and device,
  setting PyTorch's own per-process limit to the member's share of the budget
  (sent again only when that share changes).

A budget of zero means no GPU memory is allowed: any use exceeds it, and the
utilisation is +Inf (0 while nothing is used).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from gpufootprint.config import BudgetsConfig, CostConfig
from gpufootprint.engines import inputs
from gpufootprint.engines.trend import Trend
from gpufootprint.snapshot import PipelineSnapshot, ProcessSnapshot

EMPTY_CACHE, MEMORY_FRACTION = "torch_empty_cache", "torch_memory_fraction"


@dataclass(frozen=True, slots=True)
class BudgetRule:
    scope: str  # process | pod | namespace | gpu
    name: str  # the entity, or "*" for each one seen
    bytes: int | None = None
    fraction: float | None = None
    soft_action: bool = False
    hard_action: bool = False
    soft_fraction: float = 0.9

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BudgetRule:
        return cls(scope=d["scope"], name=str(d["name"]), bytes=d.get("bytes"), fraction=d.get("fraction"),
                   soft_action=bool(d.get("soft_action", False)), hard_action=bool(d.get("hard_action", False)),
                   soft_fraction=float(d.get("soft_fraction", 0.9)))


@dataclass(frozen=True, slots=True)
class BudgetStatus:
    scope: str
    name: str
    budget_bytes: int | None  # None: a fraction of a GPU whose memory size is unknown
    used_bytes: int
    utilization_ratio: float | None
    exhaustion_seconds: float | None  # None: not growing, or too few samples
    slope_bytes_per_second: float | None
    exceeded: bool
    pids: tuple[int, ...]
    devices: tuple[int, ...]
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class BudgetAction:
    scope: str
    name: str
    pid: int
    action: str
    body: tuple[tuple[str, Any], ...]  # the CONTROL frame's JSON, as sorted items
    reason: str

    def control(self) -> dict[str, Any]:
        return dict(self.body)


@dataclass(slots=True)
class _Entity:
    scope: str
    name: str
    procs: list[ProcessSnapshot] = field(default_factory=list)
    devices: set[int] = field(default_factory=set)


def _entities(rule: BudgetRule, snap: PipelineSnapshot) -> list[_Entity]:
    found: dict[str, _Entity] = {}

    def member(key: str | None, proc: ProcessSnapshot, devs: list[int]) -> None:
        if key is None or (rule.name != "*" and key != rule.name):
            return
        ent = found.setdefault(key, _Entity(rule.scope, key))
        if proc not in ent.procs:
            ent.procs.append(proc)
        ent.devices.update(devs)

    for proc in snap.processes:
        if not inputs.live(proc):
            continue
        devs = [d.dev for d in proc.devices]
        if rule.scope == "process":
            member(str(proc.pid), proc, devs)
        elif rule.scope == "pod":
            member(inputs.pod_of(proc), proc, devs)
        elif rule.scope == "namespace":
            member(inputs.namespace_of(proc), proc, devs)
        elif rule.scope == "gpu":
            for d in devs:
                member(str(d), proc, [d])
    if rule.scope == "gpu":
        for gpu in inputs.gpu_states(snap):
            if rule.name in ("*", str(gpu)):
                found.setdefault(str(gpu), _Entity("gpu", str(gpu), devices={gpu}))
    elif rule.name != "*" and rule.name not in found:
        found[rule.name] = _Entity(rule.scope, rule.name)  # a named budget with nothing in it: still exported
    return [found[k] for k in sorted(found)]


class BudgetTracker:
    """Evaluates the rules on successive snapshots; keeps trends and action state."""

    def __init__(self, cfg: BudgetsConfig, cost: CostConfig | None = None) -> None:
        self.cfg = cfg
        self.rules = tuple(BudgetRule.from_dict(r) for r in cfg.rules)
        self.cost = cost or CostConfig()
        self.trends: dict[tuple[str, str], Trend] = {}
        self.action_counts: Counter[tuple[str, str, str]] = Counter()
        self._soft_sent: dict[tuple[str, str, int], float] = {}
        self._hard_sent: dict[tuple[str, str, int, int], float] = {}

    def evaluate(self, snap: PipelineSnapshot) -> tuple[tuple[BudgetStatus, ...], tuple[BudgetAction, ...]]:
        now = snap.taken_at
        gpus = inputs.gpu_states(snap)
        statuses: list[BudgetStatus] = []
        actions: list[BudgetAction] = []
        seen: set[tuple[str, str]] = set()
        for rule in self.rules:
            for ent in _entities(rule, snap):
                key = (ent.scope, ent.name)
                if key in seen:
                    continue  # the first rule naming an entity wins
                seen.add(key)
                used = sum(d.device_bytes for p in ent.procs for d in p.devices
                           if rule.scope != "gpu" or str(d.dev) == ent.name)
                totals = [inputs.gpu_total_bytes(gpus[d], self.cost.memory_bytes, self.cost.default_model)
                          for d in sorted(ent.devices) if d in gpus]
                budget: int | None
                reasons: list[str] = []
                if rule.bytes is not None:
                    budget = rule.bytes
                elif totals and all(t is not None for t in totals):
                    budget = int(rule.fraction * sum(t for t in totals if t is not None))  # type: ignore[operator]
                else:
                    budget = None
                    reasons.append("fraction budget: the GPU memory size is unknown" if ent.devices
                                   else "fraction budget: no GPU in use yet")
                trend = self.trends.get(key)
                if trend is None:  # (not setdefault: its argument, a new Trend, would be built at every call)
                    trend = self.trends[key] = Trend(self.cfg.trend_window_seconds)
                trend.add(now, float(used))
                slope = trend.slope(self.cfg.min_trend_points)
                ratio: float | None = None
                exhaustion: float | None = None
                exceeded = False
                if budget is not None:
                    exceeded = used > budget
                    ratio = used / budget if budget > 0 else (math.inf if used > 0 else 0.0)
                    if exceeded:
                        exhaustion = 0.0
                    elif slope is not None and slope > 0:
                        exhaustion = (budget - used) / slope
                statuses.append(BudgetStatus(
                    scope=ent.scope, name=ent.name, budget_bytes=budget, used_bytes=used, utilization_ratio=ratio,
                    exhaustion_seconds=exhaustion, slope_bytes_per_second=slope, exceeded=exceeded,
                    pids=tuple(sorted(p.pid for p in ent.procs)), devices=tuple(sorted(ent.devices)),
                    reasons=tuple(reasons)))
                if budget is not None:
                    actions.extend(self._actions(rule, ent, budget, used, ratio, now, gpus))
        live_keys = {(s.scope, s.name) for s in statuses}
        for key in list(self.trends):
            if key not in live_keys:
                del self.trends[key]
        for a in actions:
            self.action_counts[(a.scope, a.name, a.action)] += 1
        return tuple(statuses), tuple(actions)

    def _actions(self, rule: BudgetRule, ent: _Entity, budget: int, used: int, ratio: float | None, now: float,
                 gpus: dict[int, Any]) -> list[BudgetAction]:
        out: list[BudgetAction] = []
        probes = [p for p in ent.procs if p.source == "probe"]
        if rule.soft_action and ratio is not None and ratio >= rule.soft_fraction and used > 0:
            for p in probes:
                k = (ent.scope, ent.name, p.pid)
                last = self._soft_sent.get(k)
                if last is None or now - last >= self.cfg.action_cooldown_seconds:
                    self._soft_sent[k] = now
                    out.append(BudgetAction(ent.scope, ent.name, p.pid, EMPTY_CACHE, (("op", EMPTY_CACHE),),
                                            f"use {used} B is {ratio:.2f} of the budget {budget} B "
                                            f">= soft limit {rule.soft_fraction}"))
        if rule.hard_action and probes:
            share = budget / len(probes)
            for p in probes:
                for d in p.devices:
                    total = inputs.gpu_total_bytes(gpus[d.dev], self.cost.memory_bytes, self.cost.default_model) \
                        if d.dev in gpus else None
                    if not total:
                        continue  # PyTorch's limit is a fraction of the GPU: unknown size, no action
                    frac = round(min(1.0, share / total), 6)
                    k2 = (ent.scope, ent.name, p.pid, d.dev)
                    if self._hard_sent.get(k2) == frac:
                        continue
                    self._hard_sent[k2] = frac
                    out.append(BudgetAction(ent.scope, ent.name, p.pid, MEMORY_FRACTION,
                                            (("device", d.dev), ("fraction", frac), ("op", MEMORY_FRACTION)),
                                            f"hard limit: {share:.0f} B of {total} B on GPU {d.dev}"))
        return out
