"""The demo's training process: its recording, then its steady steps again and again.

The repetitions must read as one process that goes on training: nothing late, no ingest error,
and a footprint that stays where the recording left it (a repeated step allocates nothing).
"""

from __future__ import annotations

import itertools
import threading
import time
from types import SimpleNamespace

import pytest
from gpufootprint.config import FootprintConfig
from gpufootprint.demo import STEADY_KINDS, STEADY_STEPS, bundled_traces, feeders, play_order, steady_block
from gpufootprint.hub import FeatureHub
from gpufootprint.ingest.session import Session
from gpufootprint.pipeline import Pipeline
from gpufootprint.records import RecordKind
from gpufootprint.replay import frame_time_ns, load_frames, shift_frame
from gpufootprint.wire.framing import HEADER_SIZE, Frame, FrameType, encode_json

PID = 857


def test_the_steady_steps_repeat_on_time_without_late_records_and_leave_the_footprint_as_recorded() -> None:
    (path,) = [p for p in bundled_traces() if p.name in STEADY_STEPS]
    frames, problems = load_frames(path)
    assert problems == []
    block, period, last = steady_block(frames, *STEADY_STEPS[path.name])
    assert {RecordKind(f.tag) for f in block} <= set(STEADY_KINDS)
    assert sum(len(f.records()) for f in block if RecordKind(f.tag) is RecordKind.KERNEL) == 3 * 99
    assert 60e6 < period < 70e6  # three steps of about 22 ms
    mark = frames[last].json()
    pipeline = Pipeline(FootprintConfig(), hub=FeatureHub(), kernel_retention=200_000)
    session = Session(pipeline, source="trace", name="demo")
    hello = encode_json(FrameType.HELLO, {"pid": PID, "start_time": 1})
    session.handle(Frame(FrameType.HELLO, 0, hello[HEADER_SIZE:], 0))
    first = next(t for t in map(frame_time_ns, frames) if t is not None)
    delta = 1_800_000_000 * 10**9 - first
    rounds = 300  # 20 s of training after the recording
    sent = len([f for f in frames[:last + 1] if f.type is not FrameType.HELLO]) + rounds * len(block)
    for f, later in itertools.islice(play_order(frames, (block, period, last)), sent):
        session.handle(shift_frame(f, delta + later, pid=PID))
    pipeline.advance(PID, delta + mark["ts"] + (rounds + 1) * period)
    assert pipeline.late_records == 0 and sum(pipeline.errors.counts.values()) == 0
    state = pipeline.device_state(PID, 0)
    assert state is not None
    assert state.live_bytes.get("device") == mark["expect_live_bytes"]["device"], state.live_bytes
    # the graph advisor reads the kernels of one process that never restarted
    kernels = pipeline.processes[PID].kernels
    assert kernels is not None and len(kernels.array()) >= rounds * 3 * 99


def test_the_slow_leak_is_played_twice_half_a_trace_apart_so_one_copy_always_has_its_trend() -> None:
    traces = bundled_traces()
    plan = feeders(traces, speed=1.0)
    leak = [(pid, after) for path, pid, after in plan if path.name == "synth_leak.gfp.gz"]
    assert len(leak) == 2 and leak[0][1] == 0.0
    assert 590 < leak[1][1] < 610  # half of its 1,199 s
    assert len({pid for _, pid, _ in plan}) == len(plan) == len(traces) + 1  # every process its own pid
    assert feeders(traces, speed=10.0)[-1][2] == pytest.approx(leak[1][1] / 10)


@pytest.mark.parametrize("speed", [20.0, 0.5])
def test_repeated_steps_are_handed_on_at_real_time_once_their_last_record_is_due(speed: float) -> None:
    # GIVEN the training trace's feeder with an ingest that notes when each repeated batch comes
    from gpufootprint.demo import _feeder, _last_time_ns

    (path,) = [p for p in bundled_traces() if p.name in STEADY_STEPS]
    frames, _ = load_frames(path)
    block, _, _ = steady_block(frames, *STEADY_STEPS[path.name])
    repeated_kinds = {(RecordKind(f.tag), len(f.records())) for f in block}
    handed: list[tuple[float, int]] = []
    anchor: list[tuple[float, int]] = []
    recording_done = threading.Event()

    class Ingest:
        def inject(self, _session: object, frame: Frame | None) -> None:
            if frame is not None and frame.type is FrameType.MARK and frame.json().get("label") == "step_4":
                # the repeats' clock starts here: real time from this mark's time on
                anchor.append((time.monotonic(), int(frame.json()["ts"])))
                recording_done.set()
            elif recording_done.is_set() and frame is not None and frame.type is FrameType.BATCH:
                assert (RecordKind(frame.tag), len(frame.records())) in repeated_kinds
                handed.append((time.monotonic(), _last_time_ns(frame) or 0))

    app = SimpleNamespace(pipeline=Pipeline(FootprintConfig()), ingest=Ingest())
    stop = threading.Event()
    feeder = threading.Thread(target=_feeder, args=(app, path, PID, speed, stop), daemon=True)
    feeder.start()
    assert recording_done.wait(8.4 / speed + 10)
    time.sleep(1.5)
    stop.set()
    feeder.join(5)
    # THEN about 135 batches a second (three a 22 ms step), each at or after its last record's time on
    # a clock that runs at real time from the recording's end, whatever the recording's speed
    assert 150 <= len(handed) <= 260, len(handed)
    # measured from the mark, not from the first batch: a first batch handed late (a loaded machine)
    # would make every later, punctual batch look early
    ((w0, t0),) = anchor
    for w, t in handed:
        early = (t - t0) / 1e9 - (w - w0)
        assert early < 0.005, (speed, early)  # never more than the pacer's resolution early
        assert early > -0.25, (speed, early)  # nor lagging behind real time
