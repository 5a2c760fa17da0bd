"""On the GPU: CUDA Graph advice on real training steps from a DEFAULT daemon, and NVML's busy time
measured against kernel records.

Run (one command, about 5 minutes on the H200; everything it measures goes to $GPUFOOTPRINT_GPU_OUT):

    GPUFOOTPRINT_GPU_OUT=/tmp/graph-out python3 -m pytest -q -m gpu tests/gpu/test_graph_advice_gpu.py

For each held-out loop of tests/gpu/graph_workloads.py (``matmul``: ten 8192x8192 fp32 matmuls and a
synchronize, about 266 ms a step; ``tiny``: 96 tiny CuPy launches and a synchronize, about 2.6 ms;
``transformer``: a 6-layer bf16 encoder's training step):

1. **Truth.** A daemon with windows of kernel records (``sampler.kernel_window_records=kernels``, 3 s
   each) while this test polls every NVML candidate for the process's GPU busy share at 20 ms:
   ``nvmlDeviceGetProcessesUtilizationInfo`` and ``nvmlDeviceGetProcessUtilization`` (per process),
   ``nvmlDeviceGetUtilizationRates`` and ``nvmlDeviceGetSamples(GPU_UTILIZATION)`` (the device: right
   only when the process is alone on it, as here). Per kernel window: the kernels' busy share (union of
   their intervals over the window's first start to last end) and mean duration; each candidate's
   estimate by the daemon's rule (the mean of its samples stamped in the span or 0.5 s after,
   engines/busy.py) and its error. The kernel-window verdict is read from the daemon's /api/engines.
2. **Live.** A default daemon (socket and port only) while the loop runs: the time to the first
   verdict other than insufficient_data, that verdict ("capture" for matmul, "keep" for tiny, the
   kernel-window verdict for transformer), its evidence (the step-following launch window and NVML's
   busy share), and the step times before and after the first window (a lasting cost would show).
3. **Replay.** ``gpufootprint abtest`` on the probe's recording of the live run (with the daemon's
   ``/api/nvml`` saved beside it) gives the live verdict.

Written to $GPUFOOTPRINT_GPU_OUT (for tests/data; tests/integration/test_graph_advice_traces.py replays
them): ``h200_graph_<loop>.gfp.gz`` (the live run's recording, with a mark at each step phase),
``h200_graph_<loop>.gfp.gz.nvml.json``, ``h200_graph_<loop>_kernels.gfp.gz`` (the truth run's),
``graph_advice_<loop>.json`` (every figure above) and the step logs.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import cli_env
from tests.daemon_process import free_port as _free_port

HERE = Path(__file__).resolve().parent
WORKLOAD = str(HERE / "graph_workloads.py")
EXPECTED = {"matmul": "capture", "matmul2s": "capture", "tiny": "keep",
            "transformer": None}  # None: the kernel windows' verdict
BUSY_ERROR = 0.2  # graph_advisor.busy_error's default: the candidate the daemon uses must be within it
SLACK_NS = 500_000_000  # engines/busy.py SLACK_NS
#: The requirement is a verdict within 2 minutes; the run allows 75 s so three loops fit the device time.
LIVE_LIMIT_S = 75


def _out(tmp_path: Path) -> Path:
    out = Path(os.environ.get("GPUFOOTPRINT_GPU_OUT") or tmp_path / "out")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _api(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
        return json.loads(resp.read())


class Candidates:
    """Every NVML reading of GPU busy time, polled at 20 ms on a thread of this test: (wall ns, ratio)."""

    def __init__(self) -> None:
        import pynvml

        self.nv = pynvml
        pynvml.nvmlInit()
        self.h = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.samples: dict[str, list[tuple[int, int, float]]] = {  # name -> (pid or 0, ts ns, ratio)
            "processes_utilization_info": [], "process_utilization": [], "device_utilization_rates": [],
            "device_samples": []}
        self.errors: dict[str, str] = {}
        self.raw_stamp: dict[str, tuple[int, int]] = {}  # name -> (first NVML stamp in us, wall ns when read)
        self._seen = {k: 0 for k in self.samples}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    @staticmethod
    def _wall(ts_us: int) -> int:
        """NVML's sample stamp on the wall clock (as nvml/poller.py moves a monotonic one)."""
        ns, wall = ts_us * 1000, time.time_ns()
        if abs(ns - wall) < 3600 * 10**9:
            return ns
        mono = time.monotonic_ns()
        return ns + wall - mono if abs(ns - mono) < 3600 * 10**9 else ns

    def _per_process(self, name: str, fn: str) -> None:
        try:
            got = getattr(self.nv, fn)(self.h, self._seen[name])
        except Exception as exc:  # noqa: BLE001 - NOT_FOUND: no newer sample; others recorded
            if getattr(exc, "value", None) not in (0, 6):
                self.errors[name] = repr(exc)
            return
        for s in got:
            if s.timeStamp > self._seen[name]:
                self._seen[name] = int(s.timeStamp)
            self.samples[name].append((int(s.pid), self._wall(int(s.timeStamp)), s.smUtil / 100.0))
            self.raw_stamp.setdefault(name, (int(s.timeStamp), time.time_ns()))

    def _loop(self) -> None:
        nv = self.nv
        while not self._stop.wait(0.02):
            self._per_process("processes_utilization_info", "nvmlDeviceGetProcessesUtilizationInfo")
            self._per_process("process_utilization", "nvmlDeviceGetProcessUtilization")
            try:
                self.samples["device_utilization_rates"].append(
                    (0, time.time_ns(), nv.nvmlDeviceGetUtilizationRates(self.h).gpu / 100.0))
            except Exception as exc:  # noqa: BLE001
                self.errors["device_utilization_rates"] = repr(exc)
            try:
                _, got = nv.nvmlDeviceGetSamples(self.h, nv.NVML_GPU_UTILIZATION_SAMPLES, self._seen["device_samples"])
                for s in got:
                    if s.timeStamp > self._seen["device_samples"]:
                        self._seen["device_samples"] = int(s.timeStamp)
                        self.samples["device_samples"].append((0, self._wall(int(s.timeStamp)),
                                                               s.sampleValue.uiVal / 100.0))
                        self.raw_stamp.setdefault("device_samples", (int(s.timeStamp), time.time_ns()))
            except Exception as exc:  # noqa: BLE001
                if getattr(exc, "value", None) not in (0, 6):
                    self.errors["device_samples"] = repr(exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.nv.nvmlShutdown()

    def estimate(self, name: str, pid: int, start: int, end: int) -> tuple[float | None, int]:
        vals = [r for p, ts, r in self.samples[name] if p in (0, pid) and start <= ts <= end + SLACK_NS]
        return (sum(vals) / len(vals) if vals else None), len(vals)

    def pids(self, name: str) -> list[int]:
        return sorted({p for p, _, _ in self.samples[name]})

    def period_ms(self, name: str, pid: int) -> float | None:
        ts = sorted({t for p, t, _ in self.samples[name] if p in (0, pid)})
        return statistics.median(np.diff(ts).tolist()) / 1e6 if len(ts) > 2 else None


class Run:
    """A daemon (``sets``: its --set options; none: the defaults) and one workload under the probe."""

    def __init__(self, tmp: Path, mode: str, seconds: float, tee: Path, sets: list[str]) -> None:
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.env = {k: v for k, v in cli_env().items() if not k.startswith("GPUFOOTPRINT_")}
        self.sock, self.port = str(tmp / "probe.sock"), _free_port()
        args = [sys.executable, "-m", "gpufootprint", "daemon", "--socket", self.sock, "--listen",
                f"127.0.0.1:{self.port}"]
        for s in sets:
            args += ["--set", s]
        self.daemon = subprocess.Popen(args, env=self.env, cwd=tmp, stdout=subprocess.DEVNULL,
                                       stderr=open(tmp / "daemon.log", "w"))  # noqa: SIM115
        deadline = time.monotonic() + 30
        while not os.path.exists(self.sock):
            assert time.monotonic() < deadline and self.daemon.poll() is None, (tmp / "daemon.log").read_text()
            time.sleep(0.1)
        self.steplog, self.stopfile = tmp / "steps.log", tmp / "stop"
        wenv = dict(self.env, GPUFOOTPRINT_PROBE_TEE=str(tee))
        self.started = time.monotonic()
        self.workload = subprocess.Popen([sys.executable, "-m", "gpufootprint", "run", "--socket", self.sock, "--",
                                          sys.executable, WORKLOAD, mode, str(seconds), str(self.steplog),
                                          str(self.stopfile)], env=wenv,
                                         stdout=open(tmp / "workload.log", "w"),  # noqa: SIM115
                                         stderr=subprocess.STDOUT)

    def graph(self) -> list[dict[str, Any]]:
        try:
            return list(_api(self.port, "/api/engines")["graph"])
        except OSError:
            return []

    def finish_workload(self, timeout: float = 60) -> None:
        self.stopfile.touch()
        try:
            self.workload.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.workload.kill()
        time.sleep(1.0)  # the goodbye reaches the daemon

    def stop(self) -> None:
        for proc in (self.workload, self.daemon):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in (self.workload, self.daemon):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()

    def steps(self) -> np.ndarray:
        """(wall ns at the step's end, seconds) of every step the workload logged."""
        try:
            rows = [ln.split() for ln in self.steplog.read_text().splitlines() if ln.strip()]
        except OSError:
            return np.zeros((0, 2))
        return np.array([(int(a), float(b)) for a, b in rows], dtype=np.float64).reshape(-1, 2)


def _trace(path: Path) -> tuple[np.ndarray, list[dict[str, Any]], int | None]:
    """The KERNEL records, the closed windows (kernel_window bodies) and the pid of a probe's recording."""
    from gpufootprint.records import DTYPES, RecordKind
    from gpufootprint.wire.framing import FrameType
    from gpufootprint.wire.sources import TraceFile

    kernels, windows, pid = [], [], None
    untimed = 0  # kernel records since the last closed window that CUPTI wrote without a start or end
    for f in (TraceFile(path).frames() if path.is_file() else ()):  # none: the probe did not start
        if f.type is FrameType.HELLO and pid is None:
            pid = f.json().get("pid")
        elif f.type is FrameType.BATCH and f.tag == RecordKind.KERNEL:
            recs = f.records()
            untimed += int(np.count_nonzero((recs["start"] == 0) | (recs["end"] == 0)))
            kernels.append(recs)
        elif f.type in (FrameType.HEARTBEAT, FrameType.GOODBYE):
            w = f.json().get("kernel_window")
            if isinstance(w, dict) and "start_ns" in w and "end_ns" in w:
                # A window's records come before the heartbeat that closes it. Kernels still running at a
                # forced flush come without times (H100, 2026-12-06: 119 of 225 in one window of the 2 s
                # loop's 21 ms matmuls): they cannot be placed, so their time is missing from the busy share.
                windows.append({**w, "untimed_kernels": untimed})
                untimed = 0
    k = np.concatenate(kernels) if kernels else np.zeros(0, DTYPES[RecordKind.KERNEL])
    k = k[(k["start"] != 0) & (k["end"] != 0)]
    return k[np.argsort(k["start"], kind="stable")], windows, pid


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _busy(k: np.ndarray) -> tuple[float, float, int]:
    """(busy share of first start to last end, mean kernel seconds, kernels): kernels that overlap count once."""
    s, e = k["start"].astype(np.int64), np.maximum(k["end"].astype(np.int64), k["start"].astype(np.int64))
    reach = np.maximum.accumulate(e)
    gaps = np.clip(s[1:] - reach[:-1], 0, None).sum()
    span = int(reach[-1] - s[0])
    return (1.0 - gaps / span) if span > 0 else 0.0, float((e - s).mean()) / 1e9, len(k)


def _main(decisions: list[dict[str, Any]], pid: int | None = None) -> dict[str, Any] | None:
    mine = [d for d in decisions if (pid is None or d["pid"] == pid) and d["source"] == "probe"]
    return max(mine, key=lambda d: (d["decision"] != "insufficient_data", d["kernels"], d["op_count"] or 0),
               default=None)


@pytest.mark.timeout(240, method="signal")
@pytest.mark.parametrize("mode", ["matmul", "matmul2s", "tiny", "transformer"])
def test_default_daemon_advises_real_training_steps_and_nvml_busy_time_holds(tmp_path: Path, mode: str) -> None:
    out = _out(tmp_path)
    result: dict[str, Any] = {"mode": mode, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    cands = Candidates()
    try:
        # --- 1. truth: windows of kernel records --------------------------------------------------------
        ktee = out / f"h200_graph_{mode}_kernels.gfp.gz"
        truth = Run(tmp_path / "kernels", mode, 16.0, ktee, [
            "sampler.kernel_window_records=kernels", "sampler.kernel_window_ms=3000",
            "sampler.kernel_window_first_seconds=2", "sampler.kernel_window_every_seconds=6",
            "sampler.kernel_window_every_max_seconds=0"])  # the truth: a window every 6 s, not backed off
        try:
            truth.workload.wait(timeout=120)
            time.sleep(1.0)
            kd = _main(truth.graph())
        finally:
            truth.stop()
        result["kernel_window_verdict"] = kd
        kernels, windows, tpid = _trace(ktee)
        pid = int(tpid) if isinstance(tpid, int) else (int(kd["pid"]) if kd else -1)
        result["truth_logs"] = {"workload": _tail(truth.tmp / "workload.log"), "daemon": _tail(truth.tmp / "daemon.log")}
        per_window = []
        for w in windows:
            k = kernels[(kernels["start"] >= w["start_ns"]) & (kernels["start"] <= w["end_ns"])]
            if len(k) < 2:
                continue
            busy, mean_s, n = _busy(k)
            s0, e0 = int(k["start"][0]), int(k["end"].max())
            # With untimed kernels the timed ones' busy share is only a lower bound of the truth; its upper
            # bound counts each untimed kernel as one more of the mean duration. NVML's error is read against
            # the upper bound (a reading above it by more than busy_error is an error whatever the untimed
            # kernels did) and reported against both.
            untimed = int(w.get("untimed_kernels", 0))
            busy_hi = min(1.0, busy + untimed * mean_s * 1e9 / max(1, e0 - s0))
            row: dict[str, Any] = {"start_ns": s0, "end_ns": e0, "kernels": n, "untimed_kernels": untimed,
                                   "busy": busy, "busy_upper": busy_hi, "mean_kernel_s": mean_s}
            for name in cands.samples:
                est, used = cands.estimate(name, pid, s0, e0)
                row[name] = {"estimate": est, "samples": used, "error": None if est is None else est - busy_hi,
                             "error_vs_timed": None if est is None else est - busy}
            per_window.append(row)
        result["truth_windows"] = per_window
        result["candidate_period_ms"] = {n: cands.period_ms(n, pid) for n in cands.samples}
        result["candidate_errors"] = dict(cands.errors)
        result["candidate_first_stamp_us_and_wall_ns"] = dict(cands.raw_stamp)
        result["truth_pid"] = pid

        # --- 2. live: a default daemon ---------------------------------------------------------------------
        tee = out / f"h200_graph_{mode}.gfp.gz"
        live = Run(tmp_path / "live", mode, 150.0, tee, [])
        verdict, waited = None, None
        try:
            while time.monotonic() - live.started < LIVE_LIMIT_S and live.workload.poll() is None:
                d = _main(live.graph())
                if d is not None and d["decision"] != "insufficient_data":
                    verdict, waited = d, time.monotonic() - live.started
                    break
                time.sleep(0.5)
            # Steps after the windows, for a lasting cost: 8 s by default; GPUFOOTPRINT_GRAPH_AFTER_S=30 keeps the
            # loop running into the next periodic window (every 30 s), so a cost left behind shows before it.
            time.sleep(float(os.environ.get("GPUFOOTPRINT_GRAPH_AFTER_S", "8")))
            live.finish_workload()
            nvml_doc = _api(live.port, "/api/nvml")
            final = _main(live.graph(), verdict["pid"] if verdict else None)
        finally:
            live.stop()
        Path(str(tee) + ".nvml.json").write_text(json.dumps(nvml_doc))
        result["nvml_pids"] = {"daemon": {g: sorted(per) for g, per in nvml_doc["process_busy"].items()},
                               "test": cands.pids("processes_utilization_info") or cands.pids("process_utilization")}
        result.update(live_verdict=verdict, seconds_to_verdict=waited, live_final=final)
        _, lwin, _ = _trace(tee)
        result["live_logs"] = {"workload": _tail(live.tmp / "workload.log"), "daemon": _tail(live.tmp / "daemon.log")}
        result["launch_windows"] = [{"id": w.get("id"), "records": w.get("records"), "closed": w.get("closed"),
                                     "seconds": (w["end_ns"] - w["start_ns"]) / 1e9} for w in lwin]
        steps = live.steps()
        cost = []
        for w in lwin:  # each window's steps: the 3 s before it, in it, and from 1 to 4 s after it
            before = steps[(steps[:, 0] >= w["start_ns"] - 3e9) & (steps[:, 0] < w["start_ns"]), 1]
            inside = steps[(steps[:, 0] >= w["start_ns"]) & (steps[:, 0] <= w["end_ns"]), 1]
            after = steps[(steps[:, 0] > w["end_ns"] + 1e9) & (steps[:, 0] <= w["end_ns"] + 4e9), 1]
            cost.append({"steps": [len(before), len(inside), len(after)],
                         "median_before_s": float(np.median(before)) if len(before) else None,
                         "median_in_s": float(np.median(inside)) if len(inside) else None,
                         "median_after_s": float(np.median(after)) if len(after) else None,
                         "after_over_before": (float(np.median(after) / np.median(before))
                                               if len(before) >= 3 and len(after) >= 3 else None)})
        result["step_seconds_around_windows"] = cost

        # --- 3. replay: abtest on the recording -----------------------------------------------------------
        policy = tmp_path / "default.yaml"
        policy.write_text("{}\n")
        ab = subprocess.run([sys.executable, "-m", "gpufootprint", "abtest", str(tee), "--policy", str(policy),
                             "--json"], env=live.env, capture_output=True, text=True, timeout=120, check=False)
        rows = json.loads(ab.stdout)["rows"] if ab.returncode == 0 else []
        mine = [r for r in rows if verdict is not None and r["pid"] == verdict["pid"]]
        result["abtest"] = [{"stream": r["stream"], "evidence": r["evidence"],
                             "decision": r["policies"]["default"]["decision"],
                             "reasons": r["policies"]["default"]["reasons"]} for r in mine] or ab.stderr[-2000:]
    finally:
        cands.close()
        (out / f"graph_advice_{mode}.json").write_text(json.dumps(result, indent=1, default=str))
        print(json.dumps({k: result.get(k) for k in ("seconds_to_verdict", "step_seconds_around_windows",
                                                     "candidate_period_ms")},
                         default=str))

    # --- the checks, after everything was written: each one evaluated, all failures reported together ----------
    failed: list[str] = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            failed.append(what)

    check(tee.is_file() and ktee.is_file(), f"the probe recorded nothing: {tee} {ktee}")
    check(verdict is not None and waited is not None and waited <= LIVE_LIMIT_S,
          f"no verdict within {LIVE_LIMIT_S} s: {result.get('live_final')}")
    if verdict is not None:
        want = EXPECTED[mode] if EXPECTED[mode] is not None else (kd or {}).get("decision")
        check(verdict["decision"] == want, f"live {verdict['decision']} != {want}: {verdict['reasons']}")
        check(verdict["evidence"] == "launches", f"evidence {verdict['evidence']}")
        ab = {r["decision"] for r in result["abtest"]} if isinstance(result["abtest"], list) else set()
        check(ab == {verdict["decision"]}, f"abtest {result['abtest']} != live {verdict['decision']}")
        truth_mean = statistics.median(r["mean_kernel_s"] for r in per_window) if per_window else None
        lo = verdict.get("mean_kernel_seconds_min")
        result["lower_bound_vs_truth"] = {"mean_kernel_seconds_min": lo, "truth_mean_kernel_seconds": truth_mean}
        check(lo is None or truth_mean is None or lo <= truth_mean,
              f"the lower bound {lo} s is above the kernels' mean {truth_mean} s")
        if mode == "matmul":
            # a loop of one repeated kernel: the kernel windows (3 s, about 11 steps) read its steps from the
            # idle gaps between them, and the exact durations pass the seed's minimum
            check((kd or {}).get("decision") == "capture",
                  f"kernel windows' verdict {(kd or {}).get('decision')}: {(kd or {}).get('reasons')}")
        if mode.startswith("matmul"):
            check(lo is not None, "no NVML lower bound for the matmul loop")
    # The candidate the daemon uses is a lower bound once graph_advisor.busy_error is taken off: NVML may
    # read low (H200, 2026-12-03: -0.35 in a 0.3 s window at the loop's end, where the samples of the
    # 0.5 s after it saw an idle GPU; a low reading only lowers the bound) but never more than busy_error
    # high. Both signs are reported in graph_advice_<loop>.json.
    errs = [r["processes_utilization_info"]["error"] for r in per_window
            if r["processes_utilization_info"]["error"] is not None]
    if not errs:
        errs = [r["process_utilization"]["error"] for r in per_window if r["process_utilization"]["error"] is not None]
    check(bool(errs) and max(errs) <= BUSY_ERROR, f"per-process busy read above the kernels' by more than "
                                                 f"{BUSY_ERROR}: {errs}")
    (out / f"graph_advice_{mode}.json").write_text(json.dumps({**result, "failed": failed}, indent=1, default=str))
    assert not failed, failed
