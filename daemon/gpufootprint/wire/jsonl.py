"""CUPTI-JSONL v1 (the neutral interchange of shared/traces/README.md) <-> native frames.

Reading turns lines into native frames, so a JSONL trace goes through exactly the
decoder and pipeline a live probe does. A bad line (invalid JSON, a missing
field, an unknown kind) is reported with its line number and skipped; the lines
around it are kept.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any, Final

import numpy as np

from gpufootprint.records import DTYPES, RecordKind
from gpufootprint.wire import jsonl_fast
from gpufootprint.wire.framing import (
    PREAMBLE,
    Frame,
    FrameType,
    encode_batch,
    encode_json,
)

#: JSONL kind tag -> record kind.
JSONL_KINDS: Final[dict[str, RecordKind]] = {
    "mem": RecordKind.MEMORY,
    "pool": RecordKind.MEMORY_POOL,
    "cpy": RecordKind.MEMCPY,
    "set": RecordKind.MEMSET,
    "kern": RecordKind.KERNEL,
    "um": RecordKind.UNIFIED_MEMORY,
    "api": RecordKind.API,
}
KIND_TAGS: Final[dict[RecordKind, str]] = {v: k for k, v in JSONL_KINDS.items()}

#: Per record kind: (dtype field, JSONL key, required). Fields not listed are 0
#: (padding) or filled from elsewhere (pid from the meta line, name_id from names).
_FIELDS: Final[dict[RecordKind, tuple[tuple[str, str, bool], ...]]] = {
    RecordKind.MEMORY: (
        ("ts", "ts", True), ("addr", "addr", True), ("bytes", "bytes", True),
        ("pool_addr", "pool_addr", False), ("pool_thresh", "pool_thresh", False),
        ("pool_size", "pool_size", False), ("pool_used", "pool_used", False),
        ("pid", "pid", False), ("dev", "dev", False), ("ctx", "ctx", False), ("stream", "stream", False),
        ("corr", "corr", False), ("op", "op", True), ("mk", "mk", True), ("is_async", "is_async", False),
        ("pool_type", "pool_type", False),
    ),
    RecordKind.MEMORY_POOL: (
        ("ts", "ts", True), ("addr", "addr", True), ("size", "size", True), ("used", "used", False),
        ("thresh", "thresh", False), ("keep", "keep", False), ("pid", "pid", False), ("dev", "dev", False),
        ("corr", "corr", False), ("op", "op", True), ("ptype", "ptype", False),
    ),
    RecordKind.MEMCPY: (
        ("start", "start", True), ("end", "end", True), ("bytes", "bytes", True), ("pid", "pid", False),
        ("dev", "dev", False), ("src_dev", "src_dev", False), ("dst_dev", "dst_dev", False),
        ("ctx", "ctx", False), ("stream", "stream", False), ("corr", "corr", False), ("graph", "graph", False),
        ("ck", "ck", True), ("src", "src", False), ("dst", "dst", False),
    ),
    RecordKind.MEMSET: (
        ("start", "start", True), ("end", "end", True), ("bytes", "bytes", True), ("pid", "pid", False),
        ("dev", "dev", False), ("stream", "stream", False), ("corr", "corr", False), ("mk", "mk", False),
    ),
    RecordKind.KERNEL: (
        ("start", "start", True), ("end", "end", True), ("node", "node", False), ("pid", "pid", False),
        ("dev", "dev", False), ("stream", "stream", False), ("corr", "corr", False), ("graph", "graph", False),
    ),
    RecordKind.UNIFIED_MEMORY: (
        ("start", "start", True), ("end", "end", True), ("value", "value", True), ("addr", "addr", False),
        ("pid", "pid", False), ("dev", "dev", False), ("src", "src", False), ("dst", "dst", False),
        ("ck", "ck", True),
    ),
    RecordKind.API: (
        ("start", "start", True), ("end", "end", True), ("pid", "pid", False), ("dev", "dev", False),
        ("tid", "tid", False), ("corr", "corr", False), ("cbid", "cbid", True), ("domain", "domain", True),
        ("role", "role", True),
    ),
}

BATCH_RECORDS: Final = 4096
#: Lines of one shape in a row below this many are read one by one (the block parse has fixed costs).
FAST_RUN_MIN: Final = 8

ProblemSink = Callable[[str], None]


class _Lines:
    """The lines of a block, by their start and end offsets (the end at the newline or the block's end)."""

    def __init__(self, block: bytes, starts: np.ndarray, ends: np.ndarray) -> None:
        self.block, self.starts, self.ends = block, starts, ends

    def __getitem__(self, i: int) -> bytes:
        return self.block[int(self.starts[i]):int(self.ends[i])]

    def join(self, i0: int, i1: int) -> bytes:
        """Lines ``i0`` to ``i1`` joined by their newlines (one slice)."""
        return self.block[int(self.starts[i0]):int(self.ends[i1 - 1])]


class JsonlToFrames:
    """Reads CUPTI-JSONL lines and yields native stream bytes (preamble first)."""

    def __init__(self, name: str, on_problem: ProblemSink) -> None:
        self.name = name
        self.on_problem = on_problem
        self.default_pid = 0
        self.lines = 0
        # The batch being filled: rows read line by line, and arrays of rows read as a block, in line order.
        self._rows: list[tuple[int, ...]] = []
        self._parts: list[list[tuple[int, ...]] | np.ndarray] = []
        self._count = 0
        self._kind: RecordKind | None = None
        self._shapes: dict[bytes, jsonl_fast.Shape | None] = {}
        self._scratch = jsonl_fast.Scratch()
        self._repeats: dict[bytes, bytes] = {}
        self._names: dict[str, int] = {}
        self._new_names: dict[str, str] = {}

    def convert(self, lines: Iterable[bytes | str]) -> Iterator[bytes]:
        yield PREAMBLE
        for raw in lines:
            self.lines += 1
            out = self._line(raw)
            if out:
                yield out
        yield from self.finish()

    def convert_blocks(self, blocks: Iterable[bytes]) -> Iterator[bytes]:
        """Like ``convert``, from blocks of whole lines (each ends with a newline but perhaps the last of
        the input). Runs of lines of one shape are parsed together (``jsonl_fast``); the frames, the
        problems and the line numbers are exactly those of the line-by-line reader."""
        yield PREAMBLE
        for block in blocks:
            out = self._block(block)
            if out:
                yield out
        yield from self.finish()

    def _block(self, block: bytes) -> bytes:
        # The block and its shapes (its digits taken out) are searched for newlines, not split into
        # lines: the i-th newline of one is the i-th of the other, and the lines of a run of one
        # shape are one slice of the block. Lines of one shape have shapes of one length, so runs
        # of one length are found in numpy and each is checked to be one shape with one compare.
        shapes = block.translate(None, jsonl_fast.DIGITS)
        ends = np.flatnonzero(np.frombuffer(block, np.uint8) == 10)
        shape_ends = np.flatnonzero(np.frombuffer(shapes, np.uint8) == 10)
        if block and not block.endswith(b"\n"):  # a last line without its newline
            ends = np.append(ends, len(block))
            shape_ends = np.append(shape_ends, len(shapes))
        starts = np.concatenate(([0], ends[:-1] + 1)) if len(ends) else ends
        shape_starts = np.concatenate(([0], shape_ends[:-1] + 1)) if len(ends) else ends
        lengths = shape_ends - shape_starts
        cuts = (np.flatnonzero(lengths[1:] != lengths[:-1]) + 1).tolist()
        lines = _Lines(block, starts, ends)
        out: list[bytes] = []
        for g0, g1 in zip([0, *cuts], [*cuts, len(ends)]):
            if g1 - g0 < FAST_RUN_MIN:
                self._one_by_one(lines, g0, g1, out)
                continue
            at, length = int(shape_starts[g0]), int(lengths[g0])
            first = shapes[at:at + length]
            if shapes.startswith(self._repeated(first, g1 - g0), at):
                self._run(first, lines, g0, g1, out)
                continue
            # Shapes of one length but not one shape: runs of one shape, as the shapes say.
            i = g0
            for shape, group in itertools.groupby(shapes[int(shape_starts[j]):int(shape_ends[j])] for j in range(g0, g1)):
                n = sum(1 for _ in group)
                if n >= FAST_RUN_MIN:
                    self._run(shape, lines, i, i + n, out)
                else:
                    self._one_by_one(lines, i, i + n, out)
                i += n
        return b"".join(out)

    def _repeated(self, shape: bytes, n: int) -> memoryview:
        """``n`` lines of ``shape`` joined by newlines, a view of one string kept per shape (building
        and slicing it for each run cost as much as the compare)."""
        rep = self._repeats.get(shape)
        if rep is None or len(rep) < n * (len(shape) + 1):
            if len(self._repeats) >= 16:
                self._repeats.clear()
            rep = self._repeats[shape] = (shape + b"\n") * max(n, 2 * (len(rep) // (len(shape) + 1) if rep else 0))
        return memoryview(rep)[:n * (len(shape) + 1) - 1]

    def _run(self, shape: bytes, lines: _Lines, i0: int, i1: int, out: list[bytes]) -> None:
        """Lines ``i0`` to ``i1`` (of one shape) parsed as one block, or one by one where they must be."""
        parsed = self._fast(shape, lines.join(i0, i1), i1 - i0)
        if parsed is None:
            self._one_by_one(lines, i0, i1, out)
        else:
            self.lines += i1 - i0
            out.append(self._add_parsed(*parsed))

    def _one_by_one(self, lines: _Lines, i0: int, i1: int, out: list[bytes]) -> None:
        for i in range(i0, i1):
            self.lines += 1
            piece = self._line(lines[i])
            if piece:
                out.append(piece)

    def _fast(self, shape: bytes, block: bytes, n_lines: int) -> tuple[RecordKind, np.ndarray] | None:
        if shape not in self._shapes:
            self._shapes[shape] = jsonl_fast.parse_shape(shape, JSONL_KINDS, _FIELDS) if len(self._shapes) < 256 \
                else None
        parsed = self._shapes[shape]
        if parsed is None:
            return None
        recs = jsonl_fast.parse_run(block, n_lines, parsed, _FIELDS[parsed.kind], self.default_pid, self._scratch)
        return None if recs is None else (parsed.kind, recs)

    def _add_parsed(self, kind: RecordKind, recs: np.ndarray) -> bytes:
        """Rows parsed as a block join the batch as line-by-line rows would: the same batch boundaries."""
        out = []
        i = 0
        while i < len(recs):
            if kind is not self._kind or self._count >= BATCH_RECORDS:
                out.append(self._flush())
            self._kind = kind
            take = min(len(recs) - i, BATCH_RECORDS - self._count)
            self._end_rows()
            self._parts.append(recs[i:i + take])
            self._count += take
            i += take
        return b"".join(out)

    def _end_rows(self) -> None:
        if self._rows:
            self._parts.append(self._rows)
            self._rows = []

    def finish(self) -> Iterator[bytes]:
        """The batch still being filled (also after the input broke off)."""
        tail = self._flush()
        if tail:
            yield tail

    def _problem(self, message: str) -> None:
        self.on_problem(f"{self.name}:{self.lines}: {message}")

    def _line(self, raw: bytes | str) -> bytes:
        if not raw.strip():
            return b""
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            self._problem(f"invalid JSON ({exc.msg if hasattr(exc, 'msg') else exc})")
            return b""
        if not isinstance(obj, dict):
            self._problem("a line must be a JSON object")
            return b""
        tag = obj.get("k")
        kind = JSONL_KINDS.get(tag) if isinstance(tag, str) else None
        if kind is not None:
            row = self._row(kind, obj)
            if row is None:
                return b""
            out = self._flush() if (kind is not self._kind or self._count >= BATCH_RECORDS) else b""
            self._kind = kind
            self._rows.append(row)
            self._count += 1
            return out
        if tag == "meta":
            if obj.get("format") != "cupti-jsonl" or obj.get("version") != 1:
                self._problem(f"meta line says format={obj.get('format')!r} version={obj.get('version')!r}, "
                              "expected cupti-jsonl 1")
            if isinstance(obj.get("pid"), int):
                self.default_pid = obj["pid"]
            return self._flush() + encode_json(FrameType.META, obj)
        if tag == "mark":
            return self._flush() + encode_json(FrameType.MARK, obj)
        self._problem(f"unknown record kind {tag!r}")
        return b""

    def _row(self, kind: RecordKind, obj: dict[str, Any]) -> tuple[int, ...] | None:
        values: list[int] = []
        for fname, key, required in _FIELDS[kind]:
            value = obj.get(key)
            if value is None:
                if required:
                    self._problem(f"{KIND_TAGS[kind]} record lacks field {key!r}")
                    return None
                value = self.default_pid if fname == "pid" else 0
            elif isinstance(value, bool) or not isinstance(value, int) or value < 0 or value >= 1 << 64:
                self._problem(f"{KIND_TAGS[kind]} field {key!r} must be a non-negative integer, got {value!r}")
                return None
            values.append(value)
        if kind is RecordKind.KERNEL:
            values.append(self._name_id(str(obj.get("name", ""))))
        return tuple(values)

    def _name_id(self, name: str) -> int:
        nid = self._names.get(name)
        if nid is None:
            nid = len(self._names) + 1
            self._names[name] = nid
            self._new_names[str(nid)] = name
        return nid

    def _flush(self) -> bytes:
        self._end_rows()
        if not self._count or self._kind is None:
            self._parts, self._count = [], 0
            return b""
        kind, parts = self._kind, self._parts
        self._parts, self._count = [], 0
        arrays = [part if isinstance(part, np.ndarray) else self._rows_array(kind, part) for part in parts]
        recs = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        if len(recs) == 0:
            return b""
        prefix = b""
        if self._new_names:
            prefix = encode_json(FrameType.STRINGS, self._new_names)
            self._new_names = {}
        return prefix + encode_batch(kind, recs)

    def _rows_array(self, kind: RecordKind, rows: list[tuple[int, ...]]) -> np.ndarray:
        names = [f for f, _, _ in _FIELDS[kind]] + (["name_id"] if kind is RecordKind.KERNEL else [])
        recs = np.zeros(len(rows), dtype=DTYPES[kind])
        try:
            columns = list(zip(*rows))
            for fname, col in zip(names, columns):
                recs[fname] = col
        except OverflowError:
            # A value too large for its field: find the row, keep the others.
            good = []
            for row in rows:
                try:
                    np.array([row[: len(names)]], dtype=[(n, DTYPES[kind][n]) for n in names])
                    good.append(row)
                except OverflowError:
                    self._problem(f"{KIND_TAGS[kind]} record has a value too large for its field")
            return self._rows_array(kind, good)
        return recs


def write_jsonl(frames: Iterable[Frame], out: IO[str]) -> int:
    """Write native frames as CUPTI-JSONL v1; returns the number of lines written."""
    names: dict[int, str] = {}
    lines = 0
    for frame in frames:
        if frame.type is FrameType.BATCH:
            kind = RecordKind(frame.tag)
            recs = frame.records()
            fields = _FIELDS[kind]
            cols = [recs[f].tolist() for f, _, _ in fields]
            name_col = recs["name_id"].tolist() if kind is RecordKind.KERNEL else None
            tag = KIND_TAGS[kind]
            for i in range(len(recs)):
                obj: dict[str, Any] = {"k": tag}
                for (_, key, _), col in zip(fields, cols):
                    obj[key] = col[i]
                if name_col is not None:
                    obj["name"] = names.get(name_col[i], "")
                out.write(json.dumps(obj) + "\n")
                lines += 1
        elif frame.type in (FrameType.META, FrameType.MARK):
            obj = frame.json()
            obj.setdefault("k", "meta" if frame.type is FrameType.META else "mark")
            if frame.type is FrameType.META:
                obj.setdefault("format", "cupti-jsonl")
                obj.setdefault("version", 1)
            out.write(json.dumps(obj) + "\n")
            lines += 1
        elif frame.type is FrameType.STRINGS:
            names.update({int(k): v for k, v in frame.json().items() if k.isdigit()})
    return lines
