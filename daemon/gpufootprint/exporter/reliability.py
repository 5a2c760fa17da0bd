"""The daemon's own defences as metrics.

``daemon_families`` exports what the ingest server counted (connections cut off and why,
connections refused, bytes of partial frames held, records received per probe, config reloads)
and how its ticks went. Label values a probe could have chosen are made safe in
``cardinality.py``, with the other label post-processing.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import Metric

from gpufootprint.exporter.http import HttpCounters
from gpufootprint.exporter.table import Row, build, counter, each, gauge, one
from gpufootprint.serverstats import ServerStats, TickHealth
from gpufootprint.snapshot import PipelineSnapshot

HEALTH_FAMILIES: tuple[Row[TickHealth], ...] = (
    gauge("gpufootprint_daemon_snapshot_age_seconds",
          "Seconds since the last tick that succeeded, at the time of this scrape: it grows while ticks fail or stall.",
          (), one(lambda h: max(0.0, h.last_ok_age_s) if h.last_ok_wall else float("nan"))),
    counter("gpufootprint_daemon_tick_errors",
            "Ticks (watermarks, expiry, snapshot) that raised; /readyz fails until one succeeds again.", (),
            one(lambda h: h.tick_errors)),
    counter("gpufootprint_daemon_loop_errors",
            "Iterations of the ingest loop that raised outside a tick (reading sockets, accepting, injected frames); "
            "the loop goes on.", (), one(lambda h: h.loop_errors)),
)

_Stats = tuple[ServerStats, Mapping[int, str]]  # the counters, and the source of each pid the pipeline knows

STATS_FAMILIES: tuple[Row[_Stats], ...] = (
    gauge("gpufootprint_daemon_quarantined_process",
          "1 for each process whose state broke a tick and was dropped (its records are dropped until it exits), "
          "with the exception's type.", ("pid", "reason"),
          lambda s: [((str(pid), reason), 1) for pid, reason in s[0].quarantined]),
    counter("gpufootprint_daemon_quarantines", "Processes quarantined because their state broke a tick.", (),
            one(lambda s: s[0].quarantines)),
    counter("gpufootprint_daemon_disconnects",
            "Probe connections the daemon closed or lost, by reason (eof, goodbye, truncated_frame, bad_preamble, "
            "bad_version, frame_too_large, bad_checksum, bad_frame_type, bad_frame, frame_before_hello, "
            "duplicate_hello, frame_after_goodbye, resync_mismatch, unexpected_frame, hello_timeout, memory_limit, "
            "internal_error, socket_error, daemon_shutdown, share_evicted).", ("reason",), each(lambda s: dict(s[0].disconnects))),
    counter("gpufootprint_daemon_connections_refused",
            "Probe connections closed at accept, by reason (max_connections, peer_credentials, fd_limit).",
            ("reason",), each(lambda s: dict(s[0].refused))),
    counter("gpufootprint_daemon_share_refusals",
            "Records (connections, for max_connections) refused because a tenant or process was at its share of a "
            "node-wide bound, by the offender's uid (at most 32 uids, then uid=\"other\") and reason "
            "(max_connections, device_limit, allocation_limit, resync_limit, kernel_limit, strings_limit, "
            "metadata_limit).", ("uid", "reason"),
            lambda s: [((uid, reason), n) for (uid, reason), n in s[0].share_refusals]),
    counter("gpufootprint_daemon_connections", "Probe connections accepted.", (),
            one(lambda s: s[0].connections_total)),
    counter("gpufootprint_daemon_accept_errors",
            "Failed accept() calls on the probe socket (e.g. out of file descriptors).", (),
            one(lambda s: s[0].accept_errors)),
    gauge("gpufootprint_daemon_buffered_bytes",
          "Bytes of partial frames the daemon holds for all connections (bounded by daemon.max_buffered_bytes).", (),
          one(lambda s: s[0].buffered_bytes)),
    counter("gpufootprint_daemon_resync_requests",
            "Resyncs the daemon asked probes for, because a record arrived behind its watermark or the footprint "
            "differed from the probe's own table.", (), one(lambda s: s[0].resync_requests)),
    counter("gpufootprint_daemon_records_received",
            "Records received from a probe in BATCH frames, outside resyncs: compare with "
            "gpufootprint_probe_records_sent_total.", ("pid", "source"),
            lambda s: [((str(pid), s[1].get(pid, "probe")), n) for pid, n, _ in s[0].received]),
    counter("gpufootprint_daemon_resync_records_received", "Live-table records received from a probe inside resyncs.",
            ("pid", "source"), lambda s: [((str(pid), s[1].get(pid, "probe")), n) for pid, _, n in s[0].received]),
    counter("gpufootprint_daemon_config_reloads", "SIGHUP configuration reloads, by result (applied, refused).",
            ("result",), each(lambda s: dict(s[0].config_reloads))),
    gauge("gpufootprint_daemon_config_last_reload_successful",
          "1 when the last configuration reload was applied (or none was tried), 0 when refused.", (),
          one(lambda s: s[0].config_last_reload_ok)),
)


ENGINE_FAMILIES: tuple[Row[int], ...] = (
    counter("gpufootprint_engine_errors",
            "Snapshots the decision engines failed on; the outputs of the last step that succeeded stay exported.",
            (), one(lambda n: n)),
)


def engine_error_families(errors: int) -> list[Metric]:
    return build(ENGINE_FAMILIES, (((), errors),))


HTTP_FAMILIES: tuple[Row[HttpCounters], ...] = (
    counter("gpufootprint_exporter_auth_failures",
            "HTTP requests answered 401: basic-auth credentials missing or wrong (exporter.web_config_file).", (),
            one(lambda c: c.auth_failures)),
    counter("gpufootprint_exporter_http_accept_errors",
            "Failed accept() calls on the HTTP listener (out of descriptors: it pauses for 0.5 s).", (),
            one(lambda c: c.accept_errors)),
    counter("gpufootprint_exporter_http_connections_closed",
            "HTTP connections the server closed on its own, by reason (evicted: to make room under the connection "
            "cap; refused: the cap was reached by busy or new ones; timed_out: a request, reply or idle deadline).",
            ("reason",), each(lambda c: dict(c.closed))),
    counter("gpufootprint_exporter_tls_handshake_failures",
            "TLS handshakes that failed (since the web config was last loaded).", (),
            one(lambda c: c.tls_handshake_failures)),
    counter("gpufootprint_exporter_renders", "/metrics bodies rendered ahead of the scrapes or by a scrape.", (),
            one(lambda c: c.renders)),
    counter("gpufootprint_exporter_render_errors",
            "Renderings of the /metrics body ahead of the scrapes that raised (scrapes render their own meanwhile).",
            (), one(lambda c: c.render_errors)),
)


def http_families(counters: HttpCounters) -> list[Metric]:
    return build(HTTP_FAMILIES, (((), counters),))


def daemon_families(stats: ServerStats, snap: PipelineSnapshot, health: TickHealth | None = None) -> Iterator[Metric]:
    if health is not None:
        yield from build(HEALTH_FAMILIES, (((), health),))
    sources = {p.pid: p.source for p in snap.processes}
    yield from build(STATS_FAMILIES, (((), (stats, sources)),))
