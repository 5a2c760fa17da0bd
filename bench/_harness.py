"""Shared by bench/load.py and bench/soak.py: a real daemon process, its CPU and RSS, timed scrapes.

The daemon runs as ``python -m gpufootprint daemon`` exactly as a user starts it, optionally
pinned to one CPU core (``os.sched_setaffinity``) so "on one core" means one core.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "daemon"))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Usage:
    cpu_s: float
    rss_bytes: int
    hwm_bytes: int


def usage(pid: int) -> Usage:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime
    rss = hwm = 0
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    return Usage(cpu, rss, hwm)


class Daemon:
    def __init__(self, *sets: str, core: int | None = 0, profile_ingest: str | None = None) -> None:
        """``profile_ingest``: a path for the cProfile statistics of the ingest thread (bench/_profiled_daemon.py)."""
        self.dir = tempfile.mkdtemp(prefix="gfp-bench-")
        self.sock = os.path.join(self.dir, "probe.sock")
        self.port = free_port()
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT / "daemon") + os.pathsep + env.get("PYTHONPATH", "")
        run = [sys.executable, str(Path(__file__).resolve().parent / "_profiled_daemon.py"), profile_ingest] \
            if profile_ingest else [sys.executable, "-m", "gpufootprint"]
        cmd = [*run, "daemon", "--socket", self.sock,
               "--listen", f"127.0.0.1:{self.port}", "--set", "nvml.enabled=false"]
        for s in sets:
            cmd += ["--set", s]
        self.log_path = os.path.join(self.dir, "daemon.log")
        self._log = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=self._log)
        if core is not None:
            os.sched_setaffinity(self.proc.pid, {core})
        end = time.monotonic() + 30
        while time.monotonic() < end:
            try:
                if os.path.exists(self.sock):
                    self.scrape()
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"daemon did not start; log: {open(self.log_path).read()[-2000:]}")

    def scrape(self) -> tuple[float, dict[str, list[tuple[dict[str, str], float]]]]:
        """(seconds the scrape took, parsed samples)."""
        t0 = time.perf_counter()
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        took = time.perf_counter() - t0
        out: dict[str, list[tuple[dict[str, str], float]]] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out.setdefault(s.name, []).append((s.labels, s.value))
        return took, out

    def timed_scrape(self) -> float:
        t0 = time.perf_counter()
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as resp:
            resp.read()
        return time.perf_counter() - t0

    def usage(self) -> Usage:
        return usage(self.proc.pid)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._log.close()
        return rc


def total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    return sum(v for _, v in samples.get(name, []))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, Python {sys.version.split()[0]}, {os.uname().sysname} {os.uname().release}"
