"""Replay throughput, side by side with a baseline revision: records per CPU-second of the replaying process.

Every figure is a ratio measured in one run: the working tree ("new") against a git revision
("base", default HEAD; unpacked with ``git archive`` into a temporary directory), with
an A/A control (the working tree against itself) that shows how noisy the machine was. Each
(case, variant) runs in its own subprocess that imports ``gpufootprint`` from that variant's
tree and replays the file with ``gpufootprint.replay.replay_file`` exactly as ``gpufootprint
replay`` does; the subprocess reports ``time.process_time()`` around the replay (CPU seconds of
that process: the machine is shared, so wall time would measure the neighbours). Rounds are
interleaved (the order of the variants rotates every round) and the median of the rounds is
reported.

Inputs (written once, by the working tree's own writers, into a temporary directory):
  * churn-4096: synthetic caching-allocator churn (alloc/free at reused addresses, a copy every
    tenth record) in 4,096-record batches, native framing; also replayed with the feature
    frames and the sampler switched off ("footprint only", to show what they cost);
  * h200-churn-async, h200-async, h200-kernels-train: the real H200 recordings in tests/data
    looped (each loop the same pid restarted, its timestamps shifted), with their own small
    batches, watermarks, marks and heartbeats;
  * cupti-jsonl: the churn written as CUPTI-JSONL (gzip).
Each worker also returns a digest of the marks the replay produced: a variant whose marks
differ from the base's is reported (exactness is checked by the same run).

Usage: python bench/replay_throughput.py [--base REV | --base-tree DIR] [--rounds R] [--cases a,b] [--json OUT]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BATCH = 4096

CASES = ("churn-4096", "churn-4096-footprint-only", "h200-churn-async", "h200-async", "h200-kernels-train",
         "cupti-jsonl")


# --- inputs (run in the parent, with the working tree's code) -------------------------------------------


def churn_batches(n_records: int, seed: int = 1):  # type: ignore[no-untyped-def]
    """(kind, records) batches: alloc/free pairs over 2,048 reused addresses, 1 copy per 10 records."""
    import numpy as np
    from gpufootprint.records import MEMCPY_DTYPE, MEMORY_DTYPE, CopyKind, MemoryKind, RecordKind

    rng = np.random.default_rng(seed)
    t0 = 1_796_000_000_000_000_000
    slots = 2048
    produced = 0
    step = 0
    while produced < n_records:
        n = min(BATCH, n_records - produced)
        n_cpy = n // 10
        n_mem = n - n_cpy
        n_mem -= n_mem % 2
        if n_mem == 0:
            break  # one odd record left: a release needs its allocation
        half = n_mem // 2
        # Each pair: allocate at a slot, release it a little later.
        slot = (np.arange(half) + step * half) % slots
        addr = 0x7F00_0000_0000 + slot.astype(np.uint64) * (64 << 20) + np.uint64(step % 2) * 4096
        size = rng.choice([512, 4096, 1 << 20, 2 << 20, 20 << 20], size=half).astype(np.uint64)
        base = t0 + step * 10_000_000 + np.arange(half, dtype=np.int64) * 2_000
        mem = np.zeros(n_mem, dtype=MEMORY_DTYPE)
        mem["ts"][0::2], mem["ts"][1::2] = base, base + 1_000
        mem["op"][0::2], mem["op"][1::2] = 1, 2
        mem["addr"][0::2], mem["addr"][1::2] = addr, addr
        mem["bytes"][0::2], mem["bytes"][1::2] = size, size
        mem["mk"] = MemoryKind.DEVICE
        mem["pid"] = 4242
        yield RecordKind.MEMORY, mem
        if n_cpy:
            cpy = np.zeros(n_cpy, dtype=MEMCPY_DTYPE)
            cpy["start"] = t0 + step * 10_000_000 + np.arange(n_cpy, dtype=np.int64) * 9_000
            cpy["end"] = cpy["start"] + 5_000
            cpy["bytes"] = 1 << 20
            cpy["ck"] = rng.choice([CopyKind.HTOD, CopyKind.DTOH, CopyKind.DTOD], size=n_cpy)
            cpy["pid"] = 4242
            yield RecordKind.MEMCPY, cpy
        produced += n_mem + n_cpy
        step += 1


def write_native(path: Path, n_records: int) -> int:
    from gpufootprint.wire.framing import PREAMBLE, FrameType, encode_batch, encode_json

    total = 0
    with open(path, "wb") as fh:
        fh.write(PREAMBLE + encode_json(FrameType.META, {"pid": 4242, "scenario": "churn"}))
        for kind, recs in churn_batches(n_records):
            fh.write(encode_batch(kind, recs))
            total += len(recs)
    return total


def write_looped(src: Path, path: Path, min_records: int) -> int:
    """A real recording repeated until it holds ``min_records``: each loop the same pid, restarted (a new
    HELLO start_time), its timestamps moved past the previous loop's. Its own batches, watermarks, marks."""
    from gpufootprint.replay import load_frames, shift_frame
    from gpufootprint.wire.framing import PREAMBLE, FrameType, encode, encode_json

    frames, problems = load_frames(src)
    assert not problems, problems
    pid = next((f.json()["pid"] for f in frames if f.type is FrameType.HELLO), 4242)
    times = [t for t in (_frame_time(f) for f in frames) if t is not None]
    span = max(times) - min(times) + 1_000_000_000
    total = loops = 0
    with open(path, "wb") as fh:
        fh.write(PREAMBLE)
        while total < min_records:
            for frame in frames:
                f = shift_frame(frame, loops * span, pid=pid)
                if f.type is FrameType.HELLO:
                    body = f.json()
                    body["start_time"] = loops  # a new process at the same pid: the pipeline restarts it
                    fh.write(encode_json(FrameType.HELLO, body))
                    continue
                if f.type is FrameType.BATCH:
                    total += len(f.records())
                fh.write(encode(f.type, f.payload, f.tag))
            loops += 1
    return total


def _frame_time(frame: Any) -> int | None:
    from gpufootprint.records import TIME_FIELD, RecordKind
    from gpufootprint.wire.framing import FrameType

    if frame.type is FrameType.BATCH:
        recs = frame.records()
        field = TIME_FIELD[RecordKind(frame.tag)]
        return int(recs[field].max()) if len(recs) else None
    if frame.type is FrameType.WATERMARK:
        return frame.watermark()
    if frame.type in (FrameType.MARK, FrameType.GOODBYE, FrameType.HEARTBEAT):
        ts = frame.json().get("ts")
        return ts if isinstance(ts, int) else None
    return None


def write_jsonl_gz(native: Path, path: Path) -> None:
    from gpufootprint.wire.framing import iter_frames
    from gpufootprint.wire.jsonl import write_jsonl
    from gpufootprint.wire.sources import TraceFile

    with gzip.open(path, "wt", compresslevel=1) as fh:
        write_jsonl(iter_frames(TraceFile(native).chunks()), fh)


def make_inputs(tmp: Path, args: argparse.Namespace) -> dict[str, Path]:
    sys.path.insert(0, str(ROOT / "daemon"))
    data = ROOT / "tests" / "data"
    out: dict[str, Path] = {}
    wanted = set(args.cases)
    if wanted & {"churn-4096", "churn-4096-footprint-only"}:
        write_native(tmp / "churn.gfp", args.records)
        out["churn-4096"] = out["churn-4096-footprint-only"] = tmp / "churn.gfp"
    for case, name in (("h200-churn-async", "h200_probe_churn_async.gfp.gz"), ("h200-async", "h200_probe_async.gfp.gz"),
                       ("h200-kernels-train", "h200_kernels_train.gfp.gz")):
        if case in wanted:
            write_looped(data / name, tmp / f"{case}.gfp", args.loop_records)
            out[case] = tmp / f"{case}.gfp"
    if "cupti-jsonl" in wanted:
        write_native(tmp / "churn_small.gfp", args.jsonl_records)
        write_jsonl_gz(tmp / "churn_small.gfp", tmp / "churn.jsonl.gz")
        out["cupti-jsonl"] = tmp / "churn.jsonl.gz"
    return out


# --- one measurement (run in a subprocess, importing the variant's tree) ----------------------------------


def worker(src: str, path: str, footprint_only: bool) -> None:
    sys.path.insert(0, os.path.join(src, "daemon"))
    from gpufootprint.config import FootprintConfig
    from gpufootprint.pipeline import Pipeline
    from gpufootprint.replay import replay_file

    try:
        from gpufootprint.hub import FeatureHub
    except ImportError:  # a base revision from before the hub left sampler/
        from gpufootprint.sampler.hub import FeatureHub  # type: ignore[no-redef]

    class FootprintOnlyHub(FeatureHub):
        def open_device(self, pid: int, dev: int, peaks: Any) -> None:
            pass  # no frame builder and no sampler: only to show what they cost

    import gpufootprint

    assert str(Path(gpufootprint.__file__).resolve()).startswith(str(Path(src).resolve())), gpufootprint.__file__
    pipeline = Pipeline(FootprintConfig(), hub=FootprintOnlyHub() if footprint_only else FeatureHub())
    cpu0 = time.process_time()
    wall0 = time.perf_counter()
    result = replay_file(path, pipeline)
    cpu = time.process_time() - cpu0
    wall = time.perf_counter() - wall0
    digest = hashlib.sha256(json.dumps(result.marks, sort_keys=True, default=str).encode()).hexdigest()[:16]
    print(json.dumps({"records": result.records, "cpu_s": cpu, "wall_s": wall, "marks": len(result.marks),
                      "marks_digest": digest, "problems": len(result.problems),
                      "errors": dict(pipeline.errors.counts), "late": pipeline.late_records}))


def run_worker(src: Path, path: Path, footprint_only: bool) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(src), str(path)]
    if footprint_only:
        cmd.append("--footprint-only")
    # One BLAS thread: a run on 2026-12-06 saw OpenBLAS's pool busy inside one variant's timed replays only
    # (CPU time above wall time); the daemon makes no BLAS call, so this only removes that noise.
    env = {**os.environ, "PYTHONPATH": "", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
    if out.returncode != 0:  # the worker's own words, not only its exit status
        raise SystemExit(f"replay_throughput: the worker replaying {path} with {src} failed "
                         f"(exit {out.returncode}): {out.stderr.strip()[-1500:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


# --- the side-by-side run ------------------------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU's model name, for the figure's machine (per-CPU-second rates differ by model)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def checkout(rev: str, tmp: Path) -> Path:
    """The revision's files, unpacked with ``git archive`` (a ``git worktree add`` would register a
    worktree in the repository others share while the bench runs)."""
    where = tmp / "base"
    where.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision of the baseline (default HEAD)")
    ap.add_argument("--base-tree", metavar="DIR",
                    help="the baseline's files already unpacked (a machine without the repository's history, such "
                         "as the lent GPU host: `git archive REV | tar -x -C DIR` here, DIR carried there)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cases", type=lambda s: s.split(","), default=list(CASES))
    ap.add_argument("--records", type=int, default=1_000_000, help="records in the native churn trace")
    ap.add_argument("--loop-records", type=int, default=300_000, help="records in each looped real trace")
    ap.add_argument("--jsonl-records", type=int, default=200_000, help="records in the JSONL trace")
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--worker", nargs=2, metavar=("SRC", "PATH"), help=argparse.SUPPRESS)
    ap.add_argument("--footprint-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], args.footprint_only)
        return 0
    unknown = set(args.cases) - set(CASES)
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}; known: {', '.join(CASES)}")
    if args.base_tree:
        stamp_file = Path(args.base_tree) / "COMMIT"
        base_rev = stamp_file.read_text().strip() if stamp_file.exists() else str(args.base_tree)
    else:
        base_rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.base], check=True,
                                  capture_output=True, text=True).stdout.strip()
    tmp = Path(tempfile.mkdtemp(prefix="gfp-replay-bench-"))
    base_src: Path | None = None
    try:
        base_src = Path(args.base_tree).resolve() if args.base_tree else checkout(args.base, tmp)
        inputs = make_inputs(tmp, args)
        variants = {"base": base_src, "new": ROOT, "new'": ROOT}  # new' = the A/A control
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {c: {v: [] for v in variants} for c in args.cases}
        for r in range(args.rounds):
            for case in args.cases:
                order = list(variants)
                order = order[r % len(order):] + order[:r % len(order)]  # rotate: no variant always first
                for v in order:
                    runs[case][v].append(run_worker(variants[v], inputs[case], case.endswith("footprint-only")))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
        results: dict[str, Any] = {}
        print(f"{'case':28s} {'records':>9s} {'base rec/CPU-s':>15s} {'new rec/CPU-s':>14s} {'new/base':>9s} "
              f"{'A/A':>6s}  marks")
        for case in args.cases:
            row: dict[str, Any] = {}
            for v in variants:
                rates = [x["records"] / x["cpu_s"] for x in runs[case][v]]
                row[v] = {"median_records_per_cpu_s": statistics.median(rates), "rates": rates,
                          "records": runs[case][v][0]["records"], "marks_digest": runs[case][v][0]["marks_digest"],
                          "errors": runs[case][v][0]["errors"], "late": runs[case][v][0]["late"]}
            # Ratios per round (the variants of one round ran back to back), then their median.
            ratio = statistics.median(n["cpu_s"] and b["cpu_s"] / n["cpu_s"] for b, n in
                                      zip(runs[case]["base"], runs[case]["new"]))
            aa = statistics.median(n["cpu_s"] / n2["cpu_s"] for n, n2 in zip(runs[case]["new"], runs[case]["new'"]))
            same = len({row[v]["marks_digest"] for v in variants}) == 1 and \
                len({json.dumps(row[v]["errors"], sort_keys=True) for v in variants}) == 1
            row.update(ratio_new_over_base=ratio, aa_ratio=aa, marks_identical=same)
            results[case] = row
            print(f"{case:28s} {row['new']['records']:>9,} {row['base']['median_records_per_cpu_s']:>15,.0f} "
                  f"{row['new']['median_records_per_cpu_s']:>14,.0f} {ratio:>8.2f}x {aa:>6.2f}  "
                  f"{'identical' if same else 'DIFFER'} ({runs[case]['new'][0]['marks']} marks)")
        import numpy as np

        machine = (f"{platform.machine()} {os.cpu_count()} cpus ({cpu_model()}), Python {platform.python_version()}, "
                   f"numpy {np.__version__}")
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        print(f"base {base_rev} ({args.base_tree or args.base}); new = working tree; {args.rounds} rounds interleaved; {stamp}; {machine}")
        if args.json:
            Path(args.json).write_text(json.dumps({"date": stamp, "machine": machine, "base": base_rev,
                                                   "command": " ".join(sys.argv), "results": results}, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
