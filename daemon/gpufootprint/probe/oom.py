"""Failed allocations, whatever the framework: the probe's side of out-of-memory capture.

CUPTI's per-API activity switches (``cuptiActivityEnableDriverApi`` and
``cuptiActivityEnableRuntimeApi``) make CUPTI write a ``CUpti_ActivityAPI`` record for
every call of the chosen functions, with the call's return value. Both are needed: on
the H200 (CUDA 13.0, driver 580; tests/gpu/cupti_modes_diag.py, 2026-12-03) a DRIVER
record is written only for a driver function the program calls itself (cuda-bindings,
JAX, Numba, PyTorch's expandable segments); the driver call inside ``cudaMalloc``
(CuPy, PyTorch's caching allocator) writes none, while its RUNTIME record carries
``cudaErrorMemoryAllocation``. A record of an allocation entry point below whose return
value is out-of-memory (2 in both APIs) is an out-of-memory event, whatever the
framework. The record carries no arguments and no device: the requested size is unknown
on this path (only a callback subscriber's per-call parameters have it, a cost on every
allocation call of every process: docs/oom.md), and the device is the one the process
last allocated on, known for sure (``dev_known``) where the process sees one device.
With PyTorch, its own out-of-memory observer adds the requested size and the
allocator's figures.

Nothing here runs on CUPTI's thread or the workload's, except the PyTorch observer
(called by PyTorch on the failing thread after it released its allocator lock), which
only queues.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np

from gpufootprint.wire import cupti_layout

log = logging.getLogger(__name__)

#: CUDA_ERROR_OUT_OF_MEMORY (driver) and cudaErrorMemoryAllocation (runtime) share the number
CUDA_ERROR_OUT_OF_MEMORY: Final = 2

#: CUpti_ActivityKind of the per-API records
DRIVER_RECORD: Final = cupti_layout.DRIVER
RUNTIME_RECORD: Final = cupti_layout.RUNTIME

#: CUpti_driver_api_trace_cbid of the allocation entry points (stable values of CUPTI's
#: generated header; tests/unit/test_probe_oom.py checks them against cupti-python's enum).
#: The stream-ordered entry points are switched on only with ``oom_records_async``: a stream-ordered
#: allocator calls them for every tensor (about 425 calls a training step under PyTorch's
#: cudaMallocAsync backend), and their records, written between the MEMORY2 records of the same
#: calls, turn a buffer of one kind (walked in one vectorised check) into one walked record by record.
ALLOCATION_CBIDS: Final[dict[int, str]] = {
    29: "cuMemAlloc", 243: "cuMemAlloc_v2", 31: "cuMemAllocPitch", 244: "cuMemAllocPitch_v2",
    371: "cuMemAllocManaged", 549: "cuMemCreate",
    37: "cuMemAllocHost", 294: "cuMemAllocHost_v2", 39: "cuMemHostAlloc", 271: "cuMemHostAlloc_v2",
}
STREAM_ORDERED_CBIDS: Final[dict[int, str]] = {
    598: "cuMemAllocAsync", 599: "cuMemAllocAsync_ptsz", 611: "cuMemAllocFromPoolAsync",
    612: "cuMemAllocFromPoolAsync_ptsz",
}

#: CUpti_runtime_api_trace_cbid of the runtime's allocation entry points (checked the same way).
RUNTIME_ALLOCATION_CBIDS: Final[dict[int, str]] = {
    20: "cudaMalloc_v3020", 21: "cudaMallocPitch_v3020", 140: "cudaMalloc3D_v3020", 23: "cudaMallocArray_v3020",
    141: "cudaMalloc3DArray_v3020", 192: "cudaMallocMipmappedArray_v5000", 206: "cudaMallocManaged_v6000",
    25: "cudaMallocHost_v3020", 27: "cudaHostAlloc_v3020",
}
RUNTIME_STREAM_ORDERED_CBIDS: Final[dict[int, str]] = {
    373: "cudaMallocAsync_v11020", 374: "cudaMallocAsync_ptsz_v11020", 391: "cudaMallocFromPoolAsync_v11020",
    392: "cudaMallocFromPoolAsync_ptsz_v11020",
}

#: What a record of each kind may be (whichever of them were switched on).
_CBIDS: Final[dict[int, dict[int, str]]] = {
    DRIVER_RECORD: {**ALLOCATION_CBIDS, **STREAM_ORDERED_CBIDS},
    RUNTIME_RECORD: {**RUNTIME_ALLOCATION_CBIDS, **RUNTIME_STREAM_ORDERED_CBIDS},
}

#: The same numbers as arrays, for the vectorised look at a buffer's records.
_CBID_ARRAYS: Final[dict[int, np.ndarray]] = {k: np.fromiter(v, np.uint32) for k, v in _CBIDS.items()}


def switched_cbids(stream_ordered: bool) -> tuple[dict[int, str], dict[int, str]]:
    """The driver's and the runtime's entry points to switch on (``oom_records_async``: stream-ordered too)."""
    if stream_ordered:
        return _CBIDS[DRIVER_RECORD], _CBIDS[RUNTIME_RECORD]
    return ALLOCATION_CBIDS, RUNTIME_ALLOCATION_CBIDS

#: A process that fails allocations in a loop sends at most this many OOM marks a minute. Failed calls
#: judged meanwhile are not lost: they wait and go out counted in the next mark; PyTorch notices past
#: the rate are dropped and counted (``oom_marks_suppressed``).
MARKS_PER_MINUTE: Final = 60

#: A failed allocation call followed, on the same thread, within this long by a successful one is a
#: failure the framework recovered from, not an out-of-memory error: PyTorch's caching allocator and
#: CuPy's pool answer a failed cudaMalloc by freeing their caches and calling again, and only when
#: that fails too does the program see an error. Releasing a large cache (a cudaFree per block) can
#: take a good part of a second, hence one second.
RECOVERY_NS: Final = 1_000_000_000
#: Failed calls waiting to be judged at most (a process failing allocations in a tight loop): past it
#: a failure is judged at once, as not recovered from.
MAX_WAITING: Final = 10_000


class OomWatch:
    """Collects failed allocation calls and PyTorch OOM notices until the sender takes them.

    ``api_rows`` and ``api_objects`` run on the thread that reads CUPTI's buffers;
    ``torch_observer`` on the workload's failing thread; ``take`` on the sender.
    """

    def __init__(self, clock_ns: Callable[[], int] = time.time_ns,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._clock_ns = clock_ns
        self._monotonic = monotonic
        self._sent_at: deque[float] = deque()  # when the marks of the last minute went out
        self._events: deque[dict[str, Any]] = deque(maxlen=1000)
        self._lock = threading.Lock()
        self.failed_calls = 0  # allocation calls that returned OUT_OF_MEMORY (and were not recovered from)
        self.recovered_calls = 0  # ... followed on their thread by a successful call within RECOVERY_NS
        # Failed calls not yet judged: (end_ns, thread id, api, API kind); judged once every record
        # stamped up to end + RECOVERY_NS has arrived (the sender's watermark says when), or at stop.
        self._waiting: list[tuple[int, int, str, int]] = []
        self._judged_calls = 0  # failed calls judged not recovered from, since the last mark
        self._judged_last: dict[str, Any] | None = None  # the latest of them
        self.other_failures = 0  # allocation calls that failed otherwise (not an OOM)
        self.torch_events = 0
        self.marks_sent = 0
        self.marks_suppressed = 0
        self.torch_attached = False

    # --- CUPTI's API records -------------------------------------------------------------

    def reads_calls(self, *, failed: bool) -> bool:
        """Whether a buffer's API records need ``api_rows``: a call in it failed, or a failure waits to be
        judged (a success on its thread may settle it). Otherwise it has nothing to look at."""
        return failed or bool(self._waiting)

    def api_rows(self, u8: np.ndarray, offsets: Sequence[int], kind: int = DRIVER_RECORD) -> None:
        """API records of one kind (DRIVER or RUNTIME) in one raw buffer, at ``offsets`` in its bytes."""
        names = _CBIDS.get(kind)
        if names is None or not len(offsets):
            return
        if not self._waiting and not cupti_layout.api_returns(u8, offsets).any():
            return  # every call succeeded and no failure waits for one: nothing to look at (the common case)
        rows = cupti_layout.gather(u8, kind, offsets)
        alloc = np.isin(rows["cbid"], _CBID_ARRAYS[kind])
        # Successes matter only while a failure waits to be judged; the calls are few either way
        # (the stream-ordered ones, a call per tensor, are off unless asked for).
        failed = alloc & (rows["ret"] != 0)
        wanted = alloc if self._waiting or failed.any() else failed
        for r in rows[wanted]:
            self._api_call(names[int(r["cbid"])], int(r["start"]), int(r["end"]), int(r["ret"]), int(r["tid"]), kind)

    def api_objects(self, records: list[Any]) -> None:
        """cupti-python's ActivityAPI objects (the objects delivery path), DRIVER or RUNTIME."""
        for rec in records:
            kind = int(getattr(rec, "kind", DRIVER_RECORD))
            names = _CBIDS.get(kind, {})
            cbid = int(getattr(rec, "cbid", -1))
            if cbid in names:
                self._api_call(names[cbid], int(getattr(rec, "start", 0)), int(getattr(rec, "end", 0)),
                               int(getattr(rec, "return_value", 0)), int(getattr(rec, "thread_id", 0)), kind)

    def _api_call(self, api: str, start_ns: int, end_ns: int, ret: int, tid: int, kind: int) -> None:
        with self._lock:
            if ret == 0:  # a success: does it settle a failure of this thread just before it?
                kept = [w for w in self._waiting
                        if not (w[1] == tid and w[3] == kind and w[0] <= start_ns <= w[0] + RECOVERY_NS)]
                self.recovered_calls += len(self._waiting) - len(kept)
                self._waiting = kept
            elif ret != CUDA_ERROR_OUT_OF_MEMORY:
                self.other_failures += 1
            elif len(self._waiting) < MAX_WAITING:
                self._waiting.append((end_ns, tid, api, kind))
            else:
                self._judged(end_ns, tid, api)

    def settle(self, settled_ns: int | None) -> None:
        """Judge the failures whose recovery window every record has arrived for (``settled_ns``, the
        probe's watermark; None: all of them, the process is stopping): not recovered, they are
        out-of-memory errors the program saw. A PyTorch notice settles the failures that ended before
        it at once: PyTorch calls its observer only once its own free-and-retry has failed too, so
        waiting out the window would only split one event into two marks a second apart."""
        with self._lock:
            if not self._waiting:
                return
            given_up = max((e["ts"] for e in self._events if e["source"] == "torch"
                            and (settled_ns is None or e["ts"] <= settled_ns)), default=None)
            waiting: list[tuple[int, int, str, int]] = []
            for w in self._waiting:
                if (settled_ns is None or w[0] + RECOVERY_NS <= settled_ns
                        or (given_up is not None and w[0] <= given_up)):
                    self._judged(w[0], w[1], w[2])
                else:
                    waiting.append(w)
            self._waiting = waiting

    def _judged(self, end_ns: int, tid: int, api: str) -> None:
        """A failed call not recovered from: part of the next OOM mark, which counts them all and
        names the latest (under the lock; a count, so a tight loop of failures costs no memory)."""
        self.failed_calls += 1
        self._judged_calls += 1
        if self._judged_last is None or end_ns >= self._judged_last["ts"]:
            self._judged_last = {"source": "cupti", "api": api, "ts": end_ns, "thread_id": tid,
                                 "requested_bytes": None}

    # --- PyTorch ---------------------------------------------------------------------------

    def attach_torch(self) -> bool:
        """Attach the PyTorch OOM observer once torch has initialised CUDA (its per-device allocators
        exist only then: an observer attached earlier would be lost). True once attached."""
        if self.torch_attached:
            return True
        torch = sys.modules.get("torch")
        if torch is None:
            return False
        try:
            if not torch.cuda.is_initialized():
                return False
            torch._C._cuda_attach_out_of_memory_observer(self.torch_observer)
        except Exception as exc:  # noqa: BLE001 - another allocator backend, an older torch
            log.debug("gpufootprint probe: no PyTorch OOM observer: %s", exc)
            self.torch_attached = True  # do not try every heartbeat
            return False
        self.torch_attached = True
        return True

    def torch_observer(self, device: int, alloc: int, device_total: int, device_free: int) -> None:
        """PyTorch calls this before raising OutOfMemoryError (its allocator lock released)."""
        try:
            self.torch_events += 1
            event: dict[str, Any] = {"source": "torch", "ts": self._clock_ns(), "dev": int(device),
                                     "requested_bytes": int(alloc), "device_limit_bytes": int(device_total),
                                     "device_free_bytes": int(device_free)}
            torch = sys.modules.get("torch")
            if torch is not None:
                event["torch_reserved_bytes"] = int(torch.cuda.memory_reserved(device))
                event["torch_allocated_bytes"] = int(torch.cuda.memory_allocated(device))
            self._put(event)
        except Exception:  # noqa: BLE001, S110 - never into PyTorch's error path
            pass

    # --- the sender --------------------------------------------------------------------------

    def _put(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._events.append(event)

    def waiting(self) -> bool:
        """A failed call waits for its recovery window to be judged, or a PyTorch notice for the
        watermark to pass it (the sender flushes at its drain cadence until then)."""
        return bool(self._waiting or self._events)

    def pending(self) -> bool:
        return bool(self._events or self._waiting or self._judged_calls)

    def take(self, settled_ns: int | None = None) -> tuple[list[dict[str, Any]], int, dict[str, Any] | None]:
        """PyTorch's notices up to ``settled_ns`` (None: all), and the count and latest of the failed
        calls judged, since the last take. A notice waits for the watermark to pass it, so that the
        API records of the failed calls that led to it (read from CUPTI's buffers later than PyTorch
        calls its observer) are judged first and go out in the same event."""
        with self._lock:
            out = [e for e in self._events if settled_ns is None or e["ts"] <= settled_ns]
            later = [e for e in self._events if settled_ns is not None and e["ts"] > settled_ns]
            self._events.clear()
            self._events.extend(later)
            calls, last = self._judged_calls, self._judged_last
            self._judged_calls, self._judged_last = 0, None
        return out, calls, last

    def marks(self, pid: int, default_dev: int, settled_ns: int | None = None,
              only_device: bool = False, final: bool = False) -> list[dict[str, Any]]:
        """MARK bodies for the events taken now: one per PyTorch notice, and one for the failed
        allocation calls judged now (``settle``; at the last one's time, counting them all); at most
        MARKS_PER_MINUTE. An API record names no device: ``default_dev`` is the one the newest
        allocation named, known for sure only where the process sees one device (``only_device``,
        as a Kubernetes container given one GPU does). ``final``: the process is stopping, so what was
        judged goes out now, past the rate too."""
        self.settle(settled_ns)
        now = self._monotonic()
        while self._sent_at and now - self._sent_at[0] >= 60.0:
            self._sent_at.popleft()
        room = MARKS_PER_MINUTE - len(self._sent_at)
        if final:
            room = max(room, 1)
        elif room <= 0:
            return []  # nothing taken: the judged calls keep adding up for the next mark
        events, calls, last = self.take(settled_ns)
        out: list[dict[str, Any]] = []
        if last is not None:
            out.append({"label": "oom", "ts": last["ts"], "pid": pid, "dev": default_dev, "expect_live_bytes": None,
                        "oom": {"source": "cupti", "api": last["api"], "failed_calls": calls,
                                "requested_bytes": None, "dev_known": only_device,
                                "thread_id": last["thread_id"]}})
        for e in events:
            if e["source"] == "torch":
                body = {k: v for k, v in e.items() if k not in ("ts", "dev")}
                out.append({"label": "oom", "ts": e["ts"], "pid": pid, "dev": e["dev"], "expect_live_bytes": None,
                            "oom": {**body, "dev_known": True}})
        self.marks_suppressed += max(0, len(out) - room)  # PyTorch notices only: the failed calls' mark is first
        out = out[:room]
        self.marks_sent += len(out)
        self._sent_at.extend([now] * len(out))
        return out

    def counters(self) -> dict[str, int]:
        # Few keys: the daemon keeps at most 64 heartbeat counters per probe (docs/reliability.md).
        return {"oom_failed_calls": self.failed_calls, "oom_recovered_calls": self.recovered_calls,
                "oom_torch_events": self.torch_events,
                "oom_marks_suppressed": self.marks_suppressed, "oom_torch_observer": int(self.torch_attached)}
