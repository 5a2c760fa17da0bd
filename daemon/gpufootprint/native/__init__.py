"""The daemon's C core (native/core.c, built by setup.py as ``libgfp-core.so``), loaded with ctypes.

Per-record loops that cost the daemon most CPU in Python or numpy (today: the reuse tracker's walk of a
MEMORY batch, features/reuse.py; the footprint's numeric part of a MEMORY batch, footprint/table.py). The
library links against no Python, so one file serves every Python 3. Optional: where it was not built
(no C compiler at install, ``GPUFOOTPRINT_NATIVE_CORE=0``), is of another build, or
``GPUFOOTPRINT_DAEMON_NATIVE=0`` is set, ``core()`` is None and the callers take their Python paths,
which stay the reference the tests hold the C to.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
import weakref
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

#: The file setup.py builds (one name for every Python: the library does not link against Python).
LIBRARY = Path(__file__).resolve().parent / "libgfp-core.so"
_ABI = 2  # core.c GFP_CORE_ABI: a library of another build is refused (the callers then use Python)
#: Set to 0 to run the daemon's Python paths with the library present (for comparison, or to rule it out).
ENV = "GPUFOOTPRINT_DAEMON_NATIVE"


@cache
def load() -> tuple[Any | None, str]:
    """The library, bound; or None and why not (one line)."""
    if sys.byteorder != "little":  # the C reads the records' little-endian words as native ones
        return None, "not a little-endian machine"
    if not LIBRARY.exists():
        return None, f"{LIBRARY.name} was not built with this install (no C compiler?)"
    try:
        # PyDLL: the calls keep the GIL. They are short (a batch's walk, tens of microseconds), and the
        # tracker they work on is only ever touched under the GIL; a CDLL call would let it go and have
        # to win it back behind the daemon's other threads.
        lib = ctypes.PyDLL(str(LIBRARY))
        if int(lib.gfp_core_abi()) != _ABI:
            return None, f"{LIBRARY.name}: ABI {int(lib.gfp_core_abi())}, this daemon needs {_ABI}"
        stale = _stale(lib)
        if stale:
            return None, stale
    except (OSError, AttributeError) as exc:
        return None, f"{LIBRARY.name}: {exc}"
    u64, vp = ctypes.c_uint64, ctypes.c_void_p
    lib.gfp_reuse_new.restype = vp
    lib.gfp_reuse_new.argtypes = [ctypes.c_int64] * 5 + [ctypes.c_int32] * 3
    lib.gfp_reuse_free.restype = None
    lib.gfp_reuse_free.argtypes = [vp]
    lib.gfp_reuse_trim.restype = ctypes.c_int
    lib.gfp_reuse_trim.argtypes = [vp, u64]
    lib.gfp_reuse_add.restype = ctypes.c_int64
    lib.gfp_reuse_add.argtypes = [vp, vp, u64, ctypes.c_int64, u64, vp, vp]
    lib.gfp_reuse_counts.restype = None
    lib.gfp_reuse_counts.argtypes = [vp, vp]
    lib.gfp_reuse_has.restype = ctypes.c_int
    lib.gfp_reuse_has.argtypes = [vp, u64]
    lib.gfp_reuse_live.restype = u64
    lib.gfp_reuse_live.argtypes = [vp, vp, vp, u64]
    i64, i32 = ctypes.c_int64, ctypes.c_int32
    lib.gfp_bulk_layout.restype = None
    lib.gfp_bulk_layout.argtypes = [i64] * 6 + [i32, i32, ctypes.c_uint32]
    lib.gfp_bulk_plan.restype = i64
    lib.gfp_bulk_plan.argtypes = [vp, u64, i64, vp, vp]
    lib.gfp_bulk_apply.restype = i64
    lib.gfp_bulk_apply.argtypes = [vp, u64, i64, vp, i32, vp, vp, vp, vp, vp]
    lib.gfp_bulk_hit.restype = i64
    lib.gfp_bulk_hit.argtypes = [vp, u64, i32]
    return lib, ""


def source_digest(source: bytes) -> str:
    """What setup.py compiles into the library as GFP_CORE_SOURCE: the first 16 hex digits of core.c's sha256."""
    return hashlib.sha256(source).hexdigest()[:16]


def _stale(lib: Any) -> str:
    """Why a library must not be used because core.c beside it changed since it was built (a source tree
    edited and not rebuilt: its tests would otherwise test the old C); "" where it matches, or where no
    core.c is beside it (an installed wheel carries none)."""
    source = LIBRARY.with_name("core.c")
    if not source.exists():
        return ""
    lib.gfp_core_source.restype = ctypes.c_char_p
    lib.gfp_core_source.argtypes = []
    built = (lib.gfp_core_source() or b"").decode(errors="replace")
    want = source_digest(source.read_bytes())
    if built != want:
        return f"{LIBRARY.name} was built from another core.c ({built}; the one beside it is {want}): rebuild it (pip install -e .)"
    return ""


def core() -> Any | None:
    """The bound library where it loads and is not turned off, else None (read at each call: a tracker
    asks once, when it is made)."""
    if os.environ.get(ENV, "1") == "0":
        return None
    return load()[0]


class ReuseCore:
    """One reuse tracker's memory in C: the freed keys, the sizeless map, the sort's scratch. Freed with
    its owner (a finalizer, so also at interpreter exit, while the library object is still referenced)."""

    def __init__(self, lib: Any, record: np.dtype, device: int, alloc: int, release: int) -> None:
        offsets = [record.fields[name][1] for name in ("ts", "addr", "bytes", "op", "mk")]  # type: ignore[index]
        handle = lib.gfp_reuse_new(*offsets, device, alloc, release)
        if not handle:
            raise MemoryError("gfp_reuse_new")
        self.handle: int = handle
        self.add = lib.gfp_reuse_add  # bound once: called per batch
        self._lib = lib
        # The count of reuses comes back through this word (its address passed as a plain int: cheap).
        self.hits = (ctypes.c_uint64 * 1)()
        self.hits_at = ctypes.addressof(self.hits)
        self.freed = weakref.finalize(self, lib.gfp_reuse_free, handle)  # alive until it ran
        # Not at interpreter exit: the ingest thread (a daemon thread, still running past App.stop's join
        # timeout) may be inside a batch on this handle; the process is ending and its memory goes with it.
        self.freed.atexit = False

    def trim(self, capacity: int) -> None:
        if self._lib.gfp_reuse_trim(self.handle, capacity):
            raise MemoryError("gfp_reuse_trim")

    def counts(self) -> tuple[int, int, bool]:
        """(freed keys, live addresses, whether a sizeless release was seen)."""
        out = np.zeros(3, np.uint64)
        self._lib.gfp_reuse_counts(self.handle, out.ctypes.data)
        return int(out[0]), int(out[1]), bool(out[2])

    def has_freed(self, key: int) -> bool:
        return bool(self._lib.gfp_reuse_has(self.handle, key))

    def live(self) -> dict[int, int]:
        """The sizeless map (address -> last allocated size), as the Python tracker's dict."""
        n = self.counts()[1]
        addrs, sizes = np.zeros(n, np.uint64), np.zeros(n, np.uint64)
        self._lib.gfp_reuse_live(self.handle, addrs.ctypes.data, sizes.ctypes.data, n)
        return dict(zip(addrs.tolist(), sizes.tolist()))


__all__ = ["ENV", "LIBRARY", "ReuseCore", "core", "load"]
