"""Issue 7: the daemon's own defences as metrics, and label values made safe.

``daemon_families`` exports what the ingest server counted (connections cut off and
why, connections refused, bytes of partial frames held, records received per probe,
config reloads). ``sanitize_label_values`` runs over every family at scrape time:
whatever a probe managed to put into a label value (a HELLO field, a counter name)
comes out bounded in length and without control characters.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpufootprint.serverstats import ServerStats, TickHealth
from gpufootprint.snapshot import PipelineSnapshot

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def safe_label_value(value: str, max_len: int) -> str:
    """Control characters become '?'; a value over ``max_len`` is cut and ends in '~' and 8 hex
    digits of its hash, so two long values that share a prefix stay two series."""
    if _CONTROL.search(value):
        value = _CONTROL.sub("?", value)
    if len(value) > max_len:
        digest = hashlib.sha256(value.encode("utf-8", "replace")).hexdigest()[:8]
        value = value[: max_len - 9] + "~" + digest
    return value


def sanitize_label_values(families: Iterable[Metric], max_len: int) -> list[Metric]:
    out = []
    for fam in families:
        samples = fam.samples
        for i, s in enumerate(samples):
            values = s.labels.values()
            joined = "".join(values)
            if len(joined) <= max_len and joined.isprintable():
                continue  # every value short and clean, found with two C calls: the common case
            for v in values:
                # str.isprintable is one C loop: the common clean value costs next to nothing
                if len(v) > max_len or not v.isprintable():
                    samples[i] = s._replace(labels={k: safe_label_value(v, max_len) for k, v in s.labels.items()})
                    break
        out.append(fam)
    return out


def daemon_families(stats: ServerStats, snap: PipelineSnapshot, health: TickHealth | None = None) -> Iterator[Metric]:
    if health is not None:
        age = GaugeMetricFamily("gpufootprint_daemon_snapshot_age_seconds",
                                "Seconds since the last tick that succeeded, at the time of this scrape: it grows "
                                "while ticks fail or stall.")
        age.add_metric([], max(0.0, health.last_ok_age_s) if health.last_ok_wall else float("nan"))
        yield age
        errors = CounterMetricFamily("gpufootprint_daemon_tick_errors",
                                     "Ticks (watermarks, expiry, snapshot) that raised; /readyz fails until one "
                                     "succeeds again.")
        errors.add_metric([], health.tick_errors)
        yield errors
    quarantined = GaugeMetricFamily("gpufootprint_daemon_quarantined_process",
                                    "1 for each process whose state broke a tick and was dropped (its records are "
                                    "dropped until it exits), with the exception's type.", labels=["pid", "reason"])
    for pid, reason in stats.quarantined:
        quarantined.add_metric([str(pid), reason], 1)
    yield quarantined
    quarantines = CounterMetricFamily("gpufootprint_daemon_quarantines",
                                      "Processes quarantined because their state broke a tick.")
    quarantines.add_metric([], stats.quarantines)
    yield quarantines
    disc = CounterMetricFamily("gpufootprint_daemon_disconnects",
                               "Probe connections the daemon closed or lost, by reason (eof, goodbye, "
                               "truncated_frame, bad_preamble, bad_version, frame_too_large, bad_checksum, "
                               "bad_frame_type, bad_frame, frame_before_hello, duplicate_hello, frame_after_goodbye, "
                               "resync_mismatch, unexpected_frame, hello_timeout, memory_limit, internal_error, "
                               "socket_error, daemon_shutdown).", labels=["reason"])
    for reason, n in stats.disconnects:
        disc.add_metric([reason], n)
    yield disc
    refused = CounterMetricFamily("gpufootprint_daemon_connections_refused",
                                  "Probe connections closed at accept, by reason (max_connections, "
                                  "peer_credentials, fd_limit).", labels=["reason"])
    for reason, n in stats.refused:
        refused.add_metric([reason], n)
    yield refused
    total = CounterMetricFamily("gpufootprint_daemon_connections", "Probe connections accepted.")
    total.add_metric([], stats.connections_total)
    yield total
    errs = CounterMetricFamily("gpufootprint_daemon_accept_errors",
                               "Failed accept() calls on the probe socket (e.g. out of file descriptors).")
    errs.add_metric([], stats.accept_errors)
    yield errs
    buf = GaugeMetricFamily("gpufootprint_daemon_buffered_bytes",
                            "Bytes of partial frames the daemon holds for all connections "
                            "(bounded by daemon.max_buffered_bytes).")
    buf.add_metric([], stats.buffered_bytes)
    yield buf
    sources = {p.pid: p.source for p in snap.processes}
    recv = CounterMetricFamily("gpufootprint_daemon_records_received",
                               "Records received from a probe in BATCH frames, outside resyncs: compare with "
                               "gpufootprint_probe_records_sent_total.", labels=["pid", "source"])
    resync = CounterMetricFamily("gpufootprint_daemon_resync_records_received",
                                 "Live-table records received from a probe inside resyncs.", labels=["pid", "source"])
    asked = CounterMetricFamily("gpufootprint_daemon_resync_requests",
                                "Resyncs the daemon asked probes for, because a record arrived behind its watermark "
                                "or the footprint differed from the probe's own table.")
    asked.add_metric([], stats.resync_requests)
    yield asked
    for pid, n, n_resync in stats.received:
        source = sources.get(pid, "probe")
        recv.add_metric([str(pid), source], n)
        resync.add_metric([str(pid), source], n_resync)
    yield recv
    yield resync
    reloads = CounterMetricFamily("gpufootprint_daemon_config_reloads",
                                  "SIGHUP configuration reloads, by result (applied, refused).", labels=["result"])
    for result, n in stats.config_reloads:
        reloads.add_metric([result], n)
    yield reloads
    ok = GaugeMetricFamily("gpufootprint_daemon_config_last_reload_successful",
                           "1 when the last configuration reload was applied (or none was tried), 0 when refused.")
    ok.add_metric([], stats.config_last_reload_ok)
    yield ok
