"""Soak: real H200 probe traces replayed at 10x into a real daemon for --minutes; is RSS flat?

  python bench/soak.py --minutes 30 [--speed 10] [--workers 8] [--json out.json]

Each worker is a child process with its own socket and pid. It replays one recorded probe
trace (tests/data/h200_*.gfp.gz: memory, copy, memset, pool, kernel records with kernel names)
at ``--speed`` times real time, records re-stamped to now and re-labelled with its own pid,
then frees whatever the trace left allocated, and loops. Every ``--lifetime`` seconds a
worker exits (GOODBYE) and a new process takes its place, so process expiry runs too
(footprint.process_grace_seconds is set to 60 s here so that it happens within the soak).

Every 10 s: the daemon's RSS, CPU seconds, records ingested, a timed /metrics scrape.
The verdict compares RSS over the last half of the run: slope (MiB per 10 minutes) and
range. Exit status 0 always; the numbers are the result.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import ROOT, Daemon, machine, percentile, total  # noqa: E402

from gpufootprint.records import DTYPES, MEMORY_DTYPE, TIME_FIELD, MemoryOp, RecordKind  # noqa: E402
from gpufootprint.wire.framing import (  # noqa: E402
    PREAMBLE, Frame, FrameDecoder, FrameType, encode, encode_batch, encode_json, encode_watermark,
)
from gpufootprint.wire.sources import TraceFile  # noqa: E402

TRACES = ["h200_probe_caching.gfp.gz", "h200_kernels_train.gfp.gz", "h200_probe_async.gfp.gz",
          "h200_probe_expandable.gfp.gz", "h200_probe_pinned_managed.gfp.gz"]


def load_frames(path: Path) -> list[Frame]:
    dec = FrameDecoder()
    keep = (FrameType.BATCH, FrameType.STRINGS)
    return [f for c in TraceFile(path).chunks() for f in dec.feed(c) if f.type in keep]


def worker(sock_path: str, trace: str, speed: float, lifetime: float, stop_at: float) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent's handlers came along with fork
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    frames = load_frames(ROOT / "tests" / "data" / trace)
    batches = [(f, f.records()) if f.type is FrameType.BATCH else (f, None) for f in frames]
    t_first = min(int(r[TIME_FIELD[RecordKind(f.tag)]].min()) for f, r in batches if r is not None and len(r))
    pid = os.getpid()
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock_path)
    s.sendall(PREAMBLE + encode_json(FrameType.HELLO, {"pid": pid, "start_time": time.time_ns(), "soak": trace}))
    born = time.monotonic()
    sent = loops = 0
    while time.monotonic() - born < lifetime and time.time() < stop_at:
        base = time.time_ns()
        live: dict[tuple[int, int], np.void] = {}
        for f, recs in batches:
            if recs is None:
                s.sendall(encode(f.type, f.payload, f.tag))
                continue
            kind = RecordKind(f.tag)
            r = recs.copy()
            r["pid"] = pid
            tf = TIME_FIELD[kind]
            offs = ((r[tf].astype(np.int64) - t_first) / speed).astype(np.int64)
            r[tf] = base + offs
            if "end" in r.dtype.names:
                r["end"] = r[tf] + ((recs["end"].astype(np.int64) - recs[tf].astype(np.int64)) / speed).astype(np.int64)
            due = base + int(offs.max())
            delay = (due - time.time_ns()) / 1e9
            if delay > 0:
                time.sleep(delay)
            if kind is RecordKind.MEMORY:
                for row in r:
                    key = (int(row["addr"]), int(row["dev"]))
                    if row["op"] == MemoryOp.ALLOCATION:
                        live[key] = row.copy()
                    else:
                        live.pop(key, None)
            s.sendall(encode_batch(kind, r) + encode_watermark(time.time_ns()))
            sent += len(r)
        if live:  # the trace's process kept these: free them so each loop ends where it began
            rel = np.zeros(len(live), MEMORY_DTYPE)
            for i, row in enumerate(live.values()):
                rel[i] = row
            rel["op"] = MemoryOp.RELEASE
            rel["ts"] = time.time_ns()
            s.sendall(encode_batch(RecordKind.MEMORY, rel))
            sent += len(rel)
        loops += 1
        s.sendall(encode_json(FrameType.HEARTBEAT, {"ts": time.time_ns(), "counters": {
            "records_sent": sent, "records_dropped": 0, "batches_sent": loops}}))
    s.sendall(encode_json(FrameType.GOODBYE, {"ts": time.time_ns(), "counters": {"records_sent": sent,
                                                                                  "records_dropped": 0}}))
    s.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--speed", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--lifetime", type=float, default=60.0, help="seconds before a worker is replaced")
    ap.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    ap.add_argument("--json", help="write samples and summary here")
    args = ap.parse_args()
    daemon = Daemon("footprint.process_grace_seconds=60", core=0)
    ended_early: list[str] = []

    def _stop(signum: int, _frame: object) -> None:  # SIGINT/SIGTERM: finish the report with what ran
        ended_early.append(signal.Signals(signum).name)

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    os.sched_setaffinity(0, {1} if (os.cpu_count() or 1) > 1 else {0})
    t0 = time.time()
    stop_at = t0 + args.minutes * 60
    ctx = mp.get_context("fork")
    procs: list[mp.process.BaseProcess | None] = [None] * args.workers
    samples: list[dict[str, float]] = []
    next_sample = time.monotonic()
    spawned = 0
    started_cpu = daemon.usage().cpu_s
    try:
        while time.time() < stop_at and not ended_early:
            for i, p in enumerate(procs):
                if p is None or not p.is_alive():
                    if p is not None:
                        p.join()
                    trace = TRACES[(i + spawned) % len(TRACES)]
                    procs[i] = ctx.Process(target=worker, args=(daemon.sock, trace, args.speed, args.lifetime,
                                                                stop_at), daemon=True)
                    procs[i].start()  # type: ignore[union-attr]
                    spawned += 1
            if time.monotonic() >= next_sample:
                next_sample += args.interval
                took, m = daemon.scrape()
                u = daemon.usage()
                row = {"t_s": round(time.time() - t0, 1), "rss_mib": u.rss_bytes / 2**20, "hwm_mib": u.hwm_bytes / 2**20,
                       "cpu_s": u.cpu_s - started_cpu, "scrape_ms": took * 1000,
                       "records": total(m, "gpufootprint_records_ingested_total"),
                       "processes": total(m, "gpufootprint_processes"),
                       "ingest_errors": total(m, "gpufootprint_ingest_errors_total"),
                       "disconnects": total(m, "gpufootprint_daemon_disconnects_total")}
                samples.append(row)
                print(json.dumps(row), flush=True)
            time.sleep(0.2)
    finally:
        for p in procs:
            if p is not None:
                p.terminate() if ended_early else None
                p.join(args.lifetime + 10)
        rc = daemon.stop()
    half = [s for s in samples if s["t_s"] >= samples[-1]["t_s"] / 2] if samples else []
    slope = float("nan")
    if len(half) >= 2:
        x = np.array([s["t_s"] for s in half])
        y = np.array([s["rss_mib"] for s in half])
        slope = float(np.polyfit(x, y, 1)[0] * 600)  # MiB per 10 minutes
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0)), "machine": machine(),
        "command": "python bench/soak.py " + " ".join(sys.argv[1:]), "minutes_run": round((time.time() - t0) / 60, 2),
        "ended_early_by": ended_early[0] if ended_early else None,
        "speed": args.speed, "workers": args.workers, "processes_started": spawned,
        "records_ingested": samples[-1]["records"] if samples else 0,
        "rss_mib_first": samples[0]["rss_mib"] if samples else None,
        "rss_mib_last": samples[-1]["rss_mib"] if samples else None,
        "rss_mib_max": max(s["rss_mib"] for s in samples) if samples else None,
        "rss_mib_second_half_range": (max(s["rss_mib"] for s in half) - min(s["rss_mib"] for s in half)) if half else None,
        "rss_slope_mib_per_10min_second_half": slope,
        "daemon_cpu_share": (samples[-1]["cpu_s"] / samples[-1]["t_s"]) if samples and samples[-1]["t_s"] else None,
        "scrape_ms_p50": percentile([s["scrape_ms"] for s in samples], 50),
        "scrape_ms_p99": percentile([s["scrape_ms"] for s in samples], 99),
        "ingest_errors": samples[-1]["ingest_errors"] if samples else None,
        "daemon_exit_status": rc,
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "samples": samples}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
