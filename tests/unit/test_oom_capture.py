"""The daemon's OOM capture: one event per OOM, a capture that replays to the footprint at the failure.

A real pipeline and session take the frames a probe would send (records, then ``oom`` MARKs);
the manager's clock is a test clock, so coalescing is exact; captures go to a temporary directory.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from gpufootprint.config import Config, OomConfig
from gpufootprint.hub import FeatureHub
from gpufootprint.ingest.session import Session
from gpufootprint.oom.capture import Entry, roll_back
from gpufootprint.oom.manager import CAPTURE_FILE, META_FILE, REPORT_FILE, OomManager, oom_families
from gpufootprint.oom.recent import RecentRecords
from gpufootprint.pipeline import Pipeline
from gpufootprint.recording import load, series
from gpufootprint.records import RecordKind
from gpufootprint.replay import replay_file
from gpufootprint.wire.framing import PREAMBLE, FrameDecoder, FrameType, encode_batch, encode_json

from tests.conftest import ALLOC, FREE, mem, mem_batch

S = 1_000_000_000
T0 = 1_800_000_000 * S  # a wall-clock-like start
MiB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _setup(tmp_path: Path, **oom: Any) -> tuple[Pipeline, Session, OomManager, Clock]:
    cfg = dataclasses.replace(OomConfig(), directory=str(tmp_path / "oom"), **oom)
    config = Config()
    pipeline = Pipeline(dataclasses.replace(config.footprint, reorder_window_ms=0),
                        hub=FeatureHub(config.features, config.sampler))
    clock = Clock()
    manager = OomManager(cfg, pipeline, monotonic=clock, synchronous=True)
    pipeline.hub.taps.append(manager.on_records)
    session = Session(pipeline, source="probe", name="probe pid=42", peer_pid=42, on_mark=manager.on_mark)
    return pipeline, session, manager, clock


def _feed(session: Session, *frames: bytes) -> None:
    dec = FrameDecoder()
    for f in dec.feed(PREAMBLE + b"".join(frames)):
        session.handle(f)


def _oom_mark(ts: int, **oom: Any) -> bytes:
    body = {"source": "cupti", "api": "cuMemAlloc_v2", "failed_calls": 1, "requested_bytes": None,
            "dev_known": False, **oom}
    return encode_json(FrameType.MARK, {"label": "oom", "ts": ts, "pid": 42, "dev": 0, "expect_live_bytes": None,
                                        "oom": body})


def test_roll_back_undoes_allocations_and_restores_releases() -> None:
    now = {0x1: Entry(100, 3, 5, False), 0x3: Entry(300, 3, 30, False)}
    recs = mem_batch([mem(20, FREE, 0x2, 200), mem(30, ALLOC, 0x3, 300)])
    assert roll_back(now, recs, 25) == {0x1: Entry(100, 3, 5, False)}  # freed at 20, 0x3 not yet allocated
    assert roll_back(now, recs, 10) == {0x1: Entry(100, 3, 5, False), 0x2: Entry(200, 3, 10, False)}
    assert roll_back(now, recs, 30) == now


def test_recent_records_keep_the_window_and_say_from_when_nothing_is_missing() -> None:
    recent = RecentRecords(seconds=10, max_bytes=1 << 30)
    for i in range(30):
        recent.add(1, RecordKind.MEMORY, mem_batch([mem(T0 + i * S, ALLOC, 0x1000 + i, 8, pid=1)]))
    got = recent.window(1, 0)[RecordKind.MEMORY]
    assert got["ts"].min() >= T0 + 19 * S and len(got) == 11
    assert recent.covered_from(1) == T0 + 18 * S
    small = RecentRecords(seconds=100, max_bytes=3 * 80)
    for i in range(5):
        small.add(1, RecordKind.MEMORY, mem_batch([mem(T0 + i, ALLOC, 0x1000 + i, 8, pid=1)]))
    assert len(small.window(1, 0)[RecordKind.MEMORY]) == 3 and small.dropped_for_size == 2
    assert small.covered_from(1) == T0 + 1


def test_recent_records_own_what_they_keep_and_copy_only_what_is_not_their_own() -> None:
    # GIVEN the records of a decoded frame (a view into the frame's bytes), a part of a larger array, and a
    # chunk joined from two (a whole array of its own, as the pipeline applies them)
    import numpy as np
    from gpufootprint.records import holds_only_itself, join

    rows = mem_batch([mem(T0 + i, ALLOC, 0x1000 + i, 8, pid=1) for i in range(6)])
    frame_bytes = bytearray(rows.tobytes())
    decoded = np.frombuffer(frame_bytes, dtype=rows.dtype)
    larger = rows.copy()
    joined = join([rows[:3].copy(), rows[3:].copy()])
    assert not holds_only_itself(decoded) and not holds_only_itself(larger[1:4]) and holds_only_itself(joined)
    assert holds_only_itself(rows.copy()) and not holds_only_itself(larger[::2])
    assert not holds_only_itself(larger[::-1])  # the whole array's bytes, but not in its order
    recent = RecentRecords(seconds=100, max_bytes=1 << 30)
    # WHEN each is kept, and the frame's bytes and the larger array change afterwards
    recent.add(1, RecordKind.MEMORY, decoded)
    recent.add(2, RecordKind.MEMORY, larger[1:4])
    recent.add(3, RecordKind.MEMORY, joined)
    frame_bytes[:] = bytes(len(frame_bytes))
    larger["bytes"] = 0
    # THEN what was kept is what was added: the views were copied, the joined chunk kept as it is
    assert recent.window(1, 0)[RecordKind.MEMORY].tobytes() == rows.tobytes()
    assert recent.window(2, 0)[RecordKind.MEMORY].tobytes() == rows[1:4].tobytes()
    kept = recent._procs[3].chunks[0][3]
    assert kept is joined and recent.window(3, 0)[RecordKind.MEMORY].tobytes() == rows.tobytes()
    assert recent.total_bytes == 2 * rows.nbytes + 3 * rows.itemsize


def _workload(session: Session) -> None:
    """60 MiB held from before the window, a 30 MiB buffer freed in it, growth up to the failure."""
    hello = encode_json(FrameType.HELLO, {"pid": 42, "start_time": 7, "argv": ["train.py", "--big"]})
    rows = [mem(T0, ALLOC, 0x1000, 60 * MiB, pid=42), mem(T0 + 1 * S, ALLOC, 0x2000, 30 * MiB, pid=42)]
    rows += [mem(T0 + 100 * S, FREE, 0x2000, 30 * MiB, pid=42)]
    rows += [mem(T0 + (110 + i) * S, ALLOC, 0x10000 + i, 10 * MiB, pid=42) for i in range(5)]
    _feed(session, hello, encode_batch(RecordKind.MEMORY, mem_batch(rows)))


def test_one_event_per_oom_and_a_capture_that_replays_to_the_footprint_at_the_failure(tmp_path: Path) -> None:
    _pipeline, session, manager, clock = _setup(tmp_path, seconds=60, coalesce_seconds=2)
    _workload(session)
    # GIVEN two failed calls (the framework retries after freeing a 10 MiB cache block), then the
    # PyTorch notice with the requested size, all within the coalescing window
    fail = T0 + 120 * S
    _feed(session, _oom_mark(fail))
    _feed(session, encode_batch(RecordKind.MEMORY, mem_batch([mem(fail + 1000, FREE, 0x10004, 10 * MiB, pid=42)])))
    _feed(session, _oom_mark(fail + 2000, failed_calls=1))
    clock.t += 1
    _feed(session, encode_json(FrameType.MARK, {
        "label": "oom", "ts": fail + 3000, "pid": 42, "dev": 0, "expect_live_bytes": None,
        "oom": {"source": "torch", "requested_bytes": 512 * MiB, "dev_known": True,
                "torch_reserved_bytes": 100 * MiB, "device_free_bytes": MiB}}))
    # later records (after the failure) must not leak into the capture
    _feed(session, encode_batch(RecordKind.MEMORY, mem_batch([mem(fail + S, FREE, 0x10000, 10 * MiB, pid=42)])))
    manager.tick()
    assert manager.counts == {}  # still coalescing
    clock.t += 2.5
    manager.tick()
    # THEN exactly one event, counted, with the footprint at the last notice
    assert dict(manager.counts) == {(42, 0, "probe"): 1}
    (event,) = manager.api()
    assert event["footprint_bytes"] == 100 * MiB  # 60 + 4 x 10: what PyTorch said it reserved
    assert event["requested_bytes"] == 512 * MiB and event["failed_calls"] == 2 and event["notices"] == 3
    assert event["seen_by"] == ["cupti", "torch"] and event["gpu_known"] is True
    assert event["torch"]["torch_reserved_bytes"] == 100 * MiB
    assert event["window_seconds"] == 60.0
    where = tmp_path / "oom" / event["name"]
    assert sorted(p.name for p in where.iterdir()) == sorted([CAPTURE_FILE, META_FILE, REPORT_FILE])
    assert json.loads((where / META_FILE).read_text())["footprint_bytes"] == 100 * MiB
    # AND the capture replays through the daemon's pipeline to exactly that footprint
    replayed = Pipeline(Config().footprint)
    result = replay_file(where / CAPTURE_FILE, replayed)
    assert result.problems == []
    (mark,) = result.marks
    assert mark["label"] == "oom" and mark["matches"] is True
    assert mark["live_bytes"] == {"device": 100 * MiB}
    # with the window's start state: 60 MiB held before, the 30 MiB buffer freed inside the window
    assert replayed.processes[42].info.get("argv") == ["train.py", "--big"]
    (s,) = series(load([where / CAPTURE_FILE]))
    assert (int(s.device[0]), int(s.device.max()), int(s.device[-1])) == (90 * MiB, 110 * MiB, 100 * MiB)
    assert int(s.times[0]) == fail + 3000 - 60 * S  # the window: 60 s before the last notice
    html = (where / REPORT_FILE).read_text()
    assert "Out of memory" in html and "<img" in html


def test_a_process_that_dies_of_its_oom_is_captured_as_it_was(tmp_path: Path) -> None:
    pipeline, session, manager, clock = _setup(tmp_path, coalesce_seconds=2)
    _workload(session)
    _feed(session, _oom_mark(T0 + 120 * S))
    _feed(session, encode_json(FrameType.GOODBYE, {"pid": 42, "ts": T0 + 121 * S}))  # exits: the driver frees all
    assert pipeline.processes[42].devices[0].device_bytes == 0
    clock.t += 3
    manager.tick()
    (event,) = manager.api()
    assert event["footprint_bytes"] == 110 * MiB


def test_separate_ooms_are_separate_events_and_old_captures_are_removed(tmp_path: Path) -> None:
    pipeline, session, manager, _clock = _setup(tmp_path, coalesce_seconds=0, max_captures=2, report=False)
    _workload(session)
    for i in range(3):
        _feed(session, _oom_mark(T0 + (120 + i) * S))
    assert dict(manager.counts) == {(42, 0, "probe"): 3}
    left = sorted(p.name for p in (tmp_path / "oom").iterdir())
    events = manager.api()
    assert left == sorted(e["name"] for e in events[1:])  # the oldest went first
    assert events[0]["capture"] is None and events[0]["removed"] is True
    # a restarted daemon lists the captures still on disk
    again = OomManager(manager.config, pipeline)
    assert [e["name"] for e in again.api()] == [e["name"] for e in events[1:]]


def test_an_unwritable_directory_still_counts_and_logs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    _pipeline, session, manager, _clock = _setup(tmp_path, coalesce_seconds=0)
    manager.config = dataclasses.replace(manager.config, directory=str(blocker / "oom"))
    _workload(session)
    with caplog.at_level("WARNING"):
        _feed(session, _oom_mark(T0 + 120 * S))
    assert dict(manager.counts) == {(42, 0, "probe"): 1}
    assert manager.capture_errors == 1 and manager.api()[0]["capture"] is None
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("oom pid="))
    assert line == ("oom pid=42 pod=- gpu=0 requested_bytes=unknown footprint_bytes=115343360 failed_calls=1 "
                    "seen_by=cupti")
    fams = {f.name: f for f in oom_families(manager)}
    assert [(s.labels, s.value) for s in fams["gpufootprint_oom_events"].samples if s.name.endswith("_total")] == \
        [({"pid": "42", "gpu": "0", "source": "probe"}, 1.0)]
    assert fams["gpufootprint_oom_capture_errors"].samples[0].value == 1


def test_records_of_processes_that_are_gone_are_forgotten(tmp_path: Path) -> None:
    pipeline, session, manager, _clock = _setup(tmp_path)
    _workload(session)
    assert manager.buffered_bytes() > 0
    del pipeline.processes[42]
    manager.tick()
    assert manager.buffered_bytes() == 0


def test_recent_records_of_all_processes_are_bounded_together() -> None:
    # GIVEN room for 4 records in all, 3 per process
    recent = RecentRecords(seconds=100, max_bytes=3 * 80, max_total_bytes=4 * 80)
    for i in range(3):
        recent.add(1, RecordKind.MEMORY, mem_batch([mem(T0 + i, ALLOC, 0x1000 + i, 8, pid=1)]))
    for i in range(2):
        recent.add(2, RecordKind.MEMORY, mem_batch([mem(T0 + 10 + i, ALLOC, 0x2000 + i, 8, pid=2)]))
    # THEN the process holding the most lost its oldest, and says from when it is complete
    assert recent.total_bytes == 4 * 80
    assert (len(recent.window(1, 0)[RecordKind.MEMORY]), len(recent.window(2, 0)[RecordKind.MEMORY])) == (2, 2)
    assert recent.covered_from(1) == T0 and recent.covered_from(2) == 0
    recent.forget(1)
    assert recent.total_bytes == 2 * 80


def test_past_the_total_bound_the_process_holding_most_loses_first_and_of_equals_the_first_kept() -> None:
    """Against a model that scans every process for the one holding the most (of several, the first
    kept, as ``max`` over them in the order they were kept picks), through random chunk sizes, ties,
    processes forgotten and kept again: the same chunks are dropped and the same bounds said."""
    import random

    rng = random.Random(7)
    for _ in range(40):
        limit = rng.choice([2, 5, 12]) * 80
        recent = RecentRecords(seconds=1000, max_bytes=6 * 80, max_total_bytes=limit)
        model: dict[int, list[tuple[int, int]]] = {}  # pid -> [(hi, records)] oldest first; dict order = kept first
        covered: dict[int, int] = {}
        t = T0
        for _ in range(150):
            pid = rng.randint(1, 6)
            if rng.random() < 0.05:
                recent.forget(pid)
                model.pop(pid, None)
                covered.pop(pid, None)
                continue
            n = rng.choice([1, 1, 2, 3])
            t += 1
            recent.add(pid, RecordKind.MEMORY, mem_batch([mem(t + k, ALLOC, 0x1000 + k, 8, pid=pid) for k in range(n)]))
            chunks = model.setdefault(pid, [])
            chunks.append((t + n - 1, n))
            t += n
            while sum(c[1] for c in chunks) * 80 > 6 * 80:
                covered[pid] = max(covered.get(pid, 0), chunks.pop(0)[0])
            while sum(c[1] for cs in model.values() for c in cs) * 80 > limit:
                most = max(model, key=lambda p: sum(c[1] for c in model[p]))
                covered[most] = max(covered.get(most, 0), model[most].pop(0)[0])
            for p, cs in model.items():
                assert recent.nbytes(p) == 80 * sum(c[1] for c in cs)
                assert recent.covered_from(p) == covered.get(p, 0)
        assert recent.total_bytes == 80 * sum(c[1] for cs in model.values() for c in cs)
