from __future__ import annotations

import importlib.util
import os
import sys
import types
import zlib

import pytest
from gpufootprint.errors import FrameError
from gpufootprint.wire import checksum
from gpufootprint.wire.framing import PREAMBLE, FrameDecoder, FrameType, encode


def _module(monkeypatch: pytest.MonkeyPatch, name: str, crc32: object) -> str:
    fake = types.ModuleType(name)
    fake.crc32 = crc32  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, name, fake)
    return name


def test_the_frames_checksum_is_zlibs_crc32_whichever_implementation_computes_it() -> None:
    # GIVEN payloads of the lengths frames have (an 8-byte watermark to a 4,096-record batch), as bytes and as
    # memoryview slices at odd offsets (the decoder checks header bytes out of its read buffer)
    data = os.urandom(400_000)
    for n in (0, 1, 7, 8, 15, 63, 64, 65, 255, 1_024, 4_095, 40_000, 327_680):
        for seed in (0, 1, 0xFFFF_FFFF, zlib.crc32(b"head")):
            # THEN the value is zlib's: files written by either implementation read with the other
            assert checksum.crc32(data[:n], seed) == zlib.crc32(data[:n], seed), (n, seed)
            view = memoryview(data)[3 : 3 + n]
            assert checksum.crc32(view, seed) == zlib.crc32(view, seed), (n, seed)
    assert checksum.crc32(b"123456789") == 0xCBF43926  # the CRC-32 check value


@pytest.mark.skipif(importlib.util.find_spec("zlib_ng") is None, reason="zlib-ng is not installed")
def test_zlib_ng_computes_it_where_installed() -> None:
    assert checksum.IMPLEMENTATION == "zlib_ng.zlib_ng"


def test_zlib_computes_it_where_the_fast_one_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "no_such_crc", None)  # importing it raises ImportError
    assert checksum.pick("no_such_crc") == (zlib.crc32, "zlib")
    assert checksum.pick(_module(monkeypatch, "crc_without_function", None)) == (zlib.crc32, "zlib")


def test_a_fast_crc32_is_used_only_when_it_gives_zlibs_values(monkeypatch: pytest.MonkeyPatch) -> None:
    def same(data: object, value: int = 0) -> int:
        return zlib.crc32(data, value)  # type: ignore[arg-type]

    def off_by_one(data: object, value: int = 0) -> int:
        return zlib.crc32(data, value) ^ 1  # type: ignore[arg-type]

    def seed_ignored(data: object, value: int = 0) -> int:
        return zlib.crc32(data)  # type: ignore[arg-type]

    def bytes_only(data: object, value: int = 0) -> int:
        if not isinstance(data, bytes):
            raise TypeError("a bytes-like object is required")
        return zlib.crc32(data, value)

    assert checksum.pick(_module(monkeypatch, "good_crc", same)) == (same, "good_crc")
    for broken in (off_by_one, seed_ignored, bytes_only):
        assert checksum.pick(_module(monkeypatch, f"bad_crc_{broken.__name__}", broken)) == (zlib.crc32, "zlib")


def test_a_damaged_frame_is_still_refused_where_it_is() -> None:
    # GIVEN a stream whose second frame has one payload bit flipped
    first = encode(FrameType.HELLO, b'{"pid":1}')
    second = bytearray(encode(FrameType.MARK, b'{"ts":5,"pid":1,"dev":0}' + b" " * 5_000))
    second[-100] ^= 0x10
    decoder = FrameDecoder()
    frames = decoder.feed(PREAMBLE + first + bytes(second))
    # THEN the frame before it is kept and the error names the damaged frame's byte
    assert [f.type for f in frames] == [FrameType.HELLO]
    assert isinstance(decoder.error, FrameError)
    assert str(decoder.error) == (f"byte {len(PREAMBLE) + len(first)}: checksum mismatch in a MARK frame "
                                  f"of {len(second) - 12} bytes (damaged data)")


def test_the_decoder_and_the_encoders_use_the_picked_implementation() -> None:
    from gpufootprint.wire import framing

    assert framing.crc32 is checksum.crc32
