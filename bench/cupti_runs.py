"""The daemon's read of a busy probe's flushes: several CUPTI buffers a flush, through the ingest guard.

A probe forwards CUPTI's buffers as CUPTI fills them (64 KiB, 512 MEMORY2 records) and a WATERMARK after
them; at 2 M records a second from 64 probes each flush of a probe is about 3,100 records, seven buffers.
This feeds one probe's stream of ``--flushes`` such flushes (allocation/release pairs on one GPU) through
what the ingest loop runs for a connection: the frame decoder in reads of ``transport.RECV_BYTES``, the
protocol's order check and received count, the batch merger, and a session with the ingest guard into a
pipeline with its feature hub, all as the daemon wires them. Prints records per CPU-second of this
process, the best of ``--rounds``.

What one read holds depends on how far behind the daemon is. ``--reads flush`` (the default): each flush
read on its own, in reads of ``RECV_BYTES`` (a daemon that keeps up reads a flush soon after it is sent);
``--reads stream``: the stream read end to end in reads of ``RECV_BYTES`` (a daemon behind, whose reads hold
several flushes and their watermarks).

  python bench/cupti_runs.py [--src DAEMON_DIR] [--per-flush 3126] [--flushes 300] [--rounds 3]
                             [--frame-records 512] [--reads flush|stream]

``--src``: the daemon/ folder of another revision (a ``git worktree`` of it), to run side by side: run
this script once for each, alternately.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "daemon"))
ap.add_argument("--per-flush", type=int, default=3126, help="records a flush (even)")
ap.add_argument("--flushes", type=int, default=300)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--frame-records", type=int, default=512, help="records a CUPTI buffer (512: 64 KiB)")
ap.add_argument("--reads", choices=("flush", "stream"), default="flush")
args = ap.parse_args()
sys.path.insert(0, args.src)

import numpy as np
from gpufootprint.config import Config
from gpufootprint.hub import FeatureHub
from gpufootprint.ingest.protocol import BatchMerger, Connection, count_received, order_violation
from gpufootprint.ingest.session import Session

try:
    from gpufootprint.ingest.protocol import probe_connection
except ImportError:  # a revision before the daemon's wiring was one function: wired here as its _accept did
    from gpufootprint.ingest.server import PROBE_UNCHECKED

    def probe_connection(sock, pid, uid, tenant, pipeline, guard, max_frame_bytes):  # type: ignore[no-redef]
        session = Session(pipeline, source="probe", name=f"probe pid={pid}", peer_pid=pid)
        session.guard, session.limits = guard, guard.limits
        guard.census.connect(pid, uid, tenant)
        return Connection(sock, FrameDecoder(max_frame_bytes, unchecked=PROBE_UNCHECKED), session, pid, uid)
from gpufootprint.ingest.transport import RECV_BYTES
from gpufootprint.ingest.validate import Guard, Limits
from gpufootprint.pipeline import Pipeline
from gpufootprint.records import MEMORY_DTYPE, MemoryKind, MemoryOp
from gpufootprint.wire import cupti_layout, framing
from gpufootprint.wire.framing import FrameDecoder, FrameType

PID = 4321


def flush_frames(recs: np.ndarray, per_frame: int) -> bytes:
    raw = np.zeros(len(recs), cupti_layout.RAW_DTYPES[cupti_layout.MEMORY2])
    raw.view(np.uint8).reshape(len(recs), -1)[:, :4].view("<i4")[:, 0] = cupti_layout.MEMORY2
    for theirs, ours in (("timestamp", "ts"), ("address", "addr"), ("bytes", "bytes"), ("dev", "dev"), ("op", "op"),
                         ("mk", "mk")):
        raw[theirs] = recs[ours]
    data, step = raw.tobytes(), per_frame * raw.dtype.itemsize
    return b"".join(framing.encode_cupti_buffer(PID, data[i:i + step], checked=False) for i in range(0, len(data), step))


def stream(per_flush: int, flushes: int, per_frame: int) -> list[bytes]:
    """The HELLO, then each flush's bytes (its buffers and its watermark)."""
    recs = np.zeros(per_flush, MEMORY_DTYPE)
    pairs = per_flush // 2
    recs["pid"], recs["mk"], recs["bytes"] = PID, MemoryKind.DEVICE, 2 << 20
    recs["op"][0::2], recs["op"][1::2] = MemoryOp.ALLOCATION, MemoryOp.RELEASE
    out = [framing.PREAMBLE + framing.encode_json(FrameType.HELLO, {"pid": PID, "start_time": 1, "cupti_buffers": 3})]
    last = 1_700_000_000_000_000_000
    gap = 100_000_000 // per_flush  # a flush every 100 ms, its records spread over it
    for k in range(flushes):
        addr = 0x7F00_0000_0000 + ((np.arange(pairs) + k * pairs) % 4096) * (2 << 20)
        recs["addr"][0::2] = addr
        recs["addr"][1::2] = addr
        recs["ts"] = last + 1 + np.arange(per_flush, dtype=np.uint64) * gap
        last = int(recs["ts"][-1]) + 1
        out.append(flush_frames(recs, per_frame) + framing.encode_watermark(last))
    return out


def reads(parts: list[bytes], how: str) -> list[bytes]:
    """What the daemon's recv calls return: each part (``flush``) or the whole (``stream``) in pieces."""
    whole = [b"".join(parts)] if how == "stream" else parts
    return [p[i:i + RECV_BYTES] for p in whole for i in range(0, len(p), RECV_BYTES)]


def one_round(chunks: list[bytes]) -> float:
    cfg = Config()
    pipeline = Pipeline(cfg.footprint, hub=FeatureHub(cfg.features, cfg.sampler))
    guard = Guard(Limits.from_config(cfg.daemon))
    pipeline.waiting_room = guard.waiting_room
    conn = probe_connection(socket.socket(socket.AF_UNIX), PID, 0, "bench", pipeline, guard, cfg.daemon.max_frame_bytes)
    session = conn.session
    received: dict[int, list[int]] = {}
    try:
        t0 = time.process_time()
        for chunk in chunks:
            merger = BatchMerger(conn)
            for frame in conn.decoder.feed(chunk):
                assert order_violation(conn, frame) is None
                count_received(conn, frame, received)
                merger.add(frame)
            merger.flush()
        dt = time.process_time() - t0
    finally:
        conn.sock.close()
    assert not pipeline.errors.counts, dict(pipeline.errors.counts)
    assert session.records == received[PID][0], (session.records, received)
    return dt


def main() -> int:
    chunks = reads(stream(args.per_flush, args.flushes, args.frame_records), args.reads)
    n = args.per_flush * args.flushes
    best = min(one_round(chunks) for _ in range(args.rounds))
    print(f"{n / best / 1e6:.3f} M records per CPU-second ({best / args.flushes * 1e6:.0f} us a flush of "
          f"{args.per_flush} records in buffers of {args.frame_records}, {len(chunks)} reads ({args.reads}); "
          f"best of {args.rounds}; {args.src})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
