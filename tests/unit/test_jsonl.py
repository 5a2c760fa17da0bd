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


def _in_a_run(line: str, good: str, shape_only: bool = False) -> None:
    """``line`` inside a run of 20 ``good`` lines (formatted with ts, addr): both readers agree."""
    lines = [good.format(ts=i + 1, addr=i) for i in range(20)]
    text = "\n".join(lines[:10] + [line] + lines[10:]).encode() + b"\n"
    for block in (1 << 16, 700):
        slow, slow_p, fast, fast_p = _both_readers(text, block)
        assert fast == slow and fast_p == slow_p, line


_MEM = '{{"k": "mem", "ts": {ts}, "op": 1, "mk": 3, "addr": {addr}, "bytes": 8, "dev": 0, "pid": 1}}'


@pytest.mark.parametrize("line", [
    # Digits put where the shape has none, each keeping the shape (its digits taken out) and as
    # many numbers as slots, so only the bytes either side of a digit run tell them apart.
    '{"k": "mem", "ts": , "op": 1, "mk": 3, "a5ddr": 7, "bytes": 8, "dev": 0, "pid": 1}',  # empty slot + key digit
    '{"k": "mem"1, "ts": , "op": 1, "mk": 3, "addr": 5, 2"bytes": 7, "dev": 0, "pid": 1}',  # merged in the text
    '{"k": "mem", "ts":5 6, "op": 1, "mk": 3, "addr": 1, "bytes": , "dev": 0, "pid": 1}',  # two runs in one slot
    '{"k": "mem", "ts":5 , "op": 1, "mk": 3, "addr": 1, "bytes": 8, "dev": 0, "pid": 1}',  # before the space
    '{"k": "m1em", "ts": 5, "op": 1, "mk": 3, "addr": 1, "bytes": , "dev": 0, "pid": 1}',
    '{"k": "mem", "ts": 5, "op": 1, "mk": 3, "addr": 1, "bytes": 8, "dev": 0, "pid": 1}3',
    '3{"k": "mem", "ts": 5, "op": 1, "mk": 3, "addr": 1, "bytes": 8, "dev": 0, "pid": 1}',
    '{"k": "mem", "ts": 5, "op": 1, "mk": 3, "addr": 1, "bytes": , "dev": 0, "pid": 1}',  # only an empty slot
    '{"k": "mem", "ts": 5, "op": 1, "mk": 3, "addr": 1, "bytes": 8, "dev": 00, "pid": 1}',  # leading zeros
    '{"k": "mem", "ts": 5, "op": 1, "mk": 3, "addr": 1, "bytes": 8, "dev": 0, "pid": 01}',
    '{"k": "mem", "ts": 5, "op": 1, "mk": 3, "addr": 1, "bytes": 8, "dev": 0, "pid": 0001}',
    '{"k": "mem", "ts": 123456789012345678901, "op": 1, "mk": 3, "addr": 1, "bytes": 8, "dev": 0, "pid": 1}',
    '{"k": "mem", "ts": 99999999999999999999, "op": 1, "mk": 3, "addr": 1, "bytes": 8, "dev": 0, "pid": 1}',
    '{"k": "mem", "ts": 18446744073709551615, "op": 1, "mk": 3, "addr": 1, "bytes": 8, "dev": 0, "pid": 1}',
    '{"k": "mem", "ts": 5, "op": 1, "mk": 3, "addr": 1, "bytes": 8, "dev": 0, "pid": 4294967296}',  # past u32
])
def test_a_line_that_looks_canonical_but_is_not_is_read_as_the_line_reader_reads_it(line: str) -> None:
    _in_a_run(line, _MEM)


def test_number_reading_makes_every_number_past_u64_one_value() -> None:
    # The context check lets np.fromstring read numbers of any length and sends a run holding
    # 2**64 - 1 to the exact check, which relies on every larger number reading as 2**64 - 1.
    import numpy as np

    text = b" 18446744073709551616 99999999999999999999 123456789012345678901234 18446744073709551615 7"
    assert np.fromstring(text, dtype=np.uint64, sep=" ").tolist() == [2**64 - 1] * 4 + [7]


def test_a_shape_whose_slots_context_does_not_single_out_is_checked_by_position() -> None:
    from gpufootprint.wire import jsonl_fast
    from gpufootprint.wire.jsonl import _FIELDS, JSONL_KINDS

    # Between the space and the comma of "a ,b" is no slot, and no other byte tells it from one.
    odd = '{{"k": "mem", "a ,b": {addr}, "ts": {ts}, "op": 1, "mk": 3, "addr": 1, "bytes": 8}}'
    shape = odd.format(ts="", addr="").encode().translate(None, jsonl_fast.DIGITS)
    parsed = jsonl_fast.parse_shape(shape, JSONL_KINDS, _FIELDS)
    assert parsed is not None and not parsed.by_context
    canonical = jsonl_fast.parse_shape(_MEM.format(ts="", addr="").encode().translate(None, jsonl_fast.DIGITS),
                                       JSONL_KINDS, _FIELDS)
    assert canonical is not None and canonical.by_context
    for line in ['{"k": "mem", "a 1,b": , "ts": 4, "op": 1, "mk": 3, "addr": 1, "bytes": 8}',
                 '{"k": "mem", "a ,b": 3, "ts": 04, "op": 1, "mk": 3, "addr": 1, "bytes": 8}',
                 '{"k": "mem", "a ,b": 3, "ts": 4, "op": 1, "mk": 3, "addr": 1, "bytes": 8}']:
        _in_a_run(line, odd)


def test_runs_of_shapes_of_one_length_are_told_apart() -> None:
    # Shapes of one length are grouped first; two shapes of one length, in runs long and short.
    a = '{{"k": "mem", "ts": {ts}, "op": 1, "mk": 3, "addr": {addr}, "bytes": 8}}'
    b = '{{"k": "mem", "op": 2, "ts": {ts}, "mk": 3, "addr": {addr}, "bytes": 8}}'
    assert len(a.format(ts="", addr="")) == len(b.format(ts="", addr=""))
    lines, i = [], 0
    for n, form in [(12, a), (9, b), (3, a), (2, b), (20, a), (8, b), (1, a), (30, b)]:
        for _ in range(n):
            lines.append(form.format(ts=1000 + i, addr=7 * i))
            i += 1
    lines[40] = lines[40].replace('"mk": 3', '"mk": x')  # a bad line in the run of 20
    text = "\n".join(lines).encode()
    for block in (1 << 16, 500, 97):
        slow, slow_p, fast, fast_p = _both_readers(text, block)
        assert fast == slow and fast_p == slow_p and len(slow_p) == 1, block


def test_a_large_gzip_trace_reads_the_same_in_pieces_and_its_cut_is_reported(tmp_path: Path) -> None:
    # Several MiB of output from one read (it compresses 100 to 1), in two gzip members: inflated
    # in pieces of at most OUT_BLOCK, the frames are those of the plain file.
    from gpufootprint.wire import sources

    mem = '{{"k": "mem", "ts": {ts}, "op": 1, "mk": 3, "addr": 4096, "bytes": 64, "dev": 0, "pid": 3}}'
    text = ("\n".join(mem.format(ts=10 + i) for i in range(60_000)) + "\n").encode()
    assert len(text) > 4 * sources.OUT_BLOCK
    plain = tmp_path / "t.jsonl"
    plain.write_bytes(text)
    packed = tmp_path / "t.jsonl.gz"
    half = text.index(b"\n", len(text) // 2) + 1
    packed.write_bytes(gzip.compress(text[:half], 1) + gzip.compress(text[half:], 1))
    want = b"".join(TraceFile(plain).chunks())
    trace = TraceFile(packed)
    assert b"".join(trace.chunks()) == want and not trace.problems
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(packed.read_bytes()[:-20])
    trace = TraceFile(cut)
    got = b"".join(trace.chunks())
    assert len(trace.problems) == 1 and "compressed data ends before the end of the gzip stream" in trace.problems[0]
    assert len(got) > len(want) // 2


def test_blocks_are_the_whole_lines_of_any_chunking() -> None:
    import random

    from gpufootprint.wire.sources import _blocks, _Peek

    rng = random.Random(7)
    for _ in range(200):
        text = b"".join(rng.choice([b"ab\n", b"\n", b"cdefg", b"h\n\n", b"{}"]) for _ in range(rng.randrange(0, 40)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randrange(0, 8))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)]) if b > a]
        blocks = list(_blocks(_Peek(iter(chunks))))
        assert b"".join(blocks) == text
        assert all(b and b.endswith(b"\n") for b in blocks[:-1])
        # As the line reader cuts them: every block a run of whole lines, the last perhaps unended.
        assert all(b"\n" not in b for b in blocks[-1:]) or blocks[-1].endswith(b"\n")
