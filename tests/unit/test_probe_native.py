"""The raw delivery's C buffer callbacks (probe/native/cuptibuf.c, probe/nativecallbacks.py).

Real C threads (tests/native/cupti_threads.c, built here with the system's C compiler, the one that
built the library at install) call the callbacks as CUPTI does: many at once, while a Python thread
holds the GIL, and under a lock that thread waits for. The probe end to end runs on them by default
(every raw-delivery test with the fake CUPTI calls them); here, what only C callbacks can promise.
"""

from __future__ import annotations

import ctypes
import os
import random
import select
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gpufootprint.probe import nativecallbacks
from gpufootprint.probe.core import Probe
from gpufootprint.probe.nativecallbacks import NativeDelivery
from gpufootprint.probe.rawcallbacks import RawDelivery
from gpufootprint.probe.settings import ProbeSettings
from gpufootprint.wire import cupti_layout

from tests import probe_fakes as fk
from tests.native import shim as native_shim

ROOT = Path(__file__).resolve().parents[2]


def _compiler() -> str:
    cc = native_shim.compiler()
    assert cc, "no C compiler: README's install builds the probe's C callbacks with one, and these tests need it"
    return cc


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _compiler()
    return native_shim.build(tmp_path_factory.mktemp("shim"))


def _eventfd_count(fd: int) -> int:
    try:
        return int(os.eventfd_read(fd))
    except BlockingIOError:
        return 0


def test_the_install_built_the_library_and_it_loads() -> None:
    """README's install compiles it (setup.py); where a C compiler exists a missing library is a build bug."""
    _compiler()
    lib, why = nativecallbacks.load()
    assert lib is not None, why
    assert nativecallbacks.LIBRARY.name == "libgfp-cuptibuf.so"


def test_the_pool_hands_out_aligned_buffers_up_to_its_bound_and_refuses_past_it() -> None:
    fd = nativecallbacks.eventfd()
    assert fd is not None
    d = NativeDelivery(4096, 3, fd)
    got = []
    for _ in range(4):
        buf, size, most = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_size_t()
        d._req(ctypes.byref(buf), ctypes.byref(size), ctypes.byref(most))
        got.append((buf.value, size.value, most.value))
    assert [g[1] for g in got] == [4096, 4096, 4096, 0]
    assert all(g[0] % 8 == 0 for g in got[:3]) and got[3][0] is None
    assert d.refused == 1 and d.allocated == 3 and d.requested == 4
    assert d.outstanding == 3
    # completed: queued in order, clipped to the buffer's size; an empty one goes straight back
    d._cmp(None, 0, got[1][0], 4096, 100)
    d._cmp(0x1234, 7, got[0][0], 4096, 1 << 20)
    d._cmp(None, 0, got[2][0], 4096, 0)
    assert _eventfd_count(fd) == 2  # one wake a buffer to read, none for the empty one
    assert d.take() == [(got[1][0], 100), (got[0][0], 4096)]
    assert d.take() == []
    assert d.queues == {(0, 0), (0x1234, 7)}
    s = d.stats()
    assert (s["completed"], s["empty"], s["free"], s["queued"]) == (3, 1, 1, 0)
    # given back: handed out again before any new allocation
    d.give_back(got[1][0])
    d.give_back(got[0][0])
    buf, size, most = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_size_t()
    d._req(ctypes.byref(buf), ctypes.byref(size), ctypes.byref(most))
    assert buf.value in {got[0][0], got[1][0], got[2][0]} and d.allocated == 3
    os.close(fd)


def test_a_buffer_that_is_not_the_pools_is_counted_and_left_alone() -> None:
    """Another tool's buffer (it registered its own callbacks, then we ours): never read, never freed."""
    d = NativeDelivery(4096, 4, -1)
    other = ctypes.create_string_buffer(64)
    d._cmp(None, 0, ctypes.addressof(other), 64, 64)
    d._cmp(None, 0, None, 0, 0)
    assert d.foreign == 2 and d.take() == []
    d.give_back(ctypes.addressof(other))  # not ours: refused, the free list untouched
    assert d.stats()["free"] == 0


def test_eight_c_threads_churning_lose_and_duplicate_no_buffer_while_the_sender_takes(shim: Path) -> None:
    """8 threads x 5,000 request/complete cycles against a pool of 16, a Python thread taking and giving
    back meanwhile: every buffer completed is taken exactly once, with the contents its thread wrote,
    and every request either got a buffer or was refused (and counted)."""
    lib = ctypes.CDLL(str(shim))  # the GIL released while the C threads run
    lib.run_threads.restype = ctypes.c_int
    d = NativeDelivery(64, 16, -1)
    seen: Counter[tuple[int, int]] = Counter()
    done = threading.Event()

    def sender() -> None:
        while True:
            finished = done.is_set()
            for address, valid in d.take():
                assert valid == 16
                words = (ctypes.c_uint64 * 2).from_address(address)
                seen[(int(words[0]), int(words[1]))] += 1
                d.give_back(address)
            if finished:
                return
            time.sleep(0.0002)

    t = threading.Thread(target=sender)
    t.start()
    refused = lib.run_threads(d._req, d._cmp, 8, 5000)
    done.set()
    t.join()
    assert refused >= 0
    assert max(seen.values()) == 1
    assert len(seen) + refused == 8 * 5000 and len(seen) >= 16
    s = d.stats()
    assert s["refused"] == refused and s["completed"] == len(seen) and s["allocated"] <= 16
    assert s["free"] == s["allocated"] and s["queued"] == 0
    # (context, stream) as each thread completed on (a thread refused every time completes on none)
    assert d.queues <= {(0x1000 + t % 3, t % 2) for t in range(8)} and d.queues


# A Python thread holds the GIL (it called C through ctypes.PyDLL, as PyTorch's bindings hold it) and
# waits for C threads that are inside CUPTI's buffer callbacks. C callbacks finish; the ctypes thunks
# wait for the GIL for good. Run in a child: a deadlock is for good.
_HOLDS_GIL = r"""
import ctypes, sys
sys.path[:0] = [sys.argv[3]]
from gpufootprint.probe.nativecallbacks import NativeDelivery
from gpufootprint.probe.rawcallbacks import RawDelivery
shim = ctypes.PyDLL(sys.argv[2])  # PyDLL: the GIL stays held for the whole call
shim.run_threads.restype = ctypes.c_int
if sys.argv[1] == "c":
    d = NativeDelivery(4096, 8, -1)
else:
    d = RawDelivery(4096, 8, lambda address, valid: d.give_back(address))
print("refused", shim.run_threads(d._req, d._cmp, 4, 100), flush=True)
"""


def _in_child(script: str, *args: str, timeout: float = 10) -> subprocess.CompletedProcess[str] | None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "daemon"),
                                                        os.environ.get("PYTHONPATH", "")])}
    try:
        return subprocess.run([sys.executable, "-c", script, *args], check=False, cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def test_c_callbacks_run_on_threads_that_never_get_the_gil_and_python_ones_wait_for_it_for_good(
        shim: Path) -> None:
    c = _in_child(_HOLDS_GIL, "c", str(shim), str(ROOT / "daemon"))
    assert c is not None and c.returncode == 0, c
    assert c.stdout.split()[0] == "refused"
    assert _in_child(_HOLDS_GIL, "python", str(shim), str(ROOT / "daemon"), timeout=5) is None


def _allocations_through(cupti: fk.FakeRawCupti, n: int, **settings: Any) -> tuple[Probe, dict[str, Any]]:
    """A probe on ``cupti`` that sees ``n`` allocations and a mark; it and its status, stopped."""
    probe = Probe(ProbeSettings(socket="", flush_ms=10, heartbeat_ms=20, **settings), cupti, discover_devices=False)
    assert probe.start()
    try:
        t = time.time_ns()
        for i in range(n):
            cupti.emit(fk.memory_record(1, 0x1000 + i * 0x100, 256, ts=t + i))
        probe.mark("end")
        return probe, probe.status()
    finally:
        probe.stop()


def test_a_probe_runs_on_the_c_callbacks_by_default_and_says_so() -> None:
    cupti = fk.FakeRawCupti()
    probe, status = _allocations_through(cupti, 2000)
    assert isinstance(cupti.delivery, NativeDelivery)
    assert status["callbacks"] == "c" and status["native_callbacks"] == 1
    assert status["raw_records"] == 2000 and status["raw_callback_errors"] == 0
    assert probe.sender.hello["callbacks"] == "c"


def test_without_the_library_the_probe_warns_once_and_runs_on_the_ctypes_callbacks(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(nativecallbacks, "LIBRARY", nativecallbacks.LIBRARY.with_name("missing.so"))
    nativecallbacks.load.cache_clear()
    try:
        cupti = fk.FakeRawCupti()
        _, status = _allocations_through(cupti, 500)
    finally:
        nativecallbacks.load.cache_clear()
    assert type(cupti.delivery) is RawDelivery
    assert status["callbacks"] == "python" and status["native_callbacks"] == 0
    assert status["native_callbacks_unavailable"] == 1 and status["raw_records"] == 500
    warnings = [r.getMessage() for r in caplog.records if "C buffer callbacks unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "missing.so was not built" in warnings[0]


def test_the_setting_chooses_the_ctypes_callbacks() -> None:
    cupti = fk.FakeRawCupti()
    probe = Probe(ProbeSettings(socket="", flush_ms=10, native_callbacks=False), cupti, discover_devices=False)
    assert probe.start()
    probe.stop()
    assert type(cupti.delivery) is RawDelivery and probe.status()["native_callbacks_unavailable"] == 0


def test_after_stop_a_late_buffer_writes_to_no_file_that_reused_the_wake_up_fd() -> None:
    """CUPTI may complete a buffer after the probe stopped. The sender's eventfd is closed by then and its
    number may belong to another file of the program: the C callback must not write there."""
    cupti = fk.FakeRawCupti()
    probe = Probe(ProbeSettings(socket="", flush_ms=10), cupti, discover_devices=False)
    assert probe.start()
    delivery = cupti.delivery
    old_fd = probe.sender._wake.fd
    buf, size, most = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_size_t()
    delivery._req(ctypes.byref(buf), ctypes.byref(size), ctypes.byref(most))
    r, w = os.pipe()  # made before the eventfd closes, so that neither end takes its number
    probe.stop()
    os.dup2(w, old_fd)  # the closed eventfd's number is now another file's (a pipe's writing end)
    try:
        delivery._cmp(None, 0, buf.value, size.value, 16)
        assert select.select([r], [], [], 0.05)[0] == []  # nothing written to it
        assert delivery.take() == [(buf.value, 16)]  # the buffer itself is still queued, as any
        assert delivery.stats()["wake_errors"] == 0
    finally:
        for fd in (r, w, old_fd):
            os.close(fd)


# PyTorch's statistics under the allocator's mutex, holding the GIL, on the stepping thread, while another
# thread is in CUPTI's buffer callback under that mutex (tests/unit/test_probe_torch_numbers.py has the
# Python-callback form). Here the callback is called from C under glibc's loader lock, standing in for the
# mutex: the ctypes thunk waits for the GIL for good, the C callback returns.
_UNDER_LOCK = r"""
import ctypes, sys, threading, time
sys.path[:0] = [sys.argv[3]]
from gpufootprint.probe.nativecallbacks import NativeDelivery
from gpufootprint.probe.rawcallbacks import RawDelivery
VISIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
keeps_gil, frees_gil = ctypes.PyDLL(None), ctypes.CDLL(sys.argv[2])
d = NativeDelivery(4096, 8, -1) if sys.argv[1] == "c" else RawDelivery(4096, 8, lambda a, v: None)
t = threading.Thread(target=lambda: frees_gil.call_under_loader_lock(d._req, 500))
t.start()
time.sleep(0.1)  # the C thread holds the loader lock now, and waits 0.5 s before the callback
keeps_gil.dl_iterate_phdr(ctypes.cast(ctypes.CDLL(None).abs, VISIT), None)  # the statistics: lock, GIL held
t.join()
print("done", d.requested, flush=True)
"""


def test_a_c_callback_under_a_lock_the_gil_holder_waits_for_ends_and_a_python_one_never_does(shim: Path) -> None:
    c = _in_child(_UNDER_LOCK, "c", str(shim), str(ROOT / "daemon"))
    assert c is not None and c.returncode == 0, c
    assert c.stdout.split() == ["done", "1"]
    assert _in_child(_UNDER_LOCK, "python", str(shim), str(ROOT / "daemon"), timeout=5) is None


def test_two_pools_at_once_each_get_their_own_callbacks_and_buffers() -> None:
    """CUPTI's callbacks carry no pointer: each pool has its own pair of C entry points (a process registers
    one; the tests run a probe and a floor side by side, each with its own fake CUPTI)."""
    a, b = NativeDelivery(4096, 2, -1), NativeDelivery(4096, 2, -1)
    assert ctypes.cast(a._req, ctypes.c_void_p).value != ctypes.cast(b._req, ctypes.c_void_p).value
    bufs = []
    for d in (a, b):
        buf, size, most = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_size_t()
        d._req(ctypes.byref(buf), ctypes.byref(size), ctypes.byref(most))
        bufs.append(buf.value)
        d._cmp(None, 0, buf.value, 4096, 8)
    assert a.take() == [(bufs[0], 8)] and b.take() == [(bufs[1], 8)]
    b._cmp(None, 0, bufs[0], 4096, 8)  # a's buffer completed through b's callback: not b's to read
    assert b.foreign == 1 and b.take() == [] and a.foreign == 0


def _random_buffer(rng: random.Random, n: int) -> bytearray:
    """Records of the kinds the walk knows, mixed unevenly (runs, cycles, singles), as CUPTI writes them."""
    sizes = cupti_layout.walk_sizes()
    kinds = sorted(sizes)
    out = bytearray()
    while len(out) < n:
        k = rng.choice(kinds)
        for _ in range(rng.choice([1, 1, 1, 2, 5, 40])):
            rec = bytearray(rng.randbytes(sizes[k]))
            rec[0:4] = k.to_bytes(4, "little", signed=True)
            out += rec
    return out


def test_the_c_walk_gives_the_python_walks_answer_on_any_buffer() -> None:
    """The same offsets per kind, or None for both: mixed kinds, one kind, an unknown kind, a record cut off."""
    walker = nativecallbacks.Walker()
    rng = random.Random(7)
    cases = []
    for i in range(300):
        # past WALK_KEEPS_GIL_BYTES (every 50th) the walk goes through the handle that lets the GIL go
        buf = _random_buffer(rng, 2 << 20 if i % 50 == 1 else rng.choice([64, 4096, 65536]))
        if i % 10 == 3:  # a record cut off at the end
            buf = buf[:-rng.randint(1, 30)]
        if i % 10 == 7:  # a kind no walk knows, somewhere
            at = rng.randrange(0, len(buf) - 8, 8)
            buf[at:at + 4] = (9999).to_bytes(4, "little")
        cases.append(buf)
    walked = 0
    for buf in cases:
        raw = (ctypes.c_uint8 * len(buf)).from_buffer(buf)
        theirs = cupti_layout.walk(memoryview(buf), len(buf))
        ours = walker(ctypes.addressof(raw), len(buf))
        if theirs is None:
            assert ours is None
            continue
        walked += 1
        assert ours is not None and set(ours) == set(theirs)
        for kind, offs in theirs.items():
            assert list(ours[kind]) == list(offs), kind
    assert 100 < walked < 300  # both outcomes were tried


def test_the_c_walk_refuses_and_walks_the_edges_as_the_python_walk_does() -> None:
    """The edges the random buffers seldom reach: kinds not known below and past the size table, negative
    kinds, a buffer of 0-3 bytes, a kind cut off, a record ending exactly at ``valid``; and what a walk
    returned stays as it was after the next walk (the walker reuses its own arrays)."""
    walker = nativecallbacks.Walker()
    sizes = cupti_layout.walk_sizes()
    mem, rt = cupti_layout.MEMORY2, cupti_layout.RUNTIME

    def rec(kind: int, size: int) -> bytes:
        return kind.to_bytes(4, "little", signed=True) + bytes(size - 4)

    head = rec(mem, sizes[mem]) + rec(rt, sizes[rt])
    top = len(nativecallbacks._WALK_SIZES)
    cases = [(b"", 0), (b"\x31", 1), (b"\x31\x00", 2), (b"\x31\x00\x00", 3), (head, len(head)),
             (head + rec(mem, sizes[mem]), len(head) + sizes[mem]), (head + rec(mem, sizes[mem]), len(head) + 127),
             (head + b"\x05\x00\x00", len(head) + 3), (rec(rt, 40) + rec(mem, sizes[mem]), 168)]
    cases += [(head + rec(k, 216), len(head) + 216) for k in (-1, -(1 << 31), 0, 6, 48, top - 1, top, 1 << 30)]
    cases += [(head + rec(k, sizes[k]), len(head) + sizes[k]) for k in sizes]
    for body, valid in cases:
        buf = bytearray(body) + bytearray(16)  # readable past ``valid``: the walks must stop there anyway
        raw = (ctypes.c_uint8 * len(buf)).from_buffer(buf)
        theirs = cupti_layout.walk(memoryview(buf), valid)
        ours = walker(ctypes.addressof(raw), valid)
        assert (ours is None) == (theirs is None), (body[-216:], valid)
        if theirs is not None and ours is not None:
            assert {k: list(v) for k, v in ours.items()} == {k: list(v) for k, v in theirs.items()}, (body, valid)
    kept = []
    for body in (head * 3, rec(rt, 40) * 4, rec(mem, sizes[mem]) + rec(rt, 40) * 2):  # no array grows
        buf = bytearray(body)
        raw = (ctypes.c_uint8 * len(buf)).from_buffer(buf)
        kept.append(walker(ctypes.addressof(raw), len(buf)))
    assert kept[0] is not None and kept[1] is not None
    assert {k: list(v) for k, v in kept[0].items()} == {mem: [0, 168, 336], rt: [128, 296, 464]}
    assert {k: list(v) for k, v in kept[1].items()} == {rt: [0, 40, 80, 120]}


def test_a_probe_reading_buffers_of_mixed_kinds_walks_them_in_c_and_sends_what_the_python_walk_sends(
        tmp_path: Path) -> None:
    """Allocations with their calls' API records (PyTorch's cache off): the same frames either way."""
    from gpufootprint.records import RecordKind
    from gpufootprint.wire.framing import FrameType, iter_frames
    from gpufootprint.wire.sources import TraceFile

    sent = {}
    t = time.time_ns()
    for native in (True, False):
        cupti = fk.FakeRawCupti()
        out = tmp_path / f"walk-{native}.gfp"
        probe = Probe(ProbeSettings(socket="", tee=str(out), flush_ms=10, native_walk=native), cupti,
                      discover_devices=False)
        assert probe.start()
        try:
            for i in range(3000):
                cupti.emit(fk.memory_record(1, 0x1000 + (i % 50) * 0x100, 256, ts=t + 2 * i))
                if i % 3 == 0:
                    cupti.runtime_call(20, 0, start=t + 2 * i + 1, end=t + 2 * i + 1, tid=7)  # cudaMalloc, succeeded
            probe.mark("end")
            status = probe.status()
        finally:
            probe.stop()
        assert (status["native_walks"] > 0) == native and status["raw_records"] == 3000  # (API records uncounted)
        # the records (frames may split differently: the flushes' timing is the run's)
        sent[native] = sorted(tuple(int(v) for v in r) for f in iter_frames(TraceFile(out).chunks())
                              if f.type is FrameType.BATCH and f.tag == RecordKind.MEMORY for r in f.records())
    assert len(sent[True]) == 3000
    assert sent[True] == sent[False]


def test_the_api_records_return_values_read_in_place_are_the_gathered_ones() -> None:
    """The OOM watch's look at a buffer's API records reads only their return values, in place."""
    rng = random.Random(11)
    size = cupti_layout.API_RAW_DTYPE.itemsize
    rows = np.zeros(50, cupti_layout.API_RAW_DTYPE)
    rows["ret"] = [rng.choice([0, 0, 0, 2, 999]) for _ in range(50)]
    rows["cbid"] = 20
    buf = np.zeros(50 * size + 64, np.uint8)
    offsets = np.arange(50, dtype=np.intp) * size + 8
    for i, off in enumerate(offsets):
        buf[off:off + size] = rows[i:i + 1].view(np.uint8)
    assert cupti_layout.API_RAW_DTYPE.fields["ret"][1] == cupti_layout.API_RET_OFFSET
    got = cupti_layout.api_returns(buf, offsets[::3])
    assert list(got) == list(cupti_layout.gather(buf, cupti_layout.RUNTIME, offsets[::3])["ret"])
    assert list(cupti_layout.api_returns(buf, cupti_layout.Runs([range(8, 8 + 50 * size, size)]))) == list(rows["ret"])


def test_a_pool_made_for_a_registration_that_failed_is_retired_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Raw delivery given up at start (CUPTI refused the callbacks): the pool made for it is no longer the
    probe's delivery, and at stop its eventfd is still retired before it closes."""
    cupti = fk.FakeRawCupti()
    made: list[NativeDelivery] = []
    monkeypatch.setattr(cupti, "register_raw", lambda delivery: made.append(delivery) or False)
    probe = Probe(ProbeSettings(socket="", flush_ms=10), cupti, discover_devices=False)
    assert probe.start()
    assert probe.sender.raw is None and len(made) == 1  # cupti-python's objects from then on
    pool, old_fd = made[0], probe.sender._wake.fd
    buf, size, most = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_size_t()
    pool._req(ctypes.byref(buf), ctypes.byref(size), ctypes.byref(most))
    r, w = os.pipe()
    probe.stop()
    os.dup2(w, old_fd)
    try:
        pool._cmp(None, 0, buf.value, size.value, 16)
        assert select.select([r], [], [], 0.05)[0] == []
    finally:
        for fd in (r, w, old_fd):
            os.close(fd)


def test_a_library_of_another_build_is_refused_with_its_reason(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A stale library beside newer Python (an editable tree not rebuilt) would be called with the wrong
    signatures: its ABI number is checked first, and the probe falls back to the ctypes callbacks."""
    src = tmp_path / "old.c"
    src.write_text("int gfp_abi(void) { return 1; }\n")
    lib = tmp_path / "libgfp-cuptibuf.so"
    subprocess.run([_compiler(), "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, capture_output=True)
    monkeypatch.setattr(nativecallbacks, "LIBRARY", lib)
    nativecallbacks.load.cache_clear()
    try:
        got, why = nativecallbacks.load()
        assert got is None and why == f"libgfp-cuptibuf.so: ABI 1, this probe needs {nativecallbacks._ABI}"
    finally:
        nativecallbacks.load.cache_clear()
