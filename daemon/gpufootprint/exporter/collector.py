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
from gpufootprint.records import COPY_KIND_NAMES
from gpufootprint.snapshot import PipelineSnapshot, ProcessSnapshot
from gpufootprint.wire.framing import WIRE_VERSION

log = logging.getLogger(__name__)

PROC_LABELS = ["pid", "gpu", "source"]


def _proc_values(proc: ProcessSnapshot, dev: int) -> list[str]:
    return [str(proc.pid), str(dev), proc.source]


Postprocess = Callable[[list[Metric]], list[Metric]]


class FootprintCollector(Collector):
    def __init__(self, snapshot: Callable[[], PipelineSnapshot], postprocess: Postprocess | None = None) -> None:
        self._snapshot = snapshot
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
        pending = GaugeMetricFamily("gpufootprint_pending_records",
                                    "Records received but not yet applied (waiting to be put in time order).",
                                    labels=["pid", "source"])
        lag = GaugeMetricFamily("gpufootprint_watermark_timestamp_seconds",
                                "Time up to which a process's records are applied (Unix seconds).",
                                labels=["pid", "source"])
        for proc in snap.processes:
            pending.add_metric([str(proc.pid), proc.source], proc.pending_records)
            lag.add_metric([str(proc.pid), proc.source], proc.as_of_ns / 1e9)
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
        yield from (live, device, peak, pool_res, pool_used, nlive, allocs, rels, abytes, rbytes,
                    cpy_n, cpy_b, cpy_s, set_b, pending, lag)

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
                                   "Records that arrived after their time was already applied (beyond the "
                                   "reorder window).")
        late.add_metric([], snap.late_records)
        yield late
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
