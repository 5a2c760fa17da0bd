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
from gpufootprint.exporter.sampling import sampler_nvml_families
from gpufootprint.exporter.table import Row, Samples, build, counter, each, gauge, one
from gpufootprint.native import core
from gpufootprint.records import COPY_KIND_NAMES
from gpufootprint.snapshot import DeviceSnapshot, PipelineSnapshot, ProcessSnapshot
from gpufootprint.wire.framing import WIRE_VERSION

log = logging.getLogger(__name__)

PROC_LABELS = ("pid", "gpu", "source")
_PS = ("pid", "source")

Postprocess = Callable[[list[Metric]], list[Metric]]


class FootprintCollector(Collector):
    def __init__(self, snapshot: Callable[[], PipelineSnapshot], postprocess: Postprocess | None = None,
                 extra: Callable[[], Iterator[Metric]] | None = None) -> None:
        self._snapshot = snapshot
        # More families built with the same scrape (the engines'), so that pod labels and
        # the series cap apply to them as well.
        self._extra = extra
        self.collect_errors = 0
        # Pod labels and the series cap (exporter/cardinality.py), over all families.
        self._postprocess = postprocess

    def describe(self) -> list[Metric]:
        return []  # families depend on the snapshot; skip registration-time collection

    def set_series_cap(self, max_series: int) -> None:
        """A reloaded ``exporter.series_cap`` (the cap lives in the post-processing: exporter/cardinality.py)."""
        cap = getattr(self._postprocess, "cap", None)
        if cap is not None:
            cap.max_series = max_series

    def collect(self) -> Iterator[Metric]:
        try:
            families = list(self._families(self._snapshot()))
        except Exception:  # a scrape must always answer
            self.collect_errors += 1
            log.exception("building metrics failed; serving self-metrics only")
            families = []
        if self._extra is not None:
            try:
                families.extend(self._extra())
            except Exception:  # counted and logged; the other families still answer
                self.collect_errors += 1
                log.exception("building engine metrics failed")
        if self._postprocess is not None:
            try:
                families = self._postprocess(families)
            except Exception:  # never fall back to uncapped per-process series
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
                             "python": platform.python_version(), "native_core": _native_core()})
        yield info
        yield from build(DEVICE_FAMILIES, (((str(p.pid), str(d.dev), p.source), d)
                                            for p in snap.processes for d in p.devices))
        yield from build(PROCESS_FAMILIES, (((str(p.pid), p.source), p) for p in snap.processes))
        yield from probe_families(snap)
        yield from build(SNAPSHOT_FAMILIES, (((), snap),))
        yield from sampler_nvml_families(snap)
        for name, value in sorted(snap.daemon.items()):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                g = GaugeMetricFamily(f"gpufootprint_daemon_{name}", _DAEMON_HELP.get(name, name))
                g.add_metric([], value)
                yield g


# --- the footprint of each process on each GPU ------------------------------------------------


def _copies(field: str) -> Callable[[DeviceSnapshot], Samples]:
    """One sample per copy direction the device saw copies in (``memcpy_count``'s keys)."""

    def samples(d: DeviceSnapshot) -> Samples:
        values: dict[int, float] = getattr(d, field)
        return [((COPY_KIND_NAMES.get(ck, str(ck)),), values.get(ck, 0)) for ck in d.memcpy_count]

    return samples


DEVICE_FAMILIES: tuple[Row[DeviceSnapshot], ...] = (
    gauge("gpufootprint_live_bytes", "Bytes held by live allocations, by memory kind, as of the process's watermark.",
          (*PROC_LABELS, "kind"), each(lambda d: d.live_bytes)),
    gauge("gpufootprint_device_bytes", "Bytes resident on the GPU (device, device_static, array, untracked kinds).",
          PROC_LABELS, one(lambda d: d.device_bytes)),
    gauge("gpufootprint_window_peak_bytes",
          "Highest GPU-resident bytes over the trailing peak window, from exact event times.",
          PROC_LABELS, one(lambda d: d.window_peak_bytes)),
    gauge("gpufootprint_pool_reserved_bytes", "Bytes reserved by stream-ordered memory pools (cudaMallocAsync).",
          PROC_LABELS, one(lambda d: d.pool_reserved_bytes)),
    gauge("gpufootprint_pool_used_bytes", "Bytes of live stream-ordered allocations served from pools.",
          PROC_LABELS, one(lambda d: d.pool_used_bytes)),
    gauge("gpufootprint_live_allocations", "Number of live allocations.", PROC_LABELS,
          one(lambda d: d.live_allocations)),
    counter("gpufootprint_allocations", "Allocations seen, by memory kind.", (*PROC_LABELS, "kind"),
            each(lambda d: d.allocations)),
    counter("gpufootprint_releases", "Releases seen, by memory kind.", (*PROC_LABELS, "kind"),
            each(lambda d: d.releases)),
    counter("gpufootprint_allocated_bytes", "Bytes allocated, by memory kind.", (*PROC_LABELS, "kind"),
            each(lambda d: d.allocated_bytes)),
    counter("gpufootprint_released_bytes", "Bytes released, by memory kind.", (*PROC_LABELS, "kind"),
            each(lambda d: d.released_bytes)),
    counter("gpufootprint_memcpy", "Memory copies, by direction.", (*PROC_LABELS, "direction"),
            _copies("memcpy_count")),
    counter("gpufootprint_memcpy_bytes", "Bytes copied, by direction.", (*PROC_LABELS, "direction"),
            _copies("memcpy_bytes")),
    counter("gpufootprint_memcpy_seconds", "GPU time spent in copies, by direction.", (*PROC_LABELS, "direction"),
            _copies("memcpy_seconds")),
    counter("gpufootprint_memset_bytes", "Bytes set by memset.", PROC_LABELS, one(lambda d: d.memset_bytes)),
)


# --- each process ---------------------------------------------------------------------------


def _peer_copies(p: ProcessSnapshot) -> Samples:
    """Peer-copy bytes of the process's devices, summed per (source, destination) GPU."""
    peers: dict[tuple[int, int], int] = {}
    for dev in p.devices:
        for pair, n in dev.peer_copy_bytes.items():
            peers[pair] = peers.get(pair, 0) + n
    return [((str(src), str(dst)), n) for (src, dst), n in sorted(peers.items())]


PROCESS_FAMILIES: tuple[Row[ProcessSnapshot], ...] = (
    counter("gpufootprint_peer_copy_bytes",
            "Bytes copied between two GPUs (peer copies), by source and destination GPU.",
            (*_PS, "src_gpu", "dst_gpu"), _peer_copies),
    gauge("gpufootprint_pending_records", "Records received but not yet applied (waiting to be put in time order).",
          _PS, one(lambda p: p.pending_records)),
    gauge("gpufootprint_watermark_timestamp_seconds",
          "Time up to which a process's records are applied (Unix seconds).", _PS, one(lambda p: p.as_of_ns / 1e9)),
    gauge("gpufootprint_footprint_drift_bytes",
          "Bytes by which the footprint differed from the probe's own live table at the latest check (summed over "
          "GPUs and kinds; 0: exact).", _PS, one(lambda p: p.drift_bytes if p.drift_checks else None)),
    counter("gpufootprint_footprint_drift_mismatches",
            "Checks against the probe's own table that found a difference (each asks the probe for a resync).",
            _PS, one(lambda p: p.drift_mismatches if p.drift_checks else None)),
)


# --- the whole snapshot ---------------------------------------------------------------------


def _process_counts(snap: PipelineSnapshot) -> Samples:
    counts: dict[tuple[str, str], int] = {}
    for proc in snap.processes:
        key = (proc.source, "exited" if proc.exited else "running")
        counts[key] = counts.get(key, 0) + 1
    return sorted(counts.items())


def _late(snap: PipelineSnapshot) -> Samples:
    """Memory kinds always (a zero is news there), then whichever other kinds came late."""
    kinds = ("memory", "memory_pool", *sorted(k for k in snap.late_by_kind if k not in ("memory", "memory_pool")))
    return [((kind,), snap.late_by_kind.get(kind, 0)) for kind in kinds]


SNAPSHOT_FAMILIES: tuple[Row[PipelineSnapshot], ...] = (
    gauge("gpufootprint_window_peak_window_seconds", "Width of the trailing window of gpufootprint_window_peak_bytes.",
          (), one(lambda s: s.window_peak_seconds)),
    gauge("gpufootprint_processes", "Processes tracked, by source and state.", ("source", "state"), _process_counts),
    counter("gpufootprint_records_ingested", "Records accepted, by record kind.", ("kind",),
            each(lambda s: s.records_ingested, sort=True)),
    counter("gpufootprint_ingest_errors", "Records or frames that broke the model or the wire format, by reason.",
            ("reason",), each(lambda s: s.ingest_errors, sort=True)),
    counter("gpufootprint_ingest_repairs",
            "Records that looked wrong alone and were set right by a stated rule, by reason (docs/reliability.md).",
            ("reason",), each(lambda s: s.ingest_repairs, sort=True)),
    counter("gpufootprint_late_records", "Records that arrived after their time was already applied, by record kind.",
            ("kind",), _late),
    counter("gpufootprint_footprint_checks",
            "Checks of the footprint against the probes' own tables at their watermarks, by result (match, mismatch, "
            "skipped: the state was not as of that watermark).", ("result",),
            lambda s: [((r,), s.verify_results.get(r, 0)) for r in ("match", "mismatch", "skipped")]),
)

_DAEMON_HELP = {
    "probe_connections": "Probe connections open now.",
    "gpu_present": "1 when the daemon found an NVIDIA driver and GPU, else 0.",
    "snapshot_age_seconds": "Age of the snapshot this scrape was built from.",
}


# --- the probes' own counters, from their latest HEARTBEAT/GOODBYE ----------------------------


def _probe_value(key: str) -> Callable[[dict[str, float]], Samples]:
    return lambda c: (((), c[key]),) if key in c else ()


def _probe_prefixed(prefix: str) -> Callable[[dict[str, float]], Samples]:
    """``connections_ok`` -> result="ok": one sample per counter the probe named with the prefix."""
    return lambda c: [((k[len(prefix):],), v) for k, v in sorted(c.items()) if k.startswith(prefix)]


PROBE_FAMILIES: tuple[Row[dict[str, float]], ...] = (
    counter("gpufootprint_probe_records_sent", "Records the probe handed to the daemon's socket.", _PS,
            _probe_value("records_sent")),
    counter("gpufootprint_probe_records_dropped",
            "Records the probe dropped: daemon away, socket buffer full, or a connection that broke.", _PS,
            _probe_value("records_dropped")),
    counter("gpufootprint_probe_reconnects", "Times the probe connected again after losing the daemon.", _PS,
            _probe_value("reconnects")),
    counter("gpufootprint_probe_cupti_dropped_records",
            "Records CUPTI itself dropped for want of buffer space: never seen, so the footprint may be off.", _PS,
            _probe_value("cupti_dropped_records")),
    counter("gpufootprint_probe_callback_seconds",
            "CPU time spent in the probe's CUPTI buffer callback (packing records).", _PS,
            _probe_value("callback_seconds")),
    counter("gpufootprint_probe_cupti_gap_seconds",
            "Time CUPTI belonged to torch.profiler; the probe resynced from PyTorch's segments after it.", _PS,
            _probe_value("cupti_gap_seconds")),
    counter("gpufootprint_probe_resyncs",
            "Times the probe sent its whole live table: after each connect, a profiler gap, dropped records, or the "
            "daemon's request.", _PS, _probe_value("resyncs")),
    counter("gpufootprint_probe_drop_resyncs",
            "Resyncs the probe sent to repair memory records it dropped while connected (socket buffer full).", _PS,
            _probe_value("drop_resyncs")),
    gauge("gpufootprint_probe_device_bytes",
          "Bound on the GPU memory CUPTI's activity buffers take in the process (size x pool limit).", _PS,
          _probe_value("own_device_bytes")),
    gauge("gpufootprint_probe_driver_hooks",
          "1 while the probe holds its CUPTI driver-API hooks (mappings on every thread are recorded), else 0.", _PS,
          _probe_value("driver_hooks")),
    gauge("gpufootprint_probe_host_bytes",
          "Host memory the probe holds: CUPTI buffers outstanding, packing arrays, unsent frames (the C forwarder's too).", _PS,
          _probe_value("own_host_bytes")),
    counter("gpufootprint_probe_connections",
            "Probe connection attempts by result (ok, missing, refused, denied, busy, error).", (*_PS, "result"),
            _probe_prefixed("connections_")),
    counter("gpufootprint_probe_disconnects",
            "Probe connections lost, by reason (peer_closed, send_error, recv_error, bad_control, goodbye).",
            (*_PS, "reason"), _probe_prefixed("disconnects_")),
)


def probe_families(snap: PipelineSnapshot) -> list[Metric]:
    """The probes' own counters (per process: pid, source); processes without any are skipped."""
    return build(PROBE_FAMILIES, (((str(p.pid), p.source), p.probe_counters)
                                  for p in snap.processes if p.probe_counters))


def _native_core() -> str:
    """Whether the daemon's C core serves its per-batch loops ("false": the Python paths, same results)."""
    return "true" if core() is not None else "false"
