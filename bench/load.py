"""Load: 64 simulated probes over 8 GPUs at a realistic and an extreme record rate.

  python bench/load.py [--probes 64] [--gpus 8] [--rates 32000,200000] [--seconds 20] [--json out.json]

Each simulated probe is its own process (fork) with its own Unix socket connection to a real
daemon (``python -m gpufootprint daemon``, pinned to CPU core 0; the probes and this script
run on the other core). Like the real probe it flushes every 100 ms: a BATCH of MEMORY
records (allocation/release pairs on its GPU, so its live table stays small), a WATERMARK,
and every second a HEARTBEAT with its counters. Sends are non-blocking into a 16 MiB
user-space buffer (probe.buffer_bytes); a batch that does not fit is dropped and counted,
as the real probe does. Nothing here waits for the daemon.

Per rate, after a 3 s warm-up, for --seconds: records/s ingested (the daemon's
gpufootprint_records_ingested_total), daemon CPU (utime+stime / wall, so 1.0 = one core
busy), RSS (VmRSS max over the window, VmHWM), /metrics latency p50/p99 (a scrape every
--scrape-interval, 100 ms by default, from this script: far more often than Prometheus would), drops (sum of the probes'
own counts) and whether the daemon's received count equals the probes' sent count.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Daemon, machine, percentile, total  # noqa: E402

from gpufootprint.records import MEMORY_DTYPE, MemoryKind, MemoryOp, RecordKind  # noqa: E402
from gpufootprint.wire.framing import PREAMBLE, FrameType, encode_batch, encode_json, encode_watermark  # noqa: E402

FLUSH_S = 0.1
BUFFER_BYTES = 16 << 20


def probe(sock_path: str, index: int, gpus: int, per_second: float, stop_at: float, go: float,
          results: mp.Queue) -> None:  # type: ignore[type-arg]
    pid = os.getpid()
    dev = index % gpus
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock_path)
    s.sendall(PREAMBLE + encode_json(FrameType.HELLO, {"pid": pid, "start_time": time.time_ns(), "bench": "load"}))
    s.setblocking(False)
    per_batch = max(2, int(round(per_second * FLUSH_S / 2)) * 2)
    recs = np.zeros(per_batch, MEMORY_DTYPE)
    recs["pid"], recs["dev"], recs["mk"], recs["bytes"] = pid, dev, MemoryKind.DEVICE, 2 << 20
    recs["op"][0::2], recs["op"][1::2] = MemoryOp.ALLOCATION, MemoryOp.RELEASE
    pairs = per_batch // 2
    out = bytearray()
    sent = dropped = batches = 0
    accounted: list[tuple[int, int]] = []  # (end offset in the stream, records) not yet handed to the kernel
    put_total = sent_total = 0
    next_flush = go + (index % 10) * FLUSH_S / 10  # spread the probes over the flush period
    next_beat = go + 1.0
    k = 0
    last_wm: int | None = None  # records are stamped after the previous watermark: none of them is late
    while time.time() < stop_at:
        now_wall = time.time()
        if now_wall < next_flush:
            time.sleep(min(next_flush - now_wall, 0.02))
        else:
            next_flush += FLUSH_S
            now = time.time_ns()
            addr = 0x7F00_0000_0000 + ((np.arange(pairs) + k * pairs) % 4096) * (2 << 20)
            recs["addr"][0::2] = addr
            recs["addr"][1::2] = addr
            # Spread over (previous watermark, now]: a flush that came early after a late one must not
            # stamp its records before the watermark it already sent (the daemon would count them late).
            if last_wm is None:  # the first flush: the flush period before it (the daemon's clock is behind)
                last_wm = now - int(FLUSH_S * 1e9)
            step = max(1, (now - last_wm) // per_batch)
            recs["ts"] = now - (per_batch - 1 - np.arange(per_batch, dtype=np.int64)) * step
            if int(recs["ts"][0]) <= last_wm:
                now = last_wm + per_batch  # the clock did not move on enough: one ns per record
                recs["ts"] = last_wm + 1 + np.arange(per_batch, dtype=np.int64)
            last_wm = now
            k += 1
            frame = encode_batch(RecordKind.MEMORY, recs) + encode_watermark(now)
            if len(out) + len(frame) > BUFFER_BYTES:
                dropped += per_batch
            else:
                out += frame
                put_total += len(frame)
                accounted.append((put_total, per_batch))
                batches += 1
            if time.time() >= next_beat:
                next_beat += 1.0
                beat = encode_json(FrameType.HEARTBEAT, {"ts": now, "counters": {
                    "records_sent": sent, "records_dropped": dropped, "batches_sent": batches}})
                if len(out) + len(beat) <= BUFFER_BYTES:
                    out += beat
                    put_total += len(beat)
        try:
            while out:
                n = s.send(out[: 1 << 20])
                del out[:n]
                sent_total += n
        except BlockingIOError:
            pass
        while accounted and accounted[0][0] <= sent_total:
            sent += accounted.pop(0)[1]
    s.setblocking(True)
    s.settimeout(30)
    try:  # drain, then say goodbye with the final counts
        s.sendall(out)
        sent_total += len(out)
        while accounted:
            sent += accounted.pop(0)[1]
        s.sendall(encode_json(FrameType.GOODBYE, {"ts": time.time_ns(), "counters": {
            "records_sent": sent, "records_dropped": dropped, "batches_sent": batches}}))
    except OSError:
        dropped += sum(n for _, n in accounted)
    s.close()
    results.put((pid, sent, dropped))


def run_rate(args: argparse.Namespace, rate: float) -> dict[str, object]:
    daemon = Daemon("footprint.process_grace_seconds=600", *args.daemon_set, core=0)
    ctx = mp.get_context("fork")
    results: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    go = time.time() + 1.0
    warm, measure = 3.0, args.seconds
    stop_at = go + warm + measure
    per_probe = rate / args.probes
    procs = [ctx.Process(target=probe, args=(daemon.sock, i, args.gpus, per_probe, stop_at, go, results), daemon=True)
             for i in range(args.probes)]
    for p in procs:
        p.start()
    time.sleep(max(0.0, go + warm - time.time()))
    _, m0 = daemon.scrape()
    u0 = daemon.usage()
    t0 = time.monotonic()
    lat: list[float] = []
    rss: list[int] = []
    while time.time() < stop_at:
        lat.append(daemon.timed_scrape())
        rss.append(daemon.usage().rss_bytes)
        time.sleep(args.scrape_interval)
    u1 = daemon.usage()
    _, m1 = daemon.scrape()
    wall = time.monotonic() - t0
    got = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(10)
    # Let the daemon take in the last bytes and the goodbyes, then compare counts.
    deadline = time.monotonic() + 20
    sent = sum(g[1] for g in got)
    while time.monotonic() < deadline:
        _, m = daemon.scrape()
        if total(m, "gpufootprint_daemon_records_received_total") >= sent:
            break
        time.sleep(0.2)
    received = total(m, "gpufootprint_daemon_records_received_total")
    errors = {lab["reason"]: v for lab, v in m.get("gpufootprint_ingest_errors_total", [])}
    rc = daemon.stop()
    ingested = total(m1, "gpufootprint_records_ingested_total") - total(m0, "gpufootprint_records_ingested_total")
    return {
        "target_records_per_second": rate, "probes": args.probes, "gpus": args.gpus,
        "ingested_records_per_second": round(ingested / wall),
        "daemon_cpu_cores": round((u1.cpu_s - u0.cpu_s) / wall, 3),
        "rss_mib_max": round(max(rss) / 2**20, 1), "rss_hwm_mib": round(u1.hwm_bytes / 2**20, 1),
        "metrics_p50_ms": round(percentile(lat, 50) * 1000, 2), "metrics_p99_ms": round(percentile(lat, 99) * 1000, 2),
        "metrics_scrapes": len(lat), "metrics_bytes_series": len([1 for v in m1.values() for _ in v]),
        "probe_records_sent": sent, "probe_records_dropped": sum(g[2] for g in got),
        "daemon_records_received": received, "reconciled": received == sent,
        "ingest_errors": errors, "late_records": total(m, "gpufootprint_late_records_total"),
        "daemon_exit_status": rc,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--probes", type=int, default=64)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--rates", default="32000,200000", help="total records/s, comma-separated")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--scrape-interval", type=float, default=0.1, help="seconds between timed scrapes")
    ap.add_argument("--json")
    ap.add_argument("--daemon-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a daemon configuration override (repeatable), e.g. oom.enabled=false")
    args = ap.parse_args()
    os.sched_setaffinity(0, {1} if (os.cpu_count() or 1) > 1 else {0})
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "machine": machine(),
              "command": "python bench/load.py " + " ".join(sys.argv[1:]), "runs": []}
    for rate in [float(r) for r in args.rates.split(",")]:
        res = run_rate(args, rate)
        report["runs"].append(res)  # type: ignore[attr-defined]
        print(json.dumps(res), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
