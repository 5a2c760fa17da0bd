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
from gpufootprint.ingest.protocol import BatchMerger, Connection, count_received, order_violation
from gpufootprint.ingest.server import PROBE_UNCHECKED
from gpufootprint.ingest.session import Session
from gpufootprint.ingest.validate import Guard, Limits
from gpufootprint.pipeline import Pipeline
from gpufootprint.records import RecordKind
from gpufootprint.wire import cupti_layout as cl
from gpufootprint.wire import framing
from gpufootprint.wire.framing import FrameDecoder, FrameType

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
    session = Session(pipeline, source="probe", name=f"probe pid={PID}", peer_pid=PID)
    session.guard, session.limits = guard, guard.limits
    guard.census.connect(PID, 0, "t")
    conn = Connection(socket.socket(socket.AF_UNIX), FrameDecoder(cfg.daemon.max_frame_bytes, unchecked=PROBE_UNCHECKED),
                      session, PID, 0)
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
        collapse = [k for i, k in enumerate(alone["kinds_in_order"]) if i == 0 or alone["kinds_in_order"][i - 1] != k]
        assert [k for i, k in enumerate(joined["kinds_in_order"])
                if i == 0 or joined["kinds_in_order"][i - 1] != k] == collapse


def test_a_flush_of_full_memory_buffers_is_one_batch_for_the_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seven 512-record buffers and a watermark in one read (what a probe at 2 M records a second across 64
    probes sends each 100 ms): one admission by the guard, one batch to the pipeline."""
    rng = Stream(99)
    frames = [framing.PREAMBLE, framing.encode_json(FrameType.HELLO, {"pid": PID, "start_time": 1, "cupti_buffers": 3})]
    for _ in range(7):
        frames.append(framing.encode_cupti_buffer(PID, b"".join(rng._memory() for _ in range(512)), checked=False))
    frames.append(framing.encode_watermark(rng.ts))
    admitted: list[int] = []
    admit = Guard.admit

    def counted(self: Guard, proc: Any, kind: RecordKind, recs: np.ndarray, *a: Any) -> np.ndarray:
        admitted.append(len(recs))
        return admit(self, proc, kind, recs, *a)

    monkeypatch.setattr(Guard, "admit", counted)
    out = _read(b"".join(frames), [1 << 20])
    assert admitted == [7 * 512]
    assert out["kinds_in_order"] == [RecordKind.MEMORY] and out["session_records"] == 7 * 512
    assert not out["errors"]
