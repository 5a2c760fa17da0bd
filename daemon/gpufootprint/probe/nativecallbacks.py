"""The raw delivery's buffer callbacks in C (probe/native/cuptibuf.c): CUPTI's threads never wait for the GIL.

``RawDelivery`` (rawcallbacks.py) registers ctypes thunks: each call CUPTI makes takes the GIL
first, on whichever thread CUPTI runs it. That thread may be the program's own, inside
``cudaMalloc`` under its framework's allocator lock, or a C++ runtime thread (JAX's, NCCL's) that
never holds the GIL: it then waits behind the program's Python thread, and if that thread waits
for the same allocator lock holding the GIL, neither ever runs again (reproduced in
tests/unit/test_probe_native.py). ``NativeDelivery`` has the same interface; its two callbacks
are C functions of a library built into the wheel. They take one mutex for a few loads and
stores, queue ``(address, valid bytes)`` and wake the sender through an eventfd. The sender
takes the queued buffers (``take``) on its own thread and reads them as before.

Where the library was not built (no C compiler when the package was installed) or does not
load, ``load()`` says why and the probe uses the ctypes thunks: the same records, with the
GIL taken on CUPTI's threads.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import numpy as np

from gpufootprint.probe.rawcallbacks import COMPLETED, REQUESTED, RawDelivery
from gpufootprint.wire import cupti_layout

if TYPE_CHECKING:
    from gpufootprint.probe.livetable import StructQueue

#: The file setup.py builds (one name for every Python: the library does not link against Python).
LIBRARY = Path(__file__).resolve().parent / "native" / "libgfp-cuptibuf.so"
_ABI = 7  # cuptibuf.c GFP_ABI: the library of another build is refused (the probe then uses ctypes callbacks)
_STATS = ("requested", "completed", "refused", "foreign", "empty", "allocated", "free", "queued",
          "queues_overflow", "wake_errors")
_TAKE_MOST = 64  # buffers taken at a time (the sender loops until the queue is empty)


@cache
def load() -> tuple[Any | None, str]:
    """The library, bound; or None and why not (one line)."""
    if not LIBRARY.exists():
        return None, f"{LIBRARY.name} was not built with this install (no C compiler?)"
    try:
        # PyDLL: these calls keep the GIL. Each is short (a mutex that CUPTI's threads hold only for a few
        # loads and stores, never waiting for the GIL; the walk of a buffer up to WALK_KEEPS_GIL_BYTES, about
        # 0.1 ms at the default 64 KiB), and a call through CDLL lets the GIL go and must win it back: behind
        # busy Python threads up to a switch interval (5 ms) a call, several calls a buffer (on the H100, four
        # PyTorch threads under cudaMallocAsync: records dropped for a full send buffer). CUPTI calls the
        # callbacks through their C pointers, not through this handle.
        lib = ctypes.PyDLL(str(LIBRARY))
        if int(lib.gfp_abi()) != _ABI:
            return None, f"{LIBRARY.name}: ABI {int(lib.gfp_abi())}, this probe needs {_ABI}"
    except (OSError, AttributeError) as exc:
        return None, f"{LIBRARY.name}: {exc}"
    u64p = ctypes.POINTER(ctypes.c_uint64)
    lib.gfp_new.restype = ctypes.c_void_p
    lib.gfp_new.argtypes = [ctypes.c_uint64, ctypes.c_int, ctypes.c_int]
    lib.gfp_callbacks.restype = None
    lib.gfp_callbacks.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)]
    lib.gfp_retire.restype = None
    lib.gfp_retire.argtypes = [ctypes.c_void_p]
    lib.gfp_take.restype = ctypes.c_int
    lib.gfp_take.argtypes = [ctypes.c_void_p, u64p, ctypes.c_int]
    lib.gfp_give_back.restype = ctypes.c_int
    lib.gfp_give_back.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    lib.gfp_stats.restype = ctypes.c_int
    lib.gfp_stats.argtypes = [ctypes.c_void_p, u64p, ctypes.c_int]
    lib.gfp_queues.restype = ctypes.c_int
    lib.gfp_queues.argtypes = [ctypes.c_void_p, u64p, ctypes.POINTER(ctypes.c_uint32), ctypes.c_int]
    for io in (lib.gfp_send, lib.gfp_recv):
        io.restype = ctypes.c_int64
        io.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64]
    # (gfp_pump waits: only through CDLL, bound beside the rest; probe/link.py reads it as gfp_pump_nogil)
    pump = _letting_the_gil_go("gfp_pump")
    pump.restype = ctypes.c_int64
    pump.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int32]
    lib.gfp_pump_nogil = pump  # type: ignore[attr-defined]
    lib.gfp_eventfd_clear.restype = ctypes.c_int
    lib.gfp_eventfd_clear.argtypes = [ctypes.c_int]
    for walk in (lib.gfp_walk, _letting_the_gil_go("gfp_walk")):
        walk.restype = ctypes.c_int64
        walk.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p,
                         ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    for read in (lib.gfp_read, _letting_the_gil_go("gfp_read")):
        read.restype = ctypes.c_int64
        read.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p,
                         ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p,
                         ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint32, ctypes.c_uint64,
                         ctypes.c_void_p]
    for pair in (lib.gfp_pair, _letting_the_gil_go("gfp_pair")):
        pair.restype = ctypes.c_int
        pair.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                         ctypes.c_int64, ctypes.c_uint64, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p,
                         ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.c_void_p]
    lib.gfp_pair_work_bytes.restype = ctypes.c_uint64
    lib.gfp_pair_work_bytes.argtypes = [ctypes.c_int64]
    _bind_forwarder(lib)
    return lib, ""


def _bind_forwarder(lib: Any) -> None:
    """The forwarder's calls (probe/forwarder.py): its start, sync and stop wait, so only through CDLL (bound beside
    the rest as ``*_nogil``); the others return at once and keep the GIL."""
    u64p = ctypes.POINTER(ctypes.c_uint64)
    new = _letting_the_gil_go("gfp_fwd_new")  # starts a thread
    new.restype = ctypes.c_void_p
    new.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32,
                    ctypes.c_uint32, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_char_p, ctypes.c_int32, ctypes.c_int32,
                    ctypes.c_uint32, ctypes.c_uint64]
    lib.gfp_fwd_new_nogil = new
    lib.gfp_fwd_set.restype = None
    lib.gfp_fwd_set.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64]
    lib.gfp_fwd_lag.restype = ctypes.c_int64
    lib.gfp_fwd_lag.argtypes = [ctypes.c_void_p]
    sync = _letting_the_gil_go("gfp_fwd_sync")
    sync.restype = ctypes.c_int64
    sync.argtypes = [ctypes.c_void_p, ctypes.c_int32]
    lib.gfp_fwd_sync_nogil = sync
    lib.gfp_fwd_swap.restype = ctypes.c_int
    lib.gfp_fwd_swap.argtypes = [ctypes.c_void_p, u64p, ctypes.c_int]
    lib.gfp_fwd_release.restype = None
    lib.gfp_fwd_release.argtypes = [ctypes.c_void_p]
    lib.gfp_fwd_take.restype = ctypes.c_int
    lib.gfp_fwd_take.argtypes = [ctypes.c_void_p, u64p, ctypes.c_int]
    lib.gfp_fwd_stats.restype = ctypes.c_int
    lib.gfp_fwd_stats.argtypes = [ctypes.c_void_p, u64p, ctypes.c_int]
    stop = _letting_the_gil_go("gfp_fwd_stop")  # joins the thread
    stop.restype = None
    stop.argtypes = [ctypes.c_void_p]
    lib.gfp_fwd_stop_nogil = stop
    lib.gfp_fwd_free.restype = None
    lib.gfp_fwd_free.argtypes = [ctypes.c_void_p]


@cache
def _letting_the_gil_go(name: str) -> Any:
    """``gfp_walk``, ``gfp_read`` or ``gfp_pair`` through a CDLL handle of the same library: for buffers past
    ``WALK_KEEPS_GIL_BYTES``, whose walk (6.5 ms at 16 MiB, 75 ms at 256 MiB on the development VM) is longer
    than a switch interval; ``gfp_pump``, which waits for a socket's room, only ever so."""
    return getattr(ctypes.CDLL(str(LIBRARY)), name)


#: The largest buffer walked holding the GIL (the default CUPTI buffer is 64 KiB, about 0.1 ms to walk).
WALK_KEEPS_GIL_BYTES = 1 << 20


def available() -> bool:
    return load()[0] is not None


def loaded() -> Any:
    """The library, bound; OSError saying why where it is missing or did not load."""
    lib, why = load()
    if lib is None:
        raise OSError(why)
    return lib


def _none() -> np.ndarray:
    return np.zeros(0, np.uint64)


#: The fewest structs paired through the handle that lets the GIL go: a call that does must win the GIL back,
#: behind busy Python threads up to a switch interval (5 ms) of the sender's; below this the pass is shorter.
PAIR_LETS_GIL_GO = 4096


@dataclass(frozen=True)
class Paired:
    """``gfp_pair``'s answer: views into the pairer's arrays, valid until its next call. Where ``twice``, only the
    counts of what is due mean something."""

    due: int  # structs stamped at or before the cut
    first_waiting: int  # the index of the first stamped after it (the number of structs if none)
    due_after_waiting: int  # structs due after that index (0: what waits is the queue's tail)
    twice: bool = False  # an address allocated twice in a row (in time order): the record-by-record rule decides
    stay: np.ndarray = field(default_factory=_none)  # indexes of the allocations that stay live (each address's last)
    first_releases: np.ndarray = field(default_factory=_none)  # addresses whose first record is a release
    last_releases: np.ndarray = field(default_factory=_none)  # addresses whose last record is a release
    first_allocations: np.ndarray = field(default_factory=_none)  # addresses whose first record is an allocation
    repeated_releases: int = 0  # releases right after a release of the same address


class Pairer:
    """The probe table's pairing of a watermark's MEMORY2 structs by address in C (``gfp_pair``: linear in the
    structs, an address's records sorted by time where CUPTI's per-thread buffers left them out of order), for
    ``LiveTable``. Its scratch is kept between calls (about 70-140 bytes a struct, and 32-64 for the answer, of
    the largest watermark of the last ``_SHRINK_EVERY`` calls). One per sender thread: a call uses its arrays."""

    _SHRINK_EVERY = 32

    def __init__(self) -> None:
        lib = loaded()
        self._keep = lib.gfp_pair
        self._let_go = _letting_the_gil_go("gfp_pair")
        self._work_bytes = lib.gfp_pair_work_bytes
        self._work = np.zeros(0, np.uint8)
        self._out = np.zeros((4, 0), np.uint64)
        self._counts = np.zeros(9, np.int64)
        self._peak = self._peak_n = 0  # the most work (bytes) and structs needed since the last look at shrinking
        self._looks = 0  # calls since then
        self._layouts: dict[np.dtype, tuple[int, int, int, int]] = {}  # itemsize, offsets of time, address, op
        self._at: tuple[int, ...] | None = None  # work, its bytes, the four out rows, counts: addresses for C
        self.calls = 0
        self.unordered = 0  # calls that found an address's records out of time order in the queue (sorted in C)
        self.twice = 0  # calls that found an address allocated twice in a row (the record-by-record rule then)

    def __call__(self, structs: np.ndarray, cut: int, op_alloc: int, op_release: int) -> Paired | None:
        n = len(structs)
        if not structs.flags.c_contiguous:
            raise ValueError("Pairer: the structs must lie back to back")
        cut = int(cut)
        if n >= (1 << 31) - 1 or cut < 0:
            return None  # past the C pass's 32-bit indexes, or a cut before any time: numpy's path
        cut = min(cut, (1 << 64) - 1)
        self._make_room(n)
        layout = self._layouts.get(structs.dtype)
        if layout is None:
            fields = structs.dtype.fields
            assert fields is not None
            layout = self._layouts[structs.dtype] = (structs.dtype.itemsize, fields["timestamp"][1],
                                                     fields["address"][1], fields["op"][1])
        call = self._let_go if n >= PAIR_LETS_GIL_GO else self._keep
        assert self._at is not None  # the pairer's own arrays' addresses, kept while the arrays are (_make_room)
        # the structs' through .ctypes.data: __array_interface__ describes a structured dtype field by field (19 us)
        rc = int(call(structs.ctypes.data, n, *layout, cut, op_alloc, op_release, *self._at))
        out = self._out
        if rc < 0:
            raise RuntimeError(f"gfp_pair: work of {len(self._work)} bytes refused for {n} structs (rc {rc})")
        self.calls += 1
        ks, kf, kl, ka, repeated, due, first_waiting, due_after, unordered = self._counts.tolist()
        self.unordered += unordered > 0
        if rc == 1:
            self.twice += 1
            return Paired(due, first_waiting, due_after, twice=True)
        return Paired(due, first_waiting, due_after, stay=out[0, :ks].view(np.int64), first_releases=out[1, :kf],
                      last_releases=out[2, :kl], first_allocations=out[3, :ka], repeated_releases=repeated)

    def _make_room(self, n: int) -> None:
        """Work and out arrays for ``n`` structs; after a burst, every ``_SHRINK_EVERY`` calls, both shrink back
        to what the calls since needed (fresh work is zeroed: the C pass's hash table starts empty). The arrays'
        addresses for C are forgotten before either changes: should an allocation fail (MemoryError, caught by the
        sender), no address of a freed array is kept for the next call."""
        need = int(self._work_bytes(n))
        self._peak, self._peak_n = max(self._peak, need), max(self._peak_n, n)
        work_bytes, out_n = len(self._work), self._out.shape[1]
        if work_bytes < need:
            work_bytes = max(need, 2 * work_bytes)
        if out_n < n:
            out_n = max(n, 2 * out_n)
        self._looks += 1
        if self._looks >= self._SHRINK_EVERY:
            if work_bytes > 4 * self._peak:
                work_bytes = self._peak
            if out_n > 4 * self._peak_n:
                out_n = self._peak_n
            self._looks = self._peak = self._peak_n = 0
        if work_bytes != len(self._work) or out_n != self._out.shape[1] or self._at is None:
            self._at = None
            if work_bytes != len(self._work):
                self._work = np.zeros(work_bytes, np.uint8)
            if out_n != self._out.shape[1]:
                self._out = np.zeros((4, out_n), np.uint64)
            at = int(self._out.ctypes.data)
            self._at = (int(self._work.ctypes.data), len(self._work),
                        *(at + k * self._out.strides[0] for k in range(4)), int(self._counts.ctypes.data))


#: Struct size of each CUPTI kind ``cupti_layout.walk`` knows, indexed by kind (0: not known).
_WALK_SIZES = np.zeros(max(cupti_layout.walk_sizes()) + 1, dtype=np.uint32)
for _kind, _size in cupti_layout.walk_sizes().items():
    _WALK_SIZES[_kind] = _size
_SMALLEST = min(cupti_layout.walk_sizes().values())


class Walker:
    """``cupti_layout.walk``'s answer in one pass of C (``gfp_walk``): each kind's record offsets in buffer
    order, as ``np.intp`` arrays; None where the buffer cannot be walked exactly (the Python walk, and
    CUPTI's, then have their say). One per sender thread: it reuses its arrays."""

    def __init__(self) -> None:
        lib = loaded()
        self._walk = lib.gfp_walk
        self._walk_long = _letting_the_gil_go("gfp_walk")
        self._read = lib.gfp_read
        self._read_long = _letting_the_gil_go("gfp_read")
        self._summary = np.zeros(3 + len(_API_KINDS), np.int64)
        self.retries = 0  # buffers read twice: their MEMORY2 structs did not fit the queue's room
        self._at: tuple[int, int, int, int] | None = None
        self._offsets = np.zeros(0, np.uint32)
        self._scratch = np.zeros(0, np.int32)
        self._counts = np.zeros(len(_WALK_SIZES), np.int64)

    def __call__(self, address: int, valid: int) -> dict[int, Sequence[int]] | None:
        most = self._room_for(valid)
        offsets_at, scratch_at, counts_at, _ = self._arrays_at()
        walk = self._walk if valid <= WALK_KEEPS_GIL_BYTES else self._walk_long
        n = int(walk(address, valid, _SIZES_AT, len(_WALK_SIZES), offsets_at, scratch_at, most, counts_at))
        if n < 0:
            return None
        return self._grouped(n)

    def _grouped(self, n: int) -> dict[int, Sequence[int]]:
        """The last walk's ``n`` offsets by kind, in buffer order, as np.intp arrays (copies: the walker's arrays
        are reused) where the Python walk gives Runs: every reader of a walk (gather, len, iteration, the OOM
        watch, the launch rows) takes either."""
        grouped = self._offsets[:n].astype(np.intp)
        out: dict[int, Sequence[int]] = {}
        at = 0
        for kind in np.flatnonzero(self._counts).tolist():
            count = int(self._counts[kind])
            out[kind] = cast(Sequence[int], grouped[at:at + count])
            at += count
        return out

    def _room_for(self, valid: int) -> int:
        """The most records ``valid`` bytes can hold, the walker's arrays grown to that (and the addresses ``read``
        keeps of them forgotten: the C code must never write into arrays numpy has freed)."""
        most = valid // _SMALLEST + 1
        if len(self._offsets) < most:
            # forgotten first: should the second array fail (MemoryError), no address of a freed one is kept
            self._at = None
            self._offsets = np.empty(most, np.uint32)
            self._scratch = np.empty(most, np.int32)
        return most

    def _arrays_at(self) -> tuple[int, int, int, int]:
        """The addresses of the walker's arrays (offsets, scratch, counts, summary), kept until ``_room_for`` grows
        them: numpy's ``.ctypes`` costs about a microsecond a look."""
        if self._at is None:
            self._at = (self._offsets.ctypes.data, self._scratch.ctypes.data, self._counts.ctypes.data,
                        self._summary.ctypes.data)
        return self._at

    def read(self, address: int, valid: int, queue: StructQueue) -> Read | None:
        """One buffer walked in C, its MEMORY2 structs copied into the free room at ``queue``'s end (not yet
        in it: ``Read.keep`` puts them there) and its API records' return values looked at, in one call that
        keeps the GIL for a buffer up to ``WALK_KEEPS_GIL_BYTES``. None where the buffer cannot be walked
        exactly (the Python walk, and CUPTI's, then have their say). The answer is valid until the next call."""
        most = self._room_for(valid)
        offsets_at, scratch_at, counts_at, summary_at = self._arrays_at()
        read = self._read if valid <= WALK_KEEPS_GIL_BYTES else self._read_long
        # The room the queue has now, not the most a buffer could need: an API-only or kernel buffer then costs
        # the queue nothing. Where the structs do not fit (-2: the walk's counts say how many), the queue makes
        # room for exactly them and the buffer is read again (after a watermark, or as the queue first grows).
        room = min(valid // _MEMORY2_SIZE, queue.spare())
        for _ in range(2):
            n = int(read(address, valid, _SIZES_AT, len(_WALK_SIZES), offsets_at, scratch_at, most, counts_at,
                         cupti_layout.MEMORY2, queue.room(room), room, _API_KINDS_AT, len(_API_KINDS),
                         cupti_layout.API_RET_OFFSET, _COUNTED_MASK, summary_at))
            if n != -2:
                break
            room = int(self._counts[cupti_layout.MEMORY2])
            self.retries += 1
        if n < 0:
            return None
        return Read(self, queue, n, self._summary.tolist())


#: The API kinds whose records' return values ``Walker.read`` looks at (the OOM watch's), in that order.
_API_KINDS = np.array(sorted(cupti_layout.API_KINDS), dtype=np.int32)
_API_KINDS_AT = _API_KINDS.ctypes.data
_SIZES_AT = _WALK_SIZES.ctypes.data
_MEMORY2_SIZE = cupti_layout.RAW_DTYPES[cupti_layout.MEMORY2].itemsize


@cache
def kind_mask(kinds: frozenset[int]) -> int:
    """A set of CUPTI kinds as ``Read.kinds``'s mask (bit k: kind k; kept per set: asked for every buffer)."""
    return sum(1 << k for k in kinds if 0 <= k < 64)


#: The kinds the daemon counts as records (cupti_layout.RECORD_KIND), as a mask of bits by kind.
_COUNTED_MASK = kind_mask(frozenset(cupti_layout.RECORD_KIND))


class Read:
    """``Walker.read``'s answer for one buffer (valid until the walker's next call): ``kinds``, the mask of the
    kinds it holds (``kind_mask``); ``records``, those the daemon counts (memory, pool); ``memory2``, its
    MEMORY2 structs; ``failed_calls``, each API kind's records whose call did not succeed."""

    __slots__ = ("_n", "_queue", "_walker", "failed_calls", "kinds", "memory2", "records")

    def __init__(self, walker: Walker, queue: StructQueue, n: int, summary: list[int]) -> None:
        self._walker = walker
        self._queue = queue
        self._n = n
        self.kinds, self.memory2, self.records = summary[0], summary[1], summary[2]
        self.failed_calls = dict(zip(_API_KIND_LIST, summary[3:]))

    def holds(self, kind: int) -> bool:
        return bool(self.kinds >> kind & 1)

    def keep(self) -> np.ndarray:
        """Put the buffer's MEMORY2 structs in the queue (copied there already); returns them, a view of the
        queue valid until its next change."""
        return self._queue.commit(self.memory2)

    def offsets(self) -> dict[int, Sequence[int]]:
        """Each kind's record offsets, as ``Walker.__call__`` gives them (for the readers that need them: a
        failed call, a failure waiting, a launch window, a recording)."""
        return self._walker._grouped(self._n)


_API_KIND_LIST = _API_KINDS.tolist()


class NativeDelivery:
    """RawDelivery's interface over a C pool, whose two callbacks CUPTI calls (``_req``, ``_cmp``)."""

    native = True

    def __init__(self, buffer_bytes: int, max_buffers: int, wake_fd: int) -> None:
        lib = loaded()
        self._lib = lib
        self.buffer_bytes = buffer_bytes
        self.max_buffers = max(2, max_buffers)
        pool = lib.gfp_new(buffer_bytes, self.max_buffers, wake_fd)
        if not pool:
            raise MemoryError("gfp_new: no memory for the buffer pool's tables")
        self._pool = ctypes.c_void_p(pool)
        # The pool's own pair of C entry points (CUPTI's callbacks carry no pointer of ours), typed as
        # CUPTI's: what cuptiActivityRegisterCallbacks takes, and callable from Python (the fake CUPTI of
        # the tests calls them as CUPTI would).
        req, cmp = ctypes.c_void_p(), ctypes.c_void_p()
        lib.gfp_callbacks(self._pool, ctypes.byref(req), ctypes.byref(cmp))
        if not req.value or not cmp.value:
            raise OSError("gfp_callbacks: no entry points")
        self._req = REQUESTED(req.value)
        self._cmp = COMPLETED(cmp.value)
        self._out = (ctypes.c_uint64 * (2 * _TAKE_MOST))()
        self._stats = (ctypes.c_uint64 * len(_STATS))()
        self.errors = 0  # RawDelivery's count of exceptions in callbacks: C callbacks raise none
        # The forwarder reading this pool's buffers (probe/forwarder.py), while one is attached: ``take`` then
        # answers the buffers it hands over.
        self.forwarder: ctypes.c_void_p | None = None

    @property
    def pool(self) -> ctypes.c_void_p:
        return self._pool

    def register(self, lib: Any) -> int:
        """cuptiActivityRegisterCallbacks on ``lib`` with the C callbacks; CUPTI's status (0: success)."""
        fn = lib.cuptiActivityRegisterCallbacks
        fn.restype = ctypes.c_int
        fn.argtypes = [REQUESTED, COMPLETED]
        return int(fn(self._req, self._cmp))

    def retire(self) -> None:
        """No more writes to the wake fd (it may be closed once this returns); buffers still queue."""
        self._lib.gfp_retire(self._pool)

    def take(self) -> list[tuple[int, int]]:
        """Every buffer completed since the last call, oldest first, as ``(address, valid bytes)``; with a forwarder
        attached (``attach``), every buffer it handed over."""
        taken: list[tuple[int, int]] = []
        out = self._out
        fwd = self.forwarder
        while True:
            if fwd is not None:
                n = int(self._lib.gfp_fwd_take(fwd, out, _TAKE_MOST))
            else:
                n = int(self._lib.gfp_take(self._pool, out, _TAKE_MOST))
            taken.extend((int(out[2 * i]), int(out[2 * i + 1])) for i in range(n))
            if n < _TAKE_MOST:
                return taken

    def give_back(self, address: int) -> None:
        """The sender is done with a buffer (sender thread)."""
        self._lib.gfp_give_back(self._pool, address)

    def stats(self) -> dict[str, int]:
        self._lib.gfp_stats(self._pool, self._stats, len(_STATS))
        return {name: int(v) for name, v in zip(_STATS, self._stats, strict=True)}

    @property
    def requested(self) -> int:
        return self.stats()["requested"]

    @property
    def completed(self) -> int:
        return self.stats()["completed"]

    @property
    def refused(self) -> int:
        return self.stats()["refused"]

    @property
    def foreign(self) -> int:
        return self.stats()["foreign"]

    @property
    def allocated(self) -> int:
        return self.stats()["allocated"]

    @property
    def outstanding(self) -> int:
        """Buffers held by CUPTI or waiting for the sender."""
        s = self.stats()
        return s["allocated"] - s["free"]

    @property
    def queues(self) -> set[tuple[int, int]]:
        """The (CUcontext, stream) queues buffers completed on: CUPTI counts its drops per queue."""
        most = 256
        ctx = (ctypes.c_uint64 * most)()
        stream = (ctypes.c_uint32 * most)()
        n = int(self._lib.gfp_queues(self._pool, ctx, stream, most))
        return {(int(ctx[i]), int(stream[i])) for i in range(n)}


def eventfd() -> int | None:
    """A non-blocking eventfd the C callback writes to and the sender polls; None where there is none."""
    make = getattr(os, "eventfd", None)
    if make is None:
        return None
    try:
        return int(make(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC))
    except OSError:
        return None


#: Either delivery's callbacks: the same interface to the sender.
Delivery: TypeAlias = "RawDelivery | NativeDelivery"


def callbacks_kind(raw: Delivery | None) -> str:
    """What CUPTI's threads run when they hand over a buffer: ``c``, ``python`` (ctypes or cupti-python)."""
    return "c" if raw is not None and raw.native else "python"
