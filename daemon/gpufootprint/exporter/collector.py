"""Prometheus metrics, built at scrape time from the current immutable snapshot.

A custom ``Collector`` on the daemon's own registry (prometheus_client's
documented pattern): nothing is registered per process, so the series of a
process that has gone simply stop being yielded. ``collect`` never raises: a bug
here would otherwise blank the whole scrape.
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from gpufootprint import __version__
from gpufootprint.engines.runner import EngineOutputs
from gpufootprint.records import COPY_KIND_NAMES
from gpufootprint.snapshot import PipelineSnapshot, ProcessSnapshot
from gpufootprint.wire.framing import WIRE_VERSION

log = logging.getLogger(__name__)

PROC_LABELS = ["pid", "gpu", "source"]


def _proc_values(proc: ProcessSnapshot, dev: int) -> list[str]:
    return [str(proc.pid), str(dev), proc.source]


Postprocess = Callable[[list[Metric]], list[Metric]]


class FootprintCollector(Collector):
    def __init__(self, snapshot: Callable[[], PipelineSnapshot], postprocess: Postprocess | None = None,
                 extra: Callable[[], Iterator[Metric]] | None = None) -> None:
        self._snapshot = snapshot
        # More families built with the same scrape (the engines'), so that pod labels and
        # the series cap apply to them as well.
        self._extra = extra
        self.collect_errors = 0
        # Issue 6: pod labels and the series cap (exporter/cardinality.py), over all families.
        self._postprocess = postprocess

    def describe(self) -> list[Metric]:
        return []  # families depend on the snapshot; skip registration-time collection

    def collect(self) -> Iterator[Metric]:
        try:
            families = list(self._families(self._snapshot()))
        except Exception:  # noqa: BLE001 - a scrape must always answer
            self.collect_errors += 1
            log.exception("building metrics failed; serving self-metrics only")
            families = []
        if self._extra is not None:
            try:
                families.extend(self._extra())
            except Exception:  # noqa: BLE001
                self.collect_errors += 1
                log.exception("building engine metrics failed")
        if self._postprocess is not None:
            try:
                families = self._postprocess(families)
            except Exception:  # noqa: BLE001 - never fall back to uncapped per-process series
                self.collect_errors += 1
                log.exception("post-processing metrics failed; serving families without per-process series")
                families = [f for f in families if not any("pid" in s.labels for s in f.samples)]
        yield from families
        errors = CounterMetricFamily("gpufootprint_exporter_collect_errors",
                                     "Scrapes whose metrics could not be built from the snapshot.")
        errors.add_metric([], self.collect_errors)
        yield errors

    def _families(self, snap: PipelineSnapshot) -> Iterator[Metric]:
        info = InfoMetricFamily("gpufootprint_build", "Version of gpufootprint serving these metrics.")
        info.add_metric([], {"version": __version__, "wire_version": str(WIRE_VERSION),
                             "python": platform.python_version()})
        yield info

        live = GaugeMetricFamily("gpufootprint_live_bytes",
                                 "Bytes held by live allocations, by memory kind, as of the process's watermark.",
                                 labels=[*PROC_LABELS, "kind"])
        device = GaugeMetricFamily("gpufootprint_device_bytes",
                                   "Bytes resident on the GPU (device, device_static, array, untracked kinds).",
                                   labels=PROC_LABELS)
        peak = GaugeMetricFamily("gpufootprint_window_peak_bytes",
                                 "Highest GPU-resident bytes over the trailing peak window, from exact event times.",
                                 labels=PROC_LABELS)
        pool_res = GaugeMetricFamily("gpufootprint_pool_reserved_bytes",
                                     "Bytes reserved by stream-ordered memory pools (cudaMallocAsync).",
                                     labels=PROC_LABELS)
        pool_used = GaugeMetricFamily("gpufootprint_pool_used_bytes",
                                      "Bytes of live stream-ordered allocations served from pools.",
                                      labels=PROC_LABELS)
        nlive = GaugeMetricFamily("gpufootprint_live_allocations", "Number of live allocations.",
                                  labels=PROC_LABELS)
        allocs = CounterMetricFamily("gpufootprint_allocations", "Allocations seen, by memory kind.",
                                     labels=[*PROC_LABELS, "kind"])
        rels = CounterMetricFamily("gpufootprint_releases", "Releases seen, by memory kind.",
                                   labels=[*PROC_LABELS, "kind"])
        abytes = CounterMetricFamily("gpufootprint_allocated_bytes", "Bytes allocated, by memory kind.",
                                     labels=[*PROC_LABELS, "kind"])
        rbytes = CounterMetricFamily("gpufootprint_released_bytes", "Bytes released, by memory kind.",
                                     labels=[*PROC_LABELS, "kind"])
        cpy_n = CounterMetricFamily("gpufootprint_memcpy", "Memory copies, by direction.",
                                    labels=[*PROC_LABELS, "direction"])
        cpy_b = CounterMetricFamily("gpufootprint_memcpy_bytes", "Bytes copied, by direction.",
                                    labels=[*PROC_LABELS, "direction"])
        cpy_s = CounterMetricFamily("gpufootprint_memcpy_seconds", "GPU time spent in copies, by direction.",
                                    labels=[*PROC_LABELS, "direction"])
        set_b = CounterMetricFamily("gpufootprint_memset_bytes", "Bytes set by memset.", labels=PROC_LABELS)
        peer = CounterMetricFamily("gpufootprint_peer_copy_bytes",
                                   "Bytes copied between two GPUs (peer copies), by source and destination GPU.",
                                   labels=["pid", "source", "src_gpu", "dst_gpu"])
        pending = GaugeMetricFamily("gpufootprint_pending_records",
                                    "Records received but not yet applied (waiting to be put in time order).",
                                    labels=["pid", "source"])
        lag = GaugeMetricFamily("gpufootprint_watermark_timestamp_seconds",
                                "Time up to which a process's records are applied (Unix seconds).",
                                labels=["pid", "source"])
        drift = GaugeMetricFamily("gpufootprint_footprint_drift_bytes",
                                  "Bytes by which the footprint differed from the probe's own live table at the "
                                  "latest check (summed over GPUs and kinds; 0: exact).", labels=["pid", "source"])
        drift_n = CounterMetricFamily("gpufootprint_footprint_drift_mismatches",
                                      "Checks against the probe's own table that found a difference (each asks the "
                                      "probe for a resync).", labels=["pid", "source"])
        for proc in snap.processes:
            pending.add_metric([str(proc.pid), proc.source], proc.pending_records)
            lag.add_metric([str(proc.pid), proc.source], proc.as_of_ns / 1e9)
            if proc.drift_checks:
                drift.add_metric([str(proc.pid), proc.source], proc.drift_bytes)
                drift_n.add_metric([str(proc.pid), proc.source], proc.drift_mismatches)
            for dev in proc.devices:
                base = _proc_values(proc, dev.dev)
                for kind, value in dev.live_bytes.items():
                    live.add_metric([*base, kind], value)
                device.add_metric(base, dev.device_bytes)
                peak.add_metric(base, dev.window_peak_bytes)
                pool_res.add_metric(base, dev.pool_reserved_bytes)
                pool_used.add_metric(base, dev.pool_used_bytes)
                nlive.add_metric(base, dev.live_allocations)
                for fam, values in ((allocs, dev.allocations), (rels, dev.releases),
                                    (abytes, dev.allocated_bytes), (rbytes, dev.released_bytes)):
                    for kind, value in values.items():
                        fam.add_metric([*base, kind], value)
                for ck, n in dev.memcpy_count.items():
                    direction = COPY_KIND_NAMES.get(ck, str(ck))
                    cpy_n.add_metric([*base, direction], n)
                    cpy_b.add_metric([*base, direction], dev.memcpy_bytes.get(ck, 0))
                    cpy_s.add_metric([*base, direction], dev.memcpy_seconds.get(ck, 0.0))
                set_b.add_metric(base, dev.memset_bytes)
            peers: dict[tuple[int, int], int] = {}
            for dev in proc.devices:
                for pair, n in dev.peer_copy_bytes.items():
                    peers[pair] = peers.get(pair, 0) + n
            for (src, dst), n in sorted(peers.items()):
                peer.add_metric([str(proc.pid), proc.source, str(src), str(dst)], n)
        yield from (live, device, peak, pool_res, pool_used, nlive, allocs, rels, abytes, rbytes,
                    cpy_n, cpy_b, cpy_s, set_b, peer, pending, lag, drift, drift_n)
        yield from probe_families(snap)

        window = GaugeMetricFamily("gpufootprint_window_peak_window_seconds",
                                   "Width of the trailing window of gpufootprint_window_peak_bytes.")
        window.add_metric([], snap.window_peak_seconds)
        yield window
        procs = GaugeMetricFamily("gpufootprint_processes", "Processes tracked, by source and state.",
                                  labels=["source", "state"])
        counts: dict[tuple[str, str], int] = {}
        for proc in snap.processes:
            key = (proc.source, "exited" if proc.exited else "running")
            counts[key] = counts.get(key, 0) + 1
        for (source, state), n in sorted(counts.items()):
            procs.add_metric([source, state], n)
        yield procs
        ingested = CounterMetricFamily("gpufootprint_records_ingested", "Records accepted, by record kind.",
                                       labels=["kind"])
        for kind, n in sorted(snap.records_ingested.items()):
            ingested.add_metric([kind], n)
        yield ingested
        errors = CounterMetricFamily("gpufootprint_ingest_errors",
                                     "Records or frames that broke the model or the wire format, by reason.",
                                     labels=["reason"])
        for reason, n in sorted(snap.ingest_errors.items()):
            errors.add_metric([reason], n)
        yield errors
        late = CounterMetricFamily("gpufootprint_late_records",
                                   "Records that arrived after their time was already applied, by record kind.",
                                   labels=["kind"])
        for kind in ("memory", "memory_pool", *sorted(k for k in snap.late_by_kind if k not in ("memory",
                                                                                                "memory_pool"))):
            late.add_metric([kind], snap.late_by_kind.get(kind, 0))
        yield late
        checks = CounterMetricFamily("gpufootprint_footprint_checks",
                                     "Checks of the footprint against the probes' own tables at their watermarks, by "
                                     "result (match, mismatch, skipped: the state was not as of that watermark).",
                                     labels=["result"])
        for result in ("match", "mismatch", "skipped"):
            checks.add_metric([result], snap.verify_results.get(result, 0))
        yield checks
        yield from sampler_nvml_families(snap)
        for name, value in sorted(snap.daemon.items()):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                g = GaugeMetricFamily(f"gpufootprint_daemon_{name}", _DAEMON_HELP.get(name, name))
                g.add_metric([], value)
                yield g


_DAEMON_HELP = {
    "probe_connections": "Probe connections open now.",
    "gpu_present": "1 when the daemon found an NVIDIA driver and GPU, else 0.",
    "snapshot_age_seconds": "Age of the snapshot this scrape was built from.",
}


# --- probe self-metrics (issue 3) -----------------------------------------------------

_PROBE_COUNTERS = (
    ("gpufootprint_probe_records_sent", "records_sent", "Records the probe handed to the daemon's socket."),
    ("gpufootprint_probe_records_dropped", "records_dropped",
     "Records the probe dropped: daemon away, socket buffer full, or a connection that broke."),
    ("gpufootprint_probe_reconnects", "reconnects", "Times the probe connected again after losing the daemon."),
    ("gpufootprint_probe_cupti_dropped_records", "cupti_dropped_records",
     "Records CUPTI itself dropped for want of buffer space: never seen, so the footprint may be off."),
    ("gpufootprint_probe_callback_seconds", "callback_seconds",
     "CPU time spent in the probe's CUPTI buffer callback (packing records)."),
    ("gpufootprint_probe_cupti_gap_seconds", "cupti_gap_seconds",
     "Time CUPTI belonged to torch.profiler; the probe resynced from PyTorch's segments after it."),
    ("gpufootprint_probe_resyncs", "resyncs",
     "Times the probe sent its whole live table: after each connect, a profiler gap, dropped records, "
     "or the daemon's request."),
    ("gpufootprint_probe_drop_resyncs", "drop_resyncs",
     "Resyncs the probe sent to repair memory records it dropped while connected (socket buffer full)."),
)
_PROBE_GAUGES = (
    ("gpufootprint_probe_device_bytes", "own_device_bytes",
     "Bound on the GPU memory CUPTI's activity buffers take in the process (size x pool limit)."),
    ("gpufootprint_probe_driver_hooks", "driver_hooks",
     "1 while the probe holds its CUPTI driver-API hooks (mappings on every thread are recorded), else 0."),
    ("gpufootprint_probe_host_bytes", "own_host_bytes",
     "Host memory the probe holds: CUPTI buffers outstanding, packing arrays, unsent frames."),
)


def probe_families(snap: PipelineSnapshot) -> Iterator[Metric]:
    """The probes' own counters, from their latest HEARTBEAT/GOODBYE (per process: pid, source)."""
    labels = ["pid", "source"]
    fams: list[tuple[Metric, str]] = []
    for name, key, doc in _PROBE_COUNTERS:
        fams.append((CounterMetricFamily(name, doc, labels=labels), key))
    for name, key, doc in _PROBE_GAUGES:
        fams.append((GaugeMetricFamily(name, doc, labels=labels), key))
    conns = CounterMetricFamily("gpufootprint_probe_connections",
                                "Probe connection attempts by result (ok, missing, refused, denied, busy, error).",
                                labels=[*labels, "result"])
    disc = CounterMetricFamily("gpufootprint_probe_disconnects",
                               "Probe connections lost, by reason (peer_closed, send_error, recv_error, bad_control, "
                               "goodbye).", labels=[*labels, "reason"])
    for proc in snap.processes:
        c = proc.probe_counters
        if not c:
            continue
        base = [str(proc.pid), proc.source]
        for fam, key in fams:
            if key in c:
                fam.add_metric(base, c[key])  # type: ignore[attr-defined]
        for key, value in sorted(c.items()):
            if key.startswith("connections_"):
                conns.add_metric([*base, key[len("connections_"):]], value)
            elif key.startswith("disconnects_"):
                disc.add_metric([*base, key[len("disconnects_"):]], value)
    yield from (fam for fam, _ in fams)
    yield conns
    yield disc


# --- issue 4: feature frames, adaptive sampler, NVML ------------------------------------------


def sampler_nvml_families(snap: PipelineSnapshot) -> Iterator[Metric]:
    """Families of the feature frames, the sampler and the NVML source (docs/metrics.md)."""
    sources = {p.pid: p.source for p in snap.processes}
    mode = GaugeMetricFamily("gpufootprint_sampler_mode", "1 for the sampler's current mode of a process.",
                             labels=["pid", "source", "mode"])
    interval = GaugeMetricFamily("gpufootprint_sampler_interval_seconds",
                                 "The sampler's current interval for a process (5 ms burst .. 200 ms quiet).",
                                 labels=["pid", "source"])
    for st in snap.sampler:
        src = sources.get(st.pid, "trace")
        for m in ("quiet", "steady", "burst"):
            mode.add_metric([str(st.pid), src, m], 1.0 if st.mode == m else 0.0)
        interval.add_metric([str(st.pid), src], st.interval_s)
    yield mode
    yield interval
    windows = CounterMetricFamily("gpufootprint_anomaly_windows", "Anomaly windows closed, by reason.",
                                  labels=["reason"])
    for reason, n in sorted(snap.anomaly_counts.items()):
        windows.add_metric([reason], n)
    yield windows

    frame_peak = GaugeMetricFamily("gpufootprint_frame_peak_bytes",
                                   "Peak GPU-resident bytes of the last closed sampler interval (exact).",
                                   labels=PROC_LABELS)
    migrations = CounterMetricFamily("gpufootprint_page_migrations",
                                     "Unified-memory page migrations (transfer records), by direction.",
                                     labels=[*PROC_LABELS, "direction"])
    faults = CounterMetricFamily("gpufootprint_page_faults", "Unified-memory page faults, by side.",
                                 labels=[*PROC_LABELS, "side"])
    reuse = GaugeMetricFamily("gpufootprint_allocation_reuse_ratio",
                              "Share of allocations made at an (address, size) released before.",
                              labels=PROC_LABELS)
    pool_util = GaugeMetricFamily("gpufootprint_pool_utilization_ratio",
                                  "Stream-ordered pools: bytes of live allocations / bytes reserved.",
                                  labels=PROC_LABELS)
    slack = GaugeMetricFamily("gpufootprint_allocator_slack_bytes",
                              "PyTorch caching allocator: reserved minus allocated bytes (from the probe).",
                              labels=PROC_LABELS)
    mig_rate = GaugeMetricFamily("gpufootprint_page_migration_rate_hertz",
                                 "UM migrations + faults + host<->device copies per second, last closed window.",
                                 labels=PROC_LABELS)
    for f in snap.features:
        base = [str(f.pid), str(f.dev), sources.get(f.pid, "trace")]
        if f.frame_peak_bytes is not None:
            frame_peak.add_metric(base, f.frame_peak_bytes)
        for direction, n in sorted(f.page_migrations.items()):
            migrations.add_metric([*base, direction], n)
        for side, n in sorted(f.page_faults.items()):
            faults.add_metric([*base, side], n)
        if f.allocation_reuse_ratio is not None:
            reuse.add_metric(base, f.allocation_reuse_ratio)
        if f.pool_utilization_ratio is not None:
            pool_util.add_metric(base, f.pool_utilization_ratio)
        if f.allocator_slack_bytes is not None:
            slack.add_metric(base, f.allocator_slack_bytes)
        if f.migration_rate_hz is not None:
            mig_rate.add_metric(base, f.migration_rate_hz)
    yield from (frame_peak, migrations, faults, reuse, pool_util, slack, mig_rate)

    nv = snap.nvml
    if nv is None:
        return
    gl = ["gpu", "uuid", "model"]
    fams: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
        "memory_used": GaugeMetricFamily("gpufootprint_nvml_memory_used_bytes", "NVML: device memory used.", labels=gl),
        "memory_total": GaugeMetricFamily("gpufootprint_nvml_memory_total_bytes", "NVML: device memory.", labels=gl),
        "memory_reserved": GaugeMetricFamily("gpufootprint_nvml_memory_reserved_bytes",
                                             "NVML (v2 call): memory reserved by the driver and firmware.",
                                             labels=gl),
        "util": GaugeMetricFamily("gpufootprint_nvml_utilization_ratio",
                                  "NVML: share of the last sample period a kernel ran.", labels=gl),
        "tx": GaugeMetricFamily("gpufootprint_nvml_pcie_tx_bytes_per_second", "NVML: PCIe transmit throughput.",
                                labels=gl),
        "rx": GaugeMetricFamily("gpufootprint_nvml_pcie_rx_bytes_per_second", "NVML: PCIe receive throughput.",
                                labels=gl),
        "power": GaugeMetricFamily("gpufootprint_nvml_power_watts", "NVML: power draw.", labels=gl),
        "energy": CounterMetricFamily("gpufootprint_nvml_energy_joules",
                                      "NVML: energy since the driver was loaded.", labels=gl),
        "up": GaugeMetricFamily("gpufootprint_nvml_up", "1 when NVML answers for the GPU, 0 when it is lost.",
                                labels=gl),
    }
    xid = CounterMetricFamily("gpufootprint_nvml_xid_errors", "NVML: Xid critical-error events, by Xid.",
                              labels=["gpu", "xid"])
    supported = GaugeMetricFamily("gpufootprint_nvml_field_supported",
                                  "1 when the driver answers the field, 0 when it does not support it.",
                                  labels=["gpu", "field"])
    procs = GaugeMetricFamily("gpufootprint_nvml_process_used_bytes",
                              "NVML: memory a process uses on the GPU (CUDA context and libraries included); "
                              "source=probe when a probe reports the same (host) pid.",
                              labels=["pid", "gpu", "source"])
    for g in nv.gpus:
        lab = [str(g.index), g.uuid, g.model]
        fams["up"].add_metric(lab, 1.0 if g.up else 0.0)
        for key, value in (("memory_used", g.memory_used_bytes), ("memory_total", g.memory_total_bytes),
                           ("memory_reserved", g.memory_reserved_bytes), ("util", g.utilization_ratio),
                           ("tx", g.pcie_tx_bytes_per_second), ("rx", g.pcie_rx_bytes_per_second),
                           ("power", g.power_watts), ("energy", g.energy_joules)):
            if value is not None:
                fams[key].add_metric(lab, value)
        for x, n in sorted(g.xid_errors.items()):
            xid.add_metric([str(g.index), str(x)], n)
        for fld, ok in sorted(g.field_supported.items()):
            supported.add_metric([str(g.index), fld], 1.0 if ok else 0.0)
        for pid, used in sorted(g.processes.items()):
            if used is not None:
                procs.add_metric([str(pid), str(g.index), "probe" if sources.get(pid) == "probe" else "nvml"], used)
    yield from fams.values()
    yield from (xid, supported, procs)
    state = GaugeMetricFamily("gpufootprint_nvml_state", "1 for the NVML source's current state.",
                              labels=["state"])
    for name in ("ok", "unavailable", "error"):
        state.add_metric([name], 1.0 if nv.state == name else 0.0)
    yield state
    errs = CounterMetricFamily("gpufootprint_nvml_errors", "NVML calls that failed, by reason.", labels=["reason"])
    for reason, n in sorted(nv.errors.items()):
        errs.add_metric([reason], n)
    yield errs
    poll = GaugeMetricFamily("gpufootprint_nvml_poll_interval_seconds",
                             "Current NVML poll interval (follows the fastest sampler interval).")
    poll.add_metric([], nv.poll_interval_s)
    yield poll


# --- decision engines (issue 5) ---------------------------------------------------
# A separate collector over the engines' latest outputs, so the footprint families
# above stay independent of them.


class EngineCollector(Collector):
    def __init__(self, outputs: Callable[[], EngineOutputs]) -> None:
        self._outputs = outputs
        self.collect_errors = 0

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            families = list(engine_families(self._outputs()))
        except Exception:  # noqa: BLE001 - a scrape must always answer
            self.collect_errors += 1
            log.exception("building engine metrics failed")
            families = []
        yield from families


def engine_families(out: EngineOutputs) -> Iterator[Metric]:
    """Metric families of the engines' decisions (docs/metrics.md, section Engines)."""
    advice = GaugeMetricFamily("gpufootprint_graph_advice",
                               "CUDA Graph advisor decision per process and stream (1 for the current decision).",
                               labels=["pid", "source", "stream", "decision"])
    overhead = GaugeMetricFamily("gpufootprint_graph_launch_overhead_seconds",
                                 "Launch gaps per repeated step that CUDA Graph capture would save.",
                                 labels=["pid", "source", "stream"])
    for d in out.graph:
        stream = "" if d.stream is None else str(d.stream)
        advice.add_metric([str(d.pid), d.source, stream, d.decision], 1)
        if d.launch_overhead_seconds is not None:
            overhead.add_metric([str(d.pid), d.source, stream], d.launch_overhead_seconds)
    yield advice
    yield overhead

    b_bytes = GaugeMetricFamily("gpufootprint_budget_bytes", "Configured memory budget.", labels=["scope", "name"])
    b_used = GaugeMetricFamily("gpufootprint_budget_used_bytes", "GPU-resident bytes of the budget's live members.",
                               labels=["scope", "name"])
    b_ratio = GaugeMetricFamily("gpufootprint_budget_utilization_ratio",
                                "Used over budget (+Inf for a zero budget in use).", labels=["scope", "name"])
    b_exh = GaugeMetricFamily("gpufootprint_budget_exhaustion_seconds",
                              "Predicted seconds until the budget is used up, from the least-squares trend "
                              "(absent when not growing; 0 when exceeded).", labels=["scope", "name"])
    for s in out.budgets:
        labels = [s.scope, s.name]
        b_used.add_metric(labels, s.used_bytes)
        if s.budget_bytes is not None:
            b_bytes.add_metric(labels, s.budget_bytes)
        if s.utilization_ratio is not None:
            b_ratio.add_metric(labels, s.utilization_ratio)
        if s.exhaustion_seconds is not None:
            b_exh.add_metric(labels, s.exhaustion_seconds)
    b_act = CounterMetricFamily("gpufootprint_budget_actions", "Budget actions sent to probes, by action.",
                                labels=["scope", "name", "action"])
    for (scope, name, action), n in sorted(out.budget_action_counts.items()):
        b_act.add_metric([scope, name, action], n)
    yield from (b_bytes, b_used, b_ratio, b_exh, b_act)

    l_bytes = GaugeMetricFamily("gpufootprint_leak_suspect_bytes",
                                "Live bytes in allocations older than leaks.min_age_seconds.", labels=PROC_LABELS)
    l_flag = GaugeMetricFamily("gpufootprint_leak_suspect",
                               "1 when old allocations coincide with a growing footprint.", labels=PROC_LABELS)
    for leak in out.leaks:
        labels = [str(leak.pid), str(leak.dev), leak.source]
        l_bytes.add_metric(labels, leak.suspect_bytes)
        l_flag.add_metric(labels, 1 if leak.suspect else 0)
    yield from (l_bytes, l_flag)

    deg = GaugeMetricFamily("gpufootprint_degradation_advice", "Degradation advice in force (1).",
                            labels=["gpu", "pid", "advice"])
    for a in out.degradation:
        deg.add_metric([str(a.gpu), str(a.pid), a.advice], 1)
    yield deg

    if out.cost is None:
        return
    price = GaugeMetricFamily("gpufootprint_gpu_price_dollars_per_hour", "Configured price of the GPU model.",
                              labels=["gpu", "model"])
    idle_s = CounterMetricFamily("gpufootprint_idle_gpu_seconds", "GPU seconds not used by any process.",
                                 labels=["gpu"])
    idle_c = CounterMetricFamily("gpufootprint_idle_cost_dollars", "Dollars of GPU time not used by any process.",
                                 labels=["gpu"])
    unalloc = CounterMetricFamily("gpufootprint_unallocated_memory_cost_dollars",
                                  "Dollars of GPU memory no process held (memory basis remainder).", labels=["gpu"])
    for g in out.cost.gpus:
        if g.dollars_per_hour is None:
            continue
        price.add_metric([str(g.gpu), g.model or ""], g.dollars_per_hour)
        idle_s.add_metric([str(g.gpu)], g.idle_seconds)
        idle_c.add_metric([str(g.gpu)], g.idle_dollars)
        unalloc.add_metric([str(g.gpu)], g.unallocated_memory_dollars)
    cost = CounterMetricFamily("gpufootprint_cost_dollars", "Dollars accrued by the process, by basis.",
                               labels=[*PROC_LABELS, "basis"])
    unused = CounterMetricFamily("gpufootprint_unused_memory_cost_dollars",
                                 "Dollars of GPU memory the process held but did not use (allocator slack, pool "
                                 "headroom).", labels=PROC_LABELS)
    for p in out.cost.processes:
        base = [str(p.pid), str(p.dev), p.source]
        cost.add_metric([*base, "time"], p.time_dollars)
        cost.add_metric([*base, "memory"], p.memory_dollars)
        unused.add_metric(base, p.unused_memory_dollars)
    yield from (price, idle_s, idle_c, unalloc, cost, unused)
