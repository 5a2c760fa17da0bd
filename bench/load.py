"""Load: 64 simulated probes over 8 GPUs at a realistic and an extreme record rate.

  python bench/load.py [--probes 64] [--gpus 8] [--devices-per-probe 1] [--rates 32000,200000] [--seconds 20]
                       [--json out.json]

Each simulated probe is its own process (fork) with its own Unix socket connection to a real
daemon (``python -m gpufootprint daemon``, pinned to CPU core 0; the probes and this script
run on the other cores). Like the real probe it flushes every 100 ms: a BATCH of MEMORY
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
from gpufootprint.wire import cupti_layout  # noqa: E402
from gpufootprint.wire.framing import (  # noqa: E402
    CUPTI_BUFFERS_LEVEL,
    PREAMBLE,
    FrameType,
    encode_batch,
    encode_cupti_buffer,
    encode_json,
    encode_watermark,
)

FLUSH_S = 0.1
BUFFER_BYTES = 16 << 20


def _cupti_frames(pid: int, recs: np.ndarray, checked: bool) -> bytes:
    """``recs`` as the default probe sends them: CUPTI's MEMORY2 structs, 512 to a frame (a 64 KiB buffer)."""
    raw = np.zeros(len(recs), cupti_layout.RAW_DTYPES[cupti_layout.MEMORY2])
    raw.view(np.uint8).reshape(len(recs), -1)[:, :4].view("<i4")[:, 0] = cupti_layout.MEMORY2
    for theirs, ours in (("timestamp", "ts"), ("address", "addr"), ("bytes", "bytes"), ("dev", "dev"), ("op", "op"),
                         ("mk", "mk")):
        raw[theirs] = recs[ours]
    data = raw.tobytes()
    step = 512 * raw.dtype.itemsize
    kw = {} if checked else {"checked": False}  # a tree before wire level 3 (bench/ingest_frames.py TREE=) knows only checked frames
    return b"".join(encode_cupti_buffer(pid, data[i:i + step], **kw) for i in range(0, len(data), step))


def probe(sock_path: str, index: int, gpus: int, per_second: float, stop_at: float, go: float,
          results: mp.Queue, devices: int = 1, frames: str = "batch") -> None:  # type: ignore[type-arg]
    pid = os.getpid()
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock_path)
    last_mark = time.time_ns()  # the latest watermark sent
    hello = {"pid": pid, "start_time": time.time_ns(), "bench": "load"}
    if frames != "batch":
        hello["cupti_buffers"] = CUPTI_BUFFERS_LEVEL
    s.sendall(PREAMBLE + encode_json(FrameType.HELLO, hello) + encode_watermark(last_mark))
    s.setblocking(False)
    per_batch = max(2, int(round(per_second * FLUSH_S / 2)) * 2)
    recs = np.zeros(per_batch, MEMORY_DTYPE)
    pairs = per_batch // 2
    # Its GPUs: ``devices`` of them from its own (index % gpus) on; each allocation/release pair on one.
    pair_dev = (index + np.arange(pairs) % max(1, devices)) % gpus
    recs["pid"], recs["mk"], recs["bytes"] = pid, MemoryKind.DEVICE, 2 << 20
    recs["dev"][0::2], recs["dev"][1::2] = pair_dev, pair_dev
    recs["op"][0::2], recs["op"][1::2] = MemoryOp.ALLOCATION, MemoryOp.RELEASE
    out = bytearray()
    sent = dropped = batches = 0
    accounted: list[tuple[int, int]] = []  # (end offset in the stream, records) not yet handed to the kernel
    put_total = sent_total = 0
    next_flush = go + (index % 10) * FLUSH_S / 10  # spread the probes over the flush period
    next_beat = go + 1.0
    k = 0
    while time.time() < stop_at:
        now_wall = time.time()
        if now_wall < go and now_wall - last_mark / 1e9 >= 1.0:
            # Waiting for the others to start: a watermark a second, as an idle probe sends, so the
            # daemon does not advance it by its own clock past records it is about to stamp.
            last_mark = time.time_ns()
            out += encode_watermark(last_mark)
        if now_wall < next_flush:
            time.sleep(min(next_flush - now_wall, 0.02))
        else:
            next_flush += FLUSH_S
            now = time.time_ns()
            addr = 0x7F00_0000_0000 + ((np.arange(pairs) + k * pairs) % 4096) * (2 << 20)
            recs["addr"][0::2] = addr
            recs["addr"][1::2] = addr
            # Stamped after the previous watermark and up to this one, as a probe's records are: a
            # probe that fell behind its flush period (a busy machine) must not stamp records before
            # the watermark it already sent, or they arrive late (they did: 6.5 M of 9 M at 1 M/s).
            now = max(now, last_mark + per_batch)
            recs["ts"] = last_mark + 1 + (np.arange(per_batch, dtype=np.uint64) * (now - last_mark - 1)) // per_batch
            last_mark = now
            k += 1
            body = encode_batch(RecordKind.MEMORY, recs) if frames == "batch" else \
                _cupti_frames(pid, recs, checked=frames == "cupti-checked")
            frame = body + encode_watermark(now)
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
    daemon = Daemon("footprint.process_grace_seconds=600", *args.daemon_set, core=0, profile_ingest=args.profile_ingest)
    ctx = mp.get_context("fork")
    results: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    go = time.time() + 1.0 + 0.05 * args.probes  # forking 256 probes on a busy machine takes seconds
    warm, measure = 3.0, args.seconds
    stop_at = go + warm + measure
    per_probe = rate / args.probes
    procs = [ctx.Process(target=probe, args=(daemon.sock, i, args.gpus, per_probe, stop_at, go, results,
                                             args.devices_per_probe, args.frames), daemon=True)
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
        "target_records_per_second": rate, "frames": args.frames, "probes": args.probes, "gpus": args.gpus,
        "devices_per_probe": args.devices_per_probe,
        "ingested_records_per_second": round(ingested / wall),
        "daemon_cpu_cores": round((u1.cpu_s - u0.cpu_s) / wall, 3),
        "rss_mib_max": round(max(rss) / 2**20, 1), "rss_hwm_mib": round(u1.hwm_bytes / 2**20, 1),
        "metrics_p50_ms": round(percentile(lat, 50) * 1000, 2), "metrics_p99_ms": round(percentile(lat, 99) * 1000, 2),
        "metrics_scrapes": len(lat), "metrics_bytes_series": len([1 for v in m1.values() for _ in v]),
        "probe_records_sent": sent, "probe_records_dropped": sum(g[2] for g in got),
        "daemon_records_received": received, "reconciled": received == sent,
        "ingest_errors": errors, "late_records": total(m, "gpufootprint_late_records_total"),
        "share_refusals": {f'{lab["uid"]}/{lab["reason"]}': v
                           for lab, v in m.get("gpufootprint_daemon_share_refusals_total", [])},
        "daemon_exit_status": rc,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--probes", type=int, default=64)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--devices-per-probe", type=int, default=1,
                    help="GPUs each probe's process uses (8 with --gpus 8: every process on all of them)")
    ap.add_argument("--rates", default="32000,200000", help="total records/s, comma-separated")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--frames", choices=("batch", "cupti", "cupti-checked"), default="batch",
                    help="what each probe sends: BATCH frames of our records (a probe before the daemon's first "
                         "verify), or CUPTI's MEMORY2 structs in CUPTI_BUFFER frames as the default probe forwards "
                         "them, without a checksum (cupti, wire level 3) or with one (cupti-checked)")
    ap.add_argument("--scrape-interval", type=float, default=0.1, help="seconds between timed scrapes")
    ap.add_argument("--json")
    ap.add_argument("--profile-ingest", metavar="OUT.pstats",
                    help="the daemon's ingest thread under cProfile, its statistics written here at the daemon's "
                         "stop (inflates the daemon's CPU: read shares from it, not cores)")
    ap.add_argument("--daemon-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a daemon configuration override (repeatable), e.g. oom.enabled=false")
    args = ap.parse_args()
    n = os.cpu_count() or 1
    os.sched_setaffinity(0, set(range(1, n)) if n > 1 else {0})  # every core but the daemon's
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
