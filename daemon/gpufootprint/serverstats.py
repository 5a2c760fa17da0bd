"""What the ingest server says about itself, as immutable values the exporter reads.

The ingest thread copies its counters into a ``ServerStats`` at each tick, and ``TickHealth`` is
built at scrape time; both live here, beside ``snapshot.py``, so that the exporter reads values
and imports nothing from ``ingest/`` (a change to socket hardening does not touch the metrics).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerStats:
    """The ingest server's own counters, copied at each tick for the exporter."""

    connections_total: int = 0
    disconnects: tuple[tuple[str, int], ...] = ()
    refused: tuple[tuple[str, int], ...] = ()
    accept_errors: int = 0
    buffered_bytes: int = 0
    # (pid, records, resync_records) per probe pid seen on a connection, alive or closed
    received: tuple[tuple[int, int, int], ...] = ()
    config_reloads: tuple[tuple[str, int], ...] = ()
    config_last_reload_ok: float = 1.0
    resync_requests: int = 0  # resyncs asked of probes (late records, drift)
    quarantined: tuple[tuple[int, str], ...] = ()  # (pid, reason) of processes whose state was dropped
    quarantines: int = 0
    # ((uid, reason), count): records or connections refused because a tenant or process was at its share
    share_refusals: tuple[tuple[tuple[str, str], int], ...] = ()


@dataclass(frozen=True)
class TickHealth:
    """Read at scrape time, not from the snapshot: a stuck loop cannot freeze what it says."""

    last_ok_wall: float  # time.time() of the last tick that published a snapshot (0: none yet)
    last_ok_age_s: float  # seconds since then, on the monotonic clock
    tick_errors: int
    last_failed: bool  # the latest tick raised
    loop_errors: int = 0  # iterations of the ingest loop that raised outside a tick (the loop went on)

    def healthy(self, stall_s: float) -> bool:
        return self.last_ok_wall > 0 and not self.last_failed and self.last_ok_age_s <= stall_s
