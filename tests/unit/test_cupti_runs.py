"""A read's run of CUPTI buffers is read as one batch a kind, with what reading them one by one gives.

A busy probe's flush is several 64 KiB buffers, and what the daemon pays per batch (the fields' checks,
the ingest guard, the pipeline's chunk) was paid per buffer. The ingest loop's batch merger now hands a
read's consecutive CUPTI_BUFFER frames to the session together (``Session.cupti_buffers``), which joins
each run of records of one kind. These tests hold it to reading the frames one by one: the same records
in the same order, the same problems, the same footprint, through the same decoder, merger and guard
the ingest loop runs.
"""

from __future__ import annotations

import random
import socket
from typing import Any

import numpy as np
import pytest
from gpufootprint.config import Config
from gpufootprint.hub import FeatureHub
from gpufootprint.ingest.protocol import BatchMerger, Connection, count_received, order_violation, probe_connection
from gpufootprint.ingest.session import Session
from gpufootprint.ingest.validate import Guard, Limits
from gpufootprint.pipeline import Pipeline
from gpufootprint.records import MEMORY_DTYPE, RecordKind
from gpufootprint.wire import cupti_layout as cl
from gpufootprint.wire import framing
from gpufootprint.wire.framing import FrameType

PID = 4321
T0 = 1_790_000_000_000_000_000


def _struct(kind: int, **fields: int) -> bytes:
    dtype = cl.API_RAW_DTYPE if kind in (cl.DRIVER, cl.RUNTIME) else cl.RAW_DTYPES[kind]
    rec = np.zeros(1, dtype)
    rec.view(np.uint8)[:4] = np.frombuffer(np.int32(kind).tobytes(), np.uint8)
    for name, value in fields.items():
        rec[name] = value
    return rec.tobytes()


class Stream:
    """A probe's stream: CUPTI buffers of memory, pool and API records (sometimes another pid's, an
    unwalkable one, a record stamped past 2262), watermarks between flushes; time only moves on, so
    nothing is late whichever watermark applies it."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.ts = T0
        self.live: list[tuple[int, int, int]] = []  # (dev, address, bytes) allocated and not released
        self.next_addr = 0x7F00_0000_0000

    def _tick(self) -> int:
        self.ts += self.rng.randint(1, 5_000)
        return self.ts

    def _memory(self) -> bytes:
        rng = self.rng
        if self.live and rng.random() < 0.45:
            dev, addr, size = self.live.pop(rng.randrange(len(self.live)))
            op = 2  # release
        else:
            dev, addr, size, op = rng.choice((0, 0, 0, 1)), self.next_addr, (1 << 20) * rng.randint(1, 4), 1
            self.next_addr += 1 << 23
            self.live.append((dev, addr, size))
        return _struct(cl.MEMORY2, op=op, mk=3, address=addr, bytes=size, timestamp=self._tick(), dev=dev)

    def buffer(self) -> tuple[int, bytes]:
        """(pid the frame claims, a buffer's bytes)."""
        rng = self.rng
        shape = rng.random()
        n = rng.choice((1, 3, 40, 512, 600))
        parts = []
        for _ in range(n):
            roll = rng.random()
            if shape < 0.5 or roll < 0.8:
                parts.append(self._memory())
            elif roll < 0.9:
                parts.append(_struct(cl.DRIVER, cbid=7, start=self._tick(), end=self.ts + 10, pid=PID))
            else:
                parts.append(_struct(cl.MEMORY_POOL, op=1, ptype=1, dev=0, address=0x5000_0000, size=1 << 24,
                                     timestamp=self._tick()))
        if rng.random() < 0.05:  # a record beyond the year 2262: the session drops it, counted
            parts.append(_struct(cl.MEMORY2, op=1, mk=3, address=0xDEAD_0000, bytes=4096, timestamp=(1 << 64) - 5))
        if rng.random() < 0.04:  # a kind no walk knows: the buffer is dropped whole, counted
            parts.append(np.int32(9_999).tobytes() + bytes(60))
        pid = PID if rng.random() > 0.05 else PID + 1  # another pid's: refused, counted
        return pid, b"".join(parts)

    def frames(self, flushes: int) -> bytes:
        out = [framing.PREAMBLE, framing.encode_json(FrameType.HELLO, {"pid": PID, "start_time": 1, "cupti_buffers": 3})]
        for _ in range(flushes):
            for _ in range(self.rng.choice((1, 2, 4, 7))):
                pid, data = self.buffer()
                out.append(framing.encode_cupti_buffer(pid, data, checked=False))
            out.append(framing.encode_watermark(self.ts))
            if self.rng.random() < 0.2:
                out.append(framing.encode_json(FrameType.HEARTBEAT, {"ts": self.ts, "counters": {"records_sent": 1}}))
        return b"".join(out)


def _daemon_side() -> tuple[Pipeline, Session, Connection, list[tuple[RecordKind, bytes]]]:
    cfg = Config()
    pipeline = Pipeline(cfg.footprint, hub=FeatureHub(cfg.features, cfg.sampler))
    guard = Guard(Limits.from_config(cfg.daemon))
    pipeline.waiting_room = guard.waiting_room
    conn = probe_connection(socket.socket(socket.AF_UNIX), PID, 0, "t", pipeline, guard, cfg.daemon.max_frame_bytes)
    session = conn.session
    submitted: list[tuple[RecordKind, bytes]] = []
    submit = pipeline.submit

    def noted(kind: RecordKind, recs: np.ndarray, *a: Any, **kw: Any) -> Any:
        submitted.append((kind, recs.tobytes()))
        return submit(kind, recs, *a, **kw)

    pipeline.submit = noted  # type: ignore[method-assign]
    return pipeline, session, conn, submitted


def _read(data: bytes, reads: list[int] | None) -> dict[str, Any]:
    """The stream through the ingest loop's path (decoder, order, received count, merger) in reads of the
    given sizes; ``None``: every frame handed to the session on its own, as before runs were joined."""
    pipeline, session, conn, submitted = _daemon_side()
    received: dict[int, list[int]] = {}
    try:
        at, k = 0, 0
        while at < len(data):
            size = len(data) if reads is None else reads[k % len(reads)]
            k += 1
            merger = BatchMerger(conn)
            for frame in conn.decoder.feed(data[at:at + size]):
                assert order_violation(conn, frame) is None
                count_received(conn, frame, received)
                if reads is None:
                    session.handle(frame)
                else:
                    merger.add(frame)
            merger.flush()
            at += size
    finally:
        conn.sock.close()
    pipeline.watermark(PID, T0 + 10**15)  # everything applied
    by_kind: dict[RecordKind, bytes] = {}
    for kind, raw in submitted:
        by_kind[kind] = by_kind.get(kind, b"") + raw
    proc = pipeline.processes[PID]
    return {"records": by_kind, "errors": dict(pipeline.errors.counts), "frames": session.frames,
            "session_records": session.records, "received": received.get(PID),
            "devices": {dev: (fp.device_bytes, len(fp.live)) for dev, fp in proc.devices.items()},
            "kinds_in_order": [k for k, _ in submitted], "walks_left": len(session._walked or ())}


@pytest.mark.parametrize("seed", range(6))
def test_a_reads_run_of_cupti_buffers_gives_what_the_buffers_one_by_one_give(seed: int) -> None:
    data = Stream(seed).frames(flushes=40)
    alone = _read(data, None)
    assert alone["errors"].get("bad_cupti_buffer") and alone["errors"].get("pid_mismatch"), "the stream lacks its faults"
    assert alone["devices"] and alone["records"][RecordKind.MEMORY]
    for reads in ([256 * 1024], [65_599, 700_001, 13], [1 << 22]):
        joined = _read(data, reads)
        assert joined["records"] == alone["records"]  # the same records of each kind, in the same order
        assert joined["errors"] == alone["errors"]
        assert joined["devices"] == alone["devices"]
        assert (joined["session_records"], joined["received"]) == (alone["session_records"], alone["received"])
        assert joined["walks_left"] == 0  # every frame walked was read: no buffer kept
        # Fewer batches, never more; and kinds interleave as they came (a run of one kind is joined, not
        # kinds gathered across each other).
        assert len(joined["kinds_in_order"]) <= len(alone["kinds_in_order"])
        if reads == [1 << 22]:
            assert len(joined["kinds_in_order"]) < len(alone["kinds_in_order"])  # runs were joined
        collapse = [k for i, k in enumerate(alone["kinds_in_order"]) if i == 0 or alone["kinds_in_order"][i - 1] != k]
        assert [k for i, k in enumerate(joined["kinds_in_order"])
                if i == 0 or joined["kinds_in_order"][i - 1] != k] == collapse


def test_a_flush_of_full_memory_buffers_is_one_batch_for_the_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seven 512-record buffers and a watermark in one read (what a probe at 2 M records a second across 64
    probes sends each 100 ms): one admission by the guard, one batch to the pipeline. (The process's first
    buffer, on a device it has not opened, is admitted alone.)"""
    rng = Stream(99)
    opening = b"".join(_struct(cl.MEMORY2, op=1, mk=3, address=0x1000 << dev, bytes=4096, timestamp=T0 + dev, dev=dev)
                       for dev in (0, 1))  # both devices the stream's buffers use
    first = [framing.PREAMBLE, framing.encode_json(FrameType.HELLO, {"pid": PID, "start_time": 1, "cupti_buffers": 3}),
             framing.encode_cupti_buffer(PID, opening, checked=False), framing.encode_watermark(T0 + 2)]
    frames = [b"".join(first)]
    for _ in range(7):
        frames.append(framing.encode_cupti_buffer(PID, b"".join(rng._memory() for _ in range(512)), checked=False))
    frames.append(framing.encode_watermark(rng.ts))
    admitted: list[int] = []
    admit = Guard.admit

    def counted(self: Guard, proc: Any, kind: RecordKind, recs: np.ndarray, *a: Any) -> np.ndarray:
        admitted.append(len(recs))
        return admit(self, proc, kind, recs, *a)

    monkeypatch.setattr(Guard, "admit", counted)
    out = _read(b"".join(frames), [len(frames[0]), 1 << 20])
    assert admitted == [2, 7 * 512]
    assert out["kinds_in_order"] == [RecordKind.MEMORY] * 2 and out["session_records"] == 2 + 7 * 512
    assert not out["errors"]


def _mem(n: int, *, op: int = 1, dev: int = 0, addr0: int = 0x7F00_0000_0000, t0: int = T0) -> bytes:
    """``n`` MEMORY2 structs of 1 MiB each, one every 8 MiB of addresses, one a nanosecond."""
    r = np.zeros(n, cl.RAW_DTYPES[cl.MEMORY2])
    r.view(np.uint8).reshape(n, -1)[:, :4] = np.frombuffer(np.int32(cl.MEMORY2).tobytes(), np.uint8)
    r["op"], r["mk"], r["bytes"], r["dev"] = op, 3, 1 << 20, dev
    r["address"] = addr0 + np.arange(n, dtype=np.uint64) * (1 << 23)
    r["timestamp"] = t0 + np.arange(n, dtype=np.uint64)
    return r.tobytes()


def _read_into(frames: list[bytes], joined: bool, hello_pid: int = PID, future_ns: int | None = None,
          **limits: Any) -> tuple[Pipeline, Session, dict[int, list[int]]]:
    """``frames`` after a HELLO, in one read, through the merger (``joined``) or each to the session: the
    pipeline, the session and the records counted as received, by pid."""
    import dataclasses

    cfg = Config()
    pipeline = Pipeline(cfg.footprint, hub=FeatureHub(cfg.features, cfg.sampler))
    guard = Guard(dataclasses.replace(Limits.from_config(cfg.daemon), **limits))
    pipeline.waiting_room = guard.waiting_room
    conn = probe_connection(socket.socket(socket.AF_UNIX), PID, 0, "t", pipeline, guard, cfg.daemon.max_frame_bytes,
                            future_limit_ns=None if future_ns is None else (lambda: future_ns))
    session = conn.session
    hello = framing.encode_json(FrameType.HELLO, {"pid": hello_pid, "start_time": 1, "cupti_buffers": 3})
    received: dict[int, list[int]] = {}
    merger = BatchMerger(conn)
    try:
        for frame in conn.decoder.feed(framing.PREAMBLE + hello + b"".join(frames)):
            assert order_violation(conn, frame) is None
            count_received(conn, frame, received)
            if joined:
                merger.add(frame)
            else:
                session.handle(frame)
        merger.flush()
    finally:
        conn.sock.close()
    return pipeline, session, received


def _one_read(frames: list[bytes], joined: bool, hello_pid: int = PID, future_ns: int | None = None,
              **limits: Any) -> dict[str, Any]:
    """What ``_read_into`` left: errors, what waited, what was read and received, the tables after a watermark."""
    pipeline, session, received = _read_into(frames, joined, hello_pid, future_ns, **limits)
    pending = pipeline.processes[PID].pending_records if PID in pipeline.processes else 0
    pipeline.watermark(PID, T0 + 10**15)
    proc = pipeline.processes.get(PID)
    return {"errors": dict(pipeline.errors.counts), "pending_before_watermark": pending, "records": session.records,
            "received": received.get(PID), "walks_left": len(session._walked),
            "devices": {d: (fp.device_bytes, len(fp.live)) for d, fp in sorted(proc.devices.items())} if proc else {}}


def _cu(pid: int, data: bytes) -> bytes:
    return framing.encode_cupti_buffer(pid, data, checked=False)


# At a share of the node's bounds a joined batch would be refused otherwise than its buffers one by one (the
# guard keeps the first allocations of a batch that fit, counts the batch's own releases, opens devices by
# number, and applies waiting records only when some already wait): such a run goes on buffer by buffer.
SHARES = {
    "allocations freed inside the first buffer, the second past the share": (
        [_mem(512) + _mem(512, op=2, t0=T0 + 1000), _mem(700, addr0=0x9_0000_0000_0000, t0=T0 + 5000)],
        {"max_live_allocations_per_process": 600}),
    "the second buffer frees the first's and allocates past the share": (
        [_mem(600), _mem(600, op=2, t0=T0 + 1000) + _mem(300, addr0=0x9_0000_0000_0000, t0=T0 + 5000)],
        {"max_live_allocations_per_process": 600}),
    "a device past the share, opened by a later buffer of a lower number": (
        [_mem(4, dev=5), _mem(4, dev=1, addr0=0x1_0000_0000, t0=T0 + 100)], {"max_device_footprints": 1}),
    "more records waiting than the pending share": (
        [_mem(512, addr0=0x1_0000_0000_0000 * (i + 1), t0=T0 + i * 1000) for i in range(5)],
        {"max_pending_records_per_process": 1000}),
}


@pytest.mark.parametrize("case", list(SHARES))
def test_at_a_share_a_run_refuses_what_its_buffers_refused_one_by_one(case: str) -> None:
    buffers, limits = SHARES[case]
    frames = [_cu(PID, b) for b in buffers]
    alone, joined = _one_read(frames, False, **limits), _one_read(frames, True, **limits)
    assert set(alone["errors"]) & {"allocation_limit", "device_limit", "pending_limit"}, alone  # a share was met
    assert joined == alone


FINE = {
    "a frame too short for its header between two buffers": [
        _cu(PID, _mem(3)), framing.encode(FrameType.CUPTI_BUFFER, b"\1\2\3\4"),
        _cu(PID, _mem(3, addr0=0x1_0000_0000_0000, t0=T0 + 10))],
    "a resync begun and ended inside the read": [
        _cu(PID, _mem(3)), framing.encode_json(FrameType.RESYNC_BEGIN, {"ts": T0 + 5}),
        _cu(PID, _mem(2, addr0=0x2_0000_0000_0000, t0=T0 + 6)), framing.encode_json(FrameType.RESYNC_END, {}),
        _cu(PID, _mem(3, addr0=0x3_0000_0000_0000, t0=T0 + 20)), _cu(PID, _mem(3, addr0=0x4_0000_0000_0000, t0=T0 + 30))],
    "BATCH frames between runs of buffers": [
        _cu(PID, _mem(3)), _cu(PID, _mem(3, addr0=0x1_0000_0000_0000, t0=T0 + 10)),
        framing.encode_batch(RecordKind.MEMORY, np.array(
            [(T0 + 20, 0x6_0000_0000_0000, 4096, 0, 0, 0, 0, PID, 0, 1, 0, 1, 1, 3, 0, 0)], dtype=MEMORY_DTYPE)),
        _cu(PID, _mem(3, addr0=0x2_0000_0000_0000, t0=T0 + 30)), _cu(PID, _mem(3, addr0=0x3_0000_0000_0000, t0=T0 + 40))],
    "a GOODBYE after a run": [
        _cu(PID, _mem(3)), _cu(PID, _mem(3, addr0=0x1_0000_0000_0000, t0=T0 + 10)),
        framing.encode_json(FrameType.GOODBYE, {"ts": T0 + 100})],
}


@pytest.mark.parametrize("case", list(FINE))
def test_protocol_frames_inside_a_read_give_what_the_frames_one_by_one_give(case: str) -> None:
    alone, joined = _one_read(FINE[case], False), _one_read(FINE[case], True)
    assert alone["records"] > 0 and joined == alone


def test_buffers_under_the_probes_namespace_pid_join_and_another_pids_are_refused_alike() -> None:
    frames = [_cu(777, _mem(3)), _cu(777, _mem(3, addr0=0x1_0000_0000_0000, t0=T0 + 10)),
              _cu(PID + 5, _mem(2, addr0=0x5_0000_0000_0000, t0=T0 + 50)),
              _cu(777, _mem(3, addr0=0x6_0000_0000_0000, t0=T0 + 60))]
    alone, joined = _one_read(frames, False, hello_pid=777), _one_read(frames, True, hello_pid=777)
    assert alone["records"] == 9 and alone["errors"] == {"pid_mismatch": 1} and joined == alone


def test_records_ahead_of_the_clock_are_counted_by_record_in_a_joined_batch() -> None:
    frames = [_cu(PID, _mem(3, t0=T0 + 10**12)), _cu(PID, _mem(3, addr0=0x1_0000_0000_0000, t0=T0 + 2 * 10**12))]
    alone, joined = _one_read(frames, False, future_ns=T0), _one_read(frames, True, future_ns=T0)
    assert alone["errors"] == {"future_timestamp": 6} and joined == alone


def test_a_read_of_many_tiny_buffers_walks_each_once_and_keeps_no_walk(walks: list[int]) -> None:
    """A read can hold thousands of small CUPTI frames: they are read in runs of ``MAX_RUN_FRAMES``, each
    frame walked once (counted as received, then read), and no walk outlives the read."""
    from gpufootprint.ingest.protocol import MAX_RUN_FRAMES

    n = 5 * MAX_RUN_FRAMES + 7
    frames = [_cu(PID, _mem(1, addr0=0x1_0000_0000 + (k << 24), t0=T0 + k)) for k in range(n)]
    out = _one_read(frames, True)
    assert len(walks) == n and out["walks_left"] == 0 and out["records"] == n and not out["errors"]


def test_a_watermark_between_buffers_is_applied_where_it_came_so_the_pending_share_is_met_alike() -> None:
    """Each buffer alone fits the pending share and its watermark applies it; held together past the
    watermark they would not: a watermark ends a run of buffers (review 40)."""
    frames = [_cu(PID, _mem(600)), framing.encode_watermark(T0 + 700),
              _cu(PID, _mem(600, addr0=0x9_0000_0000_0000, t0=T0 + 1000)), framing.encode_watermark(T0 + 2000)]
    alone = _one_read(frames, False, max_pending_records_per_process=1000)
    joined = _one_read(frames, True, max_pending_records_per_process=1000)
    assert alone["errors"] == {} and joined == alone


def test_buffers_read_one_by_one_at_a_share_each_wait_in_arrays_of_their_own() -> None:
    """A run the guard would not admit whole goes on buffer by buffer. What then waits must hold only its own
    records: a buffer's records left waiting as a view of the run's joined batch would keep the whole run (up
    to ``DECODE_CHUNK`` records) alive for each one, so a peer at its share could pin a run's memory with every
    record it leaves waiting, past what the pending share counts."""
    # past the share: the first buffer's 700 allocations, then a buffer releasing the first of them, stamped later
    frames = [_cu(PID, _mem(700)), _cu(PID, _mem(1, op=2, t0=T0 + 5000))]
    pipeline, _, _ = _read_into(frames, True, max_live_allocations_per_process=600)
    proc = pipeline.processes[PID]
    waiting = [recs for heap in proc.pending.values() for _, _, recs, _ in heap]
    assert pipeline.errors.counts["allocation_limit"] > 0 and waiting  # the share was met, records wait
    held = {id(r if r.base is None else r.base): (r if r.base is None else r.base).nbytes for r in waiting}
    assert sum(held.values()) <= sum(r.nbytes for r in waiting), (held, [len(r) for r in waiting])


def test_convert_into_rows_of_another_length_is_refused() -> None:
    """numpy would broadcast one struct over every row of a longer ``out``: said, not written."""
    raw = np.frombuffer(_mem(1), cl.RAW_DTYPES[cl.MEMORY2])
    with pytest.raises(ValueError, match="1 records into 5 rows"):
        cl.convert(cl.MEMORY2, raw, PID, out=np.zeros(5, MEMORY_DTYPE))
    assert cl.convert(cl.MEMORY2, raw, PID, out=np.zeros(1, MEMORY_DTYPE))["addr"].tolist() == [0x7F00_0000_0000]
