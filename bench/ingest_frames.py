"""The daemon's ingest of one probe's stream, by the kind of frames it sends: records per CPU-second.

A probe of today forwards CUPTI's MEMORY2 structs (CUPTI_BUFFER frames of 512 records, 128 bytes each,
without a checksum once the daemon said so); a probe before the daemon's first verify, and every
recording, sends BATCH frames of our 80-byte records. This feeds one synthetic stream of
allocation/release pairs (``--batches`` flushes of ``--records`` records, each followed by a
watermark) through the daemon's own decoder and session into a pipeline (footprint only: no feature
frames or sampler, to show the decoding), in 1 MiB reads as a socket gives them, and prints the
records per CPU-second of this process. Compare trees side by side with ``TREE=DIR``.

Usage: [TREE=DIR] python bench/ingest_frames.py {batch,cupti,cupti-checked} [--records N] [--batches B]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.environ.get("TREE", str(Path(__file__).resolve().parents[1])) + "/daemon")

import numpy as np  # noqa: E402

from gpufootprint.configload import load_config  # noqa: E402
from gpufootprint.ingest.session import Session  # noqa: E402
from gpufootprint.pipeline import Pipeline  # noqa: E402
from gpufootprint.records import MEMORY_DTYPE, MemoryKind, MemoryOp, RecordKind  # noqa: E402
from gpufootprint.wire import framing  # noqa: E402
from gpufootprint.wire.framing import FrameDecoder, FrameType  # noqa: E402

# After gpufootprint is imported from TREE: bench/load.py's helper module puts this checkout's daemon first
# on the path, which then changes nothing (the package is loaded).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import _cupti_frames  # noqa: E402


def stream(kind: str, per: int, batches: int, pid: int = 4321) -> bytes:
    recs = np.zeros(per, MEMORY_DTYPE)
    pairs = per // 2
    recs["pid"], recs["mk"], recs["bytes"] = pid, MemoryKind.DEVICE, 2 << 20
    recs["op"][0::2], recs["op"][1::2] = MemoryOp.ALLOCATION, MemoryOp.RELEASE
    out = [framing.PREAMBLE + framing.encode_json(FrameType.HELLO, {"pid": pid, "start_time": 1, "cupti_buffers": 3})]
    last = 1_700_000_000_000_000_000
    for k in range(batches):
        addr = 0x7F00_0000_0000 + ((np.arange(pairs) + k * pairs) % 4096) * (2 << 20)
        recs["addr"][0::2] = addr
        recs["addr"][1::2] = addr
        recs["ts"] = last + 1 + np.arange(per, dtype=np.uint64) * 1000
        last = int(recs["ts"][-1]) + 1
        body = framing.encode_batch(RecordKind.MEMORY, recs) if kind == "batch" else \
            _cupti_frames(pid, recs, checked=kind == "cupti-checked")
        out.append(body + framing.encode_watermark(last))
    return b"".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("frames", choices=("batch", "cupti", "cupti-checked"))
    ap.add_argument("--records", type=int, default=30_000)
    ap.add_argument("--batches", type=int, default=40)
    args = ap.parse_args()
    data = stream(args.frames, args.records, args.batches)
    cfg = load_config(env={})
    pipeline = Pipeline(cfg.footprint)
    session = Session(pipeline, source="probe", name="probe pid=4321", peer_pid=4321)
    try:
        decoder = FrameDecoder(unchecked=frozenset({FrameType.CUPTI_BUFFER}))
    except TypeError:  # a tree before wire level 3
        decoder = FrameDecoder()
    t0 = time.process_time()
    for i in range(0, len(data), 1 << 20):
        for f in decoder.feed(data[i:i + (1 << 20)]):
            session.handle(f)
    dt = time.process_time() - t0
    assert not pipeline.errors.counts, dict(pipeline.errors.counts)
    print(f"{args.frames}: {args.records * args.batches / dt / 1e6:.2f} M records per CPU-second "
          f"({os.environ.get('TREE', 'this tree')}: {framing.__file__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
