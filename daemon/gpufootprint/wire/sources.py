"""Open a trace file of either format (native or CUPTI-JSONL, gzip or plain).

``TraceFile.chunks()`` always yields native stream bytes; ``TraceFile.frames()``
decodes them, and is the one loop that reads a trace's frames (replay, the demo,
convert). Problems are collected, each one line naming the file and the
place. Gzip is decompressed incrementally, so a file cut short still yields
every byte before the cut, and the cut is reported as a problem.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from gpufootprint.errors import FrameError, TraceError
from gpufootprint.wire.framing import PREAMBLE, Frame, FrameDecoder
from gpufootprint.wire.jsonl import JsonlToFrames

_GZIP_MAGIC = b"\x1f\x8b"
CHUNK = 1 << 20
#: The most decompressed bytes in one piece (see ``_gunzip``): 512 KiB read 100,000 JSONL lines with
#: 4 % less CPU than 1 MiB (fewer fresh pages), 256 KiB no less.
OUT_BLOCK = 1 << 19
#: The read buffer of a trace file. A plain native file's frames are read one at a time through it: a
#: payload larger than it (a batch of thousands of records) is read straight into its own bytes, the
#: small frames (watermarks, marks, small batches) come out of it. Header and payload reads with their
#: checksums took a 1,000,000-record churn file in 12 ms with 64 KiB, 14 ms with 1 MiB (2026-12-06).
FILE_BUFFER = 1 << 16


class _Truncated(Exception):
    """Raised at the end of readable data; the message says why."""


class TraceFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.problems: list[str] = []
        self.format = "unknown"
        self.compressed = False

    def chunks(self) -> Iterator[bytes]:
        with self._open() as fh:
            yield from self._stream(_raw_chunks(fh))

    def _open(self) -> BinaryIO:
        try:
            return open(self.path, "rb", buffering=FILE_BUFFER)  # closed by the callers
        except OSError as exc:
            raise TraceError(f"{self.path}: cannot open trace ({exc.strerror})") from None

    def _stream(self, raw: Iterator[bytes]) -> Iterator[bytes]:
        """Native stream bytes from the file's bytes ``raw``: gunzipped, or converted from CUPTI-JSONL."""
        first = next(raw, b"")
        self.compressed = first.startswith(_GZIP_MAGIC)
        data = _gunzip(first, raw) if self.compressed else _chain(first, raw)
        native = _Peek(data)
        head = native.peek(len(PREAMBLE))
        try:
            if head[:5] == PREAMBLE[:5]:
                self.format = "native"
                yield from native
            else:
                self.format = "cupti-jsonl"
                reader = JsonlToFrames(str(self.path), self.problems.append)
                try:
                    yield from reader.convert_blocks(_blocks(native))
                except _Truncated as exc:
                    self.problems.append(f"{self.path}:{reader.lines + 1}: {exc}")
                    yield from reader.finish()
                    return
        except _Truncated as exc:
            self.problems.append(f"{self.path}: byte {native.offset}: {exc}")

    def _pieces(self, fh: BinaryIO, decoder: FrameDecoder) -> Iterator[bytes | Frame]:
        """What ``frames`` reads from the open file: bytes for ``decoder`` to feed (each fed before this
        goes on), and, from a plain native file, its whole frames read one at a time.

        Read one at a time, a frame's payload is read straight into its own bytes: in 1 MiB pieces,
        each payload was copied once more out of a fresh piece (a 1,000,000-record churn file read
        in 25 ms, 12 ms frame by frame, 2026-12-06). The frames read whole stop at
        anything else (damage, a frame cut short, the end): from there the decoder is fed the bytes,
        so the damage and the end are judged and named as in any stream."""
        head = fh.read(len(PREAMBLE))
        if head[:5] != PREAMBLE[:5]:  # gzip, CUPTI-JSONL, or too short to tell: in pieces
            yield from self._stream(_chain(head, _raw_chunks(fh)))
            return
        self.format = "native"
        yield head  # the preamble, judged by the decoder (a version it cannot read stops here)
        yield (yield from decoder.read_whole(fh.read))  # then the bytes of what stopped it
        yield from _raw_chunks(fh)

    def frames(self, max_frame_bytes: int | None = None, *, check_end: bool = True) -> Iterator[Frame]:
        """Every frame of the file, decoded as it is read.

        Damage ends the frames: those before it are yielded and the damage is added to
        ``problems`` as it is found: in a plain native file, whose frames are read one at a
        time, once every frame before it was yielded; elsewhere before the frames decoded with
        it from the same piece. A reader that stops early also skips the end check.
        ``check_end``: a file cut inside its last frame (or before the preamble) is a problem too. ``max_frame_bytes``: the largest payload
        accepted (None or 0: the wire's default).
        """
        decoder = FrameDecoder(max_frame_bytes) if max_frame_bytes else FrameDecoder()
        with self._open() as fh:
            for piece in self._pieces(fh, decoder):
                if isinstance(piece, Frame):  # read whole, and checked
                    yield piece
                    continue
                frames = decoder.feed(piece)
                if decoder.error is not None:
                    self.problems.append(f"{self.path}: {decoder.error}")
                yield from frames
                if decoder.error is not None:
                    return
        if check_end:
            try:
                decoder.close()
            except FrameError as exc:
                self.problems.append(f"{self.path}: {exc}")


def _raw_chunks(fh) -> Iterator[bytes]:  # type: ignore[no-untyped-def]
    while True:
        data = fh.read(CHUNK)
        if not data:
            return
        yield data


def _chain(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    if first:
        yield first
    yield from rest


def _gunzip(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    """Decompress gzip members one after another, yielding output as it comes, at most
    ``OUT_BLOCK`` bytes a piece: a 1 MiB read of a JSONL trace inflates to some 20 MiB, and one
    piece that large costs twice the CPU to inflate (fresh memory) and makes every pass the JSONL
    reader makes over it miss the cache."""
    d = zlib.decompressobj(wbits=31)
    inside = False  # fed a member that has not ended yet
    for chunk in _chain(first, rest):
        while chunk:
            inside = True
            yield from _inflate(d, chunk)
            if not d.eof:
                break  # the chunk is used up: the member goes on in the next one
            inside = False
            chunk = d.unused_data
            d = zlib.decompressobj(wbits=31)
            if chunk and not chunk.startswith(_GZIP_MAGIC):
                return  # trailing garbage after the last member: gzip ignores it too
    if inside:
        tail = d.flush()
        if tail:
            yield tail
        raise _Truncated("compressed data ends before the end of the gzip stream")


def _inflate(d: zlib._Decompress, chunk: bytes) -> Iterator[bytes]:
    """All the output ``chunk`` gives, in pieces of at most ``OUT_BLOCK``. A piece cut at the limit
    may leave input in ``unconsumed_tail`` or output pending inside zlib (also with no input left),
    so it asks again until a piece comes back short or the member ends."""
    while True:
        try:
            out = d.decompress(chunk, OUT_BLOCK)
        except zlib.error as exc:
            raise _Truncated(f"compressed data is corrupt ({exc})") from None
        if out:
            yield out
        if d.eof or len(out) < OUT_BLOCK:
            return
        chunk = d.unconsumed_tail


class _Peek:
    """Iterator of chunks with a look at the first bytes and a running offset."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._head = b""
        self.offset = 0

    def peek(self, n: int) -> bytes:
        while len(self._head) < n:
            nxt = next(self._chunks, None)
            if nxt is None:
                break
            self._head += nxt
        return self._head[:n]

    def __iter__(self) -> Iterator[bytes]:
        if self._head:
            head, self._head = self._head, b""
            self.offset += len(head)
            yield head
        for chunk in self._chunks:
            self.offset += len(chunk)
            yield chunk


def _blocks(chunks: _Peek) -> Iterator[bytes]:
    """The input in blocks of whole lines, as ``_lines`` cuts them: a last line without its newline last."""
    rest = b""  # the start of a line the next chunk ends (never a newline in it)
    for chunk in chunks:
        cut = chunk.rfind(b"\n") + 1
        if not cut:
            rest += chunk
        elif rest or cut < len(chunk):
            yield b"".join((rest, memoryview(chunk)[:cut]))  # one copy, not a join and a slice
            rest = chunk[cut:]
        else:
            yield chunk
    if rest:
        yield rest  # a last line cut short fails JSON parsing, named by its number
