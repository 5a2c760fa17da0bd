"""Probe overhead: step-time ratios against no instrumentation, interleaved A/B.

Each configuration lives in its own worker process (started once, so start-up
costs are not measured); the parent runs rounds. ``--interleave step`` (the
default since run 12, 2026-12-02 20:21 UTC): within a round the workers take turns step
by step, in a fresh random order for every step, so all configurations of a
round share the same seconds of the machine. ``--interleave round``: each
worker times all its steps of the round in one turn (runs 1 to 11). Ratios
compare a configuration with the uninstrumented worker of the same round, so
drift of the machine hits both sides; the median ratio comes with a bootstrap
95 % interval over rounds.

  python bench/overhead.py --rounds 12 --out results.json

Workloads: (a) a transformer training step (6 layers, d=1024, bf16, batch
16x512); (b) a loop of 100 tiny ``add_`` launches per step. Configurations:
none; probe (the probe's default settings, daemon listening); the probe_*
variants in PROBE_CONFIGS (delivery, flush mode, GIL-free flush, bulk packing, CUPTI
buffer size; probe_daemon_away: socket missing, records dropped and counted);
torch_profiler (torch.profiler(profile_memory=True) around each round);
memory_history (torch.cuda.memory._record_memory_history); cupti_floor (CUPTI's own cost: the
kinds the probe enables, its flush period and forced-flush cadence, every buffer handed back
unread, no socket: what any CUPTI-based tool pays before it reads a record). ``--alloc`` picks
PyTorch's allocator: caching (its default: almost no records once warm), async
(``backend:cudaMallocAsync``, about 850 memory records a step) or nocache
(``PYTORCH_NO_CUDA_MEMORY_CACHING=1``, about 520). Each probed
configuration has a daemon (IngestServer) of its own, so the records it applied
late (behind its reorder window) are counted per configuration.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

_PERIOD = {"flush_mode": "period", "flush_nogil": True, "bulk_pack": True, "cupti_buffer_bytes": 64 << 10}
_FORCED_OLD = {"flush_mode": "forced", "flush_nogil": False, "bulk_pack": False, "cupti_buffer_bytes": 4 << 20}
PROBE_CONFIGS: dict[str, dict[str, Any]] = {
    "probe": {},  # the defaults of ProbeSettings
    # The default until 2026-12-02: forced flush through cupti-python (GIL held) every 100 ms.
    "probe_gil_flush": _FORCED_OLD,
    "probe_nogil": {**_FORCED_OLD, "flush_nogil": True, "bulk_pack": True},
    "probe_period": _PERIOD,
    "probe_period_gil": {**_PERIOD, "flush_nogil": False},
    "probe_period_nobulk": {**_PERIOD, "bulk_pack": False},
    "probe_period_4m": {**_PERIOD, "cupti_buffer_bytes": 4 << 20},
    "probe_forced_bulk": {**_FORCED_OLD, "bulk_pack": True},
    "probe_copies_off": {"copies": "off"},  # no MEMCPY/MEMSET records: the default since run 8
    # MEMCPY/MEMCPY2/MEMSET always on: the default until run 8
    "probe_copies_always": {"copies": "always"},
    # One copy kind each, always on (with MEMORY2 and MEMORY_POOL): which one costs on the launch path?
    "probe_k_memcpy": {"copies": "always", "copy_kinds": "memcpy"},
    "probe_k_memcpy2": {"copies": "always", "copy_kinds": "memcpy2"},
    "probe_k_memset": {"copies": "always", "copy_kinds": "memset"},
    # The default until the raw delivery: cupti-python's record objects on CUPTI's thread.
    "probe_objects": {"delivery": "objects"},
    "probe_daemon_away": {},  # the defaults, socket missing
    # Without driver-API hooks (the default until 2026-12-02 19:10 UTC: mappings on other threads lost).
    "probe_no_hooks": {"driver_hooks": False},
    # The same end through cuptiActivityEnableDriverApi(cuMemMap/cuMemUnmap): no subscriber
    # (run 12; the default since run 13).
    "probe_hooks_activity": {"driver_hooks_via": "activity"},
    "probe_hooks_subscriber": {"driver_hooks_via": "subscriber"},  # the default of run 10
    # Without the API records of the allocation calls that catch OOMs (docs/oom.md; on by default
    # since 2026-12-03): "probe" against this one is what those records cost.
    "probe_no_oom_records": {"oom_records": False},
    # The stream-ordered allocation calls' API records too (opt-in: a record per cudaMallocAsync).
    "probe_oom_async": {"oom_records_async": True},
    "probe_b": {},  # a second worker with the defaults (see REPLICAS)
    # CUPTI's buffers read in the workload's process (the default until 2026-12-03): the daemon gets
    # BATCH frames; the default now forwards buffers of memory records unread.
    "probe_packed": {"forward_buffers": False},
    # The probe's defaults; only the daemon's kernel windows differ (DAEMON_SAMPLER).
    "probe_kernel_windows_off": {},
    "probe_kernel_windows": {},
    "probe_kernel_windows_serial": {"kernel_window_kind": "serial"},
    "probe_kernel_windows_dense": {},
    "probe_launch_windows_dense": {},
    "probe_kernel_windows_off_b": {},  # a second worker without windows (a replica, as probe_b)
}
# probe_*_windows*: the daemon's sampler.kernel_window_* per configuration. Every other probed
# configuration runs the default daemon: since 2026-12-03 launch windows, 50 ms of the host's launch
# and wait calls every 30 s per process (the first 5 s in) and at bursts. "probe_kernel_windows_off":
# no window at all (what the goal of 1 % compares the default with). "probe_kernel_windows": the same
# schedule with windows of kernel records, CUPTI's CONCURRENT_KERNEL; "_serial": the serial KERNEL
# kind (the probe's kernel_window_kind); "_dense": 50 ms every 1 s, 30 times the duty cycle, of kernel
# or launch records.
_KERNELS: dict[str, Any] = {"kernel_window_ms": 50, "kernel_window_records": "kernels"}
_DENSE: dict[str, Any] = {"kernel_window_every_seconds": 1.0, "kernel_window_first_seconds": 1.0}
DAEMON_SAMPLER: dict[str, dict[str, Any]] = {
    "probe_kernel_windows_off": {"kernel_window_ms": 0},
    "probe_kernel_windows_off_b": {"kernel_window_ms": 0},
    "probe_kernel_windows": _KERNELS,
    "probe_kernel_windows_serial": _KERNELS,
    "probe_kernel_windows_dense": {**_KERNELS, **_DENSE},
    "probe_launch_windows_dense": {"kernel_window_ms": 50, **_DENSE},
}
# Workers that run the same configuration as another. Run 12 read 1.016 between two
# uninstrumented workers on (a) with a 95 % interval of [1.006, 1.026]: each process carries a
# bias of its own, so a ratio of two single workers cannot resolve 1 %. The summary's "pooled"
# part compares the geometric means of the replica groups (none, none_b, none_c against probe,
# probe_b) round by round, which averages that bias down.
REPLICAS: dict[str, str] = {"none_b": "none", "none_c": "none", "probe_b": "probe",
                            "probe_kernel_windows_off_b": "probe_kernel_windows_off"}
# Groups also compared with another group, round by round: the default's launch windows against none.
VERSUS: dict[str, str] = {"probe": "probe_kernel_windows_off"}
# none_b: a second uninstrumented worker. Its ratio to none is what the method reads with no
# instrumentation at all (A/A): the noise and bias floor for every other ratio.
CONFIGS = ["none", "none_b", "none_c", *PROBE_CONFIGS, "cupti_floor", "torch_profiler", "memory_history"]
ALLOCATORS = {"caching": {}, "async": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
              "nocache": {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}}


def cupti_floor() -> Any:
    """A CUPTI consumer that enables what the probe enables and reads nothing: the floor.

    The same activity kinds (MEMORY2, MEMORY_POOL), the same driver-API switch, CUPTI's
    flush period and a forced flush every second from a thread of its own, as the probe
    does; each completed buffer goes straight back to the pool, unread."""
    from gpufootprint.probe.backend import FOOTPRINT_ONLY, CuptiBackend
    from gpufootprint.probe.rawcallbacks import RawDelivery
    from gpufootprint.probe.settings import ProbeSettings

    s = ProbeSettings()
    backend = CuptiBackend()
    backend.configure(s.device_buffer_bytes, s.device_buffer_pool_limit)
    holder: list[RawDelivery] = []
    delivery = RawDelivery(s.cupti_buffer_bytes, s.raw_buffers, lambda addr, valid: holder[0].give_back(addr))
    holder.append(delivery)
    if not backend.register_raw(delivery):
        raise SystemExit(f"cupti_floor: raw callbacks not registered: {backend.errors}")
    for kind in FOOTPRINT_ONLY:
        backend.enable(kind)
    backend.driver_api_records(True)
    backend.flush_period(s.flush_ms)

    def flusher() -> None:
        while True:
            time.sleep(s.watermark_ms / 1000)
            backend.flush(True)

    threading.Thread(target=flusher, daemon=True, name="cupti-floor-flush").start()
    return delivery
HERE = Path(__file__).resolve()


# --- worker ---------------------------------------------------------------------


def worker(config: str, socket_path: str, steps_a: int, steps_b: int, cpus: str) -> None:
    if cpus:
        # Every worker on the same CPUs (they take turns): a worker's place on the machine
        # no longer differs from another's (A/A read 0.95-1.04 unpinned, runs 4 and 5).
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    floor = cupti_floor() if config == "cupti_floor" else None
    if config.startswith("probe"):
        from gpufootprint import probe

        ok = probe.start(socket=socket_path + ".absent" if config == "probe_daemon_away" else socket_path,
                         **PROBE_CONFIGS[config])
        if not ok:
            print(json.dumps({"error": "probe did not start", "status": probe.status()}), flush=True)
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    if config == "memory_history":
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True, dropout=0.0)
    model = torch.nn.TransformerEncoder(layer, 6).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(16, 512, 1024, device="cuda", dtype=torch.bfloat16)
    tiny = torch.zeros(256, device="cuda")

    def step_a() -> None:
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step_b() -> None:
        for _ in range(100):
            tiny.add_(1.0)

    def timed(fn: Any, n: int) -> list[float]:
        out = []
        for _ in range(n):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return out

    for _ in range(3):
        step_a()
    timed(step_b, 20)
    print(json.dumps({"ready": config}), flush=True)
    prof: Any = None
    for line in sys.stdin:
        cmd = line.strip()
        if cmd in ("a", "b"):  # one step, timed (--interleave step)
            print(json.dumps({"t": timed(step_a if cmd == "a" else step_b, 1)[0]}), flush=True)
            continue
        if cmd == "begin":  # a round starts (--interleave step)
            if config == "torch_profiler":
                from torch.profiler import ProfilerActivity, profile

                prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True)
                prof.__enter__()
            print(json.dumps({"ok": 1}), flush=True)
            continue
        if cmd == "end":
            if prof is not None:
                prof.__exit__(None, None, None)
                prof = None
            print(json.dumps({"ok": 1}), flush=True)
            continue
        if cmd != "round":
            break
        if config == "torch_profiler":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True):
                a = timed(step_a, steps_a)
                b = timed(step_b, steps_b)
        else:
            a = timed(step_a, steps_a)
            b = timed(step_b, steps_b)
        print(json.dumps({"a": a, "b": b}), flush=True)
    extra: dict[str, Any] = {}
    if floor is not None:
        extra["cupti_floor"] = {"buffers_completed": floor.completed, "buffers_refused": floor.refused}
    if config.startswith("probe"):
        from gpufootprint import probe

        extra["probe"] = probe.status()
    print(json.dumps({"done": config, **extra}), flush=True)


# --- parent -----------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def ask(p: subprocess.Popen[str], cmd: str) -> Any:
    """One command to a worker, its one-line JSON answer."""
    p.stdin.write(cmd + "\n")  # type: ignore[union-attr]
    p.stdin.flush()  # type: ignore[union-attr]
    return json.loads(p.stdout.readline())  # type: ignore[union-attr]


def bootstrap_ci(ratios: list[float], seed: int, n: int = 2000) -> tuple[float, float]:
    """95 % interval of the median of ``ratios``, resampling rounds with replacement."""
    rng = random.Random(seed)
    k = len(ratios)
    meds = sorted(statistics.median(rng.choices(ratios, k=k)) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def geo(steps: dict[str, dict[str, list[list[float]]]], group: list[str], w: str, rnd: int) -> float:
    """Geometric mean over a group of workers of their median step in one round."""
    return math.exp(statistics.fmean(math.log(statistics.median(steps[c][w][rnd])) for c in group))


def pooled(steps: dict[str, dict[str, list[list[float]]]], configs: list[str], seed: int) -> dict[str, Any]:
    """Every configuration (a replica group or a single worker) against the uninstrumented group,
    round by round (geometric means of the workers' round medians); p99 over all the steps."""
    groups: dict[str, list[str]] = {}
    for c in configs:
        groups.setdefault(REPLICAS.get(c, c), []).append(c)
    base = groups.get("none", [])
    out: dict[str, Any] = {}
    if len(base) < 2:
        return out
    for name, members in groups.items():
        if name == "none":
            continue
        row: dict[str, Any] = {"workers": members, "baseline_workers": base}
        for w in ("a", "b"):
            ratios = [geo(steps, members, w, r) / geo(steps, base, w, r) for r in range(len(steps[base[0]][w]))]
            lo, hi = bootstrap_ci(ratios, seed)
            flat = [t for c in members for r in steps[c][w] for t in r]
            bflat = [t for c in base for r in steps[c][w] for t in r]
            row[w] = {"median_ratio": round(statistics.median(ratios), 4),
                      "median_ratio_ci95": [round(lo, 4), round(hi, 4)],
                      "p99_ratio": round(pct(flat, 99) / pct(bflat, 99), 4)}
            other = groups.get(VERSUS.get(name, ""))
            if other:
                vs = [geo(steps, members, w, r) / geo(steps, other, w, r) for r in range(len(steps[base[0]][w]))]
                vlo, vhi = bootstrap_ci(vs, seed)
                row[w]["vs_" + VERSUS[name]] = round(statistics.median(vs), 4)
                row[w]["vs_" + VERSUS[name] + "_ci95"] = [round(vlo, 4), round(vhi, 4)]
            floor = groups.get("cupti_floor")
            if floor and name != "cupti_floor":
                vs = [geo(steps, members, w, r) / geo(steps, floor, w, r) for r in range(len(steps[base[0]][w]))]
                flo, fhi = bootstrap_ci(vs, seed)
                row[w]["vs_cupti_floor"] = round(statistics.median(vs), 4)
                row[w]["vs_cupti_floor_ci95"] = [round(flo, 4), round(fhi, 4)]
        out[name] = row
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--socket", default="", help=argparse.SUPPRESS)
    ap.add_argument("--cpus", default="", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps-a", type=int, default=15)
    ap.add_argument("--steps-b", type=int, default=100)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--progress", action="store_true", help="a line per round on stderr")
    ap.add_argument("--out", default="-")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--interleave", choices=("step", "round"), default="step",
                    help="workers take turns every step (step) or every round (round)")
    ap.add_argument("--alloc", choices=tuple(ALLOCATORS), default="caching",
                    help="PyTorch's allocator in every worker: caching (default), async (cudaMallocAsync), "
                         "nocache (PYTORCH_NO_CUDA_MEMORY_CACHING=1)")
    ap.add_argument("--pin", type=int, default=2,
                    help="run every worker on the same N CPUs, the parent on the others (0: no pinning)")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.socket, args.steps_a, args.steps_b, args.cpus)
        return 0
    cpus = sorted(os.sched_getaffinity(0))
    worker_cpus = cpus[-args.pin:] if 0 < args.pin < len(cpus) else []
    if worker_cpus:
        os.sched_setaffinity(0, set(cpus) - set(worker_cpus))  # the daemons stay off the workers' CPUs

    configs = args.configs.split(",")
    if args.alloc == "async" and "memory_history" in configs:
        # torch.cuda.memory._record_memory_history raises under cudaMallocAsync (H200, 2026-12-03).
        configs.remove("memory_history")
        print("memory_history left out: PyTorch refuses it under cudaMallocAsync", file=sys.stderr)
    worker_env = {**os.environ, **ALLOCATORS[args.alloc]}
    tmp = tempfile.mkdtemp(prefix="gpufootprint-bench-")
    from gpufootprint.configload import load_config
    from gpufootprint.pipeline import Pipeline
    from gpufootprint.ingest.server import IngestServer
    from gpufootprint.hub import FeatureHub

    cfg = load_config(env={})
    servers: dict[str, IngestServer] = {}
    for c in configs:
        if c.startswith("probe") and c != "probe_daemon_away":
            hub = FeatureHub(cfg.features, dataclasses.replace(cfg.sampler, **DAEMON_SAMPLER.get(c, {})))
            servers[c] = IngestServer(cfg, Pipeline(cfg.footprint, hub=hub),
                                      socket_path=os.path.join(tmp, f"{c}.sock"))
            hub.control = servers[c].send_control  # as App wires it
            servers[c].open()
            threading.Thread(target=servers[c].run, daemon=True).start()

    procs: dict[str, subprocess.Popen[str]] = {}
    for c in configs:
        sock = os.path.join(tmp, f"{c}.sock")
        procs[c] = subprocess.Popen([sys.executable, str(HERE), "--worker", c, "--socket", sock,
                                     "--steps-a", str(args.steps_a), "--steps-b", str(args.steps_b),
                                     "--cpus", ",".join(map(str, worker_cpus))],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=worker_env)
    for c, p in procs.items():
        line = p.stdout.readline()  # type: ignore[union-attr]
        if "ready" not in line:
            raise SystemExit(f"worker {c} failed to start: {line!r}")
    rng = random.Random(args.seed)
    steps: dict[str, dict[str, list[list[float]]]] = {c: {"a": [], "b": []} for c in configs}
    t_start = time.time()
    for rnd in range(args.rounds):
        if args.progress:
            print(f"round {rnd} at {time.time() - t_start:.1f} s", file=sys.stderr, flush=True)
        if args.interleave == "round":
            order = configs[:]
            rng.shuffle(order)
            for c in order:
                res = ask(procs[c], "round")
                steps[c]["a"].append(res["a"])
                steps[c]["b"].append(res["b"])
            continue
        for c in configs:
            ask(procs[c], "begin")
        for w, n in (("a", args.steps_a), ("b", args.steps_b)):
            times: dict[str, list[float]] = {c: [] for c in configs}
            for _ in range(n):
                order = configs[:]
                rng.shuffle(order)
                for c in order:
                    times[c].append(ask(procs[c], w)["t"])
            for c in configs:
                steps[c][w].append(times[c])
        for c in configs:
            ask(procs[c], "end")
    finals = {}
    for c, p in procs.items():
        finals[c] = ask(p, "stop")
        p.wait(30)
    time.sleep(0.5)
    daemons = {}
    for c, server in servers.items():
        pl = server.pipeline
        daemons[c] = {"late_records": pl.late_records, "records_ingested": dict(pl.records_ingested),
                      "errors": dict(pl.errors.counts), "checks": dict(pl.verify_results),
                      "drift_bytes_max": max((p.drift_bytes for p in pl.processes.values()), default=0),
                      "drift_mismatches": sum(p.drift_mismatches for p in pl.processes.values()),
                      "resync_requests": server.resync_requests}
        server.stop()

    summary: dict[str, Any] = {"rounds": args.rounds, "steps_a": args.steps_a, "steps_b": args.steps_b,
                               "alloc": args.alloc,
                               "interleave": args.interleave,
                               "worker_cpus": worker_cpus,
                               "wall_seconds": round(time.time() - t_start, 1), "configs": {}}
    base = steps.get("none")
    for c in configs:
        row: dict[str, Any] = {}
        for w in ("a", "b"):
            meds = [statistics.median(r) for r in steps[c][w]]
            flat = [t for r in steps[c][w] for t in r]
            row[w] = {"median_step_ms": round(statistics.median(flat) * 1e3, 4),
                      "p99_step_ms": round(pct(flat, 99) * 1e3, 4)}
            if base is not None:
                bmeds = [statistics.median(r) for r in base[w]]
                bflat = [t for r in base[w] for t in r]
                ratios = [m / b for m, b in zip(meds, bmeds)]
                row[w]["median_ratio"] = round(statistics.median(ratios), 4)
                row[w]["round_ratio_min"] = round(min(ratios), 4)
                row[w]["round_ratio_max"] = round(max(ratios), 4)
                lo, hi = bootstrap_ci(ratios, args.seed)
                row[w]["median_ratio_ci95"] = [round(lo, 4), round(hi, 4)]
                row[w]["round_ratios"] = [round(r, 4) for r in ratios]
                row[w]["p99_ratio"] = round(pct(flat, 99) / pct(bflat, 99), 4)
        row["final"] = finals.get(c)
        row["settings"] = PROBE_CONFIGS.get(c)
        row["daemon"] = daemons.get(c)
        summary["configs"][c] = row
    summary["pooled"] = pooled(steps, configs, args.seed)
    text = json.dumps(summary, indent=1)
    if args.out == "-":
        print(text)
        return 0
    Path(args.out).write_text(text + "\n")
    for c, row in summary["configs"].items():  # a short table; the whole summary is in --out
        cells = [f"{w}: med {row[w]['median_step_ms']} ms x{row[w].get('median_ratio')} "
                 f"ci95 {row[w].get('median_ratio_ci95')} "
                 f"[{row[w].get('round_ratio_min')}..{row[w].get('round_ratio_max')}] "
                 f"p99 {row[w]['p99_step_ms']} ms x{row[w].get('p99_ratio')}" for w in ("a", "b")]
        print(f"{c:20s}", " | ".join(cells))
        st = (row.get("final") or {}).get("probe") or {}
        if st:
            print(" " * 21, {k: st.get(k) for k in ("flush_mode", "delivery", "flushes", "flush_seconds",
                                                     "callback_seconds", "raw_buffers", "raw_buffers_refused",
                                                     "cupti_dropped_records",
                                                     "buffers_completed", "records_sent", "bulk_records",
                                                     "bulk_fallbacks", "records_dropped", "resyncs",
                                                     "drop_resyncs", "forwarded_buffers", "table_seconds",
                                                     "forward_seconds")}, row.get("daemon"))
    for name, row in summary["pooled"].items():
        print(f"pooled {name:13s}", f"{len(row['workers'])} vs {len(row['baseline_workers'])} workers |",
              " | ".join(f"{w}: x{row[w]['median_ratio']} ci95 {row[w]['median_ratio_ci95']} p99 x{row[w]['p99_ratio']}"
                         f" vs floor x{row[w].get('vs_cupti_floor')}"
                         + "".join(f" {k} x{v}" for k, v in row[w].items() if k.startswith("vs_probe"))
                         for w in ("a", "b")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
