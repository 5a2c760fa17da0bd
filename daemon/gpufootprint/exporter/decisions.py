"""Families of the decision engines' latest outputs (docs/metrics.md, section Engines).

Built with the same scrape as the footprint's (``FootprintCollector``'s ``extra``), so pod labels
and the series cap apply to them as well. Series of a process, budget or GPU that is gone simply
stop.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from gpufootprint.engines.budgets import BudgetStatus
from gpufootprint.engines.cost import GpuCost, ProcessCost
from gpufootprint.engines.degradation import Advice
from gpufootprint.engines.graph import GraphDecision
from gpufootprint.engines.leaks import LeakStatus
from gpufootprint.engines.runner import EngineOutputs
from gpufootprint.exporter.table import Row, build, counter, each, gauge, one

_PROC = ("pid", "gpu", "source")
_BUDGET = ("scope", "name")

GRAPH_FAMILIES: tuple[Row[GraphDecision], ...] = (
    gauge("gpufootprint_graph_advice",
          "CUDA Graph advisor decision per process and stream (1 for the current decision).",
          ("pid", "source", "stream", "decision"), lambda d: (((d.decision,), 1),)),
    gauge("gpufootprint_graph_launch_overhead_seconds", "Launch gaps per repeated step that CUDA Graph capture would "
          "save.", ("pid", "source", "stream"), one(lambda d: d.launch_overhead_seconds)),
)

BUDGET_FAMILIES: tuple[Row[BudgetStatus], ...] = (
    gauge("gpufootprint_budget_bytes", "Configured memory budget.", _BUDGET, one(lambda s: s.budget_bytes)),
    gauge("gpufootprint_budget_used_bytes", "GPU-resident bytes of the budget's live members.", _BUDGET,
          one(lambda s: s.used_bytes)),
    gauge("gpufootprint_budget_utilization_ratio", "Used over budget (+Inf for a zero budget in use).", _BUDGET,
          one(lambda s: s.utilization_ratio)),
    gauge("gpufootprint_budget_exhaustion_seconds",
          "Predicted seconds until the budget is used up, from the least-squares trend (absent when not growing; 0 "
          "when exceeded).", _BUDGET, one(lambda s: s.exhaustion_seconds)),
)

ACTION_FAMILIES: tuple[Row[EngineOutputs], ...] = (
    counter("gpufootprint_budget_actions", "Budget actions sent to probes, by action.", (*_BUDGET, "action"),
            lambda out: sorted(out.budget_action_counts.items())),
)

LEAK_FAMILIES: tuple[Row[LeakStatus], ...] = (
    gauge("gpufootprint_leak_suspect_bytes", "Live bytes in allocations older than leaks.min_age_seconds.", _PROC,
          one(lambda leak: leak.suspect_bytes)),
    gauge("gpufootprint_leak_suspect", "1 when old allocations coincide with a growing footprint.", _PROC,
          one(lambda leak: 1 if leak.suspect else 0)),
)

DEGRADATION_FAMILIES: tuple[Row[Advice], ...] = (
    gauge("gpufootprint_degradation_advice", "Degradation advice in force (1).", ("gpu", "pid", "advice"),
          lambda a: (((str(a.gpu), str(a.pid), a.advice), 1),)),
)

GPU_COST_FAMILIES: tuple[Row[GpuCost], ...] = (
    gauge("gpufootprint_gpu_price_dollars_per_hour", "Configured price of the GPU model.", ("gpu", "model"),
          lambda g: (((g.model or "",), g.dollars_per_hour or 0.0),)),
    counter("gpufootprint_idle_gpu_seconds", "GPU seconds not used by any process.", ("gpu",),
            one(lambda g: g.idle_seconds)),
    counter("gpufootprint_idle_cost_dollars", "Dollars of GPU time not used by any process.", ("gpu",),
            one(lambda g: g.idle_dollars)),
    counter("gpufootprint_unallocated_memory_cost_dollars",
            "Dollars of GPU memory no process held (memory basis remainder).", ("gpu",),
            one(lambda g: g.unallocated_memory_dollars)),
)

PROCESS_COST_FAMILIES: tuple[Row[ProcessCost], ...] = (
    counter("gpufootprint_cost_dollars", "Dollars accrued by the process, by basis.", (*_PROC, "basis"),
            each(lambda p: {"time": p.time_dollars, "memory": p.memory_dollars})),
    counter("gpufootprint_unused_memory_cost_dollars",
            "Dollars of GPU memory the process held but did not use (allocator slack, pool headroom).", _PROC,
            one(lambda p: p.unused_memory_dollars)),
)


def engine_families(out: EngineOutputs) -> Iterator[Metric]:
    """Metric families of the engines' decisions (docs/metrics.md, section Engines)."""
    yield from build(GRAPH_FAMILIES, (((str(d.pid), d.source, "" if d.stream is None else str(d.stream)), d)
                                      for d in out.graph))
    yield from build(BUDGET_FAMILIES, (((s.scope, s.name), s) for s in out.budgets))
    yield from build(ACTION_FAMILIES, (((), out),))
    yield from build(LEAK_FAMILIES, (((str(leak.pid), str(leak.dev), leak.source), leak) for leak in out.leaks))
    yield from build(DEGRADATION_FAMILIES, (((), a) for a in out.degradation))
    if out.cost is None:
        return
    # A GPU without a price accrues nothing: no series rather than zeros.
    yield from build(GPU_COST_FAMILIES, (((str(g.gpu),), g) for g in out.cost.gpus if g.dollars_per_hour is not None))
    yield from build(PROCESS_COST_FAMILIES, (((str(p.pid), str(p.dev), p.source), p) for p in out.cost.processes))

