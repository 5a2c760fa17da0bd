"""Open a trace file of either format (native or CUPTI-JSONL, gzip or plain).

``TraceFile.chunks()`` always yields native stream bytes, so callers feed one
``FrameDecoder``. Problems are collected, each one line naming the file and the
place; damage that ends the readable part of a file (a truncated gzip member,
an unreadable file) is a problem too, reported after the records before it.
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from gpufootprint.errors import TraceError
from gpufootprint.wire.framing import PREAMBLE
from gpufootprint.wire.jsonl import JsonlToFrames

_GZIP_MAGIC = b"\x1f\x8b"
CHUNK = 1 << 20


class TraceFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.problems: list[str] = []
        self.format = "unknown"
        self.compressed = False

    def _problem(self, message: str) -> None:
        self.problems.append(message)

    def _open(self) -> IO[bytes]:
        try:
            raw = open(self.path, "rb")  # noqa: SIM115 - closed by the caller's generator
        except OSError as exc:
            raise TraceError(f"{self.path}: cannot open trace ({exc.strerror})") from None
        head = raw.read(2)
        raw.seek(0)
        if head == _GZIP_MAGIC:
            self.compressed = True
            return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
        return raw

    def chunks(self) -> Iterator[bytes]:
        stream = self._open()
        try:
            try:
                head = stream.peek(len(PREAMBLE))[: len(PREAMBLE)] if hasattr(stream, "peek") else b""
            except (OSError, EOFError, zlib.error) as exc:
                raise TraceError(f"{self.path}: unreadable ({exc})") from None
            if head.startswith(PREAMBLE[:5]):
                self.format = "native"
                yield from self._native(stream)
            else:
                self.format = "cupti-jsonl"
                yield from self._jsonl(stream)
        finally:
            stream.close()

    def _native(self, stream: IO[bytes]) -> Iterator[bytes]:
        offset = 0
        while True:
            try:
                data = stream.read(CHUNK)
            except (OSError, EOFError, zlib.error) as exc:
                self._problem(f"{self.path}: byte {offset}: compressed data ends or is corrupt ({exc})")
                return
            if not data:
                return
            offset += len(data)
            yield data

    def _jsonl(self, stream: IO[bytes]) -> Iterator[bytes]:
        reader = JsonlToFrames(str(self.path), self._problem)
        lines = _safe_lines(stream, self, reader)
        yield from reader.convert(lines)


def _safe_lines(stream: IO[bytes], owner: TraceFile, reader: JsonlToFrames) -> Iterator[bytes]:
    buffered = io.BufferedReader(stream, CHUNK) if not isinstance(stream, io.BufferedReader) else stream
    while True:
        try:
            line = buffered.readline()
        except (OSError, EOFError, zlib.error) as exc:
            owner.problems.append(f"{owner.path}:{reader.lines + 1}: compressed data ends or is corrupt ({exc})")
            return
        if not line:
            return
        yield line  # a last line cut short fails JSON parsing, named by its number
