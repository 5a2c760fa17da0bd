"""CUPTI's activity buffers read as bytes: walk the records, convert them in bulk.

Part of the wire: a forwarded CUPTI buffer (``CUPTI_BUFFER`` frame) carries these structs as
CUPTI wrote them, so the probe (which reads them in the workload's process) and the daemon
(which reads forwarded buffers in ingest) share this one layout; it lives here so the
daemon never imports the probe.

A completed CUPTI buffer is a run of C structs, one after another, each starting
with its ``CUpti_ActivityKind`` (``cuptiActivityGetNextRecord`` advances by the
struct's size). For the kinds the probe enables, CUPTI 13 writes the structs
below; their sizes and offsets agree with cupti-python's ``activity_*_dtype``
(checked by ``tests/unit/test_probe_bulk.py``, with cupti-python, a dependency, and
against ``cuptiActivityGetNextRecord`` on the GPU by ``tests/gpu/test_probe_gpu.py``).

Reading the bytes replaces building one Python object per record inside CUPTI's
callback, which was most of the probe's own CPU time in callbacks and flushes on the
H200 (docs/performance.md, run 3). ``walk``
refuses a buffer it cannot walk exactly (an unknown kind, a record running past
the end); the caller then falls back to another way of reading it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Final, overload

import numpy as np

from gpufootprint.records import DTYPES, RecordKind

# CUPTI_ActivityKind numbers (stable C ABI values).
MEMCPY: Final = 1
MEMSET: Final = 2
KERNEL: Final = 3
DRIVER: Final = 4  # CUpti_ActivityAPI: cuMemMap/cuMemUnmap (driver_hooks_via="activity"), allocation calls
RUNTIME: Final = 5  # CUpti_ActivityAPI: the runtime's allocation calls (probe/oom.py)
CONCURRENT_KERNEL: Final = 10
MEMCPY2: Final = 22
UNIFIED_MEMORY_COUNTER: Final = 25
MEMORY2: Final = 49
MEMORY_POOL: Final = 50

POOL_LOCAL: Final = 1  # CUPTI_ACTIVITY_MEMORY_POOL_TYPE_LOCAL: a pool whose size CUPTI reports
UM_DTOH: Final = 2  # CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_BYTES_TRANSFER_DTOH


def _raw(itemsize: int, **fields: tuple[str, int]) -> np.dtype:
    names = list(fields)
    return np.dtype({"names": names, "formats": [fields[n][0] for n in names],
                     "offsets": [fields[n][1] for n in names], "itemsize": itemsize})


# CUpti_ActivityMemory4, _Memcpy6, _Memset4, _MemoryPool3, _MemcpyPtoP4,
# _UnifiedMemoryCounter3, _Kernel10: only the fields we read, at CUPTI 13's offsets.
RAW_DTYPES: Final[dict[int, np.dtype]] = {
    MEMORY2: _raw(128, op=("<i4", 4), mk=("<i4", 8), corr=("<u4", 12), address=("<u8", 16),
                  bytes=("<u8", 24), timestamp=("<u8", 32), dev=("<u4", 52), ctx=("<u4", 56),
                  stream=("<u4", 60), is_async=("<u4", 72), pool_type=("<i4", 80), pool_addr=("<u8", 88),
                  pool_thresh=("<u8", 96), pool_size=("<u8", 104), pool_used=("<u8", 112)),
    MEMCPY: _raw(96, ck=("u1", 4), src=("u1", 5), dst=("u1", 6), bytes=("<u8", 8), start=("<u8", 16),
                 end=("<u8", 24), dev=("<u4", 32), ctx=("<u4", 36), stream=("<u4", 40), corr=("<u4", 44),
                 graph=("<u4", 72)),
    MEMSET: _raw(88, bytes=("<u8", 8), start=("<u8", 16), end=("<u8", 24), dev=("<u4", 32),
                 stream=("<u4", 40), corr=("<u4", 44), mk=("<u2", 50)),
    MEMORY_POOL: _raw(80, op=("<i4", 4), ptype=("<i4", 8), corr=("<u4", 12), dev=("<u4", 20),
                      keep=("<u8", 24), address=("<u8", 32), size=("<u8", 40), thresh=("<u8", 48),
                      timestamp=("<u8", 56), used=("<u8", 64)),
    MEMCPY2: _raw(96, ck=("u1", 4), src=("u1", 5), dst=("u1", 6), bytes=("<u8", 8), start=("<u8", 16),
                  end=("<u8", 24), dev=("<u4", 32), ctx=("<u4", 36), stream=("<u4", 40), src_dev=("<u4", 44),
                  dst_dev=("<u4", 52), corr=("<u4", 60), graph=("<u4", 80)),
    UNIFIED_MEMORY_COUNTER: _raw(104, ck=("<i4", 4), value=("<u8", 8), start=("<u8", 16), end=("<u8", 24),
                                 address=("<u8", 32), src=("<u4", 40), dst=("<u4", 44)),
    CONCURRENT_KERNEL: _raw(216, start=("<u8", 16), end=("<u8", 24), dev=("<u4", 40), stream=("<u4", 48),
                            corr=("<u4", 92), name=("<u8", 104), node=("<u8", 144), graph=("<u4", 156)),
}
RAW_DTYPES[KERNEL] = RAW_DTYPES[CONCURRENT_KERNEL]

#: The struct cupti-python names for each kind (its ``activity_<name>_dtype``).
CUPTI_PYTHON_NAMES: Final[dict[int, str]] = {
    MEMORY2: "memory4", MEMCPY: "memcpy6", MEMSET: "memset4", MEMORY_POOL: "memory_pool3",
    MEMCPY2: "memcpy_pto_p4", UNIFIED_MEMORY_COUNTER: "unified_memory_counter3", CONCURRENT_KERNEL: "kernel10",
}

RECORD_KIND: Final[dict[int, RecordKind]] = {
    MEMORY2: RecordKind.MEMORY, MEMORY_POOL: RecordKind.MEMORY_POOL, MEMCPY: RecordKind.MEMCPY,
    MEMCPY2: RecordKind.MEMCPY, MEMSET: RecordKind.MEMSET, CONCURRENT_KERNEL: RecordKind.KERNEL,
    KERNEL: RecordKind.KERNEL, UNIFIED_MEMORY_COUNTER: RecordKind.UNIFIED_MEMORY,
}

#: CUpti_ActivityAPI, the struct of DRIVER and RUNTIME records (the fields read; a unit test checks it
#: against cupti-python's activity_api_dtype). Never converted to a batch of ours: the daemon steps
#: over them in a forwarded buffer; the probe reads failed allocations (probe/oom.py) and a launch
#: window's calls (probe/launches.py) from them.
API_RAW_DTYPE: Final = _raw(40, cbid=("<u4", 4), start=("<u8", 8), end=("<u8", 16), pid=("<u4", 24),
                            tid=("<u4", 28), corr=("<u4", 32), ret=("<u4", 36))

API_RET_OFFSET: Final = 36  # CUpti_ActivityAPI's returnValue (API_RAW_DTYPE's "ret")

# Kinds walked over but not converted.
SKIPPED_SIZES: Final[dict[int, int]] = {DRIVER: API_RAW_DTYPE.itemsize, RUNTIME: API_RAW_DTYPE.itemsize}
API_KINDS: Final = frozenset({DRIVER, RUNTIME})
_GATHERED: Final[dict[int, np.dtype]] = {**RAW_DTYPES, DRIVER: API_RAW_DTYPE, RUNTIME: API_RAW_DTYPE}
_SIZES: Final[dict[int, int]] = {**{k: dt.itemsize for k, dt in RAW_DTYPES.items()}, **SKIPPED_SIZES}
_KIND = struct.Struct("<i")


#: Records (or cycles of records) of a run that the first vectorised look checks; each next look
#: checks four times as many, so a look costs about what the run it finds is long, in a 64 KiB
#: buffer or a 16 MiB frame alike.
_FIRST_LOOK: Final = 512
#: The longest cycle of distinct kinds (MEMORY2, RUNTIME, DRIVER, ...: a launch window's calls
#: between allocations) looked for in a buffer.
_MAX_PERIOD: Final = 4
#: Records past a cycle read one by one before the look at the rest of it.
_PEEK: Final = 4
#: Records (of 128 bytes) read one by one, at most, after a cycle that did not last, before the next look.
_MAX_BACKOFF: Final = 32
#: Bytes from one record to the next of its kind in the longest cycle looked for.
_MAX_SPAN: Final = _MAX_PERIOD * 216
#: A look pays for itself when it spares reading about this many records one by one.
_WORTH_A_LOOK: Final = 8


class Runs(Sequence[int]):
    """Record offsets of one kind in buffer order, as pieces: a ``range`` for each run the walk
    found (records back to back, or one every so many bytes in a cycle of kinds), a list of ints
    for records read one by one (``walk``'s answer; ``gather`` copies a piece at a time and reads
    a buffer that is one run as a view).

    Equal to any list, tuple, range or Runs holding the same offsets."""

    __slots__ = ("pieces",)

    def __init__(self, pieces: Iterable[range | list[int]] = ()) -> None:
        self.pieces: list[range | list[int]] = []
        for piece in pieces:
            if isinstance(piece, range):
                self.add_run(piece)
            else:
                for off in piece:
                    self.append(off)

    def append(self, offset: int) -> None:
        """One offset past every offset held."""
        pieces = self.pieces
        if pieces and isinstance(pieces[-1], list):
            pieces[-1].append(offset)
        else:
            pieces.append([offset])

    def add_run(self, run: range) -> None:
        """A run past every offset held; offsets just before it that it continues join it."""
        if not run:
            return
        pieces, step, start = self.pieces, run.step, run.start
        stop = start + len(run) * step
        last = pieces[-1] if pieces else None
        if isinstance(last, list):
            while last and last[-1] == start - step:
                start = last.pop()
            if not last:
                pieces.pop()
                last = pieces[-1] if pieces else None
        n = (stop - start) // step  # the run with the offsets it took over
        if isinstance(last, range):
            if last[-1] + last.step == start and last.step == step:
                pieces[-1] = range(last.start, stop, step)  # it continues the last
                return
            if last[-1] + last.step == start and n == 1:
                pieces[-1] = range(last.start, start + last.step, last.step)  # one record, the last's next
                return
            if len(last) == 1 and start - last.start == step:
                pieces[-1] = range(last.start, stop, step)  # the last is one record, then the run
                return
        pieces.append(range(start, stop, step))

    def continues(self, offset: int) -> bool:
        """Whether ``offset`` is the next of the last run (then it is held, as part of it)."""
        last = self.pieces[-1] if self.pieces else None
        if isinstance(last, range) and last[-1] + last.step == offset:
            self.pieces[-1] = range(last.start, offset + last.step, last.step)
            return True
        return False

    def array(self) -> np.ndarray:
        """The offsets as an ``np.intp`` array."""
        parts = [np.arange(p.start, p.stop, p.step, dtype=np.intp) if isinstance(p, range)
                 else np.asarray(p, dtype=np.intp) for p in self.pieces]
        return np.concatenate(parts) if parts else np.zeros(0, np.intp)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self.array()
        return a if dtype is None else a.astype(dtype)

    def __len__(self) -> int:
        return sum(map(len, self.pieces))

    def __iter__(self) -> Iterator[int]:
        for piece in self.pieces:
            yield from piece

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[int]: ...

    def __getitem__(self, i: int | slice) -> int | Sequence[int]:
        if isinstance(i, slice):
            lo, hi, stride = i.indices(len(self))
            if stride != 1:
                return list(self)[i]
            out = Runs()
            at = 0  # index of the current piece's first offset
            for piece in self.pieces:
                n = len(piece)
                a, b = max(lo, at), min(hi, at + n)
                if a < b:
                    cut = piece[a - at:b - at]
                    out.pieces.append(cut if isinstance(cut, range) else list(cut))
                at += n
                if at >= hi:
                    break
            return out
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("Runs index out of range")
        for piece in self.pieces:
            if i < len(piece):
                return piece[i]
            i -= len(piece)
        raise AssertionError("unreachable")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Runs, list, tuple, range)):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Runs({self.pieces!r})"


def walk_sizes() -> dict[int, int]:
    """The struct size of every kind ``walk`` steps over or reads (the probe's C walk is given the same)."""
    return dict(_SIZES)


def walk(buf: bytes | memoryview, valid: int) -> dict[int, Runs] | None:
    """Offsets of each kind's records in ``buf[:valid]`` (as ``Runs``); None when it cannot be
    walked exactly.

    Records are read one by one until one comes again soon: right after one of its kind, or
    after a cycle of up to ``_MAX_PERIOD`` distinct kinds (MEMORY2, RUNTIME, MEMORY2). The cycle
    is then followed in vectorised looks at the kinds where it puts its records, and the records
    it covers are kept as runs (``range``), never as one int each. A buffer of one kind (what
    allocation churn fills: MEMORY2 records back to back) is two records read and one look.
    Where looks find little (kinds mixed at random), they are tried less and less often.
    """
    uniform = uniform_runs(buf, valid)
    if uniform is not None:
        return uniform
    runs: dict[int, Runs] = {}
    loose: dict[int, list[int]] = {}  # each kind's list of offsets read one by one, since its last run
    sizes = _SIZES
    unpack = _KIND.unpack_from
    max_span = _MAX_SPAN
    quiet, backoff = 0, 1  # after a look that found (almost) nothing, no look before byte ``quiet``
    off = 0
    while off < valid:
        if off + 4 > valid:
            return None
        kind = unpack(buf, off)[0]
        size = sizes.get(kind)
        if size is None or off + size > valid:
            return None
        lst = loose.get(kind)
        if lst is None:
            r = runs.get(kind)
            if r is None:
                runs[kind] = r = Runs()
            elif r.continues(off):  # the record after the last cycle found, as the cycle had it
                off += size
                continue
            loose[kind] = lst = [off]
            r.pieces.append(lst)
            off += size
            continue
        gap = off - lst[-1]  # bytes since this kind came last: a cycle's, if it is one
        lst.append(off)
        off += size
        if gap > max_span or off < quiet:
            continue
        found = 0
        cycle = [kind] if gap == size else _cycle(buf, off - size - gap, off - size)
        if cycle is not None:
            skip, found = _follow(buf, valid, off, cycle, runs)
            if found:
                off += skip
                for k in cycle:
                    loose.pop(k, None)
        if found < _WORTH_A_LOOK:
            quiet, backoff = off + backoff * 128, min(backoff * 2, _MAX_BACKOFF)
        else:
            backoff = 1
    return runs


def walk_stop(buf: bytes | memoryview, valid: int) -> str:
    """Where a record-by-record walk of ``buf[:valid]`` stops, in words (why ``walk`` returned None): for
    the one-line error that names the place."""
    unpack = _KIND.unpack_from
    off = 0
    while off < valid:
        if off + 4 > valid:
            return f"{valid - off} bytes after the record ending at byte {off} of {valid}"
        kind = unpack(buf, off)[0]
        size = _SIZES.get(kind)
        if size is None:
            return f"unknown record kind {kind} at byte {off} of {valid}"
        if off + size > valid:
            return f"a kind-{kind} record of {size} bytes at byte {off} runs past the buffer's {valid}"
        off += size
    return f"none: the buffer walks ({valid} bytes)"


def _cycle(buf: bytes | memoryview, start: int, end: int) -> list[int] | None:
    """The kinds of the records from ``start`` (one of the kind at ``end``) to ``end``, in the order
    they come again from the record after ``end``; None unless they are at most ``_MAX_PERIOD``
    distinct kinds."""
    unpack = _KIND.unpack_from
    kinds: list[int] = []
    at = start
    while at < end:
        if len(kinds) == _MAX_PERIOD:
            return None
        k = unpack(buf, at)[0]
        kinds.append(k)
        at += _SIZES[k]
    if len(set(kinds)) != len(kinds):
        return None
    return kinds[1:] + kinds[:1]


def _follow(buf: bytes | memoryview, valid: int, off: int, cycle: list[int],
            runs: dict[int, Runs]) -> tuple[int, int]:
    """Bytes from ``off`` that repeat ``cycle`` (distinct kinds, in order) whole, recorded in ``runs``,
    and how many records they hold."""
    sizes = [_SIZES[k] for k in cycle]
    span = sum(sizes)
    avail = (valid - off) // span
    # The next few records first, one by one: where kinds are mixed at random, most cycles end
    # there, for much less than a vectorised look costs.
    at = off
    unpack = _KIND.unpack_from
    for j in range(min(_PEEK, avail * len(cycle))):
        if unpack(buf, at)[0] != cycle[j % len(cycle)]:
            return 0, 0
        at += sizes[j % len(cycle)]
    done = 0
    look = _FIRST_LOOK
    while done < avail:
        m = min(look, avail - done)
        at = off + done * span
        bad: np.ndarray | None = None
        for k, size in zip(cycle, sizes):
            other = np.ndarray(shape=(m,), dtype="<i4", buffer=buf, offset=at, strides=(span,)) != k
            bad = other if bad is None else np.logical_or(bad, other, out=bad)
            at += size
        assert bad is not None
        i = int(bad.argmax())
        if bad[i]:
            done += i
            break
        done += m
        look *= 4
    if done:
        at = off
        for k, size in zip(cycle, sizes):
            runs[k].add_run(range(at, at + done * span, span))
            at += size
    return done * span, done * len(cycle)


def uniform_kind(buf: bytes | memoryview, valid: int) -> int | None:
    """The kind of every record in ``buf[:valid]`` when they are all of one kind, else None."""
    if valid < 4:
        return None
    kind = _KIND.unpack_from(buf, 0)[0]
    size = _SIZES.get(kind)
    if size is None or valid % size:
        return None
    # The records' kind fields as one strided slice of 4-byte words (every struct's size is a multiple of 8):
    # CPython copies it holding the GIL, where numpy lets the GIL go for arrays past 500 elements (a 64 KiB
    # buffer has 512 MEMORY2 records) and a sender behind busy Python threads then waits a switch interval
    # (5 ms) to win it back.
    view = memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    kinds = view[:valid].cast("I")[::size // _KIND.size]
    return int(kind) if kinds.tobytes() == _KIND.pack(kind) * (valid // size) else None


def uniform_runs(buf: bytes | memoryview, valid: int) -> dict[int, Runs] | None:
    """``walk``'s answer for a buffer of records of one kind (``uniform_kind``: one vectorised look, what
    allocation churn fills, where the walk read two records and followed their run); None for any other
    buffer, which ``walk`` reads (and refuses what cannot be walked)."""
    kind = uniform_kind(buf, valid)
    if kind is None:
        return None
    return {kind: Runs([range(0, valid, _SIZES[kind])])}


def gather(u8: np.ndarray, kind: int, offsets: Sequence[int]) -> np.ndarray:
    """The records of one kind at ``offsets`` as a structured array of ``RAW_DTYPES[kind]``
    (``API_RAW_DTYPE`` for DRIVER and RUNTIME records).

    One run (``Runs`` of one run: records back to back, or one every so many bytes; a ``range``
    stepping by the struct's size) is a view of the buffer, valid until the buffer is given back;
    any other offsets are copied out, as bytes (a run at a time where ``Runs`` knows the runs):
    numpy copies structured records field by field, several times slower."""
    dt = _GATHERED[kind]
    size = dt.itemsize
    if isinstance(offsets, Runs):
        pieces = offsets.pieces
        if len(pieces) == 1 and isinstance(pieces[0], range):
            run = pieces[0]
            return np.ndarray(shape=(len(run),), dtype=dt, buffer=u8, offset=run.start,
                              strides=(run.step if len(run) > 1 else size,))
        out = np.empty((len(offsets), size), dtype=np.uint8)
        at = 0
        rows = None
        for piece in pieces:
            n = len(piece)
            if isinstance(piece, range):
                out[at:at + n] = np.ndarray(shape=(n, size), dtype=np.uint8, buffer=u8, offset=piece.start,
                                            strides=(piece.step, 1))
            else:
                if rows is None:
                    rows = _byte_rows(u8, size)
                out[at:at + n] = rows[np.asarray(piece, dtype=np.intp)]
            at += n
        return out.view(dt).reshape(len(out))
    if isinstance(offsets, range) and offsets.step == size and len(offsets):
        start = offsets.start
        return u8[start:start + len(offsets) * size].view(dt)
    offs = np.asarray(offsets, dtype=np.intp)
    if not len(offs):
        return np.zeros(0, dt)
    got: np.ndarray = _byte_rows(u8, size)[offs].view(dt).reshape(len(offs))
    return got


def api_returns(u8: np.ndarray, offsets: Sequence[int]) -> np.ndarray:
    """The return values of the API records (DRIVER or RUNTIME) at ``offsets``, read in place: no record
    gathered. (Records start 8-byte aligned in CUPTI's buffers; an offset that is not 4-byte aligned
    falls back to gathering.)"""
    at = np.asarray(offsets, dtype=np.intp) + API_RET_OFFSET
    if len(at) and (int(at.min()) < 0 or int(at.max()) + 4 > len(u8) or bool((at & 3).any())):
        return np.asarray(gather(u8, RUNTIME, offsets)["ret"])
    words: np.ndarray = u8[:len(u8) // 4 * 4].view("<u4")
    got: np.ndarray = words[at >> 2]
    return got


def _byte_rows(u8: np.ndarray, size: int) -> np.ndarray:
    """``size`` bytes from every byte of ``u8`` (overlapping rows, nothing copied): indexed by record
    offsets, it copies exactly the records. (An index matrix of every byte of every record took
    eight times the buffer: 111 MiB for a 16 MiB frame of two kinds.)"""
    return np.ndarray(shape=(len(u8) - size + 1, size), dtype=np.uint8, buffer=u8, offset=0, strides=(1, 1))


#: MEMORY2's fields copied as they are, ours and CUPTI's names in the same order (``convert``).
_MEMORY2_OURS: Final = ["dev", "stream", "corr", "bytes", "ts", "addr", "ctx", "op", "mk"]
_MEMORY2_THEIRS: Final = ["dev", "stream", "corr", "bytes", "timestamp", "address", "ctx", "op", "mk"]
_MEMORY2_PAIRS: Final = tuple(zip(_MEMORY2_OURS, _MEMORY2_THEIRS))


def convert(kind: int, src: np.ndarray, pid: int, name_id: Callable[[int], int] | None = None,
            out: np.ndarray | None = None) -> np.ndarray:
    """Raw structs of one CUPTI kind -> our record dtype (``name_id`` maps a kernel's name pointer).

    ``out``: where to write them, zeros of that dtype and ``len(src)`` records (a part of a larger batch, so
    that buffers read together are converted into their joined batch, not each into its own and then copied
    again); returned."""
    if out is None:
        out = np.zeros(len(src), dtype=DTYPES[RECORD_KIND[kind]])
    elif len(out) != len(src):  # numpy would broadcast one record over every row
        raise ValueError(f"convert: {len(src)} records into {len(out)} rows")
    out["pid"] = pid
    if kind == MEMORY2:
        # Field by field: numpy's one structured assignment of the nine (by position, casting each) costs
        # more than nine plain ones (numpy 2.4, a forwarded buffer's 512 records: 16.8 against 10.7 us).
        for ours, theirs in _MEMORY2_PAIRS:
            out[ours] = src[theirs]
        n_async = np.count_nonzero(src["is_async"])
        if not n_async:
            return out  # the pool fields stay 0: meaningful only on stream-ordered allocations
        # The pool configuration is meaningful only on stream-ordered allocations. Under cudaMallocAsync
        # every record of a buffer is one, in a pool: taken as they are, without numpy's where per field
        # (a 512-record buffer 43-44 -> 24-30 us on a 2-core VM).
        n = len(src)
        if n_async == n:
            out["is_async"] = 1
            ptype = src["pool_type"]
        else:
            is_async = src["is_async"] != 0
            out["is_async"] = is_async
            ptype = np.where(is_async, src["pool_type"], 0)
        out["pool_type"] = ptype
        if np.count_nonzero(ptype) == n:
            for name in ("pool_addr", "pool_thresh", "pool_used"):
                out[name] = src[name]
        else:
            has_pool = ptype != 0
            for name in ("pool_addr", "pool_thresh", "pool_used"):
                out[name] = np.where(has_pool, src[name], 0)
        local = ptype == POOL_LOCAL
        out["pool_size"] = src["pool_size"] if np.count_nonzero(local) == n else np.where(local, src["pool_size"], 0)
    elif kind in (MEMCPY, MEMCPY2):
        out["start"] = src["start"]
        out["end"] = src["end"]
        out["bytes"] = src["bytes"]
        out["dev"] = src["dev"]
        out["ctx"] = src["ctx"]
        out["stream"] = src["stream"]
        out["corr"] = src["corr"]
        out["graph"] = src["graph"]
        out["ck"] = src["ck"]
        out["src"] = src["src"]
        out["dst"] = src["dst"]
        out["src_dev"] = src["src_dev"] if kind == MEMCPY2 else src["dev"]
        out["dst_dev"] = src["dst_dev"] if kind == MEMCPY2 else src["dev"]
    elif kind == MEMSET:
        out["start"] = src["start"]
        out["end"] = src["end"]
        out["bytes"] = src["bytes"]
        out["dev"] = src["dev"]
        out["stream"] = src["stream"]
        out["corr"] = src["corr"]
        out["mk"] = src["mk"]
    elif kind == MEMORY_POOL:
        local = src["ptype"] == POOL_LOCAL
        out["ts"] = src["timestamp"]
        out["addr"] = src["address"]
        out["size"] = np.where(local, src["size"], 0)
        out["used"] = np.where(local, src["used"], 0)
        out["thresh"] = np.where(local, src["thresh"], 0)
        out["keep"] = src["keep"]
        out["dev"] = src["dev"]
        out["corr"] = src["corr"]
        out["op"] = src["op"]
        out["ptype"] = src["ptype"]
    elif kind == UNIFIED_MEMORY_COUNTER:
        ck = src["ck"]
        out["start"] = src["start"]
        out["end"] = src["end"]
        out["value"] = src["value"]
        out["addr"] = src["address"]
        out["src"] = src["src"]
        out["dst"] = src["dst"]
        out["dev"] = np.where(ck == UM_DTOH, src["src"], src["dst"])
        out["ck"] = ck
    else:  # kernels
        out["start"] = src["start"]
        out["end"] = src["end"]
        out["node"] = src["node"]
        out["dev"] = src["dev"]
        out["stream"] = src["stream"]
        out["corr"] = src["corr"]
        out["graph"] = src["graph"]
        if name_id is not None:
            out["name_id"] = [name_id(int(p)) for p in src["name"]]
    return out

