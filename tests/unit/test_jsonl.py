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
    original = [json.loads(line) for line in gzip.decompress((DATA / name).read_bytes()).decode().splitlines()]
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


def _both_readers(text: bytes, block: int) -> tuple[bytes, list[str], bytes, list[str]]:
    from gpufootprint.wire.jsonl import JsonlToFrames

    slow_problems: list[str] = []
    slow = JsonlToFrames("t", slow_problems.append)
    lines = [ln + b"\n" for ln in text.split(b"\n")]
    lines[-1] = lines[-1][:-1]
    slow_out = b"".join(slow.convert([ln for ln in lines if ln]))
    fast_problems: list[str] = []
    fast = JsonlToFrames("t", fast_problems.append)
    blocks, rest = [], text
    while rest:  # whole lines per block, as the trace reader cuts them
        cut = rest.rfind(b"\n", 0, block) + 1 or len(rest)
        blocks.append(rest[:cut])
        rest = rest[cut:]
    fast_out = b"".join(fast.convert_blocks(blocks))
    return slow_out, slow_problems, fast_out, fast_problems


def test_block_reader_makes_exactly_the_line_readers_frames_and_problems() -> None:
    import random

    rng = random.Random(4)
    mem = ('{{"k": "mem", "ts": {ts}, "op": {op}, "mk": 3, "addr": {addr}, "bytes": {b}, "dev": 0, "pid": {pid}, '
           '"is_async": 0, "pool_thresh": {thr}}}')
    cpy = '{{"k":"cpy","start":{ts},"end":{e},"bytes":{b},"ck":1}}'
    odd = ['{"k": "mem2", "ts": 5, "op": 1, "mk": 3, "addr": 1, "bytes": 2}',  # digit in the kind: same shape
           '{"k": "mem", "ts": 05, "op": 1, "mk": 3, "addr": 1, "bytes": 2}',  # a leading zero: not JSON
           '{"k": "mem", "ts": 1.5, "op": 1, "mk": 3, "addr": 1, "bytes": 2}',
           '{"k": "mem", "ts": -1, "op": 1, "mk": 3, "addr": 1, "bytes": 2}',
           '{"k": "mem", "ts": true, "op": 1, "mk": 3, "addr": 1, "bytes": 2}',
           '{"k": "mem", "ts": 18446744073709551616, "op": 1, "mk": 3, "addr": 1, "bytes": 2}',
           '{"k": "mem", "ts": 18446744073709551615, "op": 1, "mk": 3, "addr": 1, "bytes": 2}',
           '{"k": "mem", "ts": 3, "op": 300, "mk": 3, "addr": 1, "bytes": 2}',  # too large for its u8 field
           '{"k": "mem", "t1s": 3, "op": 1, "mk": 3, "addr": 1, "bytes": 2}',
           '{"k": "mem", "ts": 3, "ts": 4, "op": 1, "mk": 3, "addr": 1, "bytes": 2}',
           '{"k": "mem", "op": 1, "mk": 3, "addr": 1, "bytes": 2}',  # lacks ts
           '', 'not json', '{"k": "mark", "ts": 9, "pid": 1, "label": "m7"}',
           '{"k": "meta", "format": "cupti-jsonl", "version": 1, "pid": 77}']
    for trial in range(12):
        out = []
        for _ in range(rng.choice([50, 300, 5000])):
            r = rng.random()
            ts = rng.randrange(1, 1 << 62)
            if r < 0.6:
                out.append(mem.format(ts=ts, op=rng.choice([1, 2]), addr=rng.randrange(1 << 48), b=rng.randrange(1 << 30),
                                      pid=rng.choice([1, 2]), thr=rng.choice([0, 18446744073709551615])))
            elif r < 0.9:
                out.append(cpy.format(ts=ts, e=ts + 5, b=rng.randrange(1 << 20)))
            elif r < 0.995:
                out.append(mem.replace(', "pid": {pid}', "").format(ts=ts, op=1, addr=7, b=8, thr=0))
            else:
                out.append(rng.choice(odd))
        text = "\n".join(out).encode() + (b"\n" if trial % 2 else b"")
        slow, slow_p, fast, fast_p = _both_readers(text, rng.choice([300, 4096, 1 << 16]))
        assert fast == slow and fast_p == slow_p, trial
    same_shape = [mem.format(ts=15, op=1, addr=3, b=8, pid=1, thr=0).replace('"k": "mem"', '"k": "mem1"')
                  .replace('"ts": 15', '"ts": 5'),  # a digit moved into the kind
                  mem.format(ts=15, op=1, addr=3, b=8, pid=1, thr=0).replace('"ts": 15', '"t1s": 5'),  # into a key
                  mem.format(ts=15, op=1, addr=3, b=8, pid=1, thr=0).replace('"ts": 15', '"ts": 05'),
                  mem.format(ts=15, op=1, addr=3, b=8, pid=1, thr=99999999999999999999)]
    for line in odd + same_shape:  # each odd line inside a run of good ones, where the block reader takes them
        good = [mem.format(ts=i + 1, op=1, addr=i, b=8, pid=1, thr=0) for i in range(20)]
        text = "\n".join(good[:10] + [line] + good[10:]).encode() + b"\n"
        slow, slow_p, fast, fast_p = _both_readers(text, 1 << 16)
        assert fast == slow and fast_p == slow_p, line
