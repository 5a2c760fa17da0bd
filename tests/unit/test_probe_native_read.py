"""The sender's read of a forwarded CUPTI buffer in one C call (``Walker.read``, cuptibuf.c ``gfp_read``).

It replaces, for a buffer the daemon reads itself, the walk's offsets, the gather of the MEMORY2 structs, their
copy into the table's queue and the OOM watch's look at the API records' return values. What leaves the probe
and what the probe keeps must not change: here two readers, one reading in C and one in numpy after the C walk
(``native_read`` off, the probe before), read the same buffers into their own real table, packer, OOM watch and
resync schedule, and every piece of state is compared after every buffer: the frames sent, the structs queued,
the OOM watch's waiting failures and counts, the launch window's records, the recordings' frames, the drops.
"""

from __future__ import annotations

import ctypes
import random
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from gpufootprint.probe import nativecallbacks
from gpufootprint.probe.launches import RUNTIME_CBIDS
from gpufootprint.probe.livetable import LiveTable, StructQueue
from gpufootprint.probe.oom import ALLOCATION_CBIDS, CUDA_ERROR_OUT_OF_MEMORY, RUNTIME_ALLOCATION_CBIDS, OomWatch
from gpufootprint.probe.packing import Packer
from gpufootprint.probe.rawreader import FORWARDABLE, FORWARDABLE_V1, RawBufferReader
from gpufootprint.probe.resync import ResyncSchedule
from gpufootprint.records import MemoryKind, RecordKind
from gpufootprint.wire import cupti_layout

MEM, POOL, DRV, RT = cupti_layout.MEMORY2, cupti_layout.MEMORY_POOL, cupti_layout.DRIVER, cupti_layout.RUNTIME
T0 = 1_700_000_000_000_000_000


class _Link:
    """The socket link's ``put_parts``: keeps what it took, refuses when told to (a full send buffer)."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, int]] = []
        self.refuse = False

    def put_parts(self, parts: Any, records: int = 0) -> bool:
        if self.refuse:
            return False
        self.sent.append((b"".join(bytes(p) for p in parts), records))
        return True


class _Tee:
    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.fail = False  # a recording's disk full: the reader counts it and goes on

    def put(self, frame: bytes) -> None:
        if self.fail:
            raise OSError(28, "No space left on device")
        self.frames.append(bytes(frame))


class _Side:
    """One reader with its own real table, packer, OOM watch and resync schedule."""

    def __init__(self, native_read: bool, *, um_wanted: bool) -> None:
        self.launches: list[tuple[RecordKind, np.ndarray]] = []
        self.packer = Packer(1234, lambda chunk: self.launches.append((chunk[0], chunk[1].copy())), capacity=4096,
                             bulk=True)
        self.table = LiveTable()
        self.oom = OomWatch(time.time_ns)
        self.um_calls: list[bool] = []
        self.given_back: list[int] = []
        self.cupti = SimpleNamespace(raw=SimpleNamespace(give_back=self.given_back.append), um_wanted=um_wanted,
                                     backend=None, configure_unified_memory=self.um_calls.append)
        self.counters: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.resyncs = ResyncSchedule()
        self.reader = RawBufferReader(pid=1234, verify_walk=False, packer=self.packer, table=self.table, oom=self.oom,
                                      cupti=self.cupti, resyncs=self.resyncs, counters=self.counters,  # type: ignore[arg-type]
                                      dropped_by_reason=self.dropped, clock_ns=lambda: 42,
                                      walker=nativecallbacks.Walker(), native_read=native_read)
        self.link = _Link()
        self.tee = _Tee()
        self.read_at: list[int] = []  # each buffer's address: each must be given back, once

    def state(self) -> dict[str, Any]:
        self.packer.flush()
        counters = {k: v for k, v in self.counters.items() if k not in ("native_reads", "native_walks")}
        return {
            "sent": list(self.link.sent), "queued": self.table.pending_raw.view().tobytes(),
            "raw_pid": self.table.raw_pid, "api_dev": self.packer.api_dev,
            "oom": self.oom.counters(), "oom_waiting": list(self.oom._waiting),
            "oom_other": self.oom.other_failures, "oom_judged": (self.oom._judged_calls, self.oom._judged_last),
            "launches": [(k, a.tobytes()) for k, a in self.launches], "launch_records": self.packer.launch_records,
            "outside": self.packer.launch_records_outside, "tee": list(self.tee.frames), "um": list(self.um_calls),
            "counters": counters, "dropped": dict(self.dropped), "resync_after": self.resyncs.after_ns,
            "given_back": len(self.given_back) == len(self.read_at) and self.given_back == self.read_at,
        }


def _record(kind: int, **fields: Any) -> bytes:
    dt = cupti_layout.API_RAW_DTYPE if kind in (DRV, RT) else cupti_layout.RAW_DTYPES[kind]
    rec = np.zeros(1, dt)
    for name, value in fields.items():
        rec[name] = value
    out = bytearray(rec.tobytes())
    out[0:4] = kind.to_bytes(4, "little")
    return bytes(out)


def _buffer(rng: random.Random, t: int, *, calls: bool, failures: bool, pool: bool, kernels: bool,
            managed: bool, size: int) -> bytes:
    """Records as CUPTI writes them: allocations and releases (each allocation followed by its calls' API records
    where ``calls``), now and then a pool record, a kernel, a failed call (out of memory or another error)."""
    out = bytearray()
    i = 0
    while len(out) < size - 300:
        i += 1
        ts = t + i * 1000
        op = rng.choice([1, 1, 2])
        mk = int(MemoryKind.MANAGED) if managed and rng.random() < 0.05 else int(MemoryKind.DEVICE)
        out += _record(MEM, op=op, mk=mk, address=0x7F00_0000_0000 + rng.randrange(64) * 0x10000,
                       bytes=4096 * rng.randint(1, 64), timestamp=ts, dev=rng.randrange(2), is_async=rng.randrange(2))
        if calls and op == 1:
            ret = 0
            if failures and rng.random() < 0.08:
                ret = rng.choice([CUDA_ERROR_OUT_OF_MEMORY, 999])
            out += _record(DRV, cbid=rng.choice(sorted(ALLOCATION_CBIDS)), start=ts, end=ts + 500, ret=ret,
                           tid=rng.choice([7, 8]))
            out += _record(RT, cbid=rng.choice(sorted(RUNTIME_ALLOCATION_CBIDS) + [1, 2]), start=ts, end=ts + 600,
                           ret=ret if rng.random() < 0.5 else 0, tid=rng.choice([7, 8]))
        if calls and rng.random() < 0.2:  # a launch (what a launch window takes)
            out += _record(RT, cbid=rng.choice(sorted(RUNTIME_CBIDS)), start=ts + 1, end=ts + 2, tid=7)
        if pool and rng.random() < 0.02:
            out += _record(POOL, op=1, dev=0, address=0x1000, timestamp=ts)
        if kernels and rng.random() < 0.01:
            out += _record(cupti_layout.CONCURRENT_KERNEL, start=ts, end=ts + 10)
    return bytes(out)


def _read(sides: list[_Side], buf: bytes, *, forwardable: frozenset[int], tee: bool, connected: bool = True) -> None:
    for side in sides:
        arr = (ctypes.c_uint8 * max(len(buf), 1)).from_buffer_copy(buf.ljust(1, b"\0"))
        side.read_at.append(ctypes.addressof(arr))
        side.reader.read(ctypes.addressof(arr), len(buf), forward_to=side.link if connected else None,  # type: ignore[arg-type]
                         forwardable=forwardable, tee=side.tee if tee else None, in_gap=False)


@pytest.mark.parametrize("seed", range(12))
def test_the_c_read_of_a_forwarded_buffer_leaves_everything_as_the_numpy_read_does(seed: int) -> None:
    rng = random.Random(seed)
    um = seed % 3 == 0
    c_side, numpy_side = _Side(True, um_wanted=um), _Side(False, um_wanted=um)
    sides = [c_side, numpy_side]
    t = T0
    for n in range(40):
        calls = rng.random() < 0.7
        # sizes past WALK_KEEPS_GIL_BYTES (1 MiB) take the handle that lets the GIL go
        buf = _buffer(rng, t, calls=calls, failures=seed % 2 == 0, pool=rng.random() < 0.3,
                      kernels=rng.random() < 0.1, managed=um, size=rng.choice([600, 4096, 65536, 65536, 3 << 19]))
        t += 10_000_000
        if n % 9 == 4:  # a record cut off: neither walk reads it (CUPTI's walk would; none here: packed)
            buf = buf[:-rng.randint(1, 30)]
        for side in sides:
            if n % 13 == 6:  # a launch window opens for a few buffers
                side.packer.launch_span = (t - 5_000_000, None)
            if n % 13 == 9:
                side.packer.launch_span = None
            side.link.refuse = n % 11 == 10
            side.tee.fail = n % 14 == 10
        # now and then the daemon is away: the buffer is walked (not read in C) and packed, between C reads
        _read(sides, buf, forwardable=FORWARDABLE if seed % 4 else FORWARDABLE_V1, tee=n % 7 == 3 or n % 14 == 10,
              connected=n % 5 != 2)
        assert c_side.state() == numpy_side.state(), f"buffer {n}"
    # an old daemon (FORWARDABLE_V1) does not step over RUNTIME records: buffers with calls are packed here
    most = 3 if seed % 4 == 0 else 15
    assert c_side.counters["native_reads"] > most and numpy_side.counters["native_reads"] == 0
    assert c_side.counters["forwarded_buffers"] > most
    if seed % 4:  # a launch window took calls
        assert c_side.packer.launch_records > 0
    if seed % 2 == 0 and seed % 4:  # failed calls were seen (RUNTIME records are read where forwarded)
        assert c_side.oom.counters() == numpy_side.oom.counters()
        assert c_side.oom.failed_calls + len(c_side.oom._waiting) + c_side.oom.other_failures > 0


def test_a_failure_waiting_makes_the_c_read_hand_the_successes_to_the_oom_watch() -> None:
    """A failed call waits to be judged; the next buffer holds only successes, one on the failed call's thread
    within the recovery window: the C read's failure count is 0, yet the watch must see that success."""
    c_side, numpy_side = _Side(True, um_wanted=False), _Side(False, um_wanted=False)
    cbid = min(ALLOCATION_CBIDS)
    first = _record(MEM, op=1, address=0x1000, bytes=4096, timestamp=T0) + _record(
        DRV, cbid=cbid, start=T0, end=T0 + 10, ret=CUDA_ERROR_OUT_OF_MEMORY, tid=7)
    second = _record(MEM, op=1, address=0x2000, bytes=4096, timestamp=T0 + 100) + _record(
        DRV, cbid=cbid, start=T0 + 100, end=T0 + 110, ret=0, tid=7)
    for buf in (first, second):
        _read([c_side, numpy_side], buf, forwardable=FORWARDABLE, tee=False)
        assert c_side.state() == numpy_side.state()
    assert c_side.oom.recovered_calls == 1 and not c_side.oom._waiting


def test_a_walk_that_grows_the_walkers_arrays_between_c_reads_leaves_the_next_read_right() -> None:
    """The walker's plain walk (a buffer not forwarded: the daemon away) and its C read share arrays: a walk of a
    larger buffer grows them, and the read after it must not write into the arrays numpy freed."""
    walker = nativecallbacks.Walker()
    q = StructQueue(cupti_layout.RAW_DTYPES[MEM])
    rng = random.Random(3)

    def at(body: bytes) -> tuple[Any, int]:
        arr = (ctypes.c_uint8 * len(body)).from_buffer_copy(body)
        return arr, ctypes.addressof(arr)

    small = _buffer(rng, T0, calls=True, failures=False, pool=False, kernels=False, managed=False, size=1000)
    large = _buffer(rng, T0, calls=True, failures=False, pool=False, kernels=False, managed=False, size=200_000)
    for body, how in ((small, "read"), (large, "walk"), (large, "read"), (small, "walk"), (large, "read")):
        _keep_alive, address = at(body)
        theirs = cupti_layout.walk(memoryview(body), len(body))
        assert theirs is not None
        if how == "walk":
            ours = walker(address, len(body))
            assert ours is not None and {k: list(v) for k, v in ours.items()} == {k: list(v) for k, v in theirs.items()}
            continue
        got = walker.read(address, len(body), q)
        assert got is not None
        assert {k: list(v) for k, v in got.offsets().items()} == {k: list(v) for k, v in theirs.items()}
        expected = cupti_layout.gather(np.frombuffer(body, np.uint8), MEM, theirs[MEM])
        assert got.keep().tobytes() == expected.tobytes()
        q.clear()


def test_structs_that_do_not_fit_the_queues_room_are_read_again_into_room_made_for_them() -> None:
    """The C read is given the room the queue has, not the most a buffer could need: a buffer whose structs do not
    fit is read a second time once the queue made room for exactly them; one with none costs the queue nothing."""
    walker = nativecallbacks.Walker()
    q = StructQueue(cupti_layout.RAW_DTYPES[MEM])
    mem = b"".join(_record(MEM, op=1, address=0x1000 + i, timestamp=T0 + i) for i in range(3000))
    api = _record(RT, ret=0) * 100
    arr = (ctypes.c_uint8 * len(api)).from_buffer_copy(api)
    got = walker.read(ctypes.addressof(arr), len(api), q)
    assert got is not None and got.memory2 == 0 and len(q._buf) == 0  # nothing made room for
    arr = (ctypes.c_uint8 * len(mem)).from_buffer_copy(mem)
    got = walker.read(ctypes.addressof(arr), len(mem), q)
    assert got is not None and walker.retries == 1
    assert got.keep()["timestamp"].tolist() == [T0 + i for i in range(3000)]
    q.clear()  # a watermark applied them: the room stays
    got = walker.read(ctypes.addressof(arr), 128 * 10, q)  # fits the room the queue now has: read once
    assert got is not None and walker.retries == 1 and got.keep()["timestamp"].tolist() == [T0 + i for i in range(10)]


def test_a_buffer_with_kernels_is_packed_and_its_structs_stay_out_of_the_queue() -> None:
    """The C read copies a buffer's MEMORY2 structs past the queue's end before the reader knows whether it
    forwards it: a buffer it packs instead (a kernel in it) must leave the queue as it was."""
    side = _Side(True, um_wanted=False)
    mem = _record(MEM, op=1, address=0x1000, bytes=4096, timestamp=T0)
    _read([side], mem * 3, forwardable=FORWARDABLE, tee=False)
    queued = side.table.pending_raw.view().tobytes()
    _read([side], mem * 2 + _record(cupti_layout.CONCURRENT_KERNEL, start=T0, end=T0 + 1), forwardable=FORWARDABLE,
          tee=False)
    assert side.table.pending_raw.view().tobytes() == queued and len(side.table.pending_raw) == 3
    assert side.counters["native_reads"] == 1 and side.counters["forwarded_buffers"] == 1
    assert side.counters["raw_buffers"] == 2


def test_the_queue_hands_out_room_and_takes_only_what_was_committed() -> None:
    dt = cupti_layout.RAW_DTYPES[MEM]
    q = StructQueue(dt)
    rows = np.zeros(5, dt)
    rows["timestamp"] = np.arange(5)
    q.append(rows[:2])
    at = q.room(3)
    ctypes.memmove(at, rows[2:].tobytes(), 3 * dt.itemsize)
    got = q.commit(3)
    assert got["timestamp"].tolist() == [2, 3, 4] and q.view()["timestamp"].tolist() == [0, 1, 2, 3, 4]
    q.room(1000)  # grows: what was committed stays, in order
    assert q.view()["timestamp"].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="past the room made"):
        q.commit(10_000)


def test_gfp_read_counts_kinds_copies_and_failed_calls_at_the_edges() -> None:
    """Straight at the C function: an empty buffer, a buffer of API records only, structs that do not fit the
    room given (refused: -2), an unknown kind (-1), and a return-value offset past an API record's end (every
    record of that kind counted as failed, for the caller to read itself)."""
    lib, why = nativecallbacks.load()
    assert lib is not None, why
    walker = nativecallbacks.Walker()
    q = StructQueue(cupti_layout.RAW_DTYPES[MEM])

    def read(body: bytes) -> nativecallbacks.Read | None:
        arr = (ctypes.c_uint8 * max(len(body), 1)).from_buffer_copy(body.ljust(1, b"\0"))
        return walker.read(ctypes.addressof(arr), len(body), q)

    got = read(b"")
    assert got is not None and got.kinds == 0 and got.records == 0 and got.memory2 == 0
    api = _record(RT, ret=0) + _record(RT, ret=2) + _record(DRV, ret=0)
    got = read(api)
    assert got is not None and got.memory2 == 0 and got.records == 0
    assert got.kinds == nativecallbacks.kind_mask(frozenset({RT, DRV})) and got.failed_calls == {DRV: 0, RT: 1}
    assert read(_record(MEM) + (9999).to_bytes(4, "little") + bytes(60)) is None
    mixed = _record(MEM, timestamp=5) + _record(POOL) + _record(MEM, timestamp=6)
    got = read(mixed)
    assert got is not None and got.memory2 == 2 and got.records == 3 and got.holds(POOL)
    assert got.keep()["timestamp"].tolist() == [5, 6]

    def raw_read(body: bytes, room: int, ret_offset: int) -> tuple[int, list[int]]:
        arr = (ctypes.c_uint8 * len(body)).from_buffer_copy(body)
        out = np.zeros(max(room, 1), cupti_layout.RAW_DTYPES[MEM])
        summary = np.zeros(3 + len(nativecallbacks._API_KINDS), np.int64)
        offsets = np.zeros(len(body) // 8 + 1, np.uint32)
        scratch = np.zeros(len(offsets), np.int32)
        counts = np.zeros(len(nativecallbacks._WALK_SIZES), np.int64)
        n = lib.gfp_read(ctypes.addressof(arr), len(body), nativecallbacks._WALK_SIZES.ctypes.data,
                         len(nativecallbacks._WALK_SIZES), offsets.ctypes.data, scratch.ctypes.data, len(offsets),
                         counts.ctypes.data, MEM, out.ctypes.data, room, nativecallbacks._API_KINDS.ctypes.data,
                         len(nativecallbacks._API_KINDS), ret_offset, nativecallbacks._COUNTED_MASK,
                         summary.ctypes.data)
        return int(n), summary.tolist()

    assert raw_read(mixed, 1, cupti_layout.API_RET_OFFSET)[0] == -2
    n, summary = raw_read(mixed + api, 2, cupti_layout.API_RET_OFFSET)
    assert n == 6 and summary[1:3] == [2, 3]
    n, summary = raw_read(api, 0, 40)  # the word would lie past the 40-byte record
    assert n == 3 and summary[3:] == [1, 2]  # DRIVER: its one record; RUNTIME: both


def test_with_walks_verified_the_c_read_is_checked_against_cuptis_walk_and_a_disagreement_goes_the_old_way() -> None:
    """``raw_verify_walk`` (the GPU tests): each buffer the C read forwards is walked by CUPTI too, counted once as
    verified; where CUPTI's walk disagrees, the buffer is read by CUPTI's walk instead (packed here, not forwarded),
    the disagreement counted once and said in the probe's errors."""
    rng = random.Random(5)
    buf = _buffer(rng, T0, calls=True, failures=False, pool=False, kernels=False, managed=False, size=20_000)

    def reference(address: int, valid: int) -> dict[int, list[int]] | None:
        walked = cupti_layout.walk(memoryview((ctypes.c_uint8 * valid).from_address(address)), valid)
        return None if walked is None else {k: list(v) for k, v in walked.items()}

    for cupti_says in ("same", "other"):
        side = _Side(True, um_wanted=False)
        errors: list[str] = []
        side.reader.errors = errors
        side.reader.verify_walk = True

        def walk_raw(address: int, valid: int, cupti_says: str = cupti_says) -> dict[int, list[int]] | None:
            got = reference(address, valid)
            if cupti_says == "other" and got is not None:
                got[MEM] = got[MEM][:-1]  # CUPTI's walk found one record fewer
            return got

        side.cupti.backend = SimpleNamespace(walk_raw=walk_raw)
        _read([side], buf, forwardable=FORWARDABLE, tee=False)
        c = side.counters
        if cupti_says == "same":
            assert c["native_reads"] == 1 and c["raw_walks_verified"] == 1 and c["raw_walk_mismatches"] == 0
            assert c["forwarded_buffers"] == 1 and len(side.link.sent) == 1 and not errors
        else:
            assert c["native_reads"] == 0 and c["raw_walks_verified"] == 1 and c["raw_walk_mismatches"] == 1
            assert c["forwarded_buffers"] == 0 and not side.link.sent and len(side.table.pending_raw) == 0
            assert len(errors) == 1 and "our walk and CUPTI's disagree" in errors[0]
