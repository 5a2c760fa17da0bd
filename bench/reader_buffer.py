"""One CUPTI buffer through the probe's reader, the C read against the numpy read, side by side (no GPU needed).

What the sender's read of one forwarded buffer costs (``RawBufferReader.read``, forwarding to a link that takes
everything; its table's queue emptied every 50,000 structs, as a watermark would), with the read in one C call
(``native_read``, the default since 2026-12-07) and with the read in numpy after the C walk (``native_read`` off),
alternating ``--alternations`` times, each figure the best of 5 x ``--number`` reads (timeit), in microseconds a
buffer. Two layouts from bench/probe_sender.py: a 64 KiB buffer of PyTorch's cache off (each allocation's MEMORY2
record and its calls' two API records: 377 allocations and releases a buffer) and one of 512 MEMORY2 records
(cudaMallocAsync churn).

Usage: python bench/reader_buffer.py [--alternations N] [--number N]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import probe_sender
from _harness import machine
from gpufootprint.probe.rawreader import FORWARDABLE


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--alternations", type=int, default=3)
    ap.add_argument("--number", type=int, default=1000)
    args = ap.parse_args()
    print(f"{machine()}; best of 5 x {args.number} reads, {args.alternations} alternations; us a buffer")
    for name, calls in (("caching off (377 MEMORY2 and their calls' API records)", True),
                        ("512 MEMORY2 records (cudaMallocAsync)", False)):
        bufs = probe_sender.buffers(20000, calls=calls)
        raw, valid = bufs[3]
        address = ctypes.addressof(raw)
        got: dict[str, list[float]] = {"C read": [], "numpy read": []}
        for _ in range(args.alternations):
            for label, native in (("C read", True), ("numpy read", False)):
                reader = probe_sender._reader(native)
                link = probe_sender._TakesAll()
                queue = reader.table.pending_raw

                def one(reader=reader, link=link, queue=queue) -> None:  # type: ignore[no-untyped-def]
                    reader.read(address, valid, forward_to=link, forwardable=FORWARDABLE, tee=None, in_gap=False)
                    if len(queue) > 50_000:
                        queue.clear()

                best = min(timeit.repeat(one, number=args.number, repeat=5)) / args.number
                got[label].append(best * 1e6)
        print(f"{name}: " + "; ".join(f"{k} {min(v):.1f}-{max(v):.1f} ({', '.join(f'{x:.1f}' for x in v)})"
                                      for k, v in got.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
