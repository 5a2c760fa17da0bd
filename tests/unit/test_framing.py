from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from gpufootprint.errors import FrameError
from gpufootprint.records import DTYPES, RecordKind
from gpufootprint.wire.framing import (
    PREAMBLE,
    Frame,
    FrameDecoder,
    FrameType,
    encode,
    encode_batch,
    encode_json,
    encode_watermark,
    iter_frames,
)

from tests.conftest import ALLOC, mem, mem_batch

WIRE_SIZES = {RecordKind.MEMORY: 80, RecordKind.MEMORY_POOL: 64, RecordKind.MEMCPY: 60, RecordKind.MEMSET: 48,
              RecordKind.KERNEL: 48, RecordKind.UNIFIED_MEMORY: 56, RecordKind.API: 40}


def _stream() -> bytes:
    recs = mem_batch([mem(10, ALLOC, 0x1000, 512), mem(20, ALLOC, 0x2000, 1024)])
    return (PREAMBLE + encode_json(FrameType.HELLO, {"pid": 100}) + encode_batch(RecordKind.MEMORY, recs)
            + encode_watermark(25) + encode_json(FrameType.MARK, {"ts": 25, "pid": 100, "dev": 0}))


def test_every_record_dtype_is_packed_and_little_endian() -> None:
    for kind, dtype in DTYPES.items():
        assert dtype.isalignedstruct is False, kind
        for name in dtype.names:
            assert dtype[name].byteorder in ("<", "|", "="), (kind, name)
        # The wire carries these sizes: changing one is a wire-version change.
        assert dtype.itemsize == WIRE_SIZES[kind], kind


def test_round_trip_returns_the_same_frames_and_records() -> None:
    frames = list(iter_frames(iter([_stream()])))
    assert [f.type for f in frames] == [FrameType.HELLO, FrameType.BATCH, FrameType.WATERMARK, FrameType.MARK]
    recs = frames[1].records()
    assert recs["addr"].tolist() == [0x1000, 0x2000] and recs["bytes"].tolist() == [512, 1024]
    assert frames[2].watermark() == 25
    assert frames[0].json() == {"pid": 100}


def test_decoding_byte_by_byte_gives_the_same_frames_as_one_chunk() -> None:
    data = _stream()
    decoder = FrameDecoder()
    frames = []
    for i in range(len(data)):
        frames.extend(decoder.feed(data[i : i + 1]))
    decoder.close()
    whole = list(iter_frames(iter([data])))
    assert [(f.type, f.tag, f.payload, f.offset) for f in frames] == [
        (f.type, f.tag, f.payload, f.offset) for f in whole]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"NOTATRACE-------", "byte 0: not a gpufootprint stream"),
        (b"GPUFP\x09\r\n" + encode(FrameType.HELLO), "byte 5: unsupported wire version 9"),
        (PREAMBLE + (2**31).to_bytes(4, "little") + b"\x02\x00\x01\x00" + bytes(4),
         "byte 8: frame length 2147483648 exceeds"),
        (PREAMBLE + (0).to_bytes(4, "little") + b"\x63\x00\x00\x00" + bytes(4), "byte 8: unknown frame type 99"),
        (PREAMBLE + encode(FrameType.HELLO, b"{}")[:-1] + b"]", "byte 8: checksum mismatch in a HELLO frame"),
    ],
)
def test_damage_is_reported_with_its_byte_offset(data: bytes, message: str) -> None:
    decoder = FrameDecoder()
    decoder.feed(data)
    assert decoder.error is not None and message in str(decoder.error)
    with pytest.raises(FrameError):
        decoder.feed(b"more")


def test_frames_before_damage_are_still_returned() -> None:
    good = _stream()
    decoder = FrameDecoder()
    frames = decoder.feed(good + b"\xff" * 12)
    assert len(frames) == 4
    assert decoder.error is not None and f"byte {len(good)}" in str(decoder.error)


def test_truncated_stream_is_an_error_at_close() -> None:
    data = _stream()
    decoder = FrameDecoder()
    frames = decoder.feed(data[:-3])
    assert len(frames) == 3
    with pytest.raises(FrameError, match="truncated inside a frame"):
        decoder.close()


def test_batch_of_wrong_size_or_unknown_kind_is_refused_by_the_frame_not_the_stream() -> None:
    frames = list(iter_frames(iter([PREAMBLE + encode(FrameType.BATCH, b"\x00" * 7, tag=RecordKind.MEMORY)
                                    + encode(FrameType.BATCH, b"", tag=77)])))
    assert len(frames) == 2
    with pytest.raises(FrameError, match="not a multiple of the record size"):
        frames[0].records()
    with pytest.raises(FrameError, match="unknown record kind 77"):
        frames[1].records()


def test_wire_version_1_recordings_without_checksums_are_still_read() -> None:
    v1 = b"GPUFP\x01\r\n" + (2).to_bytes(4, "little") + bytes([FrameType.HELLO, 0, 0, 0]) + b"{}"
    frames = list(iter_frames(iter([v1])))
    assert [(f.type, f.payload) for f in frames] == [(FrameType.HELLO, b"{}")]


def test_encode_batch_refuses_the_wrong_dtype() -> None:
    with pytest.raises(TypeError):
        encode_batch(RecordKind.MEMCPY, np.zeros(1, dtype=DTYPES[RecordKind.MEMORY]))


@pytest.mark.parametrize("seed", range(4))
def test_json_frames_read_by_the_scanner_alone_equal_json_loads(seed: int) -> None:
    # GIVEN random JSON objects (nested, unicode, numbers of every kind) and payloads that are not one
    # plain UTF-8 object: whitespace around it, a BOM, UTF-16, an array, trailing data, broken JSON
    import random

    rng = random.Random(seed)

    def value(depth: int) -> Any:
        r = rng.random()
        if depth > 2 or r < 0.4:
            return rng.choice([0, -1, 2**70, 1.5, -0.0, 1e300, True, False, None, "", "é\u2603\\\"x", "\x00"])
        if r < 0.7:
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        return {str(rng.randrange(100)): value(depth + 1) for _ in range(rng.randrange(5))}

    payloads = [json.dumps({"k": value(0), "ts": rng.randrange(1 << 62)}, ensure_ascii=rng.random() < 0.5).encode()
                for _ in range(200)]
    payloads += [b' {"a":1}', b'{"a":1} ', b'\xef\xbb\xbf{"a":1}', '{"a":1}'.encode("utf-16"),
                 '{"a":1}'.encode("utf-16-le"), b"[1,2]", b'{"a":1}{"b":2}', b'{"a":1,}', b'{"a":\xff}', b"{}",
                 b'{"a":NaN}', b'{"a":1}}', b"{", b"}", b'{"a": [1, 2]}']
    for payload in payloads:
        frame = Frame(FrameType.HEARTBEAT, 0, payload, 0)
        try:
            want: Any = json.loads(payload)
        except (UnicodeDecodeError, json.JSONDecodeError):
            want = FrameError
        if want is not FrameError and not isinstance(want, dict):
            want = FrameError
        # THEN each reads as json.loads reads it, or fails as a frame error where json.loads fails
        if want is FrameError:
            with pytest.raises(FrameError):
                frame.json()
        else:
            got = frame.json()
            assert type(got) is dict and json.dumps(got) == json.dumps(want)  # NaN != NaN: compared as text


def test_the_decoder_makes_the_frames_the_dataclass_makes() -> None:
    # GIVEN a stream of random frames of every type, read in random pieces (frames whole in a piece take
    # the decoder's own constructor, frames cut across pieces too)
    rng = np.random.default_rng(4)
    data = bytearray(PREAMBLE)
    want: list[Frame] = []
    for _ in range(300):
        ftype = FrameType(int(rng.choice([t.value for t in FrameType])))
        tag = int(rng.integers(0, 256))
        payload = rng.bytes(int(rng.integers(0, 200)))
        want.append(Frame(ftype, tag, payload, len(data)))  # at the byte where its header starts
        data += encode(ftype, payload, tag)
    decoder = FrameDecoder()
    got: list[Frame] = []
    at = 0
    while at < len(data):
        step = int(rng.integers(1, 3000))
        got.extend(decoder.feed(bytes(data[at:at + step])))
        at += step
    decoder.close()
    # THEN each frame is the one the dataclass makes of its fields: equal, same hash and repr, frozen
    assert got == want
    for f, made in zip(got, want):
        assert hash(f) == hash(made) and repr(f) == repr(made) and type(f) is Frame
        with pytest.raises(AttributeError):
            f.tag = 1  # type: ignore[misc]
