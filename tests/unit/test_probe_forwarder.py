"""The C forwarder (cuptibuf.c ``gfp_fwd_*``, probe/forwarder.py): CUPTI's buffers read, framed and queued for the
daemon on a thread of C, the sender taking the frames in bulk.

What leaves the probe must be what the sender's own read would have sent: here real buffers go through a real
pool (completed as CUPTI completes them, through the pool's C callback), the forwarder's thread reads them, and
its frames, structs, counts and the buffers it hands over are compared with what the sender's reader
(``RawBufferReader``, the C read) makes of the same buffers.
"""

from __future__ import annotations

import ctypes
import os
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from gpufootprint.probe import forwarder, nativecallbacks
from gpufootprint.probe.nativecallbacks import NativeDelivery, kind_mask
from gpufootprint.probe.oom import ALLOCATION_CBIDS, CUDA_ERROR_OUT_OF_MEMORY
from gpufootprint.probe.rawreader import FORWARDABLE, FORWARDABLE_V1
from gpufootprint.wire import cupti_layout, framing

from tests.unit.test_probe_native_read import DRV, MEM, T0, _buffer, _read, _record, _Side

pytestmark = pytest.mark.skipif(not nativecallbacks.available(), reason="the probe's C library is not built here")

PID = 1234
API = kind_mask(cupti_layout.API_KINDS)


class _Pool:
    """A real pool and its C callbacks, completed from here as CUPTI would; the sender's eventfd beside it."""

    def __init__(self, buffer_bytes: int = 1 << 21, buffers: int = 64) -> None:
        fd = nativecallbacks.eventfd()
        assert fd is not None
        self.fd = fd
        self.delivery = NativeDelivery(buffer_bytes, buffers, fd)

    def complete(self, body: bytes) -> int:
        buf, size, most = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_size_t()
        self.delivery._req(ctypes.byref(buf), ctypes.byref(size), ctypes.byref(most))
        assert buf.value and size.value >= len(body), "the pool refused a buffer"
        ctypes.memmove(buf.value, body, len(body))
        self.delivery._cmp(None, 0, buf.value, size.value, len(body))
        return int(buf.value)

    def wakes(self) -> int:
        try:
            return int(os.eventfd_read(self.fd))
        except BlockingIOError:
            return 0

    def close(self) -> None:
        self.delivery.retire()
        os.close(self.fd)


@pytest.fixture
def pool() -> Any:
    p = _Pool()
    yield p
    p.close()


def _frames(bodies: list[bytes]) -> bytes:
    return b"".join(b"".join(bytes(x) for x in framing.cupti_buffer_parts(PID, body, checked=False)) for body in bodies)


def _structs(bodies: list[bytes]) -> bytes:
    out = b""
    for body in bodies:
        offsets = cupti_layout.walk(memoryview(body), len(body))
        assert offsets is not None
        if MEM in offsets:
            out += cupti_layout.gather(np.frombuffer(body, np.uint8), MEM, offsets[MEM]).tobytes()
    return out


def _take(fwd: forwarder.Forwarder) -> dict[str, Any]:
    assert fwd.sync(2.0) == 0
    side = fwd.swap()
    if side is None:
        return {"frames": b"", "ledger": [], "structs": b"", "buffers": 0, "records": 0, "stale": 0,
                "dropped": (0, 0, 0)}
    try:
        return {"frames": bytes(side.frames), "ledger": list(zip(side.ends.tolist(), side.records_per_frame.tolist())),
                "structs": side.structs.tobytes(), "buffers": side.buffers, "records": side.records,
                "stale": side.stale, "dropped": (side.dropped_buffers, side.dropped_records, side.dropped_max_ts)}
    finally:
        fwd.release()


@pytest.mark.parametrize("seed", range(8))
def test_the_forwarder_sends_what_the_senders_read_sends_and_hands_over_what_it_reads_itself(pool: _Pool,
                                                                                             seed: int) -> None:
    """Random buffers (allocations, their calls' API records, failed calls, launches, pool records, kernels, a record
    cut off): each one the sender's reader would forward is framed byte for byte as it frames it, with its
    structs and record count; every other one is handed over, in order, and given back by no one but the sender."""
    rng = random.Random(seed)
    forwardable = FORWARDABLE if seed % 3 else FORWARDABLE_V1
    fwd = forwarder.start(pool.delivery, PID, 1 << 30)
    assert fwd is not None
    fwd.set(True, kind_mask(forwardable), 1 << 30, 0)
    reader = _Side(True, um_wanted=False)
    bodies: list[bytes] = []
    for n in range(30):
        body = _buffer(rng, T0 + n * 10_000_000, calls=rng.random() < 0.6, failures=seed % 2 == 0,
                       pool=rng.random() < 0.3, kernels=rng.random() < 0.1, managed=False,
                       size=rng.choice([600, 4096, 65536]))
        if n % 9 == 4:
            body = body[:-rng.randint(1, 30)]  # neither walk reads it
        bodies.append(body)
    expect_sent, expect_handed = [], []
    for body in bodies:
        before = len(reader.link.sent)
        _read([reader], body, forwardable=forwardable, tee=False)
        forwarded = len(reader.link.sent) > before and reader.counters["native_reads"] > len(expect_sent)
        (expect_sent if forwarded else expect_handed).append(body)
    for body in bodies:
        pool.complete(body)  # (a forwarded buffer is back in the pool at once: its address may come again)
    got = _take(fwd)
    handed = pool.delivery.take()
    handed_bodies = [ctypes.string_at(address, valid) for address, valid in handed]  # not given back: still theirs
    # A failed call turns API records over to the sender until it says otherwise: buffers with calls after it are
    # handed over too. So what was forwarded is a subsequence of what the reader forwards.
    assert handed_bodies == [body for body in bodies if body in handed_bodies]
    sent_bodies = [body for body in bodies if body not in handed_bodies]
    assert got["frames"] == _frames(sent_bodies)
    assert got["structs"] == _structs(sent_bodies)
    assert got["buffers"] == len(sent_bodies) and len(got["ledger"]) == len(sent_bodies)
    counted = [int(np.count_nonzero([k in cupti_layout.RECORD_KIND for k in _kinds(b)])) for b in sent_bodies]
    assert [r for _, r in got["ledger"]] == counted and got["records"] == sum(counted)
    # every buffer forwarded is one the reader forwards; every one handed over that the reader forwards comes
    # after a failed call
    assert all(body in expect_sent for body in sent_bodies)
    first_failed = next((i for i, b in enumerate(bodies) if _failed(b)), len(bodies))
    for i, body in enumerate(bodies):
        if body in expect_sent and body not in sent_bodies:
            assert i >= first_failed and _has_calls(body), i
    if seed % 2:  # no failures: exactly the reader's choice
        assert sent_bodies == expect_sent
    # the pool has back every buffer forwarded; those handed over wait for the sender
    stats = pool.delivery.stats()
    assert stats["allocated"] - stats["free"] == len(handed)
    assert fwd.stats()["forwarded"] == len(sent_bodies) and fwd.stats()["to_sender"] == len(handed)
    for address, _ in handed:
        pool.delivery.give_back(address)
    assert fwd.stop() == []
    fwd.free()


def _kinds(body: bytes) -> list[int]:
    offsets = cupti_layout.walk(memoryview(body), len(body))
    assert offsets is not None
    return [k for k, offs in offsets.items() for _ in offs]


def _failed(body: bytes) -> bool:
    offsets = cupti_layout.walk(memoryview(body), len(body))
    if offsets is None:
        return False
    u8 = np.frombuffer(body, np.uint8)
    return any(bool(cupti_layout.api_returns(u8, offsets[k]).any()) for k in cupti_layout.API_KINDS if k in offsets)


def _has_calls(body: bytes) -> bool:
    offsets = cupti_layout.walk(memoryview(body), len(body))
    return offsets is not None and any(k in offsets for k in cupti_layout.API_KINDS)


def _alloc(i: int, ts: int, size: int = 4096) -> bytes:
    return _record(MEM, op=1, address=0x1000 + i * 0x10000, bytes=size, timestamp=ts)


def test_a_failed_call_hands_the_calls_after_it_to_the_sender_until_it_says_otherwise(pool: _Pool) -> None:
    """The OOM watch judges a failed allocation by the calls after it on its thread (a success settles it): the
    forwarder must not send those past the sender, which learns of the failure only when it reads its buffer."""
    fwd = forwarder.start(pool.delivery, PID, 1 << 30)
    assert fwd is not None
    mask = kind_mask(FORWARDABLE)
    fwd.set(True, mask, 1 << 30, 0)
    cbid = min(ALLOCATION_CBIDS)
    failed = _alloc(0, T0) + _record(DRV, cbid=cbid, start=T0, end=T0 + 10, ret=CUDA_ERROR_OUT_OF_MEMORY, tid=7)
    success = _alloc(1, T0 + 100) + _record(DRV, cbid=cbid, start=T0 + 100, end=T0 + 110, ret=0, tid=7)
    memory_only = _alloc(2, T0 + 200)
    a_failed, a_success, _ = (pool.complete(b) for b in (failed, success, memory_only))
    assert _take(fwd)["frames"] == _frames([memory_only])  # memory records still go
    assert [a for a, _ in pool.delivery.take()] == [a_failed, a_success]
    # the sender's word again, as after it read them (no failure waiting): calls are forwarded again
    fwd.set(True, mask, 1 << 30, 0)
    pool.complete(success)
    assert _take(fwd)["frames"] == _frames([success])
    # while buffers it handed over wait to be taken, the sender's word does not bring the calls back
    pool.complete(failed)
    assert fwd.sync(2.0) == 0
    fwd.set(True, mask, 1 << 30, 0)
    pool.complete(success)
    assert _take(fwd)["frames"] == b""
    assert len(pool.delivery.take()) == 2
    for address in (a_failed, a_success):
        pool.delivery.give_back(address)
    fwd.stop()
    fwd.free()


def test_frames_past_the_room_are_dropped_their_structs_kept_and_the_sender_woken(pool: _Pool) -> None:
    """A send buffer that is full: the frame is dropped and counted (with its newest struct's time, for the resync
    the daemon then needs), its structs still go to the probe's table, and the sender is woken for it."""
    fwd = forwarder.start(pool.delivery, PID, 1 << 30)
    assert fwd is not None
    bodies = [b"".join(_alloc(j, T0 + i * 1000 + j) for j in range(100)) for i in range(5)]
    frame = len(_frames(bodies[:1]))
    fwd.set(True, kind_mask(FORWARDABLE), 2 * frame + 10, 0)
    pool.wakes()
    for body in bodies:
        pool.complete(body)
    got = _take(fwd)
    assert got["frames"] == _frames(bodies[:2])
    assert got["structs"] == _structs(bodies)  # all five
    assert got["dropped"] == (3, 300, T0 + 4 * 1000 + 99)
    assert got["buffers"] == 5 and got["records"] == 500
    assert pool.wakes() >= 1
    fwd.stop()
    fwd.free()


def test_the_sender_is_woken_once_the_outbox_holds_its_bytes_not_for_each_buffer(pool: _Pool) -> None:
    fwd = forwarder.start(pool.delivery, PID, 3 * 65_000)
    assert fwd is not None
    fwd.set(True, kind_mask(FORWARDABLE), 1 << 30, 0)
    body = b"".join(_alloc(j, T0 + j) for j in range(500))  # 64,000 bytes of structs
    pool.wakes()
    for _ in range(2):
        pool.complete(body)
    assert fwd.sync(2.0) == 0
    assert pool.wakes() == 0  # two frames: under the wake's bytes
    for _ in range(3):
        pool.complete(body)
    assert fwd.sync(2.0) == 0
    assert pool.wakes() == 1  # once, when the third passed it
    assert _take(fwd)["buffers"] == 5
    pool.complete(body)
    assert fwd.sync(2.0) == 0 and pool.wakes() == 0  # a new side: counted afresh
    fwd.stop()
    fwd.free()


def test_frames_made_for_an_earlier_connection_are_stale(pool: _Pool) -> None:
    fwd = forwarder.start(pool.delivery, PID, 1 << 30)
    assert fwd is not None
    mask = kind_mask(FORWARDABLE)
    fwd.set(True, mask, 1 << 30, 7)
    bodies = [_alloc(i, T0 + i) for i in range(3)]
    pool.complete(bodies[0])
    pool.complete(bodies[1])
    assert fwd.sync(2.0) == 0
    fwd.set(True, mask, 1 << 30, 8)  # a new connection
    pool.complete(bodies[2])
    got = _take(fwd)
    assert got["stale"] == 2 and got["frames"] == _frames(bodies)
    side_link = _Link()
    fwd.set(True, mask, 1 << 30, 9)
    pool.complete(bodies[0])
    pool.complete(bodies[1])
    assert fwd.sync(2.0) == 0
    fwd.set(True, mask, 1 << 30, 10)
    pool.complete(bodies[2])
    assert fwd.sync(2.0) == 0
    side = fwd.swap()
    assert side is not None
    took = forwarder.take_in(side, side_link)
    fwd.release()
    assert took.away == 2 and took.sent == 1 and took.frames_sent == 1
    assert side_link.data == _frames(bodies[2:]) and side_link.ledger == [(len(_frames(bodies[2:])), 1)]
    fwd.stop()
    fwd.free()


class _Link:
    def __init__(self) -> None:
        self.data = b""
        self.ledger: list[tuple[int, int]] = []

    def put_chunk(self, data: memoryview, ends: np.ndarray, records: np.ndarray) -> bool:
        self.ledger += list(zip(ends.tolist(), records.tolist()))
        self.data += bytes(data)
        return True


def test_off_it_hands_every_buffer_over_and_stopped_the_pool_wakes_the_sender_again(pool: _Pool) -> None:
    fwd = forwarder.start(pool.delivery, PID, 1 << 30)
    assert fwd is not None
    assert forwarder.start(pool.delivery, PID, 1 << 30) is None  # one a pool
    body = _alloc(0, T0)
    pool.wakes()
    first = pool.complete(body)  # never told it may: handed over
    assert fwd.sync(2.0) == 0 and pool.wakes() == 1
    assert pool.delivery.take() == [(first, len(body))]
    pool.delivery.give_back(first)
    second = pool.complete(body)
    assert fwd.sync(2.0) == 0
    assert fwd.stop() == [(second, len(body))]  # handed and not yet taken: the sender's
    pool.delivery.give_back(second)
    pool.wakes()
    third = pool.complete(body)  # the sender's again, through the pool's own queue and wake
    assert pool.wakes() == 1 and pool.delivery.take() == [(third, len(body))]
    pool.delivery.give_back(third)
    assert fwd.sync(1.0) == 0  # stopped: no wait
    fwd.free()


def test_a_sync_waits_for_the_buffers_queued_before_it_while_cupti_keeps_completing(pool: _Pool) -> None:
    """The sender's wait before a watermark ends once what was queued before it is dealt with, however many buffers
    a busy thread completes meanwhile (a wait for the ring to be empty might never end)."""
    fwd = forwarder.start(pool.delivery, PID, 1 << 30)
    assert fwd is not None
    mask = kind_mask(FORWARDABLE)
    fwd.set(True, mask, 1 << 40, 0)
    body = b"".join(_alloc(j, T0 + j) for j in range(400))
    stop = threading.Event()
    completed = [0]

    def busy() -> None:
        while not stop.is_set():
            if pool.delivery.stats()["allocated"] - pool.delivery.stats()["free"] < 32:
                pool.complete(body)
                completed[0] += 1
            else:
                time.sleep(0.0005)

    t = threading.Thread(target=busy)
    t.start()
    forwarded, behind = 0, 0
    try:
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            behind += fwd.lag() > 0
            assert fwd.sync(2.0) == 0
            forwarded += _take(fwd)["buffers"]
            time.sleep(0.001)
    finally:
        stop.set()
        t.join()
    assert fwd.sync(2.0) == 0
    forwarded += _take(fwd)["buffers"]
    assert forwarded == completed[0] > 20 and behind > 0
    fwd.stop()
    fwd.free()


def test_a_read_of_the_senders_after_the_forwarders_leaves_the_same_structs_in_the_table_queue(pool: _Pool) -> None:
    """The table's queue gets the forwarder's structs as the sender takes them in (``Sender._take_forwarded``) and
    the reader's own as it reads a handed-over buffer: the same structs as the reader alone queues."""
    reader = _Side(True, um_wanted=False)
    alone = _Side(True, um_wanted=False)
    fwd = forwarder.start(pool.delivery, PID, 1 << 30)
    assert fwd is not None
    fwd.set(True, kind_mask(FORWARDABLE), 1 << 30, 0)
    rng = random.Random(5)
    bodies = [_buffer(rng, T0 + i * 10_000_000, calls=True, failures=False, pool=False, kernels=i % 3 == 0,
                      managed=False, size=4096) for i in range(9)]
    for body in bodies:
        pool.complete(body)
        _read([alone], body, forwardable=FORWARDABLE, tee=False)
    got = _take(fwd)
    reader.table.pending_raw.append(np.frombuffer(got["structs"], cupti_layout.RAW_DTYPES[MEM]))
    for address, valid in pool.delivery.take():
        reader.read_at.append(address)
        reader.reader.read(address, valid, forward_to=reader.link, forwardable=FORWARDABLE, tee=None,  # type: ignore[arg-type]
                           in_gap=False)
    ours = sorted(row.tobytes() for row in reader.table.pending_raw.view())
    theirs = sorted(row.tobytes() for row in alone.table.pending_raw.view())
    assert ours == theirs and len(ours) > 0
    assert alone.counters["native_reads"] > reader.counters["native_reads"]  # the forwarder read some of them
    fwd.stop()
    fwd.free()


def test_a_forwarder_started_after_the_sender_read_buffers_owes_none_of_them(pool: _Pool) -> None:
    """A probe whose forwarder starts once buffers have come and gone (CUDA busy before the probe, a first
    connect's flush): a sync waits only for what is queued, not for buffers the sender read before (it used to
    wait its whole time at every drain, and no watermark went out again)."""
    first = pool.complete(_alloc(0, T0))
    assert [a for a, _ in pool.delivery.take()] == [first]  # the sender's read, before any forwarder
    pool.delivery.give_back(first)
    waiting = pool.complete(_alloc(1, T0 + 1))  # queued, not yet taken: the forwarder's to read
    fwd = forwarder.start(pool.delivery, PID, 1 << 30)
    assert fwd is not None
    t = time.monotonic()
    assert fwd.sync(2.0) == 0 and time.monotonic() - t < 1.0
    assert fwd.lag() == 0
    # the one queued was the forwarder's to read, before it was told it may forward: handed over
    assert _take(fwd)["buffers"] == 0 and pool.delivery.take() == [(waiting, len(_alloc(1, T0 + 1)))]
    fwd.set(True, kind_mask(FORWARDABLE), 1 << 30, 0)
    pool.delivery.give_back(waiting)
    later = _alloc(2, T0 + 2)
    pool.complete(later)
    t = time.monotonic()
    assert fwd.sync(2.0) == 0 and time.monotonic() - t < 1.0
    assert _take(fwd)["frames"] == _frames([later])
    fwd.stop()
    fwd.free()


def test_a_side_released_starts_afresh_its_stale_frames_and_its_wake(pool: _Pool) -> None:
    fwd = forwarder.start(pool.delivery, PID, 2 * 65_000)
    assert fwd is not None
    mask = kind_mask(FORWARDABLE)
    fwd.set(True, mask, 1 << 30, 1)
    body = b"".join(_alloc(j, T0 + j) for j in range(500))
    pool.complete(body)
    assert fwd.sync(2.0) == 0
    fwd.set(True, mask, 1 << 30, 2)  # what was framed is stale now
    for _ in range(2):
        pool.complete(body)
    assert fwd.sync(2.0) == 0
    pool.wakes()
    assert _take(fwd)["stale"] == 1
    for side in range(2):  # both sides, each after its release: no stale frame, and a wake past the bytes again
        for _ in range(3):
            pool.complete(body)
        assert fwd.sync(2.0) == 0
        assert pool.wakes() == 1, side
        got = _take(fwd)
        assert got["stale"] == 0 and got["buffers"] == 3, side
    fwd.stop()
    fwd.free()


def test_its_counters_are_read_from_what_it_last_said_once_freed(pool: _Pool) -> None:
    """``probe.status()`` reads the counters from the workload's threads while the sender may be freeing the
    forwarder: once freed, the last counters, never a call into freed memory."""
    fwd = forwarder.start(pool.delivery, PID, 1 << 30)
    assert fwd is not None
    fwd.set(True, kind_mask(FORWARDABLE), 1 << 30, 0)
    pool.complete(_alloc(0, T0))
    assert fwd.sync(2.0) == 0
    before = fwd.stats()
    _take(fwd)
    fwd.stop()
    fwd.free()
    assert fwd.stats()["forwarded"] == before["forwarded"] == 1


def test_api_calls_stay_the_senders_while_a_buffer_it_took_waits_to_be_read() -> None:
    """At a connect the sender takes what the forwarder handed over (a failed call, perhaps) before the daemon's
    ask turns forwarding on; until it has read those buffers, no API record may pass it."""
    from gpufootprint.probe.sender import Sender
    from gpufootprint.probe.settings import ProbeSettings

    sender = Sender(ProbeSettings(socket=""), None, PID, time.time_ns, None)
    sender._forwardable = FORWARDABLE
    assert sender._forwarded_kinds() & API == API
    sender.intake.q.append(("raw", 0x1000, 64))
    assert sender._forwarded_kinds() & API == 0
    assert sender._forwarded_kinds() == kind_mask(FORWARDABLE - cupti_layout.API_KINDS)
    sender.intake.q.clear()
    sender.packer.launch_span = (0, None)  # a launch window takes calls
    assert sender._forwarded_kinds() & API == 0


@contextmanager
def _forwarding_sender(path: str, delivery: NativeDelivery, **settings: Any) -> Iterator[tuple[Any, Any, Any]]:
    """A real sender (``native_forward``) connected to a listening socket at ``path`` as to a daemon that asked for
    CUPTI's buffers unchecked, its forwarder started on ``delivery``: (sender, listening socket, accepted peer)."""
    import socket

    from gpufootprint.probe.sender import Sender
    from gpufootprint.probe.settings import ProbeSettings

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(2)
    sender = Sender(ProbeSettings(socket=path, native_forward=True, **settings), None, PID, time.time_ns, None)
    try:
        sender.cupti.raw = delivery
        assert sender.link is not None and sender.link.try_connect()
        peer, _ = server.accept()
        sender._forward, sender._forwardable = True, FORWARDABLE
        sender._raw_reader.checked = False  # this daemon takes CUPTI buffers unchecked
        sender._update_forwarder()
        assert sender.forwarder is not None
        yield sender, server, peer
    finally:
        sender._stop_forwarder()
        if sender.link is not None:
            sender.link.close("test")  # a reader of the peer sees its end
        sender._wake.close()
        server.close()


def test_frames_made_for_a_connection_that_broke_never_reach_the_next_daemon(tmp_path: Any, pool: _Pool) -> None:
    """A real sender and its link: the forwarder frames a buffer for the first daemon, that connection breaks and a
    new daemon is there before the sender takes the frame in. The new daemon's first frame must be the HELLO (a
    frame before it cuts the connection), and the buffer's records reach it by the resync, not as a stale frame."""
    from gpufootprint.records import DTYPES, RecordKind
    from gpufootprint.wire.framing import FrameDecoder, FrameType

    with _forwarding_sender(str(tmp_path / "d.sock"), pool.delivery) as (sender, server, first):
        link, fwd = sender.link, sender.forwarder
        body = _alloc(0, T0)
        pool.complete(body)
        assert fwd.sync(2.0) == 0 and fwd.stats()["forwarded"] == 1  # framed for the first connection
        first.close()
        link.close("test")
        link._next_try = 0.0
        assert link.try_connect()
        second, _ = server.accept()
        sender._on_connect()
        link.pump()
        second.setblocking(False)
        data = b""
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            try:
                chunk = second.recv(1 << 20)
            except BlockingIOError:
                if data:
                    break
                time.sleep(0.01)
                continue
            if not chunk:
                break
            data += chunk
        frames = FrameDecoder().feed(data)
        assert frames and frames[0].type is FrameType.HELLO, [f.type for f in frames[:3]]
        assert FrameType.CUPTI_BUFFER not in [f.type for f in frames]  # the stale frame dropped, not sent late
        # its allocation went to the table's queue, and so to this daemon after the HELLO, with the resync
        assert sender.counters["records_dropped"] == 1 and sender.dropped_by_reason["daemon_away"] == 1
        batches = [np.frombuffer(f.payload, DTYPES[RecordKind.MEMORY]) for f in frames
                   if f.type is FrameType.BATCH and f.tag == RecordKind.MEMORY]
        assert [int(r["addr"]) for b in batches for r in b] == [0x1000]
        second.close()


def test_a_bursts_memory_goes_back_once_the_sides_hold_little_again(pool: _Pool) -> None:
    """Its two sides grow to a burst's frames and structs; a side that held under a quarter of itself in a turn
    gives its memory back (it is the probe's own host memory, in the workload's process)."""
    fwd = forwarder.start(pool.delivery, PID, 1 << 30)
    assert fwd is not None
    fwd.set(True, kind_mask(FORWARDABLE), 1 << 30, 0)
    body = b"".join(_alloc(j, T0 + j) for j in range(500))
    for _ in range(40):  # about 2.6 MB of frames and as much of structs, in one side
        pool.complete(body)
    assert _take(fwd)["buffers"] == 40
    burst = fwd.stats()["bytes"]
    assert burst > 4 << 20
    for _ in range(2):  # each side in turn holds one buffer
        pool.complete(body)
        assert _take(fwd)["buffers"] == 1
    assert fwd.stats()["bytes"] < 1 << 20 < burst
    fwd.stop()
    fwd.free()


def test_its_look_at_the_senders_queue_holds_while_workload_threads_queue_marks() -> None:
    """The sender looks for buffers taken and not read in its intake queue while the program's threads queue marks
    and profiler hand-overs there: a Python loop over the deque itself could be switched out of mid-way and meet
    it changed ("deque mutated during iteration"), which at the stop skipped the goodbye."""
    import sys
    from collections import deque

    from gpufootprint.probe.sender import Sender
    from gpufootprint.probe.settings import ProbeSettings

    sender = Sender(ProbeSettings(socket=""), None, PID, time.time_ns, None)
    sender._forwardable = FORWARDABLE
    sender.intake.q = deque(("raw", 0, 0) if i == 5000 else ("mark", {}, None) for i in range(5001))
    stop = threading.Event()

    def workload() -> None:  # Sender.queue_and_wait's append, from a workload thread (probe.mark())
        while not stop.is_set():
            sender.intake.q.append(("mark", {}, None))
            sender.intake.q.pop()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the switch comes sooner, not otherwise
    t = threading.Thread(target=workload)
    t.start()
    try:
        for _ in range(200):
            assert sender._forwarded_kinds() & API == 0  # the raw item found, no RuntimeError
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(interval)
        sender._wake.close()


def test_a_watermark_waits_for_the_forwarders_reads_of_what_came_before_it(tmp_path: Any,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A watermark says every record stamped before it was sent: while the forwarder has not read every buffer queued
    before the sender's flush (a starved CPU; here a 24 MiB buffer, some 50 MB to copy, and a sync cut to a
    millisecond), none goes out, and once it has, the next flush sends it behind the buffer's frame."""
    from gpufootprint.probe import sender as sender_module
    from gpufootprint.wire.framing import FrameDecoder, FrameType

    big = _Pool(buffer_bytes=24 << 20, buffers=2)
    try:
        # a send buffer its frame fits
        with _forwarding_sender(str(tmp_path / "d.sock"), big.delivery, buffer_bytes=32 << 20) as (sender, _, peer):
            link = sender.link
            received = bytearray()

            def read() -> None:  # the daemon's side, reading as it comes
                while chunk := peer.recv(1 << 22):
                    received.extend(chunk)

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            sender._flush_and_drain()  # the first flush: no watermark yet, the next one's time taken
            body = _alloc(0, T0) * ((24 << 20) // len(_alloc(0, T0)))
            monkeypatch.setattr(sender_module, "FORWARD_SYNC_S", 0.001)
            big.complete(body)
            sender._flush_and_drain()
            assert sender._forward_lagging and sender.counters["native_forward_lagging"] == 1
            monkeypatch.setattr(sender_module, "FORWARD_SYNC_S", 5.0)
            link.pump()
            sender._flush_and_drain()
            assert not sender._forward_lagging
            end = time.monotonic() + 20.0
            while link.buffered and time.monotonic() < end:
                link.pump(0.05)
            link.close("test")
            reader.join(10)
            decoder = FrameDecoder(max_payload=64 << 20, unchecked=frozenset({FrameType.CUPTI_BUFFER}))
            types = [f.type for f in decoder.feed(bytes(received))]
            assert types.count(FrameType.WATERMARK) == 1, types
            assert types.index(FrameType.CUPTI_BUFFER) < types.index(FrameType.WATERMARK), types
    finally:
        big.close()
