"""The probe's side of OOM capture: CUPTI's API records of the allocation calls, PyTorch's observer.

The fake CUPTI (tests/probe_fakes.py) writes API records only for the calls whose per-API switch
is on, in cupti-python's ``activity_api_dtype`` layout on the raw path; the probe must turn each
batch of CUDA_ERROR_OUT_OF_MEMORY returns into one ``oom`` MARK, after a flush.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gpufootprint.probe.core import Probe
from gpufootprint.probe.oom import (
    ALLOCATION_CBIDS,
    CUDA_ERROR_OUT_OF_MEMORY,
    RUNTIME_ALLOCATION_CBIDS,
    OomWatch,
    switched_cbids,
)
from gpufootprint.probe.settings import ProbeSettings
from gpufootprint.wire import cupti_layout
from gpufootprint.wire.framing import FrameType, iter_frames
from gpufootprint.wire.sources import TraceFile

from tests import probe_fakes as fk

CU_MEM_ALLOC_V2 = 243
CU_MEM_CREATE = 549
CU_MEM_MAP = 558  # not an allocation entry point: its failures are not OOM events here
CUDA_MALLOC = 20  # cudaMalloc_v3020: CuPy's and PyTorch's caching allocators
CUDA_MALLOC_ASYNC = 373
CUDA_LAUNCH_KERNEL = 211  # a runtime function that is no allocation


def test_allocation_cbids_are_cuptis_own_numbers() -> None:
    from cupti import cupti

    driver, runtime = switched_cbids(stream_ordered=True)
    for cbid, name in driver.items():
        assert int(getattr(cupti.driver_api_trace_cbid, name)) == cbid, name
    for cbid, name in runtime.items():
        assert int(getattr(cupti.runtime_api_trace_cbid, name)) == cbid, name
    # every allocation entry point the issue names is switched on; the stream-ordered ones on request
    for name in ("cuMemAlloc_v2", "cuMemAllocPitch_v2", "cuMemCreate", "cuMemAllocManaged", "cuMemHostAlloc",
                 "cuMemAllocHost_v2"):
        assert name in ALLOCATION_CBIDS.values()
    for name in ("cudaMalloc_v3020", "cudaMallocManaged_v6000", "cudaMallocHost_v3020", "cudaHostAlloc_v3020",
                 "cudaMallocPitch_v3020"):
        assert name in RUNTIME_ALLOCATION_CBIDS.values()
    for name in ("cuMemAllocAsync", "cuMemAllocFromPoolAsync"):
        assert name in driver.values() and name not in ALLOCATION_CBIDS.values()
    for name in ("cudaMallocAsync_v11020", "cudaMallocFromPoolAsync_v11020"):
        assert name in runtime.values() and name not in RUNTIME_ALLOCATION_CBIDS.values()


def test_api_record_layout_matches_cupti_python() -> None:
    from cupti import cupti

    theirs = cupti.activity_api_dtype
    ours_dt = cupti_layout.API_RAW_DTYPE  # read by probe/oom.py and probe/launches.py
    assert ours_dt.itemsize == theirs.itemsize == cupti_layout.SKIPPED_SIZES[cupti_layout.DRIVER]
    for name, ours in (("cbid", "cbid"), ("start", "start"), ("end", "end"), ("thread_id", "tid"),
                       ("return_value", "ret"), ("process_id", "pid"), ("correlation_id", "corr")):
        assert ours_dt.fields[ours][1] == theirs.fields[name][1], name
        assert ours_dt.fields[ours][0].itemsize == theirs.fields[name][0].itemsize, name


def _raw(rows: list[tuple[int, int, int]], kind: int = cupti_layout.DRIVER) -> tuple[np.ndarray, list[int]]:
    from cupti import cupti

    arr = np.zeros(len(rows), cupti.activity_api_dtype)
    for i, (cbid, ret, end) in enumerate(rows):
        arr[i]["kind"], arr[i]["cbid"], arr[i]["end"], arr[i]["return_value"] = kind, cbid, end, ret
    u8 = np.frombuffer(arr.tobytes(), np.uint8)
    return u8, [i * arr.dtype.itemsize for i in range(len(rows))]


def test_only_out_of_memory_returns_of_allocation_calls_are_events() -> None:
    watch = OomWatch()
    u8, offs = _raw([(CU_MEM_ALLOC_V2, 0, 10), (CU_MEM_ALLOC_V2, CUDA_ERROR_OUT_OF_MEMORY, 20),
                     (CU_MEM_MAP, CUDA_ERROR_OUT_OF_MEMORY, 30), (CU_MEM_CREATE, 1, 40),
                     (CU_MEM_CREATE, CUDA_ERROR_OUT_OF_MEMORY, 50)])
    watch.api_rows(u8, offs)
    marks = watch.marks(pid=7, default_dev=3)
    assert (watch.failed_calls, watch.other_failures) == (2, 1)
    # one mark for the batch, at the last failure's time, counting both
    assert len(marks) == 1
    m = marks[0]
    assert (m["label"], m["ts"], m["pid"], m["dev"]) == ("oom", 50, 7, 3)
    assert m["oom"]["failed_calls"] == 2 and m["oom"]["api"] == "cuMemCreate" and m["oom"]["dev_known"] is False
    assert m["expect_live_bytes"] is None  # the probe's table is past the failure by now
    assert watch.marks(pid=7, default_dev=3) == []


def test_runtime_records_are_read_with_the_runtimes_own_numbers() -> None:
    """cbid 20 is cudaMalloc in the runtime's numbering and something else in the driver's: a
    RUNTIME record must be looked up as a runtime call (CuPy's and PyTorch's OOMs come this way)."""
    watch = OomWatch()
    u8, offs = _raw([(CUDA_MALLOC, CUDA_ERROR_OUT_OF_MEMORY, 10), (CUDA_LAUNCH_KERNEL, CUDA_ERROR_OUT_OF_MEMORY, 20)],
                    kind=cupti_layout.RUNTIME)
    watch.api_rows(u8, offs, cupti_layout.RUNTIME)
    (m,) = watch.marks(pid=1, default_dev=0)
    assert (watch.failed_calls, watch.other_failures) == (1, 0)
    assert m["oom"]["api"] == "cudaMalloc_v3020" and m["ts"] == 10
    watch.api_objects([fk.api_record(CUDA_MALLOC_ASYNC, CUDA_ERROR_OUT_OF_MEMORY, end=40, kind=cupti_layout.RUNTIME),
                       fk.api_record(CUDA_MALLOC, CUDA_ERROR_OUT_OF_MEMORY, end=50)])  # driver cbid 20: no allocation
    (m,) = watch.marks(pid=1, default_dev=0)
    assert m["oom"]["api"] == "cudaMallocAsync_v11020" and watch.failed_calls == 2


def _api(cbid: int, ret: int, t: int, tid: int = 1, kind: int = cupti_layout.RUNTIME) -> Any:
    return fk.api_record(cbid, ret, end=t, tid=tid, kind=kind)


def test_a_failure_the_framework_recovers_from_is_no_oom() -> None:
    """PyTorch's and CuPy's allocators answer a failed cudaMalloc by freeing their caches and calling
    again; when that call succeeds the program never sees an error, so there must be no event."""
    ms = 1_000_000
    watch = OomWatch()
    t = 10_000 * ms
    watch.api_objects([_api(CUDA_MALLOC, CUDA_ERROR_OUT_OF_MEMORY, t), _api(CUDA_MALLOC, 0, t + 300 * ms)])
    assert watch.marks(pid=1, default_dev=0, settled_ns=t + 5000 * ms) == []
    assert (watch.failed_calls, watch.recovered_calls) == (0, 1) and not watch.pending()


def test_a_failure_is_judged_only_once_its_recovery_window_has_arrived() -> None:
    ms = 1_000_000
    watch = OomWatch()
    t = 10_000 * ms
    watch.api_objects([_api(CUDA_MALLOC, CUDA_ERROR_OUT_OF_MEMORY, t)])
    # the records up to t + 0.5 s are in: a retry may still come
    assert watch.marks(pid=1, default_dev=0, settled_ns=t + 500 * ms) == [] and watch.pending()
    # a success on another thread, or of the other API's numbering, is no retry of this call
    watch.api_objects([_api(CUDA_MALLOC, 0, t + 600 * ms, tid=2),
                       _api(CU_MEM_ALLOC_V2, 0, t + 700 * ms, kind=cupti_layout.DRIVER)])
    # a success after the window is a later allocation, not the retry
    watch.api_objects([_api(CUDA_MALLOC, 0, t + 2000 * ms)])
    (m,) = watch.marks(pid=1, default_dev=0, settled_ns=t + 2500 * ms)
    assert m["oom"]["failed_calls"] == 1 and m["ts"] == t
    assert (watch.failed_calls, watch.recovered_calls) == (1, 0)


def test_pytorchs_notice_waits_for_the_watermark_then_settles_the_failures_before_it_in_one_go() -> None:
    """PyTorch calls its observer after its own free-and-retry failed: the failed calls before the
    notice need no recovery window, and both go out together (one event, not two a second apart).
    The notice itself waits until the API records up to it have been read (the watermark)."""
    ms = 1_000_000
    clock = [10_000 * ms + 50 * ms]
    watch = OomWatch(clock_ns=lambda: clock[0])
    t = 10_000 * ms
    watch.torch_observer(0, 1 << 30, 80 << 30, 1 << 20)  # before the API record has been read
    assert watch.marks(pid=1, default_dev=0, settled_ns=t + 10 * ms) == [] and watch.pending()
    watch.api_objects([_api(CUDA_MALLOC, CUDA_ERROR_OUT_OF_MEMORY, t), _api(CUDA_MALLOC, CUDA_ERROR_OUT_OF_MEMORY,
                                                                           t + 20 * ms)])
    cupti_mark, torch_mark = watch.marks(pid=1, default_dev=0, settled_ns=t + 60 * ms)
    assert cupti_mark["oom"]["failed_calls"] == 2 and torch_mark["oom"]["requested_bytes"] == 1 << 30
    assert not watch.pending()
    # a failure after the notice still waits for its own window
    watch.api_objects([_api(CUDA_MALLOC, CUDA_ERROR_OUT_OF_MEMORY, t + 100 * ms)])
    assert watch.marks(pid=1, default_dev=0, settled_ns=t + 200 * ms) == [] and watch.waiting()


def test_a_tight_loop_of_failures_is_judged_without_waiting_past_the_bound() -> None:
    from gpufootprint.probe.oom import MAX_WAITING

    watch = OomWatch()
    watch.api_objects([_api(CUDA_MALLOC, CUDA_ERROR_OUT_OF_MEMORY, 10 + i) for i in range(MAX_WAITING + 5)])
    assert watch.marks(pid=1, default_dev=0, settled_ns=0)[0]["oom"]["failed_calls"] == 5  # past the bound, at once
    (m,) = watch.marks(pid=1, default_dev=0, settled_ns=None)
    assert m["oom"]["failed_calls"] == MAX_WAITING


def test_at_stop_every_waiting_failure_is_judged() -> None:
    watch = OomWatch()
    watch.api_objects([_api(CUDA_MALLOC, CUDA_ERROR_OUT_OF_MEMORY, 5)])
    assert watch.marks(pid=1, default_dev=0, settled_ns=6) == []
    (m,) = watch.marks(pid=1, default_dev=0, settled_ns=None)  # the process is stopping
    assert m["oom"]["failed_calls"] == 1


def test_a_process_failing_in_a_loop_sends_marks_at_a_bounded_rate_and_loses_no_failed_call() -> None:
    """Past MARKS_PER_MINUTE a minute the judged calls wait and go out, all counted, in the next mark;
    an OOM an hour later still gets its mark (a lifetime cap of 100 marks used to silence it)."""
    from gpufootprint.probe.oom import MARKS_PER_MINUTE

    now = [0.0]
    watch = OomWatch(monotonic=lambda: now[0])
    counted = 0
    for i in range(300):  # a failure every 0.1 s for 30 s
        now[0] = i * 0.1
        watch.api_objects([fk.api_record(CU_MEM_ALLOC_V2, CUDA_ERROR_OUT_OF_MEMORY, end=i + 1)])
        counted += sum(m["oom"]["failed_calls"] for m in watch.marks(pid=1, default_dev=0))
    assert watch.marks_sent == MARKS_PER_MINUTE and counted < 300
    watch.api_objects([fk.api_record(CU_MEM_ALLOC_V2, CUDA_ERROR_OUT_OF_MEMORY, end=400)])
    (at_stop,) = watch.marks(pid=1, default_dev=0, final=True)  # stopping: past the rate, all counted
    counted += at_stop["oom"]["failed_calls"]
    assert counted == 301
    now[0] = 61.0  # the minute has passed: the next mark carries every call judged meanwhile
    counted += sum(m["oom"]["failed_calls"] for m in watch.marks(pid=1, default_dev=0))
    assert counted == 301 and watch.failed_calls == 301
    now[0] = 3600.0
    watch.api_objects([fk.api_record(CU_MEM_ALLOC_V2, CUDA_ERROR_OUT_OF_MEMORY, end=10_000)])
    (late,) = watch.marks(pid=1, default_dev=0)
    assert late["oom"]["failed_calls"] == 1


def test_torch_observer_attaches_only_once_cuda_is_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = fk.fake_torch(reserved=3 << 30, allocated=2 << 30)
    torch.cuda.is_initialized = lambda: False
    monkeypatch.setitem(sys.modules, "torch", torch)
    watch = OomWatch(clock_ns=lambda: 1234)
    assert watch.attach_torch() is False and torch._C.observers == []
    torch.cuda.is_initialized = lambda: True
    assert watch.attach_torch() is True and len(torch._C.observers) == 1
    assert watch.attach_torch() is True and len(torch._C.observers) == 1  # once
    torch._C.observers[0](0, 4 << 30, 80 << 30, 1 << 20)
    (m,) = watch.marks(pid=5, default_dev=9)
    assert (m["ts"], m["dev"]) == (1234, 0)  # PyTorch names the device
    assert m["oom"]["requested_bytes"] == 4 << 30 and m["oom"]["torch_reserved_bytes"] == 3 << 30
    assert m["oom"]["dev_known"] is True and m["oom"]["source"] == "torch"


def _run(tmp_path: Path, fake: Any, steps: Any, **settings: Any) -> list[dict[str, Any]]:
    path = tmp_path / "t.gfp"
    probe = Probe(ProbeSettings(socket="", tee=str(path), flush_ms=10, **settings), fake, discover_devices=False)
    assert probe.start()
    try:
        steps(fake)
        time.sleep(0.3)
    finally:
        probe.stop()
    frames = list(iter_frames(TraceFile(path).chunks()))
    return [f.json() for f in frames if f.type is FrameType.MARK]


@pytest.mark.parametrize("cls", [fk.FakeRawCupti, fk.FakeCupti], ids=["raw", "objects"])
def test_probe_sends_one_oom_mark_after_the_records_before_it(tmp_path: Path, cls: type) -> None:
    fake = cls()

    def steps(f: Any) -> None:
        f.alloc(0x1000, 1 << 20, dev=2)
        f.api_call(CU_MEM_ALLOC_V2, CUDA_ERROR_OUT_OF_MEMORY)
        f.api_call(CU_MEM_ALLOC_V2, CUDA_ERROR_OUT_OF_MEMORY)  # the framework's retry after freeing its cache

    marks = _run(tmp_path, fake, steps)
    assert fake.api_cbids == set()  # switched off again at stop
    ooms = [m for m in marks if m["label"] == "oom"]
    assert len(ooms) == 1
    assert ooms[0]["oom"]["failed_calls"] == 2 and ooms[0]["dev"] == 2  # the device last allocated on


@pytest.mark.parametrize("cls", [fk.FakeRawCupti, fk.FakeCupti], ids=["raw", "objects"])
def test_a_runtime_allocations_oom_is_seen_with_the_default_settings(tmp_path: Path, cls: type) -> None:
    """CuPy's OOM on the H200: cudaMalloc fails, and the driver call inside it writes no DRIVER
    record (the fake does the same). The default probe must still send one OOM mark."""
    assert ProbeSettings().oom_records is True
    fake = cls()

    def steps(f: Any) -> None:
        f.alloc(0x1000, 1 << 30, dev=1)
        f.runtime_call(CUDA_MALLOC, CUDA_ERROR_OUT_OF_MEMORY)
        f.runtime_call(CUDA_MALLOC, CUDA_ERROR_OUT_OF_MEMORY)  # CuPy frees its pool's cache and retries

    marks = _run(tmp_path, fake, steps)
    ooms = [m for m in marks if m["label"] == "oom"]
    assert len(ooms) == 1 and fake.lost_while_disabled == 0
    assert ooms[0]["oom"]["api"] == "cudaMalloc_v3020" and ooms[0]["oom"]["failed_calls"] == 2
    assert ooms[0]["dev"] == 1
    assert fake.runtime_api_cbids == set()  # switched off again at stop


@pytest.mark.parametrize("cls", [fk.FakeRawCupti, fk.FakeCupti], ids=["raw", "objects"])
def test_a_retry_that_succeeds_sends_no_oom_mark(tmp_path: Path, cls: type) -> None:
    fake = cls()

    def steps(f: Any) -> None:
        f.alloc(0x1000, 1 << 30)
        f.runtime_call(CUDA_MALLOC, CUDA_ERROR_OUT_OF_MEMORY)
        f.free(0x1000, 1 << 30)  # the allocator frees its cache ...
        f.runtime_call(CUDA_MALLOC, 0)  # ... and the same call succeeds
        f.alloc(0x2000, 1 << 29)

    marks = _run(tmp_path, fake, steps)
    assert not [m for m in marks if m["label"] == "oom"]


def test_stream_ordered_allocations_are_recorded_only_on_request(tmp_path: Path) -> None:
    fake = fk.FakeRawCupti()
    marks = _run(tmp_path, fake, lambda f: f.runtime_call(CUDA_MALLOC_ASYNC, CUDA_ERROR_OUT_OF_MEMORY))
    assert fake.lost_while_disabled == 1 and not [m for m in marks if m["label"] == "oom"]
    fake = fk.FakeRawCupti()
    marks = _run(tmp_path, fake, lambda f: f.runtime_call(CUDA_MALLOC_ASYNC, CUDA_ERROR_OUT_OF_MEMORY),
                 oom_records_async=True)
    (m,) = [m for m in marks if m["label"] == "oom"]
    assert m["oom"]["api"] == "cudaMallocAsync_v11020"


def test_oom_records_can_be_switched_off(tmp_path: Path) -> None:
    fake = fk.FakeRawCupti()
    marks = _run(tmp_path, fake, lambda f: f.api_call(CU_MEM_ALLOC_V2, CUDA_ERROR_OUT_OF_MEMORY), oom_records=False)
    assert fake.lost_while_disabled == 1 and not [m for m in marks if m["label"] == "oom"]


def test_a_cupti_that_refuses_the_switch_is_counted_not_fatal(tmp_path: Path) -> None:
    fake = fk.FakeRawCupti()
    fake.api_switch_refused = True
    path = tmp_path / "t.gfp"
    probe = Probe(ProbeSettings(socket="", tee=str(path), flush_ms=10, oom_records=True), fake, discover_devices=False)
    assert probe.start()
    fake.alloc(0x1000, 4096)
    probe.stop()
    assert probe.counters["oom_records_unavailable"] == 1
    assert probe.sender.table.live_by_kind(0) == {"device": 4096}


def test_a_failed_call_names_its_gpu_as_known_only_where_the_process_sees_one_device() -> None:
    watch = OomWatch()
    watch.api_objects([_api(CUDA_MALLOC, CUDA_ERROR_OUT_OF_MEMORY, 5)])
    (one,) = watch.marks(pid=1, default_dev=0, settled_ns=None, only_device=True)
    assert one["dev"] == 0 and one["oom"]["dev_known"] is True
    watch.api_objects([_api(CUDA_MALLOC, CUDA_ERROR_OUT_OF_MEMORY, 9)])
    (many,) = watch.marks(pid=1, default_dev=3, settled_ns=None, only_device=False)
    assert many["dev"] == 3 and many["oom"]["dev_known"] is False  # the newest allocation's GPU, a guess


def _probe_with_tee(tmp_path: Path, name: str) -> tuple[Any, Probe]:
    fake = fk.FakeCupti()
    probe = Probe(ProbeSettings(socket="", tee=str(tmp_path / f"{name}.gfp")), fake, discover_devices=False)
    probe.sender.devices = [{"index": 0}]
    assert probe.start()
    fake.alloc(0x1000, 4096)
    return fake, probe


def _until(pred: Any, timeout: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return time.monotonic() - t0
        time.sleep(0.01)
    return None


def test_a_pytorch_notice_with_no_failed_call_before_it_goes_out_at_the_drain_cadence(tmp_path: Path) -> None:
    """A per-process memory fraction or the cudaMallocAsync backend raise with no failed CUDA call the
    probe sees: the notice waits for the watermark, so the probe flushes at its drain cadence meanwhile
    rather than the 1 s watermark period (review: 1.2-1.9 s before, with the default settings)."""
    _fake, probe = _probe_with_tee(tmp_path, "fraction")
    try:
        time.sleep(0.3)
        probe.sender.oom.torch_observer(0, 1 << 30, 80 << 30, 1 << 20)
        took = _until(lambda: probe.sender.oom.marks_sent == 1, 5.0)
        assert took is not None and took < 0.9, took
    finally:
        probe.stop()


def test_a_pytorch_notice_during_a_profiler_gap_goes_out_without_waiting_for_the_gap_to_end(tmp_path: Path) -> None:
    """In a torch.profiler gap no record of ours comes and the watermark stands still: the notice must
    not wait for it (review: it waited for the gap's end)."""
    _fake, probe = _probe_with_tee(tmp_path, "gap")
    try:
        time.sleep(0.3)
        probe.takeover_begin()
        probe.sender.oom.torch_observer(0, 1 << 30, 80 << 30, 1 << 20)
        assert _until(lambda: probe.sender.oom.marks_sent == 1, 3.0) is not None
        probe.takeover_end([], list)
    finally:
        probe.stop()
