"""The probe's counters as its HEARTBEAT and GOODBYE frames (and ``status()``) carry them.

The daemon exports these as the probe's own cost and losses (docs/reliability.md):
records sent and dropped by reason, CPU seconds in callbacks, flushes and the table,
host and device bytes the probe holds, CUPTI's own drops, raw-delivery and hook states.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Protocol

from gpufootprint.probe.backend import Backend
from gpufootprint.probe.intake import Intake
from gpufootprint.probe.link import SocketLink
from gpufootprint.probe.livetable import LiveTable
from gpufootprint.probe.nativecallbacks import Delivery, Pairer
from gpufootprint.probe.oom import OomWatch
from gpufootprint.probe.torchnumbers import TorchNumbers


class CounterSources(Protocol):
    """The parts of the probe its counters are read from."""

    counters: Counter[str]
    torch_numbers: TorchNumbers
    dropped_by_reason: Counter[str]
    intake: Intake
    oom: OomWatch
    link: SocketLink | None
    table: LiveTable
    table_seconds: float
    own_device_bytes: int

    @property
    def raw(self) -> Delivery | None: ...

    @property
    def forward_seconds(self) -> float: ...

    @property
    def native_read_retries(self) -> int: ...

    @property
    def native_forward_seconds(self) -> float: ...

    forwarder_bytes: int

    @property
    def native_forward_handed(self) -> int: ...


def counter_values(p: CounterSources, *, gap_seconds: float, cupti_dropped: int | None) -> dict[str, Any]:
    """Every counter, by the name the daemon knows it by (``cupti_dropped`` None: not read this time)."""
    c = p.counters
    if cupti_dropped is None:
        cupti_dropped = int(c["cupti_dropped_records"])
    raw, link, intake = p.raw, p.link, p.intake
    packer = intake.packer
    if raw is not None:
        host = raw.allocated * raw.buffer_bytes + packer.host_bytes
    else:
        outstanding = max(0, intake.buffers_requested - intake.buffers_completed)
        host = outstanding * intake.settings.cupti_buffer_bytes + packer.host_bytes
    if link is not None:
        host += link.buffered
    host += p.forwarder_bytes  # the C forwarder's sides (frames and structs not yet taken in, or room kept)
    return {
        "records_sent": c["records_sent"], "records_dropped": c["records_dropped"],
        "batches_sent": c["batches_sent"], "reconnects": max(0, (link.connects if link else 0) - 1),
        "callback_seconds": round(intake.callback_seconds, 6), "own_device_bytes": p.own_device_bytes,
        "own_host_bytes": host, "kernel_windows": c["kernel_windows"], "control_unknown": c["control_unknown"],
        "launch_windows": c["launch_windows"], "launch_records": packer.launch_records,
        "launch_windows_ended": c["launch_windows_ended"], "launch_windows_counted": c["launch_windows_counted"],
        "launch_switches_main": c["launch_switches_main"], "launch_switches_fallback": c["launch_switches_fallback"],
        "cupti_gap_seconds": round(gap_seconds, 6),
        "profiler_gaps": c["profiler_gaps"], "resyncs": c["resyncs"], "marks_dropped": c["marks_dropped"],
        "drop_resyncs": c["drop_resyncs"], "resyncs_requested": c["resyncs_requested"],
        "forwarded_buffers": c["forwarded_buffers"], "table_seconds": round(p.table_seconds, 6),
        "table_late_releases": p.table.late_release_repairs, "table_lost_releases": p.table.lost_releases,
        "forward_seconds": round(p.forward_seconds, 6),
        "flushes": c["flushes"], "flush_seconds": c["flush_ns"] / 1e9, "sender_wakeups": c["sender_wakeups"],
        "buffers_completed": intake.buffers_completed + (raw.completed if raw else 0),
        "bulk_records": packer.bulk_records, "raw_delivery": 1 if raw is not None else 0,
        "native_callbacks": 1 if raw is not None and raw.native else 0,
        "native_callbacks_unavailable": c["native_callbacks_unavailable"], "native_walks": c["native_walks"],
        "native_reads": c["native_reads"], "native_read_retries": p.native_read_retries,
        "native_forwards": c["native_forwards"], "native_forward_seconds": round(p.native_forward_seconds, 6),
        "native_forward_unavailable": c["native_forward_unavailable"], "native_forward_handed": p.native_forward_handed,
        "native_forward_lagging": c["native_forward_lagging"],
        "native_pairs": p.table.paired_in_c,
        "native_pairs_unordered": p.table.pairer.unordered if isinstance(p.table.pairer, Pairer) else 0,
        "native_pairs_twice": p.table.pairer.twice if isinstance(p.table.pairer, Pairer) else 0,
        "raw_delivery_unavailable": c["raw_delivery_unavailable"],
        "raw_buffers": c["raw_buffers"], "raw_records": c["raw_records"],
        "raw_buffers_refused": raw.refused if raw else 0,
        "raw_buffers_requested": raw.requested if raw else 0,
        "raw_callback_errors": raw.errors if raw else 0,
        "raw_queues": len(raw.queues) if raw else 0,
        "driver_hooks": c["driver_hooks"], "driver_hooks_unavailable": c["driver_hooks_unavailable"],
        "raw_foreign_buffers": raw.foreign if raw else 0,
        "raw_walk_fallbacks": c["raw_walk_fallbacks"], "raw_walk_mismatches": c["raw_walk_mismatches"],
        "raw_walk_unread_bytes": c["raw_walk_unread_bytes"],
        "raw_walks_verified": c["raw_walks_verified"], "raw_buffers_unreadable": c["raw_buffers_unreadable"],
        "bulk_fallbacks": packer.bulk_fallbacks,
        "packer_unknown_kinds": packer.unknown_kinds, "packer_bad_records": packer.bad_records,
        "driver_api_records": packer.api_records,
        "cupti_dropped_records": cupti_dropped, "cupti_bad_timestamps": c["cupti_bad_timestamps"],
        "unified_memory_configured": c["unified_memory_configured"],
        "oom_records_unavailable": c["oom_records_unavailable"], **p.oom.counters(),
        "torch_readings": p.torch_numbers.readings, "torch_read_seconds": round(p.torch_numbers.read_seconds, 6),
        **{f"connections_{k}": v for k, v in (link.connections.items() if link else ())},
        **{f"disconnects_{k}": v for k, v in (link.disconnects.items() if link else ())},
        **{f"dropped_{k}": v for k, v in p.dropped_by_reason.items()},
    }


def cupti_dropped(backend: Backend | None, raw: Delivery | None, counters: Counter[str]) -> int:
    """Records CUPTI dropped for want of buffer space, all queues, since the probe started.

    CUPTI resets its count at each read, so the reads are added up in ``counters``. Not to be
    called while the profiler holds CUPTI (its drops are not ours)."""
    if backend is None:
        return int(counters["cupti_dropped_records"])
    queues = {(0, 0)} | (raw.queues if raw is not None else set())  # the global one, and each seen
    try:
        for ctx, stream in queues:
            counters["cupti_dropped_records"] += int(backend.dropped_records(ctx, stream))
    except Exception:  # noqa: BLE001, S110 - a heartbeat goes out with the drops counted so far
        pass
    return int(counters["cupti_dropped_records"])
