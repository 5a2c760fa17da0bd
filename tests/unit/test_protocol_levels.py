"""Which forwarded CUPTI buffers a daemon asks a probe for: the lower of the probe's level (its HELLO)
and the daemon's. A probe from before RUNTIME API records names no level and forwards only when
told exactly 1; telling it 2 would quietly turn its forwarding off."""

from __future__ import annotations

import socket
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from gpufootprint.ingest.protocol import Connection, control_allowed, order_violation, verify_request
from gpufootprint.probe import control
from gpufootprint.wire import framing
from gpufootprint.wire.framing import CUPTI_BUFFERS_LEVEL, Frame, FrameType, iter_frames


def _frame(ftype: FrameType, body: dict[str, Any]) -> Frame:
    (frame,) = iter_frames([framing.PREAMBLE + framing.encode_json(ftype, body)])
    return frame


def _connection() -> Connection:
    return Connection(sock=socket.socket(socket.AF_UNIX), decoder=None, session=None,  # type: ignore[arg-type]
                      pid=1, uid=0)


@pytest.mark.parametrize("hello,asked", [
    ({"pid": 1}, 1),  # an older probe: says nothing
    ({"pid": 1, "cupti_buffers": 2}, 2),  # a probe that always checksums its buffers
    ({"pid": 1, "cupti_buffers": 3}, 3),
    ({"pid": 1, "cupti_buffers": 7}, CUPTI_BUFFERS_LEVEL),  # a newer probe: this daemon's level
    ({"pid": 1, "cupti_buffers": "2"}, 1),
    ({"pid": 1, "cupti_buffers": True}, 1),
])
def test_the_daemon_asks_for_the_lower_of_the_two_levels(hello: dict[str, Any], asked: int) -> None:
    conn = _connection()
    try:
        assert order_violation(conn, _frame(FrameType.HELLO, hello)) is None
        assert verify_request(conn) == {"op": "verify", "cupti_buffers": asked}
    finally:
        conn.sock.close()


class _Target:
    def __init__(self) -> None:
        self.levels: list[int] = []
        self.counters: Counter[str] = Counter()

    def send_totals(self, cupti_buffers: int) -> None:
        self.levels.append(cupti_buffers)


@pytest.mark.parametrize("level,seen", [(1, 1), (2, 2), (3, 3), (0, 0), ("2", 0), (None, 0)])
def test_the_probe_reads_any_level_from_1_up(level: Any, seen: int) -> None:
    target = _Target()
    body = {"op": "verify"} if level is None else {"op": "verify", "cupti_buffers": level}
    control.apply_control(_frame(FrameType.CONTROL, body), target)  # type: ignore[arg-type]
    assert target.levels == [seen]


def test_the_probes_hello_says_its_level(tmp_path: Path) -> None:
    from gpufootprint.probe.core import Probe
    from gpufootprint.probe.settings import ProbeSettings
    from gpufootprint.wire.sources import TraceFile

    from tests import probe_fakes as fk

    path = tmp_path / "t.gfp"
    probe = Probe(ProbeSettings(socket="", tee=str(path), flush_ms=10), fk.FakeRawCupti(), discover_devices=False)
    assert probe.start()
    probe.stop()
    (hello,) = [f.json() for f in iter_frames(TraceFile(path).chunks()) if f.type is FrameType.HELLO]
    assert hello["cupti_buffers"] == CUPTI_BUFFERS_LEVEL == 3


@pytest.mark.parametrize("hello,launches", [
    ({"pid": 1}, False),  # an older probe would read a launch window as a window of kernel records
    ({"pid": 1, "launch_windows": 0}, False),  # CUDA was up before the probe
    ({"pid": 1, "launch_windows": 1}, True),
    ({"pid": 1, "launch_windows": True}, False),
])
def test_a_launch_window_goes_only_to_a_probe_that_says_it_opens_them(hello: dict[str, Any], launches: bool) -> None:
    conn = _connection()
    try:
        assert order_violation(conn, _frame(FrameType.HELLO, hello)) is None
        assert control_allowed(conn, {"op": "kernel_window", "ms": 50, "id": 1, "records": "launches"}) is launches
        assert control_allowed(conn, {"op": "kernel_window", "ms": 50, "id": 1})  # kernel records: as before
        assert control_allowed(conn, {"op": "flush_interval", "ms": 20})
    finally:
        conn.sock.close()


def test_a_cupti_buffer_counted_as_received_then_read_is_walked_once(walks: list[int]) -> None:
    """The server counts a CUPTI_BUFFER's records as received, then its session reads them: one walk of
    the buffer serves both (a walk costs about 4 us a 512-record buffer), and each frame is walked afresh."""
    import numpy as np
    from gpufootprint.configload import load_config
    from gpufootprint.ingest.protocol import count_received
    from gpufootprint.ingest.session import Session
    from gpufootprint.pipeline import Pipeline
    from gpufootprint.records import MemoryOp
    from gpufootprint.wire import cupti_layout

    pid = 4242
    pipeline = Pipeline(load_config(env={}).footprint)
    conn = _connection()
    conn.pid, conn.session = pid, Session(pipeline, source="probe", name="probe", peer_pid=pid)
    received: dict[int, list[int]] = {}
    # Frames of different sizes; the first is counted but never read (a peer cut off right after it):
    # the next one is still walked afresh, not answered with the first one's walk.
    for k, n in enumerate((7, 512, 3)):
        raw = np.zeros(n, cupti_layout.RAW_DTYPES[cupti_layout.MEMORY2])
        raw.view(np.uint8).reshape(n, -1)[:, :4].view("<i4")[:, 0] = cupti_layout.MEMORY2
        raw["op"], raw["mk"], raw["bytes"] = MemoryOp.ALLOCATION, 1, 4096
        raw["address"] = (np.arange(n, dtype=np.uint64) + 1000 * k) << 20
        raw["timestamp"] = 10**18 + np.arange(n, dtype=np.uint64)
        (frame,) = iter_frames([framing.PREAMBLE + framing.encode_cupti_buffer(pid, raw.tobytes())])
        count_received(conn, frame, received)
        if k:
            conn.session.handle(frame)
    assert walks == [7 * raw.dtype.itemsize, 512 * raw.dtype.itemsize, 3 * raw.dtype.itemsize]
    assert received[pid] == [522, 0] and conn.session.records == 515
    assert not conn.session._walked  # the frames read: their bytes are not kept
