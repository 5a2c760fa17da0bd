"""An OOM capture as a native recording: replayable, and readable by ``report`` and ``export``.

The file is what a probe would have sent had it started ``seconds`` before the OOM
with its live table: HELLO, a RESYNC of the live table as of the window's start, the
window's records in time order, and an ``oom`` MARK at the failure whose
``expect_live_bytes`` is the footprint the daemon had then. ``gpufootprint replay``
of a capture therefore checks itself: the mark matches or the replay says it differs.

The table at the window's start is the daemon's live table rolled back through the
window's MEMORY records (an allocation in the window was not live before it; a
release in the window was, with the size and kind its record carries).
"""

from __future__ import annotations

import gzip
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpufootprint.records import (
    DEVICE_RESIDENT_KINDS,
    MEMORY_DTYPE,
    MEMORY_KIND_NAMES,
    TIME_FIELD,
    MemoryOp,
    RecordKind,
)
from gpufootprint.wire import framing
from gpufootprint.wire.framing import FrameType


@dataclass(frozen=True, slots=True)
class Entry:
    """One live allocation: what a resync record needs."""

    bytes: int
    kind: int
    ts: int
    is_async: bool


Table = dict[int, Entry]  # address -> allocation, one device


def roll_back(table: Mapping[int, Entry], memory: np.ndarray, after_ns: int) -> Table:
    """``table`` (the state after every record of ``memory``) as it was at ``after_ns``:
    undo, newest first, each record of ``memory`` stamped later than ``after_ns``."""
    out = dict(table)
    later = memory[memory["ts"] > np.uint64(after_ns)]
    for rec in later[::-1]:
        addr = int(rec["addr"])
        if int(rec["op"]) == MemoryOp.ALLOCATION:
            out.pop(addr, None)
        elif int(rec["op"]) == MemoryOp.RELEASE:
            # Its allocation time is before the window (or unknown): the window's start stands for it.
            out[addr] = Entry(int(rec["bytes"]), int(rec["mk"]), after_ns, bool(rec["is_async"]))
    return out


def live_by_kind(table: Mapping[int, Entry]) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in table.values():
        name = MEMORY_KIND_NAMES.get(e.kind, str(e.kind))
        out[name] = out.get(name, 0) + e.bytes
    return {k: v for k, v in out.items() if v}


def device_bytes(table: Mapping[int, Entry]) -> int:
    return sum(e.bytes for e in table.values() if e.kind in DEVICE_RESIDENT_KINDS)


def table_records(pid: int, dev: int, table: Mapping[int, Entry]) -> np.ndarray:
    recs = np.zeros(len(table), MEMORY_DTYPE)
    if table:
        recs["addr"] = list(table)
        recs["bytes"] = [e.bytes for e in table.values()]
        recs["mk"] = [e.kind for e in table.values()]
        recs["ts"] = [e.ts for e in table.values()]
        recs["is_async"] = [e.is_async for e in table.values()]
    recs["pid"] = pid
    recs["dev"] = dev
    recs["op"] = MemoryOp.ALLOCATION
    return recs


def encode_capture(*, hello: dict[str, Any], pid: int, start_ns: int, start_tables: Mapping[int, Table],
                   window: Mapping[RecordKind, np.ndarray], mark: dict[str, Any],
                   kernel_names: Mapping[int, str] | None = None) -> Iterable[bytes]:
    """The frames of a capture, preamble first."""
    yield framing.PREAMBLE
    yield framing.encode_json(FrameType.HELLO, {**hello, "pid": pid})
    if kernel_names:
        yield framing.encode_json(FrameType.STRINGS, {str(k): v for k, v in kernel_names.items()})
    yield framing.encode_json(FrameType.RESYNC_BEGIN, {"ts": start_ns, "reason": "oom_capture"})
    for dev, table in sorted(start_tables.items()):
        recs = table_records(pid, dev, table)
        for i in range(0, len(recs), 4096):
            yield framing.encode_batch(RecordKind.MEMORY, recs[i:i + 4096])
    yield framing.encode_json(FrameType.RESYNC_END, {})
    yield from _time_ordered_batches(window)
    yield framing.encode_json(FrameType.MARK, mark)


def _time_ordered_batches(window: Mapping[RecordKind, np.ndarray], most: int = 4096) -> Iterable[bytes]:
    """Batches in time order across kinds (runs of one kind), so a replay applies nothing late."""
    kinds = [k for k, recs in sorted(window.items()) if len(recs)]
    if not kinds:
        return
    times = np.concatenate([window[k][TIME_FIELD[k]] for k in kinds])
    which = np.concatenate([np.full(len(window[k]), i, np.int32) for i, k in enumerate(kinds)])
    index = np.concatenate([np.arange(len(window[k])) for k in kinds])
    order = np.argsort(times, kind="stable")
    which, index = which[order], index[order]
    cuts = np.flatnonzero(np.diff(which)) + 1
    for run_which, run_index in zip(np.split(which, cuts), np.split(index, cuts)):
        kind = kinds[int(run_which[0])]
        rows = window[kind][run_index]
        for i in range(0, len(rows), most):
            yield framing.encode_batch(kind, np.ascontiguousarray(rows[i:i + most]))


def write_capture(path: Path, frames: Iterable[bytes]) -> int:
    """Write to ``path`` (gzip), through a temporary name so a reader never sees half a file."""
    tmp = path.with_name(path.name + ".part")
    n = 0
    with gzip.open(tmp, "wb", compresslevel=6) as fh:
        for frame in frames:
            fh.write(frame)
            n += len(frame)
    tmp.replace(path)
    return n
