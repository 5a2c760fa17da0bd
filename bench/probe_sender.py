"""The probe's own CPU cost per memory record, stage by stage, on the CPU (no GPU needed).

Under allocation churn (cudaMallocAsync: about 850 MEMORY2 records a training step) everything
the probe does per record runs in the workload's process, on its CPUs, holding the GIL. This
times each stage of the sender thread on buffers laid out as CUPTI 13 writes them (64 KiB,
MEMORY2 structs of 128 bytes, alloc/free pairs at reused addresses, as a stream-ordered
allocator makes them), plus one buffer where a MEMORY_POOL record breaks the run:

  walk       find each record's offset and kind in the buffer (cupti_layout.walk)
  pack       gather and convert to the wire dtype (Packer.pack_raw)
  table      queue into the probe's live table and apply at a watermark (LiveTable)
  encode     frame the batch (framing.encode_batch: header, CRC)
  forwarded_total  all the probe does per record when the daemon reads the buffers itself: check
             the buffer holds MEMORY2 records only (else walk it: in C where the probe's library loads,
             as the probe does; GPUFOOTPRINT_BENCH_PY_WALK=1: the Python walk), look at the API records
             for failed allocations, queue the structs for the table,
             frame the buffer as it is into a send buffer, apply the table at a watermark every
             57,000 records
  reader     the probe's own reader (probe/rawreader.py) forwarding each buffer, as the sender does (without
             a checksum, as to today's daemon; before 2026-12-06 18:15 UTC this stage computed one); its
             table's queue emptied every 57,000 records, as a watermark would (before 2026-12-07 it only grew)
  reader_numpy  the same with the read after the C walk in numpy (ProbeSettings.native_read off: the probe
             before 2026-12-07 evening)

Usage: python bench/probe_sender.py [--records N] [--rounds R] [--api-every K] [--calls] [--spinners N]
Prints microseconds per record for each stage (median of R rounds) and the machine.
``--spinners N`` runs N Python threads that hold the GIL whenever they run, as a framework's threads do
between calls, while the stages run: every call of the sender's that lets the GIL go (numpy does past 500
elements, as does every ctypes.CDLL call and socket call) then waits about a switch interval (5 ms) to win
it back. It also prints the spinners' loop iterations a second (what the workload's threads got done).
``--api-every K`` adds a third layout: a 40-byte RUNTIME record (CUpti_ActivityAPI, a call no
launch window or OOM watch reads) before every K-th MEMORY2 record, as a launch window's buffers
mix them (K=1: MEMORY2 and RUNTIME records alternating).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))

from gpufootprint.probe.livetable import LiveTable
from gpufootprint.probe.oom import OomWatch
from gpufootprint.probe.rawreader import FORWARDABLE, RawBufferReader
from gpufootprint.probe.resync import ResyncSchedule
from gpufootprint.probe.packing import Packer
from gpufootprint.records import RecordKind
from gpufootprint.wire import cupti_layout, framing

BUFFER = 64 << 10
PARTS = getattr(framing, "cupti_buffer_parts", None)
# The probe's walk in C (probe/nativecallbacks.py), where this tree has it and GPUFOOTPRINT_BENCH_PY_WALK is unset
try:
    from gpufootprint.probe.nativecallbacks import Walker

    WALKER = None if os.environ.get("GPUFOOTPRINT_BENCH_PY_WALK") else Walker()
except (ImportError, OSError):
    WALKER = None
WATERMARK_RECORDS = 57_000  # records between two watermarks (1 s of 850 records a 15 ms step)


def buffers(n: int, *, pool_record_every: int = 0, size: int = BUFFER, api_record_every: int = 0,
            calls: bool = False, partial: bool = False) -> list[tuple[ctypes.Array, int]]:  # type: ignore[type-arg]
    """CUPTI buffers holding ``n`` MEMORY2 records: alloc/free pairs over 300 reused addresses (a
    MEMORY_POOL record before every ``pool_record_every``-th, a RUNTIME record before every
    ``api_record_every``-th, where set). ``calls``: as PyTorch with its caching allocator off writes them,
    each allocation's MEMORY2 record followed by its two API records (the driver's cuMemAlloc_v2 and the
    runtime's cudaMalloc, switched on for failed allocations), a release's MEMORY2 record alone
    (cudaFree is not switched on), allocations and releases interleaved unevenly. ``partial``: each buffer
    holds a different number of records (16 to all that fit), as forced flushes hand them over."""
    dt = cupti_layout.RAW_DTYPES[cupti_layout.MEMORY2]
    pool_dt = cupti_layout.RAW_DTYPES[cupti_layout.MEMORY_POOL]
    api_dt = cupti_layout.API_RAW_DTYPE
    out = []
    i = 0
    t = 1_700_000_000_000_000_000
    lengths = random.Random(7)
    while i < n:
        raw = (ctypes.c_uint8 * size)()
        u8 = np.frombuffer(raw, dtype=np.uint8)
        off = 0
        end = size if not partial else dt.itemsize * lengths.randrange(16, size // dt.itemsize + 1)
        while i < n and off + dt.itemsize <= end:
            if pool_record_every and i % pool_record_every == 0 and off + pool_dt.itemsize <= size:
                rec = np.zeros(1, pool_dt)
                u8[off:off + pool_dt.itemsize] = rec.view(np.uint8)
                u8[off:off + 4].view("<i4")[0] = cupti_layout.MEMORY_POOL
                off += pool_dt.itemsize
            if api_record_every and i % api_record_every == 0 and off + api_dt.itemsize + dt.itemsize <= size:
                api = np.zeros(1, api_dt)
                api["start"] = api["end"] = t + i * 1000
                u8[off:off + api_dt.itemsize] = api.view(np.uint8)
                u8[off:off + 4].view("<i4")[0] = cupti_layout.RUNTIME
                off += api_dt.itemsize
            op = 1 + i % 2
            if calls:  # 1-3 allocations, then as many releases, by a small fixed pattern
                op = 1 if (i % 7) in (0, 1, 3, 5) else 2
            rec = np.zeros(1, dt)
            rec["op"] = op
            rec["mk"] = 3
            rec["address"] = 0x7F00_0000_0000 + ((i // 2) % 300) * 0x10000
            rec["bytes"] = 4096 * (1 + (i // 2) % 13)
            rec["timestamp"] = t + i * 1000
            rec["is_async"] = 1
            u8[off:off + dt.itemsize] = rec.view(np.uint8)
            u8[off:off + 4].view("<i4")[0] = cupti_layout.MEMORY2
            off += dt.itemsize
            i += 1
            if calls and op == 1:
                for kind, cbid in ((cupti_layout.DRIVER, 243), (cupti_layout.RUNTIME, 20)):
                    if off + api_dt.itemsize > size:
                        break
                    api = np.zeros(1, api_dt)
                    api["cbid"] = cbid
                    api["start"] = api["end"] = t + i * 1000
                    u8[off:off + api_dt.itemsize] = api.view(np.uint8)
                    u8[off:off + 4].view("<i4")[0] = kind
                    off += api_dt.itemsize
        out.append((raw, off))
    return out


def run(bufs: list[tuple[ctypes.Array, int]], n: int) -> dict[str, float]:  # type: ignore[type-arg]
    packer = Packer(os.getpid(), lambda chunk: chunks.append(chunk), capacity=4096, bulk=True)
    chunks: list[tuple[RecordKind, np.ndarray]] = []
    table = LiveTable()
    walks = []
    t0 = time.perf_counter()
    for raw, valid in bufs:
        walks.append(cupti_layout.walk(memoryview(raw).cast("B"), valid))
    t1 = time.perf_counter()
    for (raw, valid), offs in zip(bufs, walks):
        assert offs is not None
        packer.pack_raw(memoryview(raw).cast("B"), valid, offs)
        packer.flush()
    t2 = time.perf_counter()
    for kind, arr in chunks:
        if kind is RecordKind.MEMORY:
            table.add(arr)
    table.advance(1 << 63)
    t3 = time.perf_counter()
    for kind, arr in chunks:
        framing.encode_batch(kind, arr)
    t4 = time.perf_counter()
    assert sum(len(a) for k, a in chunks if k is RecordKind.MEMORY) == n
    # Forwarded (the default once the daemon says it reads CUPTI buffers), as probe/rawreader.py does it:
    # a buffer of MEMORY2 records only goes out as it is (its header and CRC, then the buffer copied once
    # into the link's send buffer); the probe keeps the structs for its own table, which applies them at
    # a watermark every WATERMARK_RECORDS records (about a second of cudaMallocAsync churn) on a table
    # that lives through the whole run, as the probe's does.
    fwd = LiveTable()
    oom = OomWatch(time.time_ns)
    out = bytearray()
    size = cupti_layout.RAW_DTYPES[cupti_layout.MEMORY2].itemsize
    since_mark = 0
    t5 = time.perf_counter()
    for raw, valid in bufs:
        view = memoryview(raw).cast("B")
        u8 = np.frombuffer(view, dtype=np.uint8, count=valid)
        if cupti_layout.uniform_kind(view, valid) == cupti_layout.MEMORY2:
            structs = cupti_layout.gather(u8, cupti_layout.MEMORY2, range(0, valid, size))
        else:
            offs = WALKER(ctypes.addressof(raw), valid) if WALKER is not None else None
            if offs is None:
                offs = cupti_layout.walk(view, valid)
            assert offs is not None
            structs = cupti_layout.gather(u8, cupti_layout.MEMORY2, offs[cupti_layout.MEMORY2])
            for api_kind in cupti_layout.API_KINDS:  # failed allocations are looked for, as rawreader does
                if api_kind in offs and len(offs[api_kind]):
                    oom.api_rows(u8, offs[api_kind], api_kind)
        fwd.add_raw(structs, 1)
        if PARTS is not None:
            for part in PARTS(1, view[:valid]):
                out += part
        else:  # code before 2026-12-06 (for side-by-side runs): one frame, copied into the send buffer
            out += framing.encode_cupti_buffer(1, view[:valid])
        if len(out) > 1 << 20:
            out.clear()  # the socket took it
        since_mark += len(structs)
        if since_mark >= WATERMARK_RECORDS:
            fwd.advance(int(structs["timestamp"][-1]) - 500_000)  # the newest half millisecond waits
            since_mark = 0
    fwd.advance(1 << 63)
    t6 = time.perf_counter()
    # The probe's own reader (probe/rawreader.py) forwarding each buffer to a link that takes everything:
    # what the sender thread does a buffer, the probe's code as it is (its table applied only at watermarks).
    # Its table's queue is emptied every WATERMARK_RECORDS records, as a watermark would (the apply is the
    # `table` stage's): a queue that only grew would time its growth. `reader_numpy`: the same reader with the
    # read in numpy after the C walk (ProbeSettings.native_read off, the probe before 2026-12-07 evening).
    times = {}
    for stage, native_read in (("reader", True), ("reader_numpy", False)):
        reader = _reader(native_read)
        if stage == "reader_numpy" and not hasattr(reader, "native_read"):
            continue  # a tree before the C read has one reader
        link = _TakesAll()
        queue = getattr(reader.table, "pending_raw", None)
        t7 = time.perf_counter()
        for raw, valid in bufs:
            reader.read(ctypes.addressof(raw), valid, forward_to=link, forwardable=FORWARDABLE,  # type: ignore[arg-type]
                        tee=None, in_gap=False)
            if queue is not None and len(queue) >= WATERMARK_RECORDS:
                queue.clear()
        times[stage] = time.perf_counter() - t7
    us = 1e6 / n
    return {"walk": (t1 - t0) * us, "pack": (t2 - t1) * us, "table": (t3 - t2) * us, "encode": (t4 - t3) * us,
            "total": (t4 - t0) * us, "forwarded_total": (t6 - t5) * us, **{k: v * us for k, v in times.items()}}


def _native_read(on: bool) -> dict[str, bool]:
    """The reader's ``native_read`` argument, where this tree's reader has one (--src runs older trees)."""
    import inspect

    return {"native_read": on} if "native_read" in inspect.signature(RawBufferReader).parameters else {}


class _TakesAll:
    def put_parts(self, parts: object, records: int = 0) -> bool:
        return True


def _reader(native_read: bool = True) -> RawBufferReader:
    from collections import Counter
    from types import SimpleNamespace

    cupti = SimpleNamespace(raw=SimpleNamespace(give_back=lambda address: None), um_wanted=False, backend=None)
    reader = RawBufferReader(pid=1, verify_walk=False, packer=Packer(1, lambda chunk: None, capacity=4096, bulk=True),
                           table=LiveTable(), oom=OomWatch(time.time_ns), cupti=cupti,  # type: ignore[arg-type]
                           resyncs=ResyncSchedule(), counters=Counter(), dropped_by_reason=Counter(),
                           clock_ns=time.time_ns, walker=WALKER, **_native_read(native_read))
    reader.checked = False  # as the probe sends to today's daemon (CUPTI_BUFFERS_UNCHECKED): no checksum
    return reader


class Spinners:
    """Python threads that hold the GIL whenever they run; ``rate`` is their loop iterations a second."""

    def __init__(self, n: int) -> None:
        import threading

        self._stop = threading.Event()
        self.iterations = 0
        self._threads = [threading.Thread(target=self._spin, daemon=True) for _ in range(n)]
        self._t0 = time.perf_counter()
        for t in self._threads:
            t.start()

    def _spin(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            sum(range(200))
        self.iterations += n

    def stop(self) -> float:
        self._stop.set()
        for t in self._threads:
            t.join()
        return self.iterations / (time.perf_counter() - self._t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--buffer-bytes", type=int, default=BUFFER, help="CUPTI buffer size (the probe's cupti_buffer_bytes)")
    ap.add_argument("--api-every", type=int, default=0,
                    help="also time buffers with a RUNTIME record before every K-th MEMORY2 record")
    ap.add_argument("--calls", action="store_true",
                    help="also time buffers laid out as with PyTorch's caching off (allocation calls' API records)")
    ap.add_argument("--spinners", type=int, default=0,
                    help="Python threads holding the GIL while the stages run (a framework's threads)")
    args = ap.parse_args()
    print(f"{platform.node()} {platform.processor() or platform.machine()} cpus={os.cpu_count()} "
          f"python {platform.python_version()} numpy {np.__version__}; {args.records} MEMORY2 records a round, "
          f"{args.buffer_bytes} B buffers; forwarded walk: {'C' if WALKER is not None else 'Python'}")
    layouts = [("memory2 only", buffers(args.records, size=args.buffer_bytes)),
               ("memory2, partial buffers", buffers(args.records, size=args.buffer_bytes, partial=True)),
               ("a pool record every 200", buffers(args.records, pool_record_every=200, size=args.buffer_bytes))]
    if args.api_every:
        layouts.append((f"a RUNTIME record every {args.api_every}",
                        buffers(args.records, api_record_every=args.api_every, size=args.buffer_bytes)))
    if args.calls:
        layouts.append(("caching off: calls' records", buffers(args.records, calls=True, size=args.buffer_bytes)))
    for name, bufs in layouts:
        spin = Spinners(args.spinners) if args.spinners else None
        rows = [run(bufs, args.records) for _ in range(args.rounds)]
        rate = f"  spinners {spin.stop():,.0f} iterations/s" if spin is not None else ""
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"{name:26s} " + "  ".join(f"{k} {v:.3f}" for k, v in med.items()) + f"  (us per record, median){rate}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
