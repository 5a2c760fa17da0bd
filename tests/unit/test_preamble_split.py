"""A preamble cut anywhere by the pieces a stream comes in reads as the whole preamble (wire v1 included)."""

from __future__ import annotations

from gpufootprint.wire.framing import FrameDecoder, FrameType


def test_a_wire_v1_stream_split_inside_its_preamble_is_read_as_a_whole_one() -> None:
    # GIVEN a wire-v1 recording (no checksums), cut in two at every byte
    v1 = b"GPUFP\x01\r\n" + (2).to_bytes(4, "little") + bytes([FrameType.HELLO, 0, 0, 0]) + b"{}"
    for cut in range(len(v1) + 1):
        decoder = FrameDecoder()
        frames = decoder.feed(v1[:cut]) + decoder.feed(v1[cut:])
        # THEN every cut gives the one frame, as the whole stream does
        assert decoder.error is None, (cut, decoder.error)
        assert [(f.type, f.payload, f.offset) for f in frames] == [(FrameType.HELLO, b"{}", 8)], cut
        decoder.close()


def test_an_unsupported_version_split_inside_the_preamble_is_named_as_such() -> None:
    # GIVEN a preamble of wire version 9, fed one byte at a time
    decoder = FrameDecoder()
    for b in b"GPUFP\x09\r\n":
        decoder.feed(bytes([b]))
        if decoder.error is not None:
            break
    # THEN the error names the version, as for the whole preamble in one piece
    assert decoder.error is not None and "byte 5: unsupported wire version 9" in str(decoder.error)
