"""The daemon's read of a peer that stays at its share of live allocations: every run of CUPTI buffers refused.

A peer that never releases what it holds keeps its live-allocation share full, so every run of buffers it sends
is one the guard would not admit whole: the session then reads it buffer by buffer (``Session._joined``). This
feeds ``--runs`` runs of seven 512-record MEMORY2 buffers (allocations, half of them stream-ordered, a watermark
after each run) through a probe connection as the daemon wires it (decoder, batch merger, session, guard,
pipeline), with a share of ``--share`` live allocations, and prints the CPU time a run (``time.process_time``,
the runs after the first ``--warm``) and the errors counted.

  python bench/refused_runs.py [--src DAEMON_DIR] [--runs 200] [--share 1000] [--free]

``--free``: half of each buffer releases the other half, so no share is met (the whole path, for comparison).
``--src``: the daemon/ folder of another revision (``git archive REV daemon | tar x -C DIR``): run this script
once for each, alternately.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import socket
import sys
import time
from pathlib import Path

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "daemon"))
ap.add_argument("--runs", type=int, default=200)
ap.add_argument("--warm", type=int, default=20)
ap.add_argument("--share", type=int, default=1000)
ap.add_argument("--free", action="store_true")
args = ap.parse_args()
sys.path.insert(0, args.src)

import numpy as np
from gpufootprint.config import Config
from gpufootprint.hub import FeatureHub
from gpufootprint.ingest.protocol import BatchMerger, probe_connection
from gpufootprint.ingest.validate import Guard, Limits
from gpufootprint.pipeline import Pipeline
from gpufootprint.wire import cupti_layout as cl
from gpufootprint.wire import framing
from gpufootprint.wire.framing import FrameType

PID, T0 = 4321, 1_790_000_000_000_000_000


def buffer(n: int, addr0: int, t0: int) -> bytes:
    """``n`` MEMORY2 structs of 1 MiB allocations (every other one stream-ordered), or with ``--free`` the
    second half releasing the first."""
    r = np.zeros(n, cl.RAW_DTYPES[cl.MEMORY2])
    r.view(np.uint8).reshape(n, -1)[:, :4] = np.frombuffer(np.int32(cl.MEMORY2).tobytes(), np.uint8)
    r["op"], r["mk"], r["bytes"], r["dev"] = 1, 3, 1 << 20, 0
    r["address"] = addr0 + np.arange(n, dtype=np.uint64) * (1 << 23)
    r["timestamp"] = t0 + np.arange(n, dtype=np.uint64)
    r["is_async"][::2], r["pool_type"] = 1, 1
    if args.free:
        h = n // 2
        r["op"][h:], r["address"][h:] = 2, r["address"][:h]
    return r.tobytes()


def main() -> int:
    logging.disable(logging.CRITICAL)
    cfg = Config()
    pipeline = Pipeline(cfg.footprint, hub=FeatureHub(cfg.features, cfg.sampler))
    guard = Guard(dataclasses.replace(Limits.from_config(cfg.daemon), max_live_allocations_per_process=args.share))
    pipeline.waiting_room = guard.waiting_room
    conn = probe_connection(socket.socket(socket.AF_UNIX), PID, 0, "bench", pipeline, guard, cfg.daemon.max_frame_bytes)
    hello = framing.encode_json(FrameType.HELLO, {"pid": PID, "start_time": 1, "cupti_buffers": 3})
    t, addr, spent = T0, 0x7F00_0000_0000, 0.0
    for i in range(args.runs):
        data = b"".join(framing.encode_cupti_buffer(PID, buffer(512, addr + k * (512 << 23), t + k * 512),
                                                    checked=False) for k in range(7))
        addr, t = addr + 7 * (512 << 23), t + 7 * 512
        data += framing.encode_watermark(t)
        frames = list(conn.decoder.feed(framing.PREAMBLE + hello + data if i == 0 else data))
        merger = BatchMerger(conn)
        c0 = time.process_time()
        for frame in frames:
            merger.add(frame)
        merger.flush()
        if i >= args.warm:
            spent += time.process_time() - c0
    conn.sock.close()
    print(f"{args.src}: {spent / (args.runs - args.warm) * 1e6:.0f} us CPU a run of 7x512 records "
          f"({'--free' if args.free else f'share {args.share}'}); errors {dict(pipeline.errors.counts)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
