"""`gpufootprint replay` on the real H200 traces and on damaged copies of them."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from gpufootprint.config import FootprintConfig
from gpufootprint.pipeline import Pipeline
from gpufootprint.replay import replay_file

from tests.conftest import DATA, SHARED_TRACES, cli_env


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpufootprint", *args], capture_output=True, text=True,
                          env=cli_env(), timeout=timeout, check=False)


@pytest.mark.parametrize("name", SHARED_TRACES)
def test_every_mark_of_the_real_h200_traces_matches_exactly(name: str, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    proc = _cli("replay", str(DATA / name), "--report-json", str(report))
    assert proc.returncode == 0, proc.stderr
    body = json.loads(report.read_text())
    lines = gzip.decompress((DATA / name).read_bytes()).decode().splitlines()
    expected = [json.loads(line) for line in lines if '"mark"' in line]
    assert body["records"] == sum(1 for line in lines if json.loads(line)["k"] not in ("mark", "meta"))
    assert body["elapsed_s"] > 0
    assert [m["label"] for m in body["marks"]] == [m["label"] for m in expected]
    for got, want in zip(body["marks"], expected):
        assert got["live_bytes"] == want["expect_live_bytes"], got["label"]
        assert set(got) >= {"label", "ts", "pid", "dev", "live_bytes", "pool_reserved_bytes", "window_peak_bytes"}
        assert got["window_peak_bytes"] >= sum(v for k, v in got["live_bytes"].items() if k != "pinned")
    assert body["problems"] == [] and body["ingest_errors"] == {}


def test_native_conversion_replays_to_the_same_marks(tmp_path: Path) -> None:
    native = tmp_path / "caching.gfp.gz"
    assert _cli("convert", str(DATA / SHARED_TRACES[0]), "-o", str(native)).returncode == 0
    back = tmp_path / "back.jsonl"
    assert _cli("convert", str(native), "-o", str(back)).returncode == 0
    a = replay_file(DATA / SHARED_TRACES[0], Pipeline(FootprintConfig()))
    b = replay_file(native, Pipeline(FootprintConfig()))
    c = replay_file(back, Pipeline(FootprintConfig()))
    assert a.marks == b.marks == c.marks and b.format == "native" and c.format == "cupti-jsonl"


def test_truncated_gzip_gives_one_line_error_and_keeps_records_before(tmp_path: Path) -> None:
    raw = (DATA / SHARED_TRACES[0]).read_bytes()
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(raw[: len(raw) // 2])
    report = tmp_path / "r.json"
    proc = _cli("replay", str(cut), "--report-json", str(report))
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and str(cut) in errors[0] and "Traceback" not in proc.stderr
    body = json.loads(report.read_text())
    assert 0 < body["records"] < 967
    assert body["marks"] and all(m["matches"] for m in body["marks"])


def test_corrupt_native_frame_stops_there_and_keeps_what_came_before(tmp_path: Path) -> None:
    native = tmp_path / "t.gfp"
    assert _cli("convert", str(DATA / SHARED_TRACES[0]), "-o", str(native)).returncode == 0
    data = bytearray(native.read_bytes())
    at = len(data) // 2
    data[at : at + 8] = b"\xff" * 8
    native.write_bytes(bytes(data))
    proc = _cli("replay", str(native))
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "byte " in errors[0], proc.stderr
    result = replay_file(native, Pipeline(FootprintConfig()))
    assert result.records > 0 and len(result.problems) == 1


def test_unknown_record_kind_is_named_counted_and_the_rest_replayed(tmp_path: Path) -> None:
    lines = gzip.decompress((DATA / SHARED_TRACES[0]).read_bytes()).decode().splitlines()
    lines.insert(5, '{"k": "nvtx", "ts": 1}')
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    report = tmp_path / "r.json"
    proc = _cli("replay", str(bad), "--report-json", str(report))
    assert proc.returncode == 1
    assert f"{bad}:6: unknown record kind 'nvtx'" in proc.stderr
    body = json.loads(report.read_text())
    assert body["records"] == 967 and all(m["matches"] for m in body["marks"])


def test_invalid_config_is_one_line_exit_2(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("footprint:\n  window_peak_seconds: -1\n")
    for args in (("check-config", "--config", str(cfg)), ("replay", str(DATA / SHARED_TRACES[0]), "--config", str(cfg))):
        proc = _cli(*args)
        assert proc.returncode == 2
        assert proc.stderr.strip().count("\n") == 0 and "footprint.window_peak_seconds" in proc.stderr
        assert "Traceback" not in proc.stderr
    ok = _cli("check-config", "--config", str(DATA.parent.parent / "config" / "gpufootprint.yaml"))
    assert ok.returncode == 0 and ok.stdout.startswith("ok:")


def test_missing_trace_is_one_line_exit_1(tmp_path: Path) -> None:
    proc = _cli("replay", str(tmp_path / "nope.jsonl"))
    assert proc.returncode == 1 and "no such file" in proc.stderr and "Traceback" not in proc.stderr


def test_paced_replay_hands_on_each_record_at_its_own_time_not_whole_batches(tmp_path: Path) -> None:
    # GIVEN one batch of 4,000 allocations spread evenly over 2 s of trace time (a probe's batch can
    # hold 4,096 records and cover a long quiet stretch)
    import time

    import numpy as np
    from gpufootprint.records import MEMORY_DTYPE, RecordKind
    from gpufootprint.wire.framing import PREAMBLE, encode_batch

    t0 = 1_800_000_000_000_000_000
    recs = np.zeros(4000, MEMORY_DTYPE)
    recs["ts"] = t0 + np.arange(4000) * 500_000
    recs["op"], recs["mk"], recs["pid"], recs["bytes"] = 1, 3, 77, 4096
    recs["addr"] = 0x1000_0000 + np.arange(4000) * 4096
    path = tmp_path / "one_batch.gfp"
    path.write_bytes(PREAMBLE + encode_batch(RecordKind.MEMORY, recs))
    handed: list[tuple[float, int, int]] = []  # (wall s since start, first ts, records)
    started = time.monotonic()

    def seen(frame) -> None:  # type: ignore[no-untyped-def]
        r = frame.records()
        handed.append((time.monotonic() - started, int(r["ts"].min()), len(r)))

    # WHEN it is replayed at --speed 1
    result = replay_file(path, Pipeline(FootprintConfig()), speed=1.0, on_frame=seen)
    # THEN it takes the trace's 2 s, in many small batches, none handed on before its time
    assert result.problems == [] and result.records == 4000
    assert result.elapsed_s >= 1.99
    assert len(handed) > 500 and max(n for _, _, n in handed) <= 10
    assert all(wall >= (ts - t0) / 1e9 - 0.002 for wall, ts, _ in handed)
    # and through the command line as well
    t = time.monotonic()
    out = _cli("replay", "--speed", "1", str(path))
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - t >= 2.0


def test_an_empty_resync_in_a_recording_clears_the_process_it_names(tmp_path: Path) -> None:
    """A probe whose table is empty at a resync (after a profiler gap in which everything was freed)
    sends RESYNC_BEGIN and RESYNC_END with no record in between. A live daemon knows the peer's pid;
    replay and the demo must take it from the frames, or 1 GiB freed in the gap stays live."""
    from gpufootprint.records import RecordKind
    from gpufootprint.wire.framing import PREAMBLE, FrameType, encode_batch, encode_json, encode_watermark

    from tests.conftest import ALLOC, mem, mem_batch

    s = 1_000_000_000
    t0 = 1_800_000_000 * s
    frames = [encode_json(FrameType.HELLO, {"pid": 77, "start_time": 1}),
              encode_batch(RecordKind.MEMORY, mem_batch([mem(t0, ALLOC, 0x1000, 1 << 30, pid=77)])),
              encode_watermark(t0 + s),
              encode_json(FrameType.MARK, {"label": "before", "ts": t0 + s, "pid": 77, "dev": 0,
                                           "expect_live_bytes": {"device": 1 << 30}}),
              encode_json(FrameType.RESYNC_BEGIN, {"ts": t0 + 2 * s, "reason": "profiler_gap", "entries": 0,
                                                   "pid": 77}),
              encode_json(FrameType.RESYNC_END, {"ts": t0 + 2 * s, "pid": 77}),
              encode_json(FrameType.MARK, {"label": "after", "ts": t0 + 3 * s, "pid": 77, "dev": 0,
                                           "expect_live_bytes": {}})]
    rec = tmp_path / "gap.gfp"
    rec.write_bytes(PREAMBLE + b"".join(frames))
    report = tmp_path / "r.json"
    proc = _cli("replay", str(rec), "--report-json", str(report))
    body = json.loads(report.read_text())
    assert [(m["label"], m["matches"]) for m in body["marks"]] == [("before", True), ("after", True)], body["marks"]
    assert proc.returncode == 0, proc.stderr


def test_the_demo_moves_a_recordings_resync_to_its_own_pid_and_time() -> None:
    """The demo plays each recording as a process of its own (``shift_frame``: new pid, times moved to
    now). A RESYNC left with the recording's pid cleared nothing of the demo's process and made a
    phantom process of the recorded pid (review finding on the empty-resync rule)."""
    import time

    from gpufootprint.ingest.session import Session
    from gpufootprint.records import RecordKind
    from gpufootprint.replay import shift_frame
    from gpufootprint.wire.framing import PREAMBLE, FrameType, encode_batch, encode_json, encode_watermark, iter_frames

    from tests.conftest import ALLOC, mem, mem_batch

    s = 1_000_000_000
    t0 = 1_800_000_000 * s
    raw = PREAMBLE + b"".join([
        encode_json(FrameType.HELLO, {"pid": 77, "start_time": 1}),
        encode_batch(RecordKind.MEMORY, mem_batch([mem(t0, ALLOC, 0x1000, 1 << 30, pid=77)])),
        encode_watermark(t0 + s),
        encode_json(FrameType.RESYNC_BEGIN, {"ts": t0 + 2 * s, "reason": "profiler_gap", "entries": 0, "pid": 77}),
        encode_json(FrameType.RESYNC_END, {"ts": t0 + 2 * s, "pid": 77}),
        encode_watermark(t0 + 3 * s)])
    pipeline = Pipeline(FootprintConfig())
    session = Session(pipeline, source="trace", name="demo")
    delta = time.time_ns() - t0
    for frame in iter_frames(iter([raw])):
        session.handle(shift_frame(frame, delta, pid=4242))
    assert set(pipeline.processes) == {4242}  # no phantom of the recorded pid
    assert all(fp.device_bytes == 0 for fp in pipeline.processes[4242].devices.values())
