"""Replay a recorded trace through the daemon's own decoder, session and pipeline."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpufootprint.ingest.session import Session
from gpufootprint.pipeline import Pipeline
from gpufootprint.records import TIME_FIELD, RecordKind, copy_records, take
from gpufootprint.wire.framing import HEADER_SIZE, Frame, FrameType, encode_batch, encode_json, encode_watermark
from gpufootprint.wire.sources import TraceFile


@dataclass
class ReplayResult:
    path: str
    format: str
    records: int
    frames: int
    elapsed_s: float
    marks: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def frame_time_ns(frame: Frame) -> int | None:
    """The earliest timestamp a frame carries, for pacing; None when it has none."""
    if frame.type is FrameType.BATCH:
        try:
            recs = frame.records()
        except Exception:  # noqa: BLE001 - the session reports the damage
            return None
        return int(recs[TIME_FIELD[RecordKind(frame.tag)]].min()) if len(recs) else None
    if frame.type is FrameType.MARK:
        ts = frame.json().get("ts")
        return ts if isinstance(ts, int) else None
    return None


class Pacer:
    """Sleeps so that trace time advances ``speed`` times faster than wall time."""

    #: Records due within this much wall time of each other are handed on together.
    RESOLUTION_S = 0.001

    def __init__(self, speed: float, stop: threading.Event | None = None,
                 origin: tuple[float, int] | None = None) -> None:
        """``origin``: (monotonic time, trace time) that are due together; by default the first
        timestamp waited for is due at once."""
        self.speed = speed
        self.stop = stop or threading.Event()
        self._origin: tuple[float, int] | None = origin

    def wait_for(self, ts_ns: int | None) -> None:
        if ts_ns is None:
            return
        if self._origin is None:
            self._origin = (time.monotonic(), ts_ns)
            return
        wall0, trace0 = self._origin
        due = wall0 + (ts_ns - trace0) / 1e9 / self.speed
        delay = due - time.monotonic()
        if delay > 0:
            self.stop.wait(delay)

    def due_slots(self, ts_ns: np.ndarray) -> np.ndarray:
        """Each timestamp's wall-clock due time in units of ``RESOLUTION_S`` (equal: due together)."""
        origin = self._origin[1] if self._origin is not None else int(ts_ns.min())
        return (ts_ns.astype(np.int64) - origin) // max(1, int(self.RESOLUTION_S * 1e9 * self.speed))


def paced(frame: Frame, pacer: Pacer) -> Iterator[Frame]:
    """``frame`` handed on when it is due: a batch is split so that each record comes at its own
    time (records due within ``Pacer.RESOLUTION_S`` of each other stay together)."""
    if frame.type is not FrameType.BATCH:
        pacer.wait_for(frame_time_ns(frame))
        yield frame
        return
    try:
        kind = RecordKind(frame.tag)
        recs = frame.records()
    except Exception:  # noqa: BLE001 - the session reports the damage
        yield frame
        return
    if len(recs) == 0:
        yield frame
        return
    times = recs[TIME_FIELD[kind]].astype(np.int64)
    order = np.argsort(times, kind="stable")
    recs, times = take(recs, order), times[order]
    pacer.wait_for(int(times[0]))
    slots = pacer.due_slots(times)
    cuts = np.flatnonzero(np.diff(slots)) + 1
    if len(cuts) == 0:
        yield frame
        return
    for lo, hi in zip(np.concatenate(([0], cuts)).tolist(), np.concatenate((cuts, [len(recs)])).tolist()):
        pacer.wait_for(int(times[lo]))
        if pacer.stop.is_set():
            return
        raw = encode_batch(kind, recs[lo:hi])
        yield Frame(frame.type, frame.tag, raw[HEADER_SIZE:], frame.offset)


def replay_file(
    path: str | Path,
    pipeline: Pipeline,
    *,
    speed: float | None = None,
    on_frame: Callable[[Frame], None] | None = None,
    stop: threading.Event | None = None,
    max_frame_bytes: int | None = None,
    guard: Any = None,
    on_mark: Callable[[dict[str, Any]], None] | None = None,
) -> ReplayResult:
    """Run ``path`` through ``pipeline``. Damage is reported in ``problems``; records before it count."""
    trace = TraceFile(path)
    marks: list[dict[str, Any]] = []
    def mark(result: dict[str, Any]) -> None:
        marks.append(result)
        if on_mark is not None:  # the daemon's OOM manager, when a replay is served (replay --listen)
            on_mark(result)

    session = Session(pipeline, source="trace", name=str(path), on_mark=mark)
    pacer = Pacer(speed, stop) if speed else None
    started = time.perf_counter()
    if pacer is None and stop is None and on_frame is None and guard is None:
        # The plain replay (``gpufootprint replay``, abtest, the benches): each frame straight to the session,
        # without the per-frame tuple, inner loop and four checks of the general loop below.
        handle = session.handle
        for frame in trace.frames(max_frame_bytes):
            handle(frame)
        session.close()
        return ReplayResult(
            path=str(path), format=trace.format, records=session.records, frames=session.frames,
            elapsed_s=time.perf_counter() - started, marks=marks, problems=trace.problems + session.problems,
        )
    for whole in trace.frames(max_frame_bytes):
        for frame in (paced(whole, pacer) if pacer is not None else (whole,)):
            if stop is not None and stop.is_set():
                break
            if on_frame is not None:
                on_frame(frame)
            if guard is None:
                session.handle(frame)
            else:
                with guard:  # the daemon's ingest thread publishes snapshots meanwhile
                    session.handle(frame)
        if stop is not None and stop.is_set():
            break  # before the next frame is read: a stopped replay skips the end-of-file check
    if guard is None:
        session.close()
    else:
        with guard:
            session.close()
    elapsed = time.perf_counter() - started
    return ReplayResult(
        path=str(path), format=trace.format, records=session.records, frames=session.frames,
        elapsed_s=elapsed, marks=marks, problems=trace.problems + session.problems,
    )


_SHIFT_FIELDS = {
    RecordKind.MEMORY: ("ts",),
    RecordKind.MEMORY_POOL: ("ts",),
    RecordKind.MEMCPY: ("start", "end"),
    RecordKind.MEMSET: ("start", "end"),
    RecordKind.KERNEL: ("start", "end"),
    RecordKind.UNIFIED_MEMORY: ("start", "end"),
    RecordKind.API: ("start", "end"),
}


def shift_frame(frame: Frame, delta_ns: int, pid: int | None = None) -> Frame:
    """The same frame with every timestamp moved by ``delta_ns`` (and pid replaced): for looping demos."""
    if frame.type is FrameType.BATCH:
        kind = RecordKind(frame.tag)
        recs = copy_records(frame.records())
        for name in _SHIFT_FIELDS[kind]:
            recs[name] = (recs[name].astype("i8") + delta_ns).astype("u8")
        if pid is not None:
            recs["pid"] = pid
        raw = encode_batch(kind, recs)
    elif frame.type in (FrameType.MARK, FrameType.META, FrameType.HELLO, FrameType.HEARTBEAT, FrameType.GOODBYE,
                        FrameType.RESYNC_BEGIN, FrameType.RESYNC_END, FrameType.TOTALS):
        body = frame.json()
        if isinstance(body.get("ts"), int):
            body["ts"] += delta_ns
        if pid is not None and "pid" in body:
            body["pid"] = pid
        raw = encode_json(frame.type, body)
    elif frame.type is FrameType.WATERMARK:
        raw = encode_watermark(frame.watermark() + delta_ns)
    else:
        return frame
    return Frame(frame.type, frame.tag, raw[HEADER_SIZE:], frame.offset)


def load_frames(path: str | Path) -> tuple[list[Frame], list[str]]:
    """Every frame of a (small) trace in memory, and the problems met reading it."""
    trace = TraceFile(path)
    frames = list(trace.frames())
    return frames, trace.problems
