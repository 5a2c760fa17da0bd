#!/usr/bin/env python3
"""Generate deploy/grafana/gpufootprint.json with grafana-foundation-sdk.

    python deploy/grafana/generate.py            # rewrite the checked-in file
    python deploy/grafana/generate.py --check    # exit 1 if the file is stale

The dashboard is code so that every panel query is a string the tests can run
against a real Prometheus (tests/integration/test_prometheus.py) and a change to
a metric name breaks a test, not a dashboard nobody opened. Metric names are the
ones in the contract (docs/metrics.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import bargauge, common, stat, statetimeline, table, timeseries
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus as prom
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm

OUT = Path(__file__).with_name("gpufootprint.json")
DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")

# Every per-process query carries this selector; "All" is ".*", which also matches a
# missing label, so the dashboard works with kubernetes.mode=off (no pod labels).
SEL = 'cluster=~"$cluster", node=~"$node", namespace=~"$namespace", pod=~"$pod", gpu=~"$gpu"'
NODE_SEL = 'cluster=~"$cluster", node=~"$node"'
GPU_SEL = 'cluster=~"$cluster", node=~"$node", gpu=~"$gpu"'
PROC_SEL = 'cluster=~"$cluster", node=~"$node", namespace=~"$namespace", pod=~"$pod"'  # pid-level, no gpu label


@dataclass(frozen=True)
class Q:
    expr: str
    legend: str = ""
    instant: bool = False


# Grafana has no dollars-per-hour unit; a custom suffix keeps the number a rate, not an amount.
RATE_USD_PER_HOUR = "suffix: $/h"


def target(q: Q, ref: str) -> prom.Dataquery:
    t = prom.Dataquery().expr(q.expr).ref_id(ref).datasource(DS)
    if q.legend:
        t = t.legend_format(q.legend)
    return t.instant() if q.instant else t.range()


def with_targets(panel, queries: list[Q], title: str, desc: str, w: int, h: int):  # type: ignore[no-untyped-def]
    panel = panel.title(title).description(desc).datasource(DS).span(w).height(h)
    for i, q in enumerate(queries):
        panel = panel.with_target(target(q, chr(ord("A") + i)))
    return panel


def ts(title: str, desc: str, queries: list[Q], unit: str, *, stacked: bool = False, w: int = 12, h: int = 8,
       bars: bool = False) -> timeseries.Panel:
    p = timeseries.Panel().unit(unit).fill_opacity(35 if stacked else 10).line_width(1)
    p = p.legend(common.VizLegendOptions().display_mode(cm.LegendDisplayMode.TABLE).placement(
        cm.LegendPlacement.RIGHT).show_legend(True).calcs(["lastNotNull", "max"]))
    if stacked:
        p = p.stacking(common.StackingConfig().mode(cm.StackingMode.NORMAL).group("A"))
    if bars:
        p = p.draw_style(cm.GraphDrawStyle.BARS)
    return with_targets(p, queries, title, desc, w, h)


def stat_panel(title: str, desc: str, queries: list[Q], unit: str, *, w: int = 6, h: int = 5) -> stat.Panel:
    p = stat.Panel().unit(unit).graph_mode(cm.BigValueGraphMode.AREA).color_mode(cm.BigValueColorMode.VALUE)
    p = p.reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    return with_targets(p, queries, title, desc, w, h)


def table_panel(title: str, desc: str, queries: list[Q], unit: str, *, w: int = 12, h: int = 8,
                column_units: dict[str, str] | None = None) -> table.Panel:
    p = table.Panel().unit(unit).show_header(True)
    for column, column_unit in (column_units or {}).items():
        p = p.override_by_name(column, [dm.DynamicConfigValue(id_val="unit", value=column_unit)])
    return with_targets(p, queries, title, desc, w, h)


def bars_panel(title: str, desc: str, queries: list[Q], unit: str, *, w: int = 12, h: int = 8,
               lo: float | None = None, hi: float | None = None) -> bargauge.Panel:
    p = bargauge.Panel().unit(unit).reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    if lo is not None:
        p = p.min(lo)
    if hi is not None:
        p = p.max(hi)
    return with_targets(p, queries, title, desc, w, h)


def variable(name: str, label: str, query: str) -> db.QueryVariable:
    return (db.QueryVariable(name).label(label).datasource(DS)
            .query({"query": query, "refId": f"var-{name}", "qryType": 1})
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).multi(True).include_all(True).all_value(".*")
            .sort(dm.VariableSort.ALPHABETICAL_ASC).current(dm.VariableOption(selected=True, text="All",
                                                                              value="$__all")))


def build() -> dict:  # type: ignore[type-arg]
    r = "$__rate_interval"
    d = (db.Dashboard("gpufootprint: GPU memory footprint, cost and advice")
         .uid("gpufootprint").tags(["gpu", "cuda", "gpufootprint"]).editable()
         .refresh("30s").time("now-1h", "now").timezone("browser").tooltip(dm.DashboardCursorSync.CROSSHAIR)
         .description("Runtime GPU memory footprint from CUPTI, per process and pod. Generated by "
                      "deploy/grafana/generate.py; edit the code, not this dashboard."))
    d = d.with_variable(db.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
    d = d.with_variable(variable("cluster", "cluster", "label_values(gpufootprint_build_info, cluster)"))
    d = d.with_variable(variable("node", "node", 'label_values(gpufootprint_build_info{cluster=~"$cluster"}, node)'))
    d = d.with_variable(variable("namespace", "namespace",
                                 f"label_values(gpufootprint_device_bytes{{{NODE_SEL}}}, namespace)"))
    d = d.with_variable(variable("pod", "pod", f'label_values(gpufootprint_device_bytes{{{NODE_SEL}, '
                                               'namespace=~"$namespace"}, pod)'))
    d = d.with_variable(variable("gpu", "gpu", f"label_values(gpufootprint_device_bytes{{{NODE_SEL}}}, gpu)"))
    # Anomaly windows (the sampler's) as annotations: a mark where windows closed. The counter is
    # per daemon (label reason only, no pid/pod), so only the node variables can select it.
    d = d.annotation(db.AnnotationQuery().name("anomaly windows").datasource(DS).enable(True).icon_color("red")
                     .expr(f"sum by (reason) (increase(gpufootprint_anomaly_windows_total{{{NODE_SEL}}}[1m])) > 0"))

    d = d.with_row(db.Row("Footprint"))
    d = d.with_panel(ts(
        "GPU memory per process, stacked by kind",
        "Bytes held by live allocations (CUPTI MEMORY2), per process and memory kind, as of each process's "
        "watermark. Includes memory PyTorch's own statistics cannot see (CUDA libraries' workspaces).",
        [Q(f"sum by (node, namespace, pod, pid, kind) (gpufootprint_live_bytes{{{SEL}}})",
           "{{namespace}}/{{pod}} pid {{pid}} {{kind}}")], "bytes", stacked=True, w=24, h=9))
    d = d.with_panel(ts(
        "Window peak vs NVML used memory",
        "Highest GPU-resident bytes over the trailing window, from exact event times, against what NVML "
        "reports when it is polled: the gap is the spikes a poller misses.",
        [Q(f"sum by (gpu) (gpufootprint_window_peak_bytes{{{SEL}}})", "gpu {{gpu}} window peak (CUPTI)"),
         Q(f"sum by (gpu) (gpufootprint_device_bytes{{{SEL}}})", "gpu {{gpu}} now (CUPTI)"),
         Q(f"max by (gpu) (gpufootprint_nvml_memory_used_bytes{{{GPU_SEL}}})", "gpu {{gpu}} NVML used")],
        "bytes"))
    d = d.with_panel(ts(
        "Copy bandwidth by direction",
        "Bytes per second moved by cudaMemcpy* (CUPTI MEMCPY), by direction. Probed processes report copies only "
        "with probe.copies: always (off by default: it costs 3-9% on launch-bound steps).",
        [Q(f"sum by (direction) (rate(gpufootprint_memcpy_bytes_total{{{SEL}}}[{r}]))", "{{direction}}")],
        "Bps"))
    d = d.with_panel(ts(
        "Unified memory page migrations and faults",
        "Pages migrated per second (by direction) and page faults per second (by side), from CUPTI's unified "
        "memory counters.",
        [Q(f"sum by (direction) (rate(gpufootprint_page_migrations_total{{{SEL}}}[{r}]))", "migrate {{direction}}"),
         Q(f"sum by (side) (rate(gpufootprint_page_faults_total{{{SEL}}}[{r}]))", "faults {{side}}")], "ops"))
    d = d.with_panel(ts(
        "Allocation churn",
        "Allocations per second by kind: high churn with a flat footprint points at allocator reuse.",
        [Q(f"sum by (kind) (rate(gpufootprint_allocations_total{{{SEL}}}[{r}]))", "{{kind}}")], "ops"))

    d = d.with_row(db.Row("Sampler and advice"))
    d = d.with_panel(with_targets(
        statetimeline.Panel().merge_values(True).fill_opacity(70), [
            Q(f"max by (node, namespace, pod, pid, mode) (gpufootprint_sampler_mode{{{PROC_SEL}}}) == 1",
              "{{pod}} pid {{pid}} {{mode}}")],
        "Sampler mode", "quiet / steady / burst, as the adaptive sampler chose it; anomaly windows show as "
        "annotations (red).", 12, 7))
    d = d.with_panel(table_panel(
        "CUDA Graph advice",
        "Per stream: capture (launch overhead worth saving), keep, already captured, or not enough data.",
        [Q(f"max by (node, namespace, pod, pid, stream, decision) (gpufootprint_graph_advice{{{PROC_SEL}}}) == 1",
           instant=True),
         Q(f"max by (node, namespace, pod, pid, stream) (gpufootprint_graph_launch_overhead_seconds{{{PROC_SEL}}})",
           instant=True)], "none", column_units={"Value #B": "s"}))

    d = d.with_row(db.Row("Budgets and leaks"))
    d = d.with_panel(bars_panel(
        "Budget utilisation", "Used bytes over budget bytes, per budget (budgets.rules). Budgets carry scope and "
        "name, not pod labels: only the cluster and node variables select them.",
        [Q(f"max by (scope, name) (gpufootprint_budget_utilization_ratio{{{NODE_SEL}}})", "{{scope}} {{name}}")],
        "percentunit", w=8, lo=0, hi=1))
    d = d.with_panel(bars_panel(
        "Time to budget exhaustion", "Predicted from the recent growth; no bar: not growing.",
        [Q(f"min by (scope, name) (gpufootprint_budget_exhaustion_seconds{{{NODE_SEL}}})", "{{scope}} {{name}}")],
        "s", w=8))
    d = d.with_panel(ts(
        "Leak suspects", "Bytes held by allocations the leak engine flags, per process.",
        [Q(f"sum by (node, namespace, pod, pid) (gpufootprint_leak_suspect_bytes{{{SEL}}})", "{{pod}} pid {{pid}}")],
        "bytes", w=8))

    d = d.with_row(db.Row("Cost"))
    d = d.with_panel(stat_panel(
        "Spend now", "Dollars per hour accrued by all GPU processes in the selection, now.",
        [Q(f"sum(rate(gpufootprint_cost_dollars_total{{{SEL}, basis=\"time\"}}[{r}])) * 3600")], RATE_USD_PER_HOUR))
    d = d.with_panel(stat_panel(
        "Idle GPU hours", "Hours GPUs in the selection sat idle over the dashboard's time range.",
        [Q(f"sum(increase(gpufootprint_idle_gpu_seconds_total{{{GPU_SEL}}}[$__range])) / 3600")], "h"))
    d = d.with_panel(stat_panel(
        "Idle GPU cost", "Dollars spent on idle GPUs over the time range.",
        [Q(f"sum(increase(gpufootprint_idle_cost_dollars_total{{{GPU_SEL}}}[$__range]))")], "currencyUSD"))
    d = d.with_panel(stat_panel(
        "Memory held but unused", "Dollars of GPU memory reserved by allocators but holding no live "
        "allocation, over the time range.",
        [Q(f"sum(increase(gpufootprint_unused_memory_cost_dollars_total{{{SEL}}}[$__range]))")], "currencyUSD"))
    d = d.with_panel(table_panel(
        "Spend by namespace and pod", "Dollars accrued over the time range, by basis (time or memory share).",
        [Q(f"sum by (namespace, pod, basis) (increase(gpufootprint_cost_dollars_total{{{SEL}}}[$__range]))",
           instant=True)], "currencyUSD", w=24))

    d = d.with_row(db.Row("Probe and daemon health"))
    d = d.with_panel(ts(
        "Probe overhead", "CPU seconds per second the probe's CUPTI callbacks take inside each workload "
        "(thread CPU time packing records).",
        [Q(f"sum by (node, namespace, pod, pid) (rate(gpufootprint_probe_callback_seconds_total{{{PROC_SEL}}}[{r}]))",
           "{{pod}} pid {{pid}} callbacks")], "percentunit", w=8))
    d = d.with_panel(ts(
        "Probe drops", "Records the probe dropped rather than slow the workload down, records CUPTI itself "
        "dropped (never seen: the footprint may be off), and records the daemon refused (by reason) or got "
        "too late to order.",
        [Q(f"sum by (node, namespace, pod, pid) (rate(gpufootprint_probe_records_dropped_total{{{PROC_SEL}}}[{r}]))",
           "{{pod}} pid {{pid}} dropped"),
         Q(f"sum by (node, namespace, pod, pid) "
           f"(rate(gpufootprint_probe_cupti_dropped_records_total{{{PROC_SEL}}}[{r}]))",
           "{{pod}} pid {{pid}} lost in CUPTI"),
         Q(f"sum by (reason) (rate(gpufootprint_ingest_errors_total{{{NODE_SEL}}}[{r}])) "
           "or on() vector(0)", "daemon refused {{reason}}"),
         Q(f"sum(rate(gpufootprint_late_records_total{{{NODE_SEL}}}[{r}]))", "late")], "ops", w=8))
    d = d.with_panel(ts(
        "Ingest and exporter", "Records accepted per second by kind, and series folded by the series cap.",
        [Q(f"sum by (kind) (rate(gpufootprint_records_ingested_total{{{NODE_SEL}}}[{r}]))", "{{kind}}"),
         Q(f"sum by (metric) (rate(gpufootprint_series_dropped_total{{{NODE_SEL}}}[{r}]))",
           "capped {{metric}}")], "ops", w=8))
    out = json.loads(JSONEncoder(sort_keys=True, indent=2).encode(d.build()))
    for i, panel in enumerate(out["panels"], start=1):
        panel["id"] = i  # the SDK leaves ids at 0; Grafana links and edits panels by id
    return out


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the checked-in file differs")
    ap.add_argument("-o", "--output", type=Path, default=OUT)
    args = ap.parse_args()
    text = render()
    if args.check:
        if not args.output.exists() or args.output.read_text() != text:
            print(f"{args.output} is stale: run python deploy/grafana/generate.py", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
