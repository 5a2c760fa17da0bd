"""Every counter a probe sends in its heartbeats reaches the daemon, in the worst case this build can
meet: every connection result, every disconnect reason and every drop reason at once (one key each),
as after daemon restarts under load. The daemon keeps a bounded number of a live peer's counters
(their names become label values); a probe of this build must fit in that bound whole."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from gpufootprint.configload import load_config
from gpufootprint.ingest import session as session_module
from gpufootprint.ingest.session import Session
from gpufootprint.pipeline import Pipeline
from gpufootprint.probe.counters import counter_values
from gpufootprint.probe.link import SocketLink
from gpufootprint.probe.livetable import LiveTable
from gpufootprint.probe.oom import OomWatch
from gpufootprint.probe.torchnumbers import TorchNumbers
from gpufootprint.wire import framing
from gpufootprint.wire.framing import FrameDecoder, FrameType

# Every name the probe's link and sender give a connection result, a disconnect and a dropped record.
CONNECTION_RESULTS = ("ok", "missing", "refused", "denied", "busy", "error")
DISCONNECT_REASONS = ("send_error", "peer_closed", "bad_control", "recv_error", "goodbye")
DROP_REASONS = ("buffer_full", "daemon_away", "disconnect", "queue_full")


def _probe_that_met_everything() -> SimpleNamespace:
    link = SocketLink("/nonexistent", buffer_bytes=1 << 20, backoff_max_s=1.0, on_control=lambda f: None)
    link.connections.update(dict.fromkeys(CONNECTION_RESULTS, 1))
    link.disconnects.update(dict.fromkeys(DISCONNECT_REASONS, 1))
    packer = SimpleNamespace(launch_records=0, host_bytes=0, bulk_records=0, bulk_fallbacks=0, unknown_kinds=0,
                             bad_records=0, api_records=0)
    intake = SimpleNamespace(packer=packer, callback_seconds=0.0, buffers_requested=0, buffers_completed=0,
                             settings=SimpleNamespace(cupti_buffer_bytes=1 << 20))
    return SimpleNamespace(counters=Counter(), intake=intake, oom=OomWatch(), link=link, table=LiveTable(),
                           table_seconds=0.0, own_device_bytes=0, raw=None, forward_seconds=0.0, native_read_retries=0, native_forward_seconds=0.0, native_forward_handed=0, forwarder_bytes=0,
                           torch_numbers=TorchNumbers(), dropped_by_reason=Counter(dict.fromkeys(DROP_REASONS, 10)))


def test_every_counter_of_a_probe_that_met_every_reason_reaches_the_daemon() -> None:
    counters = counter_values(_probe_that_met_everything(), gap_seconds=0.0, cupti_dropped=0)  # type: ignore[arg-type]
    assert len(counters) <= session_module._MAX_COUNTERS, len(counters)
    pipeline = Pipeline(load_config(env={}).footprint)
    session = Session(pipeline, source="probe", name="probe pid=4321", peer_pid=4321)
    for f in FrameDecoder().feed(framing.PREAMBLE
                                 + framing.encode_json(FrameType.HELLO, {"pid": 4321, "start_time": 1})
                                 + framing.encode_json(FrameType.HEARTBEAT, {"ts": 3000, "pid": 4321,
                                                                             "counters": counters})):
        session.handle(f)
    kept = pipeline.processes[4321].probe_counters
    assert sorted(set(counters) - set(kept)) == []
