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
from collections.abc import Callable, Sequence
from typing import Final

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

# Kinds walked over but not converted.
SKIPPED_SIZES: Final[dict[int, int]] = {DRIVER: API_RAW_DTYPE.itemsize, RUNTIME: API_RAW_DTYPE.itemsize}
API_KINDS: Final = frozenset({DRIVER, RUNTIME})
_GATHERED: Final[dict[int, np.dtype]] = {**RAW_DTYPES, DRIVER: API_RAW_DTYPE, RUNTIME: API_RAW_DTYPE}
_SIZES: Final[dict[int, int]] = {**{k: dt.itemsize for k, dt in RAW_DTYPES.items()}, **SKIPPED_SIZES}
_KIND = struct.Struct("<i")


def walk(buf: bytes | memoryview, valid: int) -> dict[int, Sequence[int]] | None:
    """Offsets of each kind's records in ``buf[:valid]``; None when it cannot be walked exactly.

    A buffer of one kind only (what allocation churn fills: MEMORY2 records back to back) is
    recognised in one vectorised check; any other is walked record by record, and a run of
    one kind inside it is measured in one vectorised look.
    """
    uniform = _walk_uniform(buf, valid)
    if uniform is not None:
        return uniform
    offsets: dict[int, list[int]] = {}
    sizes = _SIZES
    unpack = _KIND.unpack_from
    off = 0
    prev, same = -1, 0
    while off < valid:
        if off + 4 > valid:
            return None
        kind = unpack(buf, off)[0]
        size = sizes.get(kind)
        if size is None or off + size > valid:
            return None
        lst = offsets.get(kind)
        if lst is None:
            offsets[kind] = lst = []
        lst.append(off)
        off += size
        same = same + 1 if kind == prev else 0
        prev = kind
        if same >= 8 and valid - off >= 8 * size:
            # A run of one kind: find where it ends with one vectorised look at the rest.
            n = (valid - off) // size
            kinds = np.ndarray(shape=(n,), dtype="<i4", buffer=buf, offset=off, strides=(size,))
            other = np.flatnonzero(kinds != kind)
            run = int(other[0]) if len(other) else n
            lst.extend(range(off, off + run * size, size))
            off += run * size
            same = 0
    return offsets  # type: ignore[return-value]


def uniform_kind(buf: bytes | memoryview, valid: int) -> int | None:
    """The kind of every record in ``buf[:valid]`` when they are all of one kind, else None."""
    if valid < 4:
        return None
    kind = _KIND.unpack_from(buf, 0)[0]
    size = _SIZES.get(kind)
    if size is None or valid % size:
        return None
    kinds = np.ndarray(shape=(valid // size,), dtype="<i4", buffer=buf, offset=0, strides=(size,))
    return int(kind) if bool((kinds == kind).all()) else None


def _walk_uniform(buf: bytes | memoryview, valid: int) -> dict[int, Sequence[int]] | None:
    """``{kind: range(0, valid, size)}`` when every record of the buffer is of the first one's kind."""
    if valid < 4:
        return None
    kind = _KIND.unpack_from(buf, 0)[0]
    size = _SIZES.get(kind)
    if size is None or valid % size or valid // size < 2:
        return None
    n = valid // size
    kinds = np.ndarray(shape=(n,), dtype="<i4", buffer=buf, offset=0, strides=(size,))
    if not bool((kinds == kind).all()):
        return None
    return {kind: list(range(0, valid, size))}


def gather(u8: np.ndarray, kind: int, offsets: Sequence[int]) -> np.ndarray:
    """The records of one kind at ``offsets`` as a structured array of ``RAW_DTYPES[kind]``
    (``API_RAW_DTYPE`` for DRIVER and RUNTIME records).

    Records back to back (a ``range`` stepping by the struct's size) are a view of the buffer,
    valid until the buffer is given back; any other offsets are copied out."""
    dt = _GATHERED[kind]
    size = dt.itemsize
    if isinstance(offsets, range) and offsets.step == size and len(offsets):
        start = offsets.start
        return u8[start:start + len(offsets) * size].view(dt)
    offs = np.asarray(offsets, dtype=np.intp)
    if len(offs) > 1:
        # Mostly back to back (runs broken by a record of another kind): a view per run.
        breaks = np.flatnonzero(np.diff(offs) != size) + 1
        if len(breaks) * 8 < len(offs):
            starts = np.concatenate(([0], breaks))
            ends = np.concatenate((breaks, [len(offs)]))
            return np.concatenate([u8[offs[i]:offs[i] + (j - i) * size].view(dt)
                                   for i, j in zip(starts.tolist(), ends.tolist())])
    if not len(offs):
        return np.zeros(0, dt)
    # Records at any offsets: one structured view starting at every byte (overlapping, nothing
    # copied), indexed by the offsets, copies exactly the records. (An index matrix of every byte
    # of every record took eight times the buffer: 111 MiB for a 16 MiB frame of two kinds.)
    starts = np.ndarray(shape=(len(u8) - size + 1,), dtype=dt, buffer=u8, offset=0, strides=(1,))
    rows: np.ndarray = starts[offs]
    return rows


def convert(kind: int, src: np.ndarray, pid: int, name_id: Callable[[int], int] | None = None) -> np.ndarray:
    """Raw structs of one CUPTI kind -> our record dtype (``name_id`` maps a kernel's name pointer)."""
    out = np.zeros(len(src), dtype=DTYPES[RECORD_KIND[kind]])
    out["pid"] = pid
    if kind == MEMORY2:
        out["dev"] = src["dev"]
        out["stream"] = src["stream"]
        out["corr"] = src["corr"]
        out["bytes"] = src["bytes"]
        out["ts"] = src["timestamp"]
        out["addr"] = src["address"]
        out["ctx"] = src["ctx"]
        out["op"] = src["op"]
        out["mk"] = src["mk"]
        is_async = src["is_async"] != 0
        out["is_async"] = is_async
        # The pool configuration is meaningful only on stream-ordered allocations.
        ptype = np.where(is_async, src["pool_type"], 0)
        out["pool_type"] = ptype
        has_pool = ptype != 0
        out["pool_addr"] = np.where(has_pool, src["pool_addr"], 0)
        out["pool_thresh"] = np.where(has_pool, src["pool_thresh"], 0)
        out["pool_used"] = np.where(has_pool, src["pool_used"], 0)
        out["pool_size"] = np.where(ptype == POOL_LOCAL, src["pool_size"], 0)
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

