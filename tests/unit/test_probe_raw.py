"""The raw delivery: CUPTI's buffers read as bytes, against cupti-python's record objects.

The fake CUPTI (tests/probe_fakes.py) writes the same record objects either as
objects (cupti-python's callbacks) or as C structs in cupti-python's layouts
into buffers handed out by the probe's real ctypes ``requested`` thunk and
returned through its ``completed`` thunk. What reaches the wire must be the same.
"""

from __future__ import annotations

import ctypes
import gc
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gpufootprint.probe import nativecallbacks
from gpufootprint.probe.core import Probe
from gpufootprint.probe.rawcallbacks import RawDelivery, view
from gpufootprint.probe.settings import ProbeSettings
from gpufootprint.records import RecordKind
from gpufootprint.wire import cupti_layout
from gpufootprint.wire.framing import FrameType, iter_frames
from gpufootprint.wire.sources import TraceFile

from tests import probe_fakes as fk


def _workload_records() -> list[Any]:
    """Every kind the probe reads, with the fields that matter set (built once, emitted to both fakes)."""
    t = time.time_ns()
    recs = [fk.memory_record(1, 0x1000 + i * 0x100, 256 + i, ts=t + i) for i in range(300)]
    recs += [fk.memory_record(2, 0x1000 + i * 0x100, 256 + i, ts=t + 1000 + i) for i in range(0, 300, 2)]
    recs.append(fk.memory_record(1, 0x9000_0000, 1 << 20, ts=t + 2000, is_async=1, pool_type=1,
                                 pool_addr=0x8000_0000, pool_size=4 << 20, pool_used=1 << 20, stream=3))
    recs.append(fk.pool_record(1, 0x8000_0000, 4 << 20, 1 << 20, ts=t + 2001))
    for n in (64, 4096, 1 << 20):
        recs += [fk.memcpy_record(n, start=t + 3000 + n), fk.memset_record(n)]
    recs.append(fk.peer_copy_record(1 << 16, 0, 1))
    recs += [fk.kernel_record(name, graph=5, node=9) for name in ("gemm", "softmax", "gemm", "a" * 300)]
    # managed memory: the probe configures the unified-memory counters once it sees this allocation
    recs.append(fk.memory_record(1, 0x7000_0000, 64 << 20, ts=t + 4000, mk=5))
    return recs


_RECORDS = _workload_records()
_UM_RECORDS = [fk.um_record(1, 4096, 0x7000), fk.um_record(2, 8192, 0x7000)]


def _workload(fake: fk.FakeCupti, probe: Probe) -> None:
    for rec in _RECORDS:
        fake.emit(rec)
    # a launch window: launches and waits of both APIs become API records (one call the window does not want)
    probe.sender.open_kernel_window(60_000, 1, "launches")
    t = time.time_ns() + 1_000_000  # inside the window (it keeps the calls made while it is open)
    for i, (cbid, kind) in enumerate([(211, fk.RUNTIME), (211, fk.RUNTIME), (307, fk.DRIVER), (165, fk.RUNTIME),
                                      (652, fk.DRIVER), (131, fk.RUNTIME), (311, fk.RUNTIME), (17, fk.DRIVER)]):
        assert fake.host_call(cbid, kind=kind, start=t + i * 100, end=t + i * 100 + 50, tid=7)
    probe.mark("managed")  # a flush: the probe has seen the managed allocation
    assert fake.um_configurations == 1
    for rec in _UM_RECORDS:
        fake.emit(rec)


def _run(tmp_path: Path, fake: fk.FakeCupti, name: str, **settings: Any) -> tuple[Probe, dict[RecordKind, list[Any]],
                                                                                   dict[int, str]]:
    out = tmp_path / f"{name}.gfp"
    probe = Probe(ProbeSettings(socket="", tee=str(out), kernels=True, flush_ms=10, copies="always", **settings), fake,
                  discover_devices=False)
    assert probe.start()
    try:
        _workload(fake, probe)
        probe.mark("end")
    finally:
        probe.stop()
    records: dict[RecordKind, list[Any]] = {}
    names: dict[int, str] = {}
    for f in iter_frames(TraceFile(out).chunks()):
        if f.type is FrameType.BATCH:
            records.setdefault(RecordKind(f.tag), []).extend(f.records())
        elif f.type is FrameType.STRINGS:
            names.update({int(k): v for k, v in f.json().items()})
    return probe, records, names


def test_raw_delivery_writes_the_same_records_as_cupti_pythons_objects(tmp_path: Path) -> None:
    # GIVEN the same workload through cupti-python's objects and through raw buffers
    _, objects, obj_names = _run(tmp_path, fk.FakeCupti(buffer_records=37), "objects", bulk_pack=False)
    raw_fake = fk.FakeRawCupti(shuffle=True)
    probe, raw, raw_names = _run(tmp_path, raw_fake, "raw", raw_verify_walk=True, cupti_buffer_bytes=4096)
    st = probe.status()
    # THEN the raw path was used, walked every buffer as CUPTI's own walk does ...
    assert st["delivery"] == "raw" and raw_fake.buffers_delivered > 5
    assert st["raw_buffers"] == raw_fake.buffers_delivered == st["raw_walks_verified"]
    assert st["raw_walk_mismatches"] == st["raw_walk_fallbacks"] == st["packer_bad_records"] == 0
    # ... and every record of every kind is the same, field for field (kernel names by name)
    assert set(raw) == set(objects) == set(RecordKind)
    for kind in RecordKind:
        a, b = np.array(objects[kind]), np.array(raw[kind])
        a_names, b_names = [""] * len(a), [""] * len(b)
        if kind is RecordKind.KERNEL:  # ids are per probe: compare the names they stand for
            a_names = [obj_names[int(i)] for i in a["name_id"]]
            b_names = [raw_names[int(i)] for i in b["name_id"]]
            a["name_id"] = b["name_id"] = 0
        if kind is RecordKind.API:  # each run's launch window is at its own time: compare from its first call
            for x in (a, b):
                t0 = x["start"].min()
                x["start"] -= t0
                x["end"] -= t0
        assert (sorted(zip((r.tobytes() for r in a), a_names, strict=True))
                == sorted(zip((r.tobytes() for r in b), b_names, strict=True))), kind
    assert len(raw[RecordKind.MEMORY]) == 452
    api = np.sort(np.array(raw[RecordKind.API]), order="start")  # the launch window's 8 calls, role and API each
    assert api["role"].tolist() == [1, 1, 1, 2, 1, 2, 3, 2] and api["domain"].tolist() == [5, 5, 4, 5, 4, 5, 5, 4]
    assert (api["tid"] == 7).all() and api["cbid"].tolist() == [211, 211, 307, 165, 652, 131, 311, 17]
    assert sorted(raw_names.values()) == sorted({"gemm", "softmax", "a" * 300})
    # every buffer went back to the pool
    assert probe.sender.raw is not None and probe.sender.raw.outstanding == 0 and st["raw_records"] == sum(map(len, raw.values()))


def test_a_buffers_view_is_its_valid_bytes_and_does_not_make_a_ctypes_type_for_each_length() -> None:
    """CUPTI hands buffers back with as many lengths as their records take; ``ctypes.c_uint8 * n`` made
    a new type for each (about 10 us in the sender's thread, GIL held, and garbage for the collector)."""
    raw = (ctypes.c_uint8 * 65_536).from_buffer_copy(np.random.default_rng(3).integers(0, 256, 65_536, np.uint8))
    address = ctypes.addressof(raw)
    types = set()
    for valid in (*range(0, 65_537, 8), 1, 4097, 65_535):
        v = view(address, valid)
        assert len(v) == valid and v.tobytes() == bytes(raw)[:valid], valid
        types.add(type(v.obj))
    assert len(types) <= 5, len(types)  # one per power-of-two size from 4 KiB to 64 KiB
    # and they are kept: no view alive, a collection does not take them (else each is made again)
    kept = weakref.ref(type(view(address, 100).obj))
    types.clear()
    gc.collect()
    assert kept() is not None


def test_a_buffer_that_cannot_be_walked_falls_back_to_cuptis_walk_and_loses_nothing() -> None:
    fake = fk.FakeRawCupti()
    probe = Probe(ProbeSettings(socket="", flush_ms=10, copies="always"), fake, discover_devices=False)
    assert probe.start()
    try:
        saved = dict(cupti_layout._SIZES)
        # as if CUPTI wrote a kind we cannot size: neither our walk (Python or C) nor its table knows it
        cupti_layout._SIZES.pop(cupti_layout.MEMSET)
        nativecallbacks._WALK_SIZES[cupti_layout.MEMSET] = 0
        try:
            fake.alloc(0x1000, 512)
            fake.emit(fk.memset_record(64))
            fake.alloc(0x2000, 1024)
            probe.mark("m")
        finally:
            cupti_layout._SIZES.update(saved)
            nativecallbacks._WALK_SIZES[cupti_layout.MEMSET] = saved[cupti_layout.MEMSET]
    finally:
        probe.stop()
    st = probe.status()
    assert st["raw_walk_fallbacks"] >= 1 and st["raw_buffers_unreadable"] == 0
    assert probe.sender.table.live_by_kind(0) == {"device": 1536}


def test_walk_refuses_unknown_kinds_and_records_past_the_end() -> None:
    rec = np.zeros(1, dtype=cupti_layout.RAW_DTYPES[cupti_layout.MEMSET])
    body = bytearray(rec.tobytes())
    body[0:4] = cupti_layout.MEMSET.to_bytes(4, "little")
    two = bytes(body) * 2
    assert cupti_layout.walk(two, len(two)) == {cupti_layout.MEMSET: [0, 88]}
    assert cupti_layout.walk(two, len(two) - 8) is None  # the second record runs past the valid bytes
    bad = bytearray(two)
    bad[88:92] = (999).to_bytes(4, "little")
    assert cupti_layout.walk(bytes(bad), len(bad)) is None
    assert cupti_layout.walk(b"", 0) == {}


def test_the_buffer_pool_is_bounded_and_cupti_counts_what_did_not_fit(tmp_path: Path) -> None:
    # GIVEN a pool of 4 buffers and a sender that has not yet given any back
    got: list[tuple[int, int]] = []
    d = RawDelivery(4096, 4, lambda a, n: got.append((a, n)))
    addrs = []
    for _ in range(6):
        buf, size, most = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_size_t()
        d._req(ctypes.byref(buf), ctypes.byref(size), ctypes.byref(most))
        addrs.append((buf.value, size.value))
    # THEN 4 were handed out (8-byte aligned), then none: CUPTI drops those records and counts them
    assert [s for _, s in addrs] == [4096] * 4 + [0, 0]
    assert all(a is not None and a % 8 == 0 for a, _ in addrs[:4]) and addrs[4][0] is None
    assert d.allocated == 4 and d.refused == 2
    # a completed buffer reaches the sender; an empty one goes straight back; a foreign one is left alone
    d._cmp(None, 0, addrs[0][0], 4096, 100)
    d._cmp(None, 0, addrs[1][0], 4096, 0)
    d._cmp(None, 0, 12345678, 4096, 100)
    assert got == [(addrs[0][0], 100)] and d.foreign == 1 and d.outstanding == 3
    d.give_back(addrs[0][0])
    buf, size, most = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_size_t()
    d._req(ctypes.byref(buf), ctypes.byref(size), ctypes.byref(most))
    assert buf.value in (addrs[0][0], addrs[1][0]) and d.allocated == 4


def test_records_cupti_dropped_in_a_contexts_own_queue_are_counted(tmp_path: Path) -> None:
    # GIVEN buffers that belong to a context's queue (not CUPTI's global one) and a pool of 4
    fake = fk.FakeRawCupti()
    fake.queue = (0x5A5A000, 7)
    probe = Probe(ProbeSettings(socket="", raw_buffers=4, cupti_buffer_bytes=4096, flush_ms=10), fake,
                  discover_devices=False)
    assert probe.start()
    try:
        # WHEN no buffer comes back while CUPTI writes 200 records (4 buffers hold 4 x 32 of them)
        assert probe.sender.raw is not None
        held: list[int] = []
        give_back = probe.sender.raw.give_back
        probe.sender.raw.give_back = held.append  # type: ignore[method-assign]
        for i in range(200):
            fake.alloc(0x1000 + i * 0x100, 256)
        fake.flush(True)
        probe.sender.raw.give_back = give_back  # type: ignore[method-assign]
        probe.mark("end")
        for address in held:
            give_back(address)
    finally:
        probe.stop()
    st = probe.status()
    # THEN the drops CUPTI counted on that queue reach the probe's counter (the global queue has none)
    assert st["raw_records"] == 128 and st["raw_queues"] == 1, st
    assert st["cupti_dropped_records"] == 72 and fake.refused_records == 0, st


def test_a_callback_that_fails_inside_never_raises_into_cupti() -> None:
    def boom(address: int, valid: int) -> None:
        raise RuntimeError("sender queue broke")

    d = RawDelivery(4096, 4, boom)
    buf, size, most = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_size_t()
    d._req(ctypes.byref(buf), ctypes.byref(size), ctypes.byref(most))
    d._cmp(None, 0, buf.value, 4096, 64)  # would print a traceback from ctypes if it raised
    assert d.errors == 1


@pytest.mark.parametrize("delivery", ["raw", "objects"])
def test_the_profiler_hand_over_re_registers_the_same_delivery(tmp_path: Path, delivery: str) -> None:
    # GIVEN a probe on the raw-capable fake, asked for one delivery or the other
    fake = fk.FakeRawCupti()
    probe = Probe(ProbeSettings(socket="", flush_ms=10, delivery=delivery, torch_hook=False), fake,
                  discover_devices=False)
    assert probe.start()
    try:
        fake.alloc(0x1000, 100)
        probe.takeover_begin()
        fake.register(lambda: (0, 0), lambda recs: None)  # the profiler takes CUPTI
        probe.takeover_end([], list)
        fake.alloc(0x2000, 200)
        probe.mark("after")
    finally:
        probe.stop()
    # THEN the probe took CUPTI back with the same delivery and saw the allocation after the gap
    assert (fake.delivery is not None) == (delivery == "raw")
    assert probe.status()["delivery"] == delivery
    assert probe.sender.table.live_by_kind(0) == {"device": 300}


def test_records_cupti_stamped_beyond_2_63_are_counted_in_the_probe_not_sent() -> None:
    fake = fk.FakeRawCupti()
    sent: list[Any] = []
    probe = Probe(ProbeSettings(socket="", flush_ms=10, copies="always"), fake, discover_devices=False)
    probe.sender._emit = lambda frame, **kw: sent.append(frame) or True  # type: ignore[method-assign]
    assert probe.start()
    try:
        fake.emit(fk.memset_record(64))
        bad = fk.memset_record(128)
        bad.start = bad.end = (1 << 64) - 1  # as CUPTI delivered a few on the H200
        fake.emit(bad)
        fake.alloc(0x1000, 512)
        probe.mark("m")
    finally:
        probe.stop()
    st = probe.status()
    assert st["cupti_bad_timestamps"] == 1
    assert st["records_sent"] == 2 and probe.sender.table.live_by_kind(0) == {"device": 512}


def test_walk_and_gather_agree_with_a_record_by_record_reading_on_mixed_and_uniform_buffers() -> None:
    """The vectorised paths (a buffer of one kind; runs of one kind inside a mixed buffer; views
    per run) give exactly what reading one record after another gives."""
    import random

    import numpy as np

    rng = random.Random(5)
    sizes = {k: cupti_layout.RAW_DTYPES[k].itemsize for k in (cupti_layout.MEMORY2, cupti_layout.MEMORY_POOL,
                                                            cupti_layout.MEMSET)}
    for trial in range(60):
        layout: list[int] = []
        while sum(sizes[k] for k in layout) < 40_000:
            if trial % 3 == 0:
                layout.append(cupti_layout.MEMORY2)  # uniform
            else:
                k = rng.choice([cupti_layout.MEMORY_POOL, cupti_layout.MEMSET])
                layout.extend([cupti_layout.MEMORY2] * rng.choice([1, 3, 9, 40, 200]) + [k] * rng.choice([1, 2, 12]))
        buf = bytearray(sum(sizes[k] for k in layout))
        expect: dict[int, list[int]] = {}
        off = 0
        for i, k in enumerate(layout):
            buf[off:off + 4] = k.to_bytes(4, "little", signed=True)
            buf[off + 16:off + 24] = (i + 1).to_bytes(8, "little")  # something to tell records apart
            expect.setdefault(k, []).append(off)
            off += sizes[k]
        got = cupti_layout.walk(memoryview(buf), len(buf))
        assert got == expect, trial
        u8 = np.frombuffer(bytes(buf), dtype=np.uint8)
        for k, offs in expect.items():
            fancy = u8[np.asarray(offs)[:, None] + np.arange(sizes[k])].view(cupti_layout.RAW_DTYPES[k]).reshape(-1)
            got_rows = cupti_layout.gather(u8, k, offs)
            assert len(got_rows) == len(offs)
            for name in fancy.dtype.names or ():
                assert np.array_equal(got_rows[name], fancy[name]), (trial, k, name)


def test_an_idle_senders_wakes_are_its_watermarks_and_heartbeats_and_a_completed_buffer_wakes_it_at_once(
        tmp_path: Path) -> None:
    # GIVEN a probe with raw delivery in period mode: CUPTI's thread completes buffers by itself; the
    # sender forces a flush (and a watermark) every 400 ms and sends a heartbeat every 400 ms
    fake = fk.FakeRawCupti()
    probe = Probe(ProbeSettings(socket="", tee=str(tmp_path / "t.gfp"), flush_ms=10, watermark_ms=400,
                                heartbeat_ms=400), fake, discover_devices=False)
    assert probe.start()
    try:
        time.sleep(0.2)  # start-up wakes (the first flush, the priming's end) are over
        # WHEN the process stays idle for 1.2 s
        before = probe.status()["sender_wakeups"]
        time.sleep(1.2)
        idle = probe.status()["sender_wakeups"] - before
        # THEN the sender woke for its flushes and heartbeats only (about 6), not at the 10 ms drain cadence (120)
        assert 2 <= idle <= 15, idle
        # WHEN CUPTI's thread completes a buffer between two forced flushes
        buffers = probe.status()["raw_buffers"]
        fake.deliver([fk.memory_record(1, 0x4000, 4096)])
        # THEN the sender reads it at once, not at the next forced flush (up to 400 ms away)
        deadline = time.monotonic() + 0.15
        while probe.status()["raw_buffers"] == buffers and time.monotonic() < deadline:
            time.sleep(0.005)
        assert probe.status()["raw_buffers"] == buffers + 1
    finally:
        probe.stop()


def _idle_wakes_after_a_mark(tmp_path: Path, **settings: Any) -> int:
    """Wakes of an idle raw-delivery probe's sender in 1.2 s, once a mark 0.2 s after a heartbeat has moved
    its forced flushes (watermarks, every 400 ms) off its heartbeats (every 400 ms)."""
    fake = fk.FakeRawCupti()
    probe = Probe(ProbeSettings(socket="", tee=str(tmp_path / "t.gfp"), flush_ms=10, watermark_ms=400,
                                heartbeat_ms=400, **settings), fake, discover_devices=False)
    assert probe.start()
    try:
        time.sleep(0.6)  # past start-up and a heartbeat
        probe.mark("realign")  # an urgent flush: the next watermark is due 400 ms from here
        before = probe.status()["sender_wakeups"]
        time.sleep(1.2)
        return int(probe.status()["sender_wakeups"] - before)
    finally:
        probe.stop()


def test_an_idle_sender_does_its_heartbeat_and_its_watermark_in_one_wake(tmp_path: Path) -> None:
    # Each wake of the sender takes the GIL from the workload's threads once: a heartbeat due within half
    # its period goes out at a watermark's wake (and the other way round), so the two share one wake
    # GIVEN an idle probe whose watermarks a mark moved off its heartbeats
    coalesced = _idle_wakes_after_a_mark(tmp_path / "a")
    apart = _idle_wakes_after_a_mark(tmp_path / "b", coalesce_wakes=False)
    # THEN it wakes about once per 400 ms (3), where kept apart they wake about twice as often (6)
    assert coalesced <= 4, (coalesced, apart)
    assert apart >= coalesced + 2, (coalesced, apart)


def _idle_frames(tmp_path: Path, seconds: float, **settings: Any) -> dict[FrameType, int]:
    """HEARTBEAT and WATERMARK frames an idle raw-delivery probe wrote in ``seconds``."""
    tmp_path.mkdir()
    fake = fk.FakeRawCupti()
    probe = Probe(ProbeSettings(socket="", tee=str(tmp_path / "t.gfp"), **settings), fake, discover_devices=False)
    assert probe.start()
    try:
        time.sleep(seconds)
    finally:
        probe.stop()
    counts = {FrameType.HEARTBEAT: 0, FrameType.WATERMARK: 0}
    for f in iter_frames(TraceFile(tmp_path / "t.gfp").chunks()):
        if f.type in counts:
            counts[f.type] += 1
    return counts


def test_shared_wakes_never_send_heartbeats_more_often_than_their_period(tmp_path: Path) -> None:
    # GIVEN forced flushes every 50 ms (flush_mode forced; a launch window's count and a waiting OOM force them
    # as often in period mode) and heartbeats every 400 ms, for 2 s
    cfg = {"flush_mode": "forced", "flush_ms": 50, "heartbeat_ms": 400}
    coalesced = _idle_frames(tmp_path / "a", 2.0, **cfg)[FrameType.HEARTBEAT]
    apart = _idle_frames(tmp_path / "b", 2.0, coalesce_wakes=False, **cfg)[FrameType.HEARTBEAT]
    # THEN sharing a wake moves a heartbeat earlier, but does not make them come twice as often (5 or 6 in 2 s)
    assert coalesced <= apart + 1, (coalesced, apart)


def test_shared_wakes_never_make_forced_flushes_more_often_than_their_period(tmp_path: Path) -> None:
    # GIVEN watermarks every 800 ms and heartbeats every 200 ms (period mode), for 2.4 s
    cfg = {"watermark_ms": 800, "heartbeat_ms": 200}
    coalesced = _idle_frames(tmp_path / "a", 2.4, **cfg)[FrameType.WATERMARK]
    apart = _idle_frames(tmp_path / "b", 2.4, coalesce_wakes=False, **cfg)[FrameType.WATERMARK]
    # THEN each forced flush (a CUPTI flush and a watermark) may share a heartbeat's wake, but they come no more
    # often than every 800 ms (3 or 4 in 2.4 s)
    assert coalesced <= apart + 1, (coalesced, apart)
