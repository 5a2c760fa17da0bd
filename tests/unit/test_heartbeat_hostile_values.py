"""A HEARTBEAT's counter values from a hostile peer or a damaged trace: JSON's integers have no bound and
Python's JSON reads NaN and Infinity. A value that is not a finite number a float holds is dropped; the
session neither raises (live: the connection was cut as ``internal_error``; a replay stopped) nor keeps
it (found by review on 2026-12-06; it predates that day's changes)."""

from __future__ import annotations

import gzip
from pathlib import Path

from gpufootprint.configload import load_config
from gpufootprint.ingest.session import Session
from gpufootprint.pipeline import Pipeline
from gpufootprint.replay import replay_file
from gpufootprint.wire import framing
from gpufootprint.wire.framing import FrameDecoder, FrameType

HOSTILE = (b'{"pid":7,"counters":{"ok_one":1,"ok_big":1e300,"huge":1' + b"0" * 400
           + b',"nan":NaN,"inf":Infinity,"minus_inf":-Infinity,"minus_huge":-1' + b"0" * 400 + b"}}")


def test_a_live_peers_heartbeat_keeps_its_finite_counters_and_drops_the_rest() -> None:
    pipeline = Pipeline(load_config(env={}).footprint)
    session = Session(pipeline, source="probe", name="probe pid=7", peer_pid=7)
    for f in FrameDecoder().feed(framing.PREAMBLE + framing.encode(FrameType.HEARTBEAT, HOSTILE)):
        session.handle(f)
    assert pipeline.process(7, "probe").probe_counters == {"ok_one": 1.0, "ok_big": 1e300}


def test_a_traces_heartbeat_with_such_values_does_not_stop_the_replay(tmp_path: Path) -> None:
    path = tmp_path / "t.gfp.gz"
    path.write_bytes(gzip.compress(framing.PREAMBLE + framing.encode(FrameType.HEARTBEAT, HOSTILE)
                                   + framing.encode_watermark(10**18)))
    pipeline = Pipeline(load_config(env={}).footprint)
    assert replay_file(path, pipeline).frames == 2
    assert pipeline.process(7, "trace").probe_counters == {"ok_one": 1.0, "ok_big": 1e300}
