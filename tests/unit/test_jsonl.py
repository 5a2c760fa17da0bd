"""CUPTI-JSONL <-> native: the same records both ways; bad lines named and skipped."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import pytest

from gpufootprint.wire.framing import FrameType, iter_frames
from gpufootprint.wire.jsonl import write_jsonl
from gpufootprint.wire.sources import TraceFile
from tests.conftest import DATA, SHARED_TRACES


def _frames(path: Path) -> list:
    return list(iter_frames(TraceFile(path).chunks()))


@pytest.mark.parametrize("name", SHARED_TRACES)
def test_jsonl_to_native_and_back_keeps_every_line(name: str, tmp_path: Path) -> None:
    original = [json.loads(line) for line in gzip.open(DATA / name, "rt")]
    out = io.StringIO()
    n = write_jsonl(_frames(DATA / name), out)
    back = [json.loads(line) for line in out.getvalue().splitlines()]
    assert n == len(original)
    for a, b in zip(original, back):
        # Every key of the original survives with its value (the writer may add zero-valued fields).
        assert {k: b.get(k) for k in a} == a


def test_native_file_replays_identical_frames_to_the_jsonl_it_came_from(tmp_path: Path) -> None:
    native = tmp_path / "t.gfp"
    native.write_bytes(b"".join(TraceFile(DATA / SHARED_TRACES[0]).chunks()))
    a = [(f.type, f.tag, f.payload) for f in _frames(DATA / SHARED_TRACES[0])]
    b = [(f.type, f.tag, f.payload) for f in _frames(native)]
    assert a == b
    assert TraceFile(native).format == "unknown"  # format is known only once read
    t = TraceFile(native)
    list(t.chunks())
    assert t.format == "native"


def test_bad_lines_are_named_by_line_number_and_the_rest_is_kept(tmp_path: Path) -> None:
    lines = [
        '{"k": "meta", "format": "cupti-jsonl", "version": 1, "pid": 5}',
        '{"k": "mem", "ts": 10, "op": 1, "mk": 3, "addr": 4096, "bytes": 64, "dev": 0}',
        '{"k": "mem", "ts": 11, "op": 1, "mk": 3, "addr": 8192',  # cut short
        '{"k": "telemetry", "ts": 12}',  # unknown kind
        '{"k": "mem", "ts": 13, "op": 1, "mk": 3, "bytes": 8}',  # no addr
        '{"k": "mem", "ts": -1, "op": 1, "mk": 3, "addr": 1, "bytes": 8}',  # negative
        '{"k": "mem", "ts": 14, "op": 1, "mk": 3, "addr": 12288, "bytes": 32, "dev": 0}',
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    trace = TraceFile(path)
    frames = list(iter_frames(trace.chunks()))
    batches = [f.records() for f in frames if f.type is FrameType.BATCH]
    assert sum(len(b) for b in batches) == 2
    assert all((b["pid"] == 5).all() for b in batches), "records without a pid take the meta line's"
    assert [p.split(": ", 1)[0] for p in trace.problems] == [f"{path}:{n}" for n in (3, 4, 5, 6)]
    assert "unknown record kind 'telemetry'" in trace.problems[1]
    assert "lacks field 'addr'" in trace.problems[2]
