"""A stateful fake of cupti-python's activity API: the only fake in the probe tests.

Record objects carry the attribute names of cupti-python 13.0.1's records
(ActivityMemory4, ActivityMemoryPool3, ActivityMemcpy6, ActivityMemcpyPtoP4,
ActivityMemset4, ActivityKernel10, ActivityUnifiedMemoryCounter3), and behave
like CUPTI where it matters to the probe: records of a kind arrive only while
that kind is enabled, never retroactively; they are delivered in buffers, on
flush, not in timestamp order when ``shuffle`` is set; registering callbacks
again replaces the previous ones (what torch.profiler's Kineto does).
"""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace
from typing import Any

MEMCPY, MEMSET, CONCURRENT_KERNEL, MEMCPY2, UM, MEMORY2, MEMORY_POOL = 1, 2, 10, 22, 25, 49, 50
KERNEL = 3  # the serial kernel kind (CUpti_ActivityKernel, the same struct as CONCURRENT_KERNEL)
RUNTIME = 5  # CUpti_ActivityAPI, written per call of a runtime function switched on by cuptiActivityEnableRuntimeApi
DRIVER = 4  # CUpti_ActivityAPI: written per call of a driver function switched on by cuptiActivityEnableDriverApi


def memory_record(op: int, addr: int, size: int, *, ts: int | None = None, mk: int = 3, dev: int = 0,
                  is_async: int = 0, pool_type: int = 0, pool_addr: int = 0, pool_size: int = 0,
                  pool_used: int = 0, stream: int = 7, pid: int = 0, corr: int = 1) -> Any:
    cfg = SimpleNamespace(memory_pool_type=pool_type, pad2=0, address=pool_addr, release_threshold=0,
                          utilized_size=pool_used, pool=SimpleNamespace(size_=pool_size, process_id=0))
    return SimpleNamespace(kind=MEMORY2, memory_operation_type=op, memory_kind=mk, correlation_id=corr, address=addr,
                           bytes=size, timestamp=ts if ts is not None else time.time_ns(), pc=0, process_id=pid,
                           device_id=dev, context_id=1, stream_id=stream, name="", is_async=is_async, pad1=0,
                           source="", memory_pool_config=cfg)


def pool_record(op: int, addr: int, size: int, used: int, *, ts: int | None = None, dev: int = 0) -> Any:
    return SimpleNamespace(kind=MEMORY_POOL, memory_pool_operation_type=op, memory_pool_type=1, correlation_id=2,
                           process_id=0, device_id=dev, address=addr, timestamp=ts or time.time_ns(),
                           is_managed_pool=0, pad2=0, size_=size, release_threshold=0, utilized_size=used,
                           min_bytes_to_keep=0)


def memcpy_record(nbytes: int, ck: int = 1, *, start: int | None = None, dev: int = 0) -> Any:
    t = start or time.time_ns()
    return SimpleNamespace(kind=MEMCPY, start=t, end=t + 1000, device_id=dev, context_id=1, stream_id=7,
                           correlation_id=3, runtime_correlation_id=0, graph_id=0, graph_node_id=0, channel_id=0,
                           channel_type=0, is_device_launched=0, copy_count=1, reserved0=0, pad=0, pad2=0,
                           copy_kind=ck, src_kind=2, dst_kind=3, flags_=0, bytes=nbytes)


def peer_copy_record(nbytes: int, src: int, dst: int) -> Any:
    t = time.time_ns()
    return SimpleNamespace(kind=MEMCPY2, start=t, end=t + 500, device_id=src, context_id=1, stream_id=7,
                           correlation_id=4, graph_id=0, graph_node_id=0, channel_id=0, channel_type=0,
                           pad=0, pad2=0, copy_kind=10, src_kind=3, dst_kind=3, flags_=0, bytes=nbytes,
                           src_device_id=src, src_context_id=1, dst_device_id=dst, dst_context_id=2)


def odd_record(size: int = 32, kind_word: int = 999) -> Any:
    """A record neither our walk nor CUPTI's can size (its kind word unknown), written where a MEMORY2
    record would be: what a buffer our walk refuses looks like, whatever wrote it."""
    body = bytearray(size)
    body[:4] = kind_word.to_bytes(4, "little")
    return SimpleNamespace(kind=MEMORY2, raw_bytes=bytes(body), stream_id=0)


def memset_record(nbytes: int) -> Any:
    t = time.time_ns()
    return SimpleNamespace(kind=MEMSET, value=0, bytes=nbytes, start=t, end=t + 100, device_id=0, context_id=1,
                           stream_id=7, correlation_id=5, graph_id=0, graph_node_id=0, channel_id=0,
                           channel_type=0, is_device_launched=0, reserved0=0, pad=0, pad2=0, flags_=0,
                           memory_kind=3)


def kernel_record(name: str, *, graph: int = 0, node: int = 0, kind: int | None = None) -> Any:
    t = time.time_ns()
    return SimpleNamespace(kind=CONCURRENT_KERNEL if kind is None else kind, name=name, start=t, end=t + 2000, completed=0, queued=0,
                           submitted=0, device_id=0, context_id=1, stream_id=7, correlation_id=6, grid_id=1,
                           graph_id=graph, graph_node_id=node, channel_id=0, channel_type=1, launch_type=0,
                           is_device_launched=0)


def api_record(cbid: int, ret: int, *, end: int | None = None, tid: int = 1, kind: int = DRIVER,
               start: int | None = None) -> Any:
    """A CUpti_ActivityAPI record (cupti-python's ActivityAPI attribute names), DRIVER or RUNTIME."""
    t = end or time.time_ns()
    return SimpleNamespace(kind=kind, cbid=cbid, start=t - 5000 if start is None else start, end=t, process_id=0,
                           thread_id=tid, correlation_id=9, return_value=ret)


def um_record(ck: int, value: int, addr: int) -> Any:
    t = time.time_ns()
    return SimpleNamespace(kind=UM, counter_kind=ck, value=value, start=t, end=t + 10, address=addr,
                           src_id=0, dst_id=0, stream_id=0, process_id=0, pad=0, flags_=0)


class FakeCupti:
    """Implements the probe's ``Backend`` protocol over an in-memory CUPTI."""

    def __init__(self, *, buffer_records: int = 64, shuffle: bool = False, seed: int = 1) -> None:
        self.requested: Any = None
        self.completed: Any = None
        self.enabled: set[int] = set()
        self.enabled_ever: set[int] = set()
        self.pending: list[Any] = []
        self.buffer_records = buffer_records
        self.shuffle = shuffle
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.flushes = 0
        self.registrations = 0
        self.lost_while_disabled = 0
        self.um_configurations = 0
        self.subscribed = False  # the driver-API callback subscription (CUPTI allows one subscriber)
        self.other_subscriber = False  # another tool (a profiler) holds that one place
        self.driver_api_switch = False  # cuptiActivityEnableDriverApi(cuMemMap/cuMemUnmap)
        self.api_cbids: set[int] = set()  # cuptiActivityEnableDriverApi for the allocation calls
        self.runtime_api_cbids: set[int] = set()  # cuptiActivityEnableRuntimeApi for the runtime's
        self.api_switch_refused = False  # scenario: this CUPTI refuses the per-API switch
        self.launch_switch: list[bool] = []  # launch_api_records calls (a launch window's per-API switches)
        self.launch_switch_threads: list[int] = []  # the thread that made each of those calls
        self.launch_switch_at: list[float] = []  # and when (time.monotonic)
        self.launch_cbids: dict[int, set[int]] = {DRIVER: set(), RUNTIME: set()}
        self.errors: list[str] = []
        self.flush_periods: list[int] = []  # cuptiActivityFlushPeriod calls, in ms

    # --- Backend protocol ---
    def register_raw(self, delivery: Any) -> bool:
        """cupti-python's objects only: no raw callbacks here (FakeRawCupti has them)."""
        return False

    def walk_raw(self, address: int, valid: int) -> dict[int, list[int]] | None:
        return None

    def flush_period(self, ms: int) -> bool:
        self.flush_periods.append(ms)
        return True

    def per_thread_buffer(self, on: bool | None) -> int | None:
        return None

    def libcupti_paths(self) -> list[str]:
        return []

    def driver_hooks(self, on: bool) -> bool:
        if on and self.other_subscriber:
            return False
        self.subscribed = on
        return True

    def driver_api_records(self, on: bool) -> bool:
        """CUPTI's per-API activity switch: no subscriber needed, so another tool's place does not matter."""
        self.driver_api_switch = on
        return True

    def oom_api_records(self, on: bool, stream_ordered: bool = False) -> bool:
        """The per-API switches for the allocation entry points (the probe's OOM records)."""
        from gpufootprint.probe.oom import switched_cbids

        if self.api_switch_refused:
            return False
        driver, runtime = switched_cbids(stream_ordered)
        self.api_cbids = set(driver) if on else set()
        self.runtime_api_cbids = set(runtime) if on else set()
        return True

    def launch_api_records(self, on: bool) -> bool:
        """The per-API switches of a launch window (probe/launches.py)."""
        from gpufootprint.probe.launches import DRIVER_CBIDS, RUNTIME_CBIDS

        if self.api_switch_refused:
            return False
        self.launch_switch.append(on)
        self.launch_switch_threads.append(threading.get_ident())
        self.launch_switch_at.append(time.monotonic())
        self.launch_cbids = {DRIVER: set(DRIVER_CBIDS) if on else set(), RUNTIME: set(RUNTIME_CBIDS) if on else set()}
        return True

    def host_call(self, cbid: int, *, kind: int = RUNTIME, start: int | None = None, end: int | None = None,
                  tid: int = 1) -> bool:
        """A launch or synchronisation call on the host: CUPTI writes its API record only while that
        function's per-API switch is on (a launch window)."""
        if cbid in self.launch_cbids[kind]:
            with self.lock:
                self.pending.append(api_record(cbid, 0, kind=kind, start=start, end=end, tid=tid))
            return True
        self.lost_while_disabled += 1
        return False

    def api_call(self, cbid: int, ret: int, **kw: Any) -> None:
        """The program called a driver function itself and it returned ``ret``: CUPTI writes its
        DRIVER record only while that function's switch is on."""
        if cbid in self.api_cbids:
            with self.lock:
                self.pending.append(api_record(cbid, ret, **kw))
        else:
            self.lost_while_disabled += 1

    def runtime_call(self, cbid: int, ret: int, **kw: Any) -> None:
        """A runtime allocation (cudaMalloc: CuPy, PyTorch's caching allocator) returned ``ret``. As
        on the H200, the driver call inside it writes no DRIVER record whatever the driver switches
        say; only the runtime function's own switch gives a (RUNTIME) record."""
        if cbid in self.runtime_api_cbids:
            with self.lock:
                self.pending.append(api_record(cbid, ret, kind=RUNTIME, **kw))
        else:
            self.lost_while_disabled += 1

    def other_tool_subscribes(self) -> bool:
        """A profiler's cuptiSubscribe: refused while the probe holds CUPTI's one subscriber place."""
        if self.subscribed:
            return False
        self.other_subscriber = True
        return True

    def register(self, requested: Any, completed: Any) -> None:
        self.requested, self.completed = requested, completed
        self.registrations += 1

    def enable(self, kind: int) -> bool:
        self.enabled.add(kind)
        self.enabled_ever.add(kind)
        return True

    def disable(self, kind: int) -> bool:
        self.enabled.discard(kind)
        return True

    def flush(self, forced: bool) -> None:
        with self.lock:
            recs, self.pending = self.pending, []
            self.flushes += 1
        if self.shuffle:
            self.rng.shuffle(recs)
        for i in range(0, len(recs), self.buffer_records):
            if self.requested is not None:
                self.requested()
            if self.completed is not None:
                self.completed(recs[i:i + self.buffer_records])

    def configure(self, device_buffer_bytes: int, pool_limit: int) -> int:
        return device_buffer_bytes * pool_limit

    def configure_unified_memory(self) -> bool:
        self.um_configurations += 1
        self.enabled.add(UM)
        return True

    def dropped_records(self, ctx: int = 0, stream: int = 0) -> int:
        return 0

    def versions(self) -> dict[str, Any]:
        return {"cupti": 130000, "driver": 13000, "fake": True}

    # --- the "GPU" side ---
    def emit(self, rec: Any) -> None:
        if rec.kind in self.enabled:
            with self.lock:
                self.pending.append(rec)
        else:
            self.lost_while_disabled += 1

    def launch(self, name: str) -> None:
        """A kernel ran: CUPTI writes its record in whichever kernel kind is on (the serial KERNEL
        kind has the same struct), none when neither is."""
        self.emit(kernel_record(name, kind=KERNEL if KERNEL in self.enabled else CONCURRENT_KERNEL))

    def alloc(self, addr: int, size: int, **kw: Any) -> None:
        self.emit(memory_record(1, addr, size, **kw))

    def free(self, addr: int, size: int, **kw: Any) -> None:
        self.emit(memory_record(2, addr, size, **kw))


# cupti-python's struct for each kind: what CUPTI 13 writes into its buffers.
_STRUCTS = {MEMORY2: "memory4", MEMORY_POOL: "memory_pool3", MEMCPY: "memcpy6", MEMCPY2: "memcpy_pto_p4",
            MEMSET: "memset4", CONCURRENT_KERNEL: "kernel10", UM: "unified_memory_counter3", DRIVER: "api", KERNEL: "kernel10",
            RUNTIME: "api"}


def _struct_dtype(kind: int) -> Any:
    from cupti import cupti  # a pinned dependency; importable without a GPU

    return getattr(cupti, f"activity_{_STRUCTS[kind]}_dtype")


class FakeRawCupti(FakeCupti):
    """The same in-memory CUPTI, delivering buffers of C structs through the probe's raw callbacks.

    Each record object is written into cupti-python's ``activity_*_dtype`` layout
    (kernel names as C strings this fake owns), records back to back in a buffer
    the probe's ``requested`` thunk handed out, and ``completed`` is called through
    the real ctypes thunk. Registering cupti-python callbacks (``register``)
    replaces the raw ones, as a second registration does in CUPTI.
    """

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.delivery: Any = None
        self._names: dict[str, Any] = {}  # name -> ctypes buffer (kept alive like CUPTI's strings)
        self.refused_records = 0
        self.buffers_delivered = 0
        # The (CUcontext, stream) queue this fake's buffers belong to; CUPTI counts drops per queue.
        self.queue: tuple[int, int] = (0, 0)
        self.walk_disagrees = False  # scenario: the reference walk misses each buffer's last record

    def register(self, requested: Any, completed: Any) -> None:
        super().register(requested, completed)
        self.delivery = None

    def register_raw(self, delivery: Any) -> bool:
        self.delivery = delivery
        self.requested = self.completed = None
        self.registrations += 1
        return True

    def dropped_records(self, ctx: int = 0, stream: int = 0) -> int:
        if (ctx, stream) != self.queue:
            return 0
        n, self.refused_records = self.refused_records, 0
        return n

    def to_struct(self, rec: Any) -> bytes:
        import ctypes

        import numpy as np

        if getattr(rec, "raw_bytes", None) is not None:
            return bytes(rec.raw_bytes)  # written as it is (``odd_record``)

        dt = _struct_dtype(rec.kind)
        row = np.zeros(1, dtype=dt)
        for f in dt.names:
            if f == "memory_pool_config":
                cfg = rec.memory_pool_config
                sub = row[f]
                sub["memory_pool_type"] = cfg.memory_pool_type
                sub["address"] = cfg.address
                sub["release_threshold"] = cfg.release_threshold
                sub["utilized_size"] = cfg.utilized_size
                sub["pool"]["size_"] = cfg.pool.size_
                row[f] = sub
            elif f == "name" and rec.kind == CONCURRENT_KERNEL:
                buf = self._names.get(rec.name)
                if buf is None:
                    self._names[rec.name] = buf = ctypes.create_string_buffer(rec.name.encode())
                row[f] = ctypes.addressof(buf)
            else:
                v = getattr(rec, f, None)
                if isinstance(v, int) and not dt.fields[f][0].shape:
                    row[f] = v
        return row.tobytes()

    def flush(self, forced: bool) -> None:
        if self.delivery is None:
            super().flush(forced)
            return

        with self.lock:
            recs, self.pending = self.pending, []
            self.flushes += 1
        if self.shuffle:
            self.rng.shuffle(recs)
        self.deliver(recs)

    def deliver(self, recs: list[Any]) -> None:
        """Write ``recs`` into buffers the probe hands out and complete each, like CUPTI."""
        import ctypes

        structs = [self.to_struct(r) for r in recs]
        i = 0
        while i < len(structs):
            # Like CUPTI: ask for a buffer, write whole records while they fit, complete it.
            buf, size, most = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_size_t()
            self.delivery._req(ctypes.byref(buf), ctypes.byref(size), ctypes.byref(most))
            if not buf.value or size.value < len(structs[i]):
                self.refused_records += 1  # no buffer: CUPTI drops the record and counts it
                i += 1
                continue
            used = 0
            while i < len(structs) and used + len(structs[i]) <= size.value:
                ctypes.memmove(buf.value + used, structs[i], len(structs[i]))
                used += len(structs[i])
                i += 1
            self.buffers_delivered += 1
            self.delivery._cmp(self.queue[0] or None, self.queue[1], buf.value, size.value, used)

    def walk_raw(self, address: int, valid: int) -> dict[int, list[int]] | None:
        """The reference walk (cuptiActivityGetNextRecord's job): by each struct's size. Like the backend's
        loop over cuptiActivityGetNextRecord, it stops at a record it cannot read and gives what it found
        before it (all of a buffer, or none of it, is not what CUPTI's walk says)."""
        import ctypes

        out: dict[int, list[int]] = {}
        off = 0
        while off < valid:
            kind = ctypes.c_int32.from_address(address + off).value
            if kind not in _STRUCTS or off + _struct_dtype(kind).itemsize > valid:
                return out
            out.setdefault(kind, []).append(off)
            off += _struct_dtype(kind).itemsize
        if self.walk_disagrees and out:
            last = max(out, key=lambda k: out[k][-1])
            out[last].pop()  # scenario: CUPTI's walk ends a record early
            if not out[last]:
                del out[last]
        return out


class StreamBufferedCupti(FakeRawCupti):
    """CUPTI as it behaves under allocation churn: one buffer per stream (thread), each handed over
    when it is full, by CUPTI's worker, the moment it fills; a half-full buffer of a quiet stream
    waits for a forced flush. So a busy stream's records reach the probe long before a quiet
    stream's older ones, and a forced flush hands the partial buffers over in no particular order.

    ``emit_at(rec, stamped_ns)`` writes a record stamped earlier than now: an API call that took its
    timestamp, then ran (a cudaFree waiting for the device) before CUPTI wrote the record.
    """

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.streams: dict[int, list[Any]] = {}
        self.full_buffers = 0
        self.partial_buffers = 0

    def emit(self, rec: Any) -> None:
        if rec.kind not in self.enabled:
            self.lost_while_disabled += 1
            return
        full: list[Any] | None = None
        with self.lock:
            buf = self.streams.setdefault(getattr(rec, "stream_id", 0), [])
            buf.append(rec)
            if len(buf) >= self.buffer_records:
                full = self.streams.pop(getattr(rec, "stream_id", 0))
                self.full_buffers += 1
            if full is not None and self.delivery is not None:
                self.deliver(full)  # under the lock: CUPTI completes one buffer at a time

    def flush(self, forced: bool) -> None:
        if not forced:
            return
        with self.lock:
            self.flushes += 1
            parts = list(self.streams.values())
            self.streams = {}
            self.rng.shuffle(parts)
            for part in parts:
                self.partial_buffers += 1
                if self.delivery is not None:
                    self.deliver(part)


def fake_torch(reserved: int = 0, allocated: int = 0) -> Any:
    """A stand-in for the parts of ``torch`` the probe touches: CUDA initialised, the allocator's
    figures, and ``torch._C._cuda_attach_out_of_memory_observer`` keeping what is attached."""
    observers: list[Any] = []
    def nested(d: int = 0) -> dict[str, Any]:
        return {"allocated_bytes": {"all": {"current": allocated, "peak": allocated}},
                "reserved_bytes": {"all": {"current": reserved, "peak": reserved}}}

    cuda = SimpleNamespace(is_initialized=lambda: True, device_count=lambda: 1, memory_stats_as_nested_dict=nested,
                           memory_reserved=lambda d=0: reserved, memory_allocated=lambda d=0: allocated)
    c = SimpleNamespace(observers=observers, _cuda_attach_out_of_memory_observer=observers.append)
    return SimpleNamespace(cuda=cuda, _C=c, __name__="torch")
