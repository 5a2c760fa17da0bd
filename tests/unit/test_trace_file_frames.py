"""A plain native file's frames, read one at a time by ``TraceFile.frames``, against the same file's bytes
fed to the decoder in pieces: the same frames at the same offsets, and on damage or a cut the same
one-line problem, the frames before it kept."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from gpufootprint.errors import FrameError
from gpufootprint.records import MEMORY_DTYPE, RecordKind
from gpufootprint.wire import sources
from gpufootprint.wire.framing import (
    HEADER_SIZE,
    PREAMBLE,
    FrameDecoder,
    FrameType,
    encode,
    encode_batch,
    encode_json,
    encode_watermark,
)
from gpufootprint.wire.sources import TraceFile

Seen = tuple[list[tuple[FrameType, int, bytes, int]], list[str]]


def _batch(n: int, t0: int) -> bytes:
    recs = np.zeros(n, dtype=MEMORY_DTYPE)
    recs["ts"] = t0 + np.arange(n)
    recs["addr"] = 0x1000 + np.arange(n) * 512
    recs["bytes"] = 512
    recs["op"] = 1
    recs["pid"] = 100
    return encode_batch(RecordKind.MEMORY, recs)


def _stream() -> bytes:
    """Small frames around batches larger than the file's read buffer (4,096 records: 320 KiB)."""
    assert 4096 * MEMORY_DTYPE.itemsize > sources.FILE_BUFFER
    parts = [PREAMBLE, encode_json(FrameType.HELLO, {"pid": 100})]
    for i, n in enumerate((3, 4096, 1, 700, 4096, 2)):
        parts += [_batch(n, 1000 * i), encode_watermark(1000 * i + 999),
                  encode_json(FrameType.MARK, {"ts": 1000 * i + 999, "pid": 100, "dev": 0})]
    parts.append(encode(FrameType.RESYNC_END))  # an empty payload
    return b"".join(parts)


def _read_whole(path: Path, max_frame_bytes: int | None = None) -> Seen:
    trace = TraceFile(path)
    frames = [(f.type, f.tag, f.payload, f.offset) for f in trace.frames(max_frame_bytes)]
    return frames, trace.problems


def _in_pieces(path: Path, max_frame_bytes: int | None = None) -> Seen:
    """The file's bytes as ``chunks`` gives them, fed to a decoder as ``frames`` did before it read frames whole."""
    trace = TraceFile(path)
    decoder = FrameDecoder(max_frame_bytes) if max_frame_bytes else FrameDecoder()
    frames, problems = [], []
    for chunk in trace.chunks():
        frames += [(f.type, f.tag, f.payload, f.offset) for f in decoder.feed(chunk)]
        if decoder.error is not None:
            problems.append(f"{path}: {decoder.error}")
            break
    else:
        try:
            decoder.close()
        except FrameError as exc:
            problems.append(f"{path}: {exc}")
    return frames, trace.problems + problems


def _check(tmp_path: Path, data: bytes, max_frame_bytes: int | None = None) -> Seen:
    path = tmp_path / "t.gfp"
    path.write_bytes(data)
    whole = _read_whole(path, max_frame_bytes)
    assert whole == _in_pieces(path, max_frame_bytes)
    return whole


def test_an_intact_file_gives_every_frame_read_whole_without_feeding_the_decoder(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    data = _stream()
    fed: list[int] = []
    feed = FrameDecoder.feed
    monkeypatch.setattr(FrameDecoder, "feed", lambda self, b: fed.append(len(b)) or feed(self, b))
    frames, problems = _read_whole(_write(tmp_path, data))
    assert fed == [len(PREAMBLE), 0]  # the preamble, then the end of the file
    monkeypatch.undo()
    assert (frames, problems) == _check(tmp_path, data)
    assert len(frames) == 2 + 6 * 3 and not problems
    assert frames[-1][2] == b"" and frames[-1][3] == len(data) - HEADER_SIZE


def _write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "w.gfp"
    path.write_bytes(data)
    return path


def _frame_starts(data: bytes) -> list[int]:
    starts, at = [], len(PREAMBLE)
    while at < len(data):
        starts.append(at)
        at += HEADER_SIZE + int.from_bytes(data[at:at + 4], "little")
    return starts


def test_a_file_cut_anywhere_ends_as_the_decoder_says(tmp_path: Path) -> None:
    data = _stream()
    cuts = {0, 1, 5, 7, len(PREAMBLE)}
    for start in _frame_starts(data):
        cuts |= {start, start + 1, start + HEADER_SIZE - 1, start + HEADER_SIZE, start + HEADER_SIZE + 1, start + 300}
    cuts |= set(random.Random(7).sample(range(len(data)), 40))
    for cut in sorted(c for c in cuts if c < len(data)):
        frames, problems = _check(tmp_path, data[:cut])
        assert all(at + HEADER_SIZE + len(payload) <= cut for _, _, payload, at in frames)
        if cut > len(PREAMBLE) and cut not in _frame_starts(data):
            assert problems and "truncated inside a frame" in problems[0], (cut, problems)


@pytest.mark.parametrize("field", ["length", "type", "flags", "tag", "crc", "payload", "last byte"])
def test_a_damaged_frame_stops_the_file_where_the_decoder_stops_it(tmp_path: Path, field: str) -> None:
    data = bytearray(_stream())
    offset = {"length": 0, "type": 4, "flags": 5, "tag": 6, "crc": 8, "payload": HEADER_SIZE + 1000}[field] \
        if field != "last byte" else None
    for start in _frame_starts(bytes(data)):
        length = int.from_bytes(data[start:start + 4], "little")
        if offset is None:
            at = start + HEADER_SIZE + length - 1
        elif offset >= HEADER_SIZE:
            at = start + min(offset, HEADER_SIZE + length - 1)
            if length == 0:
                continue
        else:
            at = start + offset
        for flip in (0x01, 0x80):
            damaged = bytearray(data)
            damaged[at] ^= flip
            frames, problems = _check(tmp_path, bytes(damaged))
            assert problems, (field, start, flip)
            assert problems[0].startswith(f"{tmp_path / 't.gfp'}: byte {start}: ") or field == "length", problems
            assert [f[3] for f in frames] == [s for s in _frame_starts(bytes(data)) if s < start]


def test_a_frame_past_the_limit_is_refused_as_the_decoder_refuses_it(tmp_path: Path) -> None:
    frames, problems = _check(tmp_path, _stream(), max_frame_bytes=100_000)
    assert "exceeds the limit 100000" in problems[0]
    assert [f[0] for f in frames] == [FrameType.HELLO, FrameType.BATCH, FrameType.WATERMARK, FrameType.MARK]


@pytest.mark.parametrize("data", [b"", b"GPUF", b"GPUFP", PREAMBLE[:7], PREAMBLE, b"GPUFP\x07\r\n" + b"x" * 40,
                                  b"GPUFP\x02\r\r" + bytes(16)])
def test_a_file_too_short_or_of_another_version_reads_as_before(tmp_path: Path, data: bytes) -> None:
    _check(tmp_path, data)


def test_wire_version_1_frames_read_whole_and_cut(tmp_path: Path) -> None:
    v1 = b"GPUFP\x01\r\n" + b"".join((2 + i).to_bytes(4, "little") + bytes([FrameType.HELLO, 0, 0, 0]) + b"{}" + b" " * i
                                     for i in range(3))
    frames, problems = _check(tmp_path, v1)
    assert [f[2] for f in frames] == [b"{}", b"{} ", b"{}  "] and not problems
    assert _check(tmp_path, v1[:-1])[1]
    assert _check(tmp_path, v1[:12] + bytes([99]) + v1[13:])[1]
