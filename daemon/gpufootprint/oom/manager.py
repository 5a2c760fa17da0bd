"""The daemon's side of out-of-memory capture: count, log, keep what led to it.

A probe reports each out-of-memory as an ``oom`` MARK (probe/oom.py): one for the
failed driver calls it saw in CUPTI's API records, one per PyTorch OOM notice. A
framework retries after freeing its cache, and PyTorch may call its observer more
than once, so the notices of one process that come within ``coalesce_seconds`` of its
first are one event, closed that long after the first notice came (never later: a
process that keeps failing still gets its event on time). Notices that come after
that, until the process has gone ``episode_quiet_seconds`` without one, belong to the
same episode: they are counted into the event (failed calls, notices) and make no new
event or capture, so a program that fails, frees and fails again in a loop (a training
step that catches its OOM and retries every few seconds) gives one capture and a count.
For each event the daemon

* counts it (``gpufootprint_oom_events_total``),
* logs one line: pid, pod, GPU, requested bytes, footprint,
* writes a capture: the process's records of the last ``seconds`` plus its live
  table, as a native recording (oom/capture.py), with ``meta.json`` and a
  ``report.html`` beside it, into ``directory`` (at most ``max_captures``, the
  oldest removed first); ``/api/oom`` lists them.

Everything but the file writing runs on the ingest thread; the live tables are
copied at each notice, so a process that dies of its OOM right after still has its
state captured. Files are written by one worker thread.
"""

from __future__ import annotations

import json
import logging
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpufootprint.config import OomConfig
from gpufootprint.oom.capture import Entry, Table, device_bytes, encode_capture, live_by_kind, roll_back, write_capture
from gpufootprint.oom.recent import RecentRecords
from gpufootprint.pipeline import Pipeline
from gpufootprint.records import RecordKind

log = logging.getLogger(__name__)

CAPTURE_FILE = "capture.gfp.gz"
REPORT_FILE = "report.html"
META_FILE = "meta.json"
_KEEP_EVENTS = 1000  # events listed by /api/oom (captures or not)
_KEEP_COUNTS = 10_000  # (pid, gpu, source) counters kept; the oldest go first
REPORT_TIMEOUT_S = 300.0


@dataclass
class _Pending:
    pid: int
    first_mono: float
    last_mono: float
    notices: list[dict[str, Any]] = field(default_factory=list)
    tables: dict[int, Table] = field(default_factory=dict)  # copied at the latest notice
    tables_as_of: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    source: str = "probe"
    event: dict[str, Any] | None = None  # made: later notices of the episode are counted into it


class OomManager:
    def __init__(self, config: OomConfig, pipeline: Pipeline, *,
                 pod_of: Callable[[int], dict[str, str]] | None = None,
                 monotonic: Callable[[], float] = time.monotonic, synchronous: bool = False) -> None:
        self.config = config
        self.pipeline = pipeline
        self.pod_of = pod_of
        self._monotonic = monotonic
        self.recent = RecentRecords(config.seconds, config.max_buffer_bytes, config.max_total_buffer_bytes)
        self._pending: dict[int, _Pending] = {}
        self.counts: Counter[tuple[int, int, str]] = Counter()
        self.failed_calls: Counter[tuple[int, int, str]] = Counter()  # every failed call, repeats included
        self.events: deque[dict[str, Any]] = deque(maxlen=_KEEP_EVENTS)
        self.captures_written = 0
        self.capture_errors = 0
        self.notices = 0
        self._seq = 0
        self._lock = threading.Lock()  # events and captures are read by HTTP threads
        self._synchronous = synchronous
        self._jobs: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._dir_ok: bool | None = None
        self._load_existing()

    # --- taps (ingest thread) -------------------------------------------------------------

    def on_records(self, pid: int, dev: int, kind: RecordKind, recs: np.ndarray) -> None:
        if self.config.enabled:
            self.recent.add(pid, kind, recs)

    def on_mark(self, result: dict[str, Any]) -> None:
        """A MARK's state from the session; ``oom`` marks are OOM notices."""
        if result.get("label") != "oom" or not isinstance(result.get("oom"), dict):
            return
        pid, ts = result.get("pid"), result.get("ts")
        if not isinstance(pid, int) or not isinstance(ts, int):
            return
        self.notices += 1
        now = self._monotonic()
        p = self._pending.get(pid)
        if p is None:
            p = self._pending[pid] = _Pending(pid, now, now)
        p.last_mono = now
        notice = dict(result["oom"])
        notice["ts"] = ts
        notice["dev"] = result.get("dev", 0)
        calls = notice.get("failed_calls")
        calls = calls if isinstance(calls, int) and calls > 0 else 0
        if p.event is not None:  # the same episode, its event already made
            event = p.event
            with self._lock:
                event["failed_calls"] += calls
                event["notices"] += 1
                event["last_notice_ts"] = max(ts, int(event.get("last_notice_ts", ts)))
                self.failed_calls[(pid, int(event["gpu"]), p.source)] += calls
            return
        p.notices.append(notice)
        proc = self.pipeline.processes.get(pid)
        if proc is not None:
            p.info = dict(proc.info)
            p.source = proc.source
            p.tables_as_of = proc.applied_to
            p.tables = {dev: {addr: Entry(*a) for addr, a in fp.live.items()}
                        for dev, fp in proc.devices.items()}
        if self.config.coalesce_seconds <= 0:
            self._finish(p)
            self._pending.pop(pid, None)

    def tick(self) -> None:
        """Make the events whose first notice is ``coalesce_seconds`` old; end the episodes whose last
        notice is ``episode_quiet_seconds`` old; forget gone processes' records."""
        now = self._monotonic()
        wait = self.config.coalesce_seconds
        for p in list(self._pending.values()):
            if p.event is None and now - p.first_mono >= wait:
                self._finish(p)
            if p.event is not None and now - p.last_mono >= max(wait, self.config.episode_quiet_seconds):
                self._pending.pop(p.pid, None)
        for pid in self.recent.pids():
            if pid not in self.pipeline.processes and pid not in self._pending:
                self.recent.forget(pid)

    # --- an event -------------------------------------------------------------------------

    def _finish(self, p: _Pending) -> None:
        notices = p.notices
        t_oom = max(n["ts"] for n in notices)
        known = [n for n in notices if n.get("dev_known")]
        dev = int(known[-1]["dev"]) if known else int(notices[-1]["dev"])
        requested = next((n["requested_bytes"] for n in reversed(notices)
                          if isinstance(n.get("requested_bytes"), int)), None)
        t_until = max(p.tables_as_of, t_oom)
        t0 = max(t_oom - int(self.config.seconds * 1e9), self.recent.covered_from(p.pid))
        window = self.recent.window(p.pid, min(t0, t_oom), t_until) if self.config.enabled else {}
        memory = window.get(RecordKind.MEMORY)
        at_oom: dict[int, Table] = {}
        at_start: dict[int, Table] = {}
        for d, table in p.tables.items():
            recs = memory[memory["dev"] == d] if memory is not None else None
            if recs is None:
                at_oom[d] = at_start[d] = table
                continue
            at_oom[d] = roll_back(table, recs[recs["ts"] <= np.uint64(p.tables_as_of)], t_oom)
            at_start[d] = roll_back(at_oom[d], recs[recs["ts"] <= np.uint64(t_oom)], t0)
        table = at_oom.get(dev, {})
        footprint = device_bytes(table)
        pod = self._pod(p.pid)
        torch = next((n for n in reversed(notices) if n.get("source") == "torch"), None)
        self._seq += 1
        when = datetime.fromtimestamp(t_oom / 1e9, tz=timezone.utc)
        name = f"oom-{when:%Y%m%dT%H%M%S}Z-pid{p.pid}-{self._seq}"
        event: dict[str, Any] = {
            "name": name, "pid": p.pid, "gpu": dev, "source": p.source, "ts": t_oom,
            "time": when.isoformat().replace("+00:00", "Z"), "requested_bytes": requested,
            "footprint_bytes": footprint, "live_bytes": live_by_kind(table),
            "failed_calls": sum(int(n.get("failed_calls", 0)) for n in notices),
            "notices": len(notices), "seen_by": sorted({str(n.get("source")) for n in notices}),
            "gpu_known": bool(known), "window_start": t0, "window_seconds": round((t_oom - t0) / 1e9, 3),
            "command": p.info.get("cmd") or p.info.get("argv") or p.info.get("exe"),
            **({"pod": pod} if pod else {}),
        }
        if torch is not None:
            event["torch"] = {k: torch[k] for k in ("torch_reserved_bytes", "torch_allocated_bytes",
                                                    "device_free_bytes", "device_limit_bytes") if k in torch}
        p.event = event
        p.tables = {}  # the copies are in the event's capture now
        key = (p.pid, dev, p.source)
        with self._lock:  # scrapes and /api/processes read the counts from other threads
            self.counts[key] += 1
            self.failed_calls[key] += event["failed_calls"]
            for counts in (self.counts, self.failed_calls):
                while len(counts) > _KEEP_COUNTS:
                    del counts[next(iter(counts))]
        log.warning("oom pid=%d pod=%s gpu=%d requested_bytes=%s footprint_bytes=%d failed_calls=%d seen_by=%s",
                    p.pid, pod.get("pod", "-") if pod else "-", dev,
                    "unknown" if requested is None else requested, footprint, event["failed_calls"],
                    ",".join(event["seen_by"]))
        if p.source != "probe" or not (self.config.enabled and self._directory_ready()):
            # A replayed recording's OOM (replay --listen) is counted and listed, never captured again.
            event["capture"] = None
            with self._lock:
                self.events.append(event)
            return
        mark = {"label": "oom", "ts": t_oom, "pid": p.pid, "dev": dev, "expect_live_bytes": event["live_bytes"],
                "oom": {k: v for k, v in event.items() if k not in ("live_bytes",)}}
        frames = list(encode_capture(hello={**p.info, "capture_of": name}, pid=p.pid, start_ns=t0,
                                     start_tables=at_start, window=window_until(window, t_oom), mark=mark))
        event["capture"] = f"{name}/{CAPTURE_FILE}"
        job = {"name": name, "frames": frames, "event": event}
        with self._lock:
            self.events.append(event)
        if self._synchronous:
            self._write(job)
        else:
            self._start_worker()
            self._jobs.put(job)

    def _pod(self, pid: int) -> dict[str, str]:
        if self.pod_of is None:
            return {}
        try:
            labels = self.pod_of(pid)
        except Exception:  # noqa: BLE001 - attribution is best effort here
            return {}
        return {k: v for k, v in labels.items() if k in ("namespace", "pod", "container") and v}

    # --- files (worker thread) --------------------------------------------------------------

    def _directory_ready(self) -> bool:
        if self._dir_ok is None:
            try:
                Path(self.config.directory).mkdir(parents=True, exist_ok=True)
                self._dir_ok = True
            except OSError as exc:
                self._dir_ok = False
                self.capture_errors += 1
                log.warning("oom captures disabled: cannot create oom.directory %s: %s", self.config.directory, exc)
        return self._dir_ok

    def _start_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._work, name="gpufootprint-oom", daemon=True)
            self._worker.start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                self._write(job)
            except Exception:  # a capture bug must not end the worker: later captures still get written
                self.capture_errors += 1
                log.exception("oom capture worker failed on one capture")
            finally:
                self._jobs.task_done()

    def _write(self, job: dict[str, Any]) -> None:
        event = job["event"]
        where = Path(self.config.directory) / job["name"]
        try:
            where.mkdir(parents=True, exist_ok=True)
            write_capture(where / CAPTURE_FILE, job["frames"])
            (where / META_FILE).write_text(self._meta_text(event))
        except OSError as exc:
            self.capture_errors += 1
            with self._lock:
                event["capture"] = None
            log.warning("oom capture %s not written: %s", where, exc)
            return
        self.captures_written += 1
        if self.config.report:
            self._report(job["name"], where, event)
        self._prune()

    def _meta_text(self, event: dict[str, Any]) -> str:
        """meta.json: a copy taken under the lock (the ingest thread counts later notices into the event)."""
        with self._lock:
            return json.dumps(event, indent=1) + "\n"

    def _report(self, name: str, where: Path, event: dict[str, Any]) -> None:
        """``gpufootprint report`` of the capture, in a child process: matplotlib never enters the
        daemon (its memory stays the daemon's own), and a plotting failure cannot reach it."""
        cmd = [sys.executable, "-m", "gpufootprint", "report", str(where / CAPTURE_FILE), "-o",
               str(where / REPORT_FILE), "--title", f"OOM capture {name}"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=REPORT_TIMEOUT_S, check=False)
            detail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        except (OSError, subprocess.TimeoutExpired) as exc:
            detail = str(exc)
        if not (where / REPORT_FILE).exists():
            log.warning("oom report for %s not written: %s", where, detail)
            return
        with self._lock:
            event["report"] = f"{name}/{REPORT_FILE}"
        try:
            (where / META_FILE).write_text(self._meta_text(event))
        except OSError as exc:
            log.warning("oom capture %s: meta.json not updated: %s", where, exc)

    def _prune(self) -> None:
        root = Path(self.config.directory)
        ours = sorted((d for d in root.glob("oom-*") if (d / META_FILE).exists()), key=lambda d: d.stat().st_mtime)
        for old in ours[:max(0, len(ours) - self.config.max_captures)]:
            shutil.rmtree(old, ignore_errors=True)
            with self._lock:
                for e in self.events:
                    if e.get("name") == old.name:
                        e["capture"] = None
                        e.pop("report", None)
                        e["removed"] = True

    def _load_existing(self) -> None:
        """Captures written before a restart stay listed."""
        if not self.config.enabled:
            return
        root = Path(self.config.directory)
        try:
            dirs = sorted((d for d in root.glob("oom-*") if (d / META_FILE).exists()), key=lambda d: d.stat().st_mtime)
        except OSError:
            return
        for d in dirs[-_KEEP_EVENTS:]:
            try:
                meta = json.loads((d / META_FILE).read_text())
            except (OSError, ValueError):
                continue
            if isinstance(meta, dict):
                meta["restored"] = True
                self.events.append(meta)

    def stop(self) -> None:
        if self._worker is not None and self._worker.is_alive():
            self._jobs.put(None)
            self._worker.join(timeout=30)

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Tests: until every queued capture is written."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._jobs.unfinished_tasks == 0:
                return True
            time.sleep(0.02)
        return False

    # --- outputs ------------------------------------------------------------------------------

    def api(self) -> list[dict[str, Any]]:
        """GET /api/oom: OOM events, oldest first, with their capture and report paths under oom.directory."""
        with self._lock:
            return [dict(e) for e in self.events]

    def counts_now(self) -> dict[tuple[int, int, str], int]:
        with self._lock:
            return dict(self.counts)

    def failed_calls_now(self) -> dict[tuple[int, int, str], int]:
        with self._lock:
            return dict(self.failed_calls)

    def buffered_bytes(self) -> int:
        return self.recent.total_bytes


def window_until(window: dict[RecordKind, np.ndarray], until_ns: int) -> dict[RecordKind, np.ndarray]:
    from gpufootprint.records import TIME_FIELD

    return {k: v[v[TIME_FIELD[k]] <= np.uint64(until_ns)] for k, v in window.items()}


def _per_process(name: str, documentation: str, counts: dict[tuple[int, int, str], int]) -> Metric:
    family = CounterMetricFamily(name, documentation, labels=["pid", "gpu", "source"])
    for (pid, gpu, source), n in sorted(counts.items()):
        family.add_metric([str(pid), str(gpu), source], n)
    return family


def oom_families(manager: OomManager) -> Iterator[Metric]:
    """gpufootprint_oom_* (docs/metrics.md): per-process events, and the capture machinery's own state."""
    yield _per_process("gpufootprint_oom_events", "Out-of-memory events (failed allocations and PyTorch notices; "
                       "one an episode, docs/oom.md).", manager.counts_now())
    yield _per_process("gpufootprint_oom_failed_calls", "Allocation calls that failed with out-of-memory and were "
                       "not recovered from, repeats within an event's episode included.", manager.failed_calls_now())
    written = CounterMetricFamily("gpufootprint_oom_captures", "OOM captures written to oom.directory.")
    written.add_metric([], manager.captures_written)
    yield written
    errors = CounterMetricFamily("gpufootprint_oom_capture_errors",
                                 "OOM captures that could not be written (see the daemon's log).")
    errors.add_metric([], manager.capture_errors)
    yield errors
    buffered = GaugeMetricFamily("gpufootprint_oom_buffered_bytes",
                                 "Bytes of recent records kept for OOM captures (all processes).")
    buffered.add_metric([], manager.buffered_bytes())
    yield buffered
