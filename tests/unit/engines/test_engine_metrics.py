from __future__ import annotations

import math

import numpy as np
from engine_support import GIB, dev, proc, snap
from gpufootprint.config import BudgetsConfig, Config, CostConfig
from gpufootprint.engines.runner import EMPTY_OUTPUTS, Engines
from gpufootprint.exporter.collector import FootprintCollector
from gpufootprint.exporter.decisions import engine_families
from gpufootprint.records import KERNEL_DTYPE
from gpufootprint.snapshot import EMPTY_SNAPSHOT, GpuState
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry


def kernels(pid: int) -> np.ndarray:
    r = np.zeros(40, KERNEL_DTYPE)
    r["start"] = 10**9 + np.arange(40) * 1_000_000
    r["end"] = r["start"] + 900_000
    r["pid"], r["stream"], r["name_id"] = pid, 7, np.arange(40) % 10
    return r


def scrape(outputs) -> dict[str, list]:  # type: ignore[no-untyped-def]
    reg = CollectorRegistry(auto_describe=False)
    # As the daemon serves them: the engines' families are the footprint collector's extra.
    reg.register(FootprintCollector(lambda: EMPTY_SNAPSHOT, extra=lambda: engine_families(outputs)))
    text = generate_latest(reg).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_engine_families_carry_the_contract_names_and_labels() -> None:
    cfg = Config(budgets=BudgetsConfig(rules=[{"scope": "process", "name": "*", "bytes": 0, "soft_action": True}]),
                 cost=CostConfig(default_model="H200"))
    eng = Engines(cfg)
    g = (GpuState(0, "NVIDIA H200", total_bytes=140 * GIB, utilization_ratio=0.25),)
    p = proc(11, dev(0, GIB), recent_kernels=kernels(11))
    eng.step(snap(0.0, p, gpus=g))
    out = eng.step(snap(10.0, p, gpus=g))
    m = scrape(out)
    advice = m["gpufootprint_graph_advice"]
    assert [(s.labels, s.value) for s in advice] == [
        ({"pid": "11", "source": "probe", "stream": "7", "decision": "insufficient_data"}, 1.0)]
    assert m["gpufootprint_graph_launch_overhead_seconds"][0].value > 0
    assert m["gpufootprint_budget_bytes"][0].value == 0
    assert math.isinf(m["gpufootprint_budget_utilization_ratio"][0].value)
    assert m["gpufootprint_budget_exhaustion_seconds"][0].value == 0
    assert [(s.name, s.labels["action"], s.value) for s in m["gpufootprint_budget_actions"]] == [
        ("gpufootprint_budget_actions_total", "torch_empty_cache", 1.0)]
    assert m["gpufootprint_gpu_price_dollars_per_hour"][0].labels == {"gpu": "0", "model": "NVIDIA H200"}
    cost = {s.labels["basis"]: s.value for s in m["gpufootprint_cost_dollars"] if s.name.endswith("_total")}
    assert abs(cost["time"] - 0.25 * 3.80 * 10 / 3600) < 1e-12
    idle = [s.value for s in m["gpufootprint_idle_cost_dollars"] if s.name.endswith("_total")]
    assert abs(idle[0] - 0.75 * 3.80 * 10 / 3600) < 1e-12
    for name in ("gpufootprint_idle_gpu_seconds", "gpufootprint_unused_memory_cost_dollars",
                 "gpufootprint_leak_suspect_bytes", "gpufootprint_leak_suspect", "gpufootprint_degradation_advice",
                 "gpufootprint_budget_used_bytes"):
        assert name in m


def test_empty_outputs_scrape_cleanly_and_a_broken_source_does_not_raise() -> None:
    assert scrape(EMPTY_OUTPUTS)["gpufootprint_graph_advice"] == []

    def broken():  # type: ignore[no-untyped-def]
        raise RuntimeError("boom")

    reg = CollectorRegistry(auto_describe=False)
    col = FootprintCollector(lambda: EMPTY_SNAPSHOT, extra=lambda: engine_families(broken()))
    reg.register(col)
    generate_latest(reg)
    assert col.collect_errors == 1
