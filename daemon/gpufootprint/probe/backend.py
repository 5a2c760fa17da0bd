"""The hardware edge: CUPTI's activity API through cupti-python.

``Backend`` is the small protocol the probe needs; ``CuptiBackend`` is the real
one (cupti imported lazily, every call guarded: a CUPTI error is a state, never
an exception into the workload). Tests pass their own object with the same
methods that calls ``completed`` with fake records (tests/probe_fakes.py).

(About 450 lines: one guarded method per CUPTI call the probe makes, each a few lines.)
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

# The CUPTI_ActivityKind numbers are kept in one place.
from gpufootprint.wire.cupti_layout import (
    MEMCPY,
    MEMCPY2,
    MEMORY2,
    MEMORY_POOL,
    MEMSET,
    UNIFIED_MEMORY_COUNTER,
)
from gpufootprint.wire.probe_options import copy_kind_names

log = logging.getLogger(__name__)

Requested = Callable[[], tuple[int, int]]
Completed = Callable[[list[Any]], None]

# CUPTI_ActivityKind values the probe enables.
ALWAYS_ON = (MEMORY2, MEMORY_POOL, MEMCPY, MEMCPY2, MEMSET)
FOOTPRINT_ONLY = (MEMORY2, MEMORY_POOL)
_COPY_KIND = {"memcpy": MEMCPY, "memcpy2": MEMCPY2, "memset": MEMSET}


def copy_kinds(names: str) -> tuple[int, ...]:
    """The CUPTI kinds of ``ProbeSettings.copy_kinds`` (unknown names are ignored: settings checked them)."""
    return tuple(_COPY_KIND[n] for n in copy_kind_names(names) if n in _COPY_KIND)


class Backend(Protocol):
    """Every call the probe makes into CUPTI. A switch a backend cannot set answers False (the probe
    counts it and goes on); ``CuptiBackend`` documents what each does."""

    @property
    def errors(self) -> Sequence[str]:
        """Error lines, newest last: the probe quotes the newest in its warnings."""
        ...

    def register(self, requested: Requested, completed: Completed) -> None: ...
    def register_raw(self, delivery: Any) -> bool: ...
    def walk_raw(self, address: int, valid: int) -> Mapping[int, Sequence[int]] | None: ...
    def enable(self, kind: int) -> bool: ...
    def disable(self, kind: int) -> bool: ...
    def flush(self, forced: bool) -> None: ...
    def flush_period(self, ms: int) -> bool: ...
    def configure(self, device_buffer_bytes: int, pool_limit: int) -> int: ...
    def configure_unified_memory(self) -> bool: ...
    def driver_hooks(self, on: bool) -> bool: ...
    def driver_api_records(self, on: bool) -> bool: ...
    def oom_api_records(self, on: bool, stream_ordered: bool = False) -> bool: ...
    def launch_api_records(self, on: bool) -> bool: ...
    def per_thread_buffer(self, on: bool | None) -> int | None: ...
    def libcupti_paths(self) -> list[str]: ...
    def dropped_records(self, ctx: int = 0, stream: int = 0) -> int: ...
    def versions(self) -> dict[str, Any]: ...


class CuptiBackend:
    """cupti-python 13.x. Dispatches on ints, never on record class names."""

    def __init__(self, flush_nogil: bool = False) -> None:
        from cupti import cupti  # lazy: the first call loads libcupti

        self._c = cupti
        self.errors: list[str] = []
        self._flush_nogil = flush_nogil
        self._lib_flush: Any = None
        self._lib_api_switches: Any = None  # cuptiActivityEnable{Driver,Runtime}Api through ctypes, or False
        # cuptiActivityEnable, cuptiActivityDisable, cuptiActivityGetNumDroppedRecords through ctypes, looked up
        # once (False: not possible, cupti-python's wrappers instead)
        self._lib_calls: Any = None
        self._hooks: tuple[Any, int, list[int]] | None = None  # libcupti, domain, callback ids
        self._hooks_looked_up = False
        self._subscriber: ctypes.c_void_p | None = None

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> bool:
        try:
            fn(*args)
            return True
        except (self._c.cuptiError, RuntimeError) as exc:
            self._note(f"{what}: {exc}")
            log.debug("cupti %s failed: %s", what, exc)
            return False

    def register(self, requested: Requested, completed: Completed) -> None:
        if not self._call("activity_register_callbacks", self._c.activity_register_callbacks, requested, completed):
            raise RuntimeError(self.errors[-1])

    def _nogil_calls(self) -> Any:
        """(enable, disable, dropped) bound on the one mapped libcupti, or False.

        The sender thread calls these while the workload runs CUDA (kernel windows, the drop count of
        every heartbeat). cupti-python's wrappers hold the GIL for the whole call; CUPTI may hold its
        own lock while it calls our buffer callbacks, which are Python and need the GIL, on the
        workload's thread: a call that waits for that lock while holding the GIL would never return,
        and neither would the workload. Through ctypes the GIL is released for the call."""
        if self._lib_calls is None:
            self._lib_calls = False
            lib = _libcupti()
            if lib is not None:
                try:
                    enable, disable = lib.cuptiActivityEnable, lib.cuptiActivityDisable
                    dropped = lib.cuptiActivityGetNumDroppedRecords
                    for fn in (enable, disable):
                        fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_uint32]
                    dropped.restype = ctypes.c_int
                    dropped.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.POINTER(ctypes.c_size_t)]
                    self._lib_calls = (enable, disable, dropped)
                except AttributeError:
                    pass
        return self._lib_calls

    def _switch(self, what: str, index: int, kind: int) -> bool:
        calls = self._nogil_calls()
        if calls:
            status = int(calls[index](kind))
            if status != 0:
                self._note(f"{what}({kind}): status {status}")
                log.debug("cupti %s(%d) failed: status %d", what, kind, status)
            return status == 0
        fn = self._c.activity_enable if index == 0 else self._c.activity_disable
        return self._call(f"activity_{'enable' if index == 0 else 'disable'}({kind})", fn, kind)

    def enable(self, kind: int) -> bool:
        return self._switch("cuptiActivityEnable", 0, kind)

    def disable(self, kind: int) -> bool:
        return self._switch("cuptiActivityDisable", 1, kind)

    def flush(self, forced: bool) -> None:
        # cupti-python's wrapper holds the GIL for the whole flush (measured: ~3 ms on
        # the H200, every thread of the workload stalled). The same C function through
        # ctypes releases the GIL; the buffer callbacks take it back as they run.
        if self._flush_nogil and self._lib_flush is None:
            self._lib_flush = _libcupti_function("cuptiActivityFlushAll") or False
        if self._lib_flush:
            status = self._lib_flush(ctypes.c_uint32(1 if forced else 0))
            if status != 0:
                self._note(f"cuptiActivityFlushAll: status {status}")
            return
        self._call("activity_flush_all", self._c.activity_flush_all, 1 if forced else 0)

    def flush_period(self, ms: int) -> bool:
        """CUPTI's worker thread delivers full, completed buffers every ``ms`` (0: CUPTI's heuristics)."""
        return self._call("activity_flush_period", self._c.activity_flush_period, int(ms))

    def libcupti_paths(self) -> list[str]:
        """Every libcupti file mapped into this process (two copies: see docs/probe.md)."""
        return mapped_libcupti()

    def _set(self, attr: int, value: int) -> bool:
        v = ctypes.c_size_t(value)
        sz = ctypes.c_size_t(ctypes.sizeof(v))
        return self._call(f"activity_set_attribute({attr})", self._c.activity_set_attribute, attr,
                          ctypes.addressof(sz), ctypes.addressof(v))

    def _get(self, attr: int) -> int | None:
        v = ctypes.c_size_t(0)
        sz = ctypes.c_size_t(ctypes.sizeof(v))
        ok = self._call(f"activity_get_attribute({attr})", self._c.activity_get_attribute, attr,
                        ctypes.addressof(sz), ctypes.addressof(v))
        return int(v.value) if ok else None

    def configure(self, device_buffer_bytes: int, pool_limit: int) -> int:
        """Bound CUPTI's device buffers; returns the bound in bytes (size x pool limit)."""
        a = self._c.ActivityAttribute
        if device_buffer_bytes <= 0:  # CUPTI's own defaults: read them only
            return (self._get(a.ATTR_DEVICE_BUFFER_SIZE) or 0) * (self._get(a.ATTR_DEVICE_BUFFER_POOL_LIMIT) or 0)
        self._set(a.ATTR_DEVICE_BUFFER_SIZE, device_buffer_bytes)
        self._set(a.ATTR_DEVICE_BUFFER_POOL_LIMIT, pool_limit)
        self._set(a.ATTR_DEVICE_BUFFER_PRE_ALLOCATE_VALUE, min(pool_limit, 1))
        size = self._get(a.ATTR_DEVICE_BUFFER_SIZE) or device_buffer_bytes
        limit = self._get(a.ATTR_DEVICE_BUFFER_POOL_LIMIT) or pool_limit
        return size * limit

    def configure_unified_memory(self) -> bool:
        """Configure the unified-memory counters and enable their kind."""
        c = self._c
        k = c.ActivityUnifiedMemoryCounterKind
        kinds = [k.BYTES_TRANSFER_HTOD, k.BYTES_TRANSFER_DTOH, k.CPU_PAGE_FAULT_COUNT, k.GPU_PAGE_FAULT,
                 k.THRASHING, k.THROTTLING, k.REMOTE_MAP, k.BYTES_TRANSFER_DTOD]
        try:
            cfg = c.ActivityUnifiedMemoryCounterConfig(len(kinds))
            cfg.scope = 1  # as the cupti-python sample does: set for every entry
            cfg.device_id = 0
            cfg.enable = 1
            for i, kind in enumerate(kinds):
                cfg[i].kind = kind
        except Exception as exc:  # noqa: BLE001 - the config class moved between releases
            self._note(f"unified memory config: {exc}")
            return False
        if not self._call("activity_configure_unified_memory_counter",
                          c.activity_configure_unified_memory_counter, cfg.ptr, len(kinds)):
            return False
        return self.enable(UNIFIED_MEMORY_COUNTER)

    def driver_hooks(self, on: bool) -> bool:
        """Be (on) or stop being (off) a subscriber of CUPTI's driver-API callbacks for cuMemMap and
        cuMemUnmap; True when the state asked for holds.

        Why: on the H200 (CUPTI 13.0, driver 580) the MEMORY2 records of virtual-memory mappings
        made on any thread but the main one (PyTorch's expandable segments grown from the autograd
        thread, say) never arrived while no callback subscriber existed, and all arrived with one
        (tests/gpu/vmm_diag.py, docs/probe.md "Lost records"). The callback itself is libc's
        ``abs``: a C function that reads only its registers, so CUPTI never waits for Python there
        (a Python callback would need the GIL on a thread that may hold PyTorch's allocator lock).
        CUPTI allows one subscriber per process: the probe leaves before a torch.profiler session
        and comes back after it.
        """
        api = self._hooks_api() if on or self._subscriber is not None else None
        if not on:
            if self._subscriber is not None and api is not None:
                status = int(api[0].cuptiUnsubscribe(self._subscriber))
                if status != 0:
                    self._note(f"cuptiUnsubscribe: status {status}")
            self._subscriber = None
            return True
        if self._subscriber is not None:
            return True
        if api is None:
            return False
        lib, domain, cbids = api
        sub = ctypes.c_void_p()
        status = int(lib.cuptiSubscribe(ctypes.byref(sub), _NOOP_CALLBACK, None))
        if status != 0:  # another subscriber (a profiler, another tool) holds CUPTI's one place
            self._note(f"cuptiSubscribe: status {status}")
            return False
        for cbid in cbids:
            status = int(lib.cuptiEnableCallback(1, sub, domain, cbid))
            if status != 0:
                self._note(f"cuptiEnableCallback({cbid}): status {status}")
                lib.cuptiUnsubscribe(sub)
                return False
        self._subscriber = sub
        return True

    def driver_api_records(self, on: bool) -> bool:
        """The other way to the same end (``driver_hooks_via="activity"``): CUPTI's per-API activity
        switch for cuMemMap and cuMemUnmap, which needs no subscriber (a profiler keeps its place).
        CUPTI then writes a DRIVER record per call; the packer counts and skips them."""
        switch = getattr(self._c, "activity_enable_driver_api", None)
        if switch is None:
            self._note("driver hooks: this cupti-python has no activity_enable_driver_api")
            return False
        ok = True
        for cbid in (self._c.driver_api_trace_cbid.cuMemMap, self._c.driver_api_trace_cbid.cuMemUnmap):
            ok = self._call(f"activity_enable_driver_api({int(cbid)})", switch, int(cbid), 1 if on else 0) and ok
        return ok

    def oom_api_records(self, on: bool, stream_ordered: bool = False) -> bool:
        """CUPTI's per-API activity switches for the driver's and the runtime's allocation entry
        points (probe/oom.py says why both, and why the stream-ordered ones only on request): an
        API record per call, with its return value, so a failed allocation is seen."""
        from gpufootprint.probe.oom import switched_cbids

        return self._per_api("oom records", *switched_cbids(stream_ordered), on)

    def _per_api(self, what: str, driver: Iterable[int], runtime: Iterable[int], on: bool) -> bool:
        """cupti-python's per-API activity switches for these driver and runtime cbids (GIL held)."""
        ok = True
        for name, cbids in (("activity_enable_driver_api", driver), ("activity_enable_runtime_api", runtime)):
            switch = getattr(self._c, name, None)
            if switch is None:
                self._note(f"{what}: this cupti-python has no {name}")
                ok = False
                continue
            for cbid in cbids:
                ok = self._call(f"{name}({cbid})", switch, cbid, 1 if on else 0) and ok
        return ok

    def launch_api_records(self, on: bool) -> bool:
        """CUPTI's per-API switches for the launch and synchronisation calls (a launch window,
        probe/launches.py): an API record per call, host-side only."""
        from gpufootprint.probe.launches import DRIVER_CBIDS, RUNTIME_CBIDS

        # Switched from the sender thread while the workload runs CUDA: through ctypes, with the GIL
        # released (as the flush), so a CUPTI that holds its lock while it calls our buffer callbacks
        # (which need the GIL) on the workload's thread can never wait on us in turn.
        if self._lib_api_switches is None:
            lib = _libcupti()
            self._lib_api_switches = False
            if lib is not None:
                try:
                    fns = (lib.cuptiActivityEnableDriverApi, lib.cuptiActivityEnableRuntimeApi)
                    for fn in fns:
                        fn.restype = ctypes.c_int
                        fn.argtypes = [ctypes.c_uint32, ctypes.c_uint8]
                    self._lib_api_switches = fns
                except AttributeError:
                    pass
        if self._lib_api_switches:
            ok = True
            for fn, cbids in zip(self._lib_api_switches, (DRIVER_CBIDS, RUNTIME_CBIDS), strict=True):
                for cbid in cbids:
                    status = fn(cbid, 1 if on else 0)
                    if status != 0:
                        self._note(f"{fn.__name__}({cbid}, {int(on)}): status {status}")
                        ok = False
            return ok
        missing = [n for n in ("activity_enable_driver_api", "activity_enable_runtime_api") if not hasattr(self._c, n)]
        if missing:  # half a window's switches would record launches or waits alone: none at all
            self._note(f"launch windows: this cupti-python has no {missing[0]}")
            return False
        return self._per_api("launch windows", DRIVER_CBIDS, RUNTIME_CBIDS, on)

    def _hooks_api(self) -> tuple[Any, int, list[int]] | None:
        """The mapped libcupti with the three callback-API functions bound, looked up once."""
        if not self._hooks_looked_up:
            self._hooks_looked_up = True
            lib = _libcupti()
            if lib is None or _NOOP_CALLBACK is None:
                self._note("driver hooks: not exactly one libcupti mapped, or no libc")
                return None
            try:
                lib.cuptiSubscribe.restype = ctypes.c_int
                lib.cuptiSubscribe.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_void_p]
                lib.cuptiEnableCallback.restype = ctypes.c_int
                lib.cuptiEnableCallback.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
                lib.cuptiUnsubscribe.restype = ctypes.c_int
                lib.cuptiUnsubscribe.argtypes = [ctypes.c_void_p]
                cbids = [int(self._c.driver_api_trace_cbid.cuMemMap), int(self._c.driver_api_trace_cbid.cuMemUnmap)]
                self._hooks = (lib, int(self._c.CallbackDomain.DRIVER_API), cbids)
            except (AttributeError, OSError) as exc:
                self._note(f"driver hooks: {exc}")
        return self._hooks

    def _note(self, error: str) -> None:
        """Keep an error line for status and warnings (at most 50: a retried call must not grow it)."""
        if len(self.errors) < 50:
            self.errors.append(error)

    def register_raw(self, delivery: Any) -> bool:
        """Register the raw delivery's callbacks (C or ctypes) on the one mapped libcupti (False: not possible)."""
        lib = _libcupti()
        if lib is None:
            self._note("raw delivery: not exactly one libcupti mapped")
            return False
        try:
            status = delivery.register(lib)
        except (OSError, AttributeError) as exc:
            self._note(f"raw delivery: {exc}")
            return False
        if status != 0:
            self._note(f"cuptiActivityRegisterCallbacks: status {status}")
            return False
        # The same libcupti serves the flush, through ctypes: the GIL is released while
        # CUPTI flushes, and our ctypes callbacks take it only to queue a buffer.
        self._flush_nogil = True
        if not self._lib_flush:
            self._lib_flush = _libcupti_function("cuptiActivityFlushAll", lib) or False
        self._lib_next = lib.cuptiActivityGetNextRecord
        self._lib_next.restype = ctypes.c_int
        self._lib_next.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)]
        return True

    def walk_raw(self, address: int, valid: int) -> dict[int, list[int]] | None:
        """Offsets of each kind's records by cuptiActivityGetNextRecord (the reference walk)."""
        fn = getattr(self, "_lib_next", None)
        if fn is None:
            return None
        rec = ctypes.c_void_p(None)
        out: dict[int, list[int]] = {}
        while fn(address, valid, ctypes.byref(rec)) == 0 and rec.value:
            kind = ctypes.c_int32.from_address(rec.value).value
            out.setdefault(kind, []).append(rec.value - address)
        return out

    def dropped_records(self, ctx: int = 0, stream: int = 0) -> int:
        """Records CUPTI dropped (no buffer space) from one queue since the last call; the count resets.

        ``ctx`` 0 is the global queue; a context's own queue is named by the CUcontext and
        stream that CUPTI passes with each completed buffer.
        """
        v = ctypes.c_size_t(0)
        calls = self._nogil_calls()
        if calls:  # from the sender thread at every heartbeat: without the GIL (``_nogil_calls``)
            status = int(calls[2](ctypes.c_void_p(ctx or None), ctypes.c_uint32(stream), ctypes.byref(v)))
            if status != 0:
                self._note(f"cuptiActivityGetNumDroppedRecords: status {status}")
                return 0
            return int(v.value)
        ok = self._call("activity_get_num_dropped_records", self._c.activity_get_num_dropped_records, ctx, stream,
                        ctypes.addressof(v))
        return int(v.value) if ok else 0

    def per_thread_buffer(self, on: bool | None) -> int | None:
        """CUPTI_ACTIVITY_ATTR_PER_THREAD_BUFFER: set it (None: leave CUPTI's default); returns what CUPTI reports."""
        attr = self._c.ActivityAttribute.ATTR_PER_THREAD_BUFFER
        for width in (1, 8):  # a uint8_t in CUPTI's header; a size_t where a release says so
            v = ctypes.c_size_t(0 if on is None else int(on))
            sz = ctypes.c_size_t(width)
            if on is not None and not self._call(f"activity_set_attribute({attr})", self._c.activity_set_attribute,
                                                 attr, ctypes.addressof(sz), ctypes.addressof(v)):
                continue
            v = ctypes.c_size_t(0)
            sz = ctypes.c_size_t(width)
            if self._call(f"activity_get_attribute({attr})", self._c.activity_get_attribute, attr,
                          ctypes.addressof(sz), ctypes.addressof(v)):
                return int(v.value) & (0xFF if width == 1 else -1)
        return None

    def versions(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        try:
            from importlib.metadata import version

            out["cupti_python"] = version("cupti-python")
        except Exception:  # noqa: BLE001, S110 - a version is optional: the hello goes without it
            pass
        get_version = getattr(self._c, "get_version", None)
        try:
            if get_version is not None:
                out["cupti"] = int(get_version())
            else:
                # Only the copy cupti-python already mapped: a dlopen by soname can load
                # a second libcupti (a CUDA toolkit's) into the process.
                paths = self.libcupti_paths()
                if len(paths) == 1:
                    lib = ctypes.CDLL(paths[0])
                    v = ctypes.c_uint32(0)
                    if lib.cuptiGetVersion(ctypes.byref(v)) == 0:
                        out["cupti"] = int(v.value)
        except (OSError, AttributeError):
            pass
        try:
            from cuda.bindings import driver

            err, v = driver.cuDriverGetVersion()
            if int(err) == 0:
                out["driver"] = int(v)
        except Exception:  # noqa: BLE001, S110 - a version is optional: the hello goes without it
            pass
        return out


def mapped_libcupti() -> list[str]:
    """Every libcupti file mapped into this process, from /proc/self/maps ([] when unreadable)."""
    try:
        with open("/proc/self/maps") as fh:
            return sorted({line.split(None, 5)[5].strip() for line in fh
                           if "libcupti.so" in line and len(line.split(None, 5)) == 6})
    except OSError:
        return []


def _noop_callback() -> int | None:
    """Address of libc's ``abs``: a C function CUPTI may call as a callback (it touches no memory)."""
    try:
        return ctypes.cast(ctypes.CDLL(None).abs, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


_NOOP_CALLBACK = _noop_callback()


def _libcupti() -> Any:
    """The one libcupti mapped into this process, opened by its path; None when not exactly one."""
    paths = mapped_libcupti()
    if len(paths) != 1:
        return None
    try:
        return ctypes.CDLL(paths[0])
    except OSError:
        return None


def _libcupti_function(name: str, lib: Any = None) -> Any:
    """A libcupti function taking one uint32, through ctypes (GIL released during the call), or None.

    From ``lib``, or from the one libcupti mapped into the process, opened by that exact
    path (so dlopen returns the copy cupti-python uses). A soname lookup found a
    second copy on the H200 test machine (PyTorch's), with records lost and a crash.
    """
    lib = lib if lib is not None else _libcupti()
    if lib is None:
        return None
    try:
        fn = getattr(lib, name)
    except AttributeError:
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_uint32]
    return fn
