"""Launch windows in the probe: CUPTI's per-API records of the launch and wait calls (probe/launches.py)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gpufootprint.probe import launches
from gpufootprint.probe.core import Probe
from gpufootprint.probe.settings import ProbeSettings
from gpufootprint.records import ApiRole, RecordKind
from gpufootprint.wire import cupti_layout
from gpufootprint.wire.framing import FrameType, iter_frames
from gpufootprint.wire.sources import TraceFile

from tests import probe_fakes as fk


def test_launch_window_cbids_are_cuptis_own_numbers() -> None:
    cupti = pytest.importorskip("cupti.cupti")  # a pinned dependency: importable without a GPU
    for cbid, (name, _) in launches.DRIVER_CBIDS.items():
        assert int(getattr(cupti.driver_api_trace_cbid, name)) == cbid, name
    for cbid, (name, _) in launches.RUNTIME_CBIDS.items():
        assert int(getattr(cupti.runtime_api_trace_cbid, name)) == cbid, name


def test_a_buffers_api_records_become_launch_records_with_their_roles() -> None:
    # GIVEN CUPTI's 40-byte API structs: two launches, a wait, an allocation call (the OOM records') and
    # a cbid past the end of the table
    rows = [(fk.RUNTIME, 211, 100, 104), (fk.RUNTIME, 20, 105, 106), (fk.DRIVER, 307, 110, 115),
            (fk.RUNTIME, 165, 120, 180), (fk.RUNTIME, 9999, 181, 182)]
    raw = np.zeros(len(rows), cupti_layout.API_RAW_DTYPE)
    for i, (_, cbid, start, end) in enumerate(rows):
        raw[i]["cbid"], raw[i]["start"], raw[i]["end"], raw[i]["tid"], raw[i]["corr"] = cbid, start, end, 3, i
    u8 = np.frombuffer(raw.tobytes(), dtype=np.uint8)
    got = [launches.api_records(u8, [i * 40], kind, pid=42, dev=1) for i, (kind, *_) in enumerate(rows)]
    # THEN only the launch-window calls remain, each with its role, API, thread, pid and device
    kept = np.concatenate(got)
    assert kept["cbid"].tolist() == [211, 307, 165]
    assert kept["role"].tolist() == [ApiRole.LAUNCH, ApiRole.LAUNCH, ApiRole.SYNC]
    assert kept["domain"].tolist() == [fk.RUNTIME, fk.DRIVER, fk.RUNTIME]
    assert (kept["pid"] == 42).all() and (kept["dev"] == 1).all() and (kept["tid"] == 3).all()
    assert kept["start"].tolist() == [100, 110, 120] and kept["end"].tolist() == [104, 115, 180]


def _wait(cond: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.01)


def _wait_closed(p: Probe) -> None:
    """Until the open window has closed and its calls are packed (the sender closes it in steps: the
    window first, then the switches, through the main thread, then the flush that brings its calls)."""
    _wait(lambda: p.sender.windows.kernel_window is None and p.sender.packer.launch_span is None)


def test_the_switches_are_on_while_cuda_starts_then_only_in_launch_windows(tmp_path: Path) -> None:
    # GIVEN a probe started before CUDA (the per-API switches record only if on when CUDA starts)
    fake = fk.FakeCupti()
    p = Probe(ProbeSettings(socket="", tee=str(tmp_path / "t.gfp"), flush_ms=10), fake, discover_devices=False)
    assert p.start()
    try:
        assert fake.launch_switch == [True] and p.sender.hello["launch_windows"] == 1
        # a launch while CUDA starts is recorded by CUPTI but is no window's: not sent
        t = time.time_ns()
        assert fake.host_call(211, start=t, end=t + 1_000)
        fake.alloc(0x1000, 4096)  # CUDA is up
        _wait(lambda: fake.launch_switch == [True, False])
        assert fake.launch_switch == [True, False]
        assert not fake.host_call(211, start=t + 3_000, end=t + 4_000)  # off between windows: nothing written
        # WHEN the daemon opens a launch window
        p.sender.open_kernel_window(200, 7, "launches")
        assert fake.launch_switch == [True, False, True] and fk.CONCURRENT_KERNEL not in fake.enabled
        t = time.time_ns()
        for i in range(3):
            assert fake.host_call(211, start=t + i * 100, end=t + 50 + i * 100)
        assert fake.host_call(131, start=t + 400, end=t + 900)
        _wait_closed(p)
        # a call CUPTI still records after the window closed (switching off takes it a while): not the window's
        assert fake.host_call(211, start=time.time_ns(), end=time.time_ns() + 10) is False  # off in this fake
        assert fake.launch_switch == [True, False, True, False]
        st = p.status()
        assert st["launch_windows"] == 1 and st["kernel_windows"] == 0 and st["launch_records"] == 4
    finally:
        p.stop()
    frames = list(iter_frames(TraceFile(tmp_path / "t.gfp").chunks()))
    api = np.concatenate([f.records() for f in frames if f.type is FrameType.BATCH and f.tag == RecordKind.API])
    # THEN exactly the window's calls went out, and the window's heartbeat says it held launches
    assert api["start"].tolist() == [t, t + 100, t + 200, t + 400]
    assert api["role"].tolist() == [1, 1, 1, 2]
    closed = [f.json()["kernel_window"] for f in frames if f.type is FrameType.HEARTBEAT and "kernel_window" in f.json()]
    assert closed and closed[0]["id"] == 7 and closed[0]["records"] == "launches"


def test_a_probe_started_after_cuda_opens_no_launch_window(tmp_path: Path) -> None:
    # GIVEN CUDA was up before the probe: switched on now, the per-API switches would record nothing
    # and leave launches slower for good (H200, 2026-12-03)
    fake = fk.FakeCupti()
    p = Probe(ProbeSettings(socket="", tee=str(tmp_path / "t.gfp"), flush_ms=10), fake, discover_devices=False)
    p.sender.cuda_before = True
    assert p.start()
    try:
        assert fake.launch_switch == [] and p.sender.hello["launch_windows"] == 0
        p.sender.open_kernel_window(50, 1, "launches")
        assert fake.launch_switch == [] and p.sender.windows.kernel_window is None
        assert p.counters["kernel_windows_refused"] == 1
    finally:
        p.stop()


def test_a_window_of_kernel_records_asked_for_during_a_launch_window_ends_it_and_opens_its_own(tmp_path: Path) -> None:
    # GIVEN a launch window the sampler opened (H200, 2026-12-03: a kernel window asked for during one was
    # merged into it and recorded no kernel)
    fake = fk.FakeCupti()
    p = Probe(ProbeSettings(socket="", tee=str(tmp_path / "t.gfp"), flush_ms=10), fake, discover_devices=False)
    assert p.start()
    try:
        p.sender.open_kernel_window(5_000, 1, "launches")
        assert fake.launch_switch[-1] is True
        # WHEN a window of kernel records is asked for
        p.sender.open_kernel_window(200, 7)
        # THEN the launch window closed (its switches off) and the kernel window is open with its kind
        assert fake.launch_switch[-1] is False and fk.CONCURRENT_KERNEL in fake.enabled
        assert p.sender.windows.kernel_window is not None and p.sender.windows.kernel_window["id"] == 7
        assert p.sender.windows.kernel_window["records"] == "kernels"
        _wait_closed(p)
        assert fk.CONCURRENT_KERNEL not in fake.enabled
    finally:
        p.stop()
    closed = [f.json()["kernel_window"] for f in iter_frames(TraceFile(tmp_path / "t.gfp").chunks())
              if f.type is FrameType.HEARTBEAT and "kernel_window" in f.json()]
    assert [(w["id"], w["records"]) for w in closed] == [(1, "launches"), (7, "kernels")]


@pytest.mark.parametrize("when", ["priming", "window"])
def test_after_a_profiler_had_cupti_the_launch_switches_are_off_for_good(tmp_path: Path, when: str) -> None:
    # GIVEN the switches on (priming, or a launch window) when torch.profiler takes CUPTI over: they may
    # not be switched off inside the gap, and switched on after it they would record nothing and slow launches
    fake = fk.FakeCupti()
    p = Probe(ProbeSettings(socket="", tee=str(tmp_path / "t.gfp"), flush_ms=1000, watermark_ms=60_000), fake,
              discover_devices=False)
    assert p.start()
    try:
        if when == "window":
            fake.alloc(0x1000, 4096)
            _wait(lambda: not p.sender.windows.launch_priming)
            p.sender.open_kernel_window(60_000, 3, "launches")
        assert fake.launch_switch[-1] is True
        p.takeover_begin()
        p.takeover_end([], list)
        _wait(lambda: not p.in_gap)
        # THEN they are off, and no launch window opens any more
        assert fake.launch_switch[-1] is False and not p.sender.windows.launch_windows_ok
        if when == "window":
            _wait(lambda: p.sender.windows.kernel_window is None, 0.2)
        p.sender.windows.kernel_window = None  # whatever was open: a new request must be refused
        p.sender.open_kernel_window(50, 4, "launches")
        assert p.sender.windows.kernel_window is None and fake.launch_switch[-1] is False
        assert p.counters["kernel_windows_refused"] >= 1
    finally:
        p.stop()


@contextlib.contextmanager
def _cuda_up(tmp_path: Path, fake: fk.FakeCupti, **settings: Any) -> Iterator[Probe]:
    """A probe over ``fake`` recording to ``tmp_path/t.gfp``, started before CUDA, once CUDA is up."""
    p = Probe(ProbeSettings(socket="", tee=str(tmp_path / "t.gfp"), **settings), fake, discover_devices=False)
    assert p.start()
    try:
        fake.alloc(0x1000, 4096)
        _wait(lambda: not p.sender.windows.launch_priming)
        yield p
    finally:
        p.stop()


def test_a_launch_window_closes_itself_once_it_holds_the_steps_the_daemon_asked_for(tmp_path: Path) -> None:
    # GIVEN a launch window leased for 10 s that should hold 2 whole steps (a step ends at a wait for the
    # GPU with launches since the wait before it): every launch costs the workload while the switches are
    # on, and the daemon would read the steps only a watermark and a control round trip later
    fake = fk.FakeCupti()
    with _cuda_up(tmp_path, fake, flush_ms=10) as p:  # CUDA is up: the priming has ended
        p.sender.open_kernel_window(10_000, 9, "launches", steps=2)
        opened = time.monotonic()
        t = time.time_ns()
        # WHEN the workload runs: the end of a step begun before the window, then steps of 3 launches and a
        # wait; a second wait with nothing launched since the first ends no step
        calls = [211, 131, 131] + [211, 211, 211, 131] * 2
        for i, cbid in enumerate(calls):
            assert fake.host_call(cbid, start=t + i * 100, end=t + i * 100 + 50)
        _wait_closed(p)
        # THEN the window closed at its second whole step, long before its lease
        assert p.sender.windows.kernel_window is None and time.monotonic() - opened < 5.0
        assert fake.launch_switch == [True, False, True, False]
        # AND the daemon's renewal and close of that window, sent before it read the steps, open nothing
        p.sender.open_kernel_window(2_000, 9, "launches", steps=2)
        p.sender.open_kernel_window(1, 9, "launches", steps=2)
        assert p.sender.windows.kernel_window is None and fake.launch_switch == [True, False, True, False]
        # AND a later window (a new id) opens as usual, and one without a step bound keeps its lease
        p.sender.open_kernel_window(300, 10, "launches")
        assert p.sender.windows.kernel_window is not None and fake.launch_switch[-1] is True
        for i, cbid in enumerate([211, 131] * 4):
            assert fake.host_call(cbid, start=time.time_ns() + i, end=time.time_ns() + i + 10)
        time.sleep(0.15)
        assert p.sender.windows.kernel_window is not None  # four steps, no bound: open until its lease ends
        _wait_closed(p)
        st = p.status()
        assert st["launch_windows"] == 2 and st["launch_windows_counted"] == 1
    frames = list(iter_frames(TraceFile(tmp_path / "t.gfp").chunks()))
    closed = [f.json()["kernel_window"] for f in frames if f.type is FrameType.HEARTBEAT and "kernel_window" in f.json()]
    assert [(w["id"], w.get("closed")) for w in closed] == [(9, "counted"), (10, None)]
    api = np.concatenate([f.records() for f in frames if f.type is FrameType.BATCH and f.tag == RecordKind.API])
    assert (api["start"][: len(calls)] - t).tolist() == [i * 100 for i in range(len(calls))]


def test_a_launch_window_closes_itself_at_the_calls_the_daemon_asked_for_without_a_wait(tmp_path: Path) -> None:
    # GIVEN a program that launches and never waits for the GPU: no step ever ends
    fake = fk.FakeCupti()
    with _cuda_up(tmp_path, fake, flush_ms=10) as p:  # CUDA is up: the priming has ended
        p.sender.open_kernel_window(10_000, 4, "launches", steps=4, max_records=50)
        t = time.time_ns()
        for i in range(60):
            assert fake.host_call(211, start=t + i, end=t + i + 1)
        # THEN it closes at its calls' bound, not at its 10 s lease
        _wait_closed(p)
        assert p.sender.windows.kernel_window is None and p.status()["launch_windows_counted"] == 1


def test_a_counting_window_a_profiler_interrupted_forces_no_flushes_and_its_renewal_closes_it(tmp_path: Path) -> None:
    # GIVEN a launch window counting steps when torch.profiler takes CUPTI over and hands it back: the
    # switches are off for good, so nothing will ever be counted in it (found by review: it kept forcing
    # a flush ten times a second for as long as the daemon renewed it)
    fake = fk.FakeCupti()
    with _cuda_up(tmp_path, fake, flush_ms=1000, watermark_ms=60_000) as p:  # CUDA is up: the priming has ended
        p.sender.open_kernel_window(10_000, 3, "launches", steps=4)
        assert p.sender.windows.counting()
        p.takeover_begin()
        p.takeover_end([], list)
        _wait(lambda: not p.in_gap)
        # THEN it counts no more: no forced flush every 0.1 s
        assert not p.sender.windows.counting()
        flushes = fake.flushes
        time.sleep(0.5)
        assert fake.flushes - flushes <= 1, fake.flushes - flushes
        # AND the daemon's next renewal closes it rather than holding it open
        p.sender.open_kernel_window(2_000, 3, "launches", steps=4)
        assert p.sender.windows.kernel_window is None


def test_no_forced_flushes_for_a_count_while_kernel_records_are_on(tmp_path: Path) -> None:
    # GIVEN kernel records always on: a forced flush writes the kernels still running without times (H100,
    # 2026-12-06), so the count waits for the watermark's flush as before
    fake = fk.FakeCupti()
    with _cuda_up(tmp_path, fake, flush_ms=1000, watermark_ms=60_000, kernels=True) as p:  # CUDA is up: the priming has ended
        p.sender.open_kernel_window(10_000, 5, "launches", steps=4)
        assert p.sender.windows.kernel_window is not None and not p.sender.windows.counting()
        flushes = fake.flushes
        time.sleep(0.5)
        assert fake.flushes - flushes <= 1, fake.flushes - flushes


def test_a_counting_window_stays_open_for_the_shortest_window_the_daemon_asked_for(tmp_path: Path) -> None:
    fake = fk.FakeCupti()
    with _cuda_up(tmp_path, fake, flush_ms=10) as p:  # CUDA is up: the priming has ended
        p.sender.open_kernel_window(10_000, 6, "launches", steps=1, min_ms=700)
        opened = time.monotonic()
        t = time.time_ns()
        for i, cbid in enumerate([211, 131, 211, 131, 211, 131]):
            assert fake.host_call(cbid, start=t + i, end=t + i + 10)
        time.sleep(0.4)
        assert p.sender.windows.kernel_window is not None  # counted, but younger than min_ms
        _wait_closed(p)
        assert 0.65 < time.monotonic() - opened < 3.0 and p.status()["launch_windows_counted"] == 1


def test_a_new_connection_closes_the_last_daemons_window_and_holds_none_of_its_ids_against_the_new_one(
        tmp_path: Path) -> None:
    # GIVEN a launch window of the last daemon's, counting (found by review: it could close at its count
    # after the reconnect and then make the probe ignore the new daemon's window of the same id)
    fake = fk.FakeCupti()
    with _cuda_up(tmp_path, fake, flush_ms=1000, watermark_ms=60_000) as p:  # CUDA is up: the priming has ended
        p.sender.open_kernel_window(2_000, 1, "launches", steps=2)
        # WHEN the probe connects to a new daemon
        p.sender._on_connect()
        # THEN that window is closed there, not left to count
        assert p.sender.windows.kernel_window is None and fake.launch_switch[-1] is False
        assert p.sender.windows.counted_id == 0
        # AND the new daemon's first window (id 1 again) opens
        p.sender.open_kernel_window(2_000, 1, "launches", steps=2)
        assert p.sender.windows.kernel_window is not None and fake.launch_switch[-1] is True
