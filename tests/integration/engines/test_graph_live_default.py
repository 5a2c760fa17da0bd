"""A launch-bound process gets a CUDA Graph verdict from a default daemon within a minute.

The daemon runs with the shipped defaults (only its socket and HTTP port chosen here): its sampler
opens 50 ms *launch windows* (sampler.kernel_window_records: launches), the host-side launch and
wait calls, since windows of kernel records left a loop of tiny launches about 10 % slower for the
rest of the run on the H200 (docs/performance.md). The real probe (over the fake CUPTI, which keeps
launch and wait calls only while a launch window has their per-API switches on, and kernel records
only while a kernel kind is on) runs a launch-bound loop in a child process connected over the real
Unix socket. The windows must reach the probe, the calls must reach the advisor, and /api/engines
and /metrics must give a verdict other than insufficient_data within a minute. The same loop under
windows of kernel records (one setting) is judged from the kernels themselves.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from gpufootprint.app import App
from gpufootprint.config import Config
from gpufootprint.configload import load_config
from prometheus_client.parser import text_string_to_metric_families

from tests.probe_process import finish_probe_child, start_probe_child

pytestmark = pytest.mark.integration


def _first_verdict(config: Config, tmp_path: Path, *first: str) -> tuple[list[dict[str, Any]], float, dict[str, Any],
                                                                         str]:
    sock = tmp_path / "probe.sock"
    app = App(config, socket_path=str(sock), listen="127.0.0.1:0")
    app.start()
    child = start_probe_child(sock, tmp_path, *(first or ("alloc:0x10000:67108864",)), "launch_loop:15",
                              GPUFOOTPRINT_PROBE_FLUSH_MS="100", GPUFOOTPRINT_PROBE_HEARTBEAT_MS="1000")
    verdicts: list[dict[str, Any]] = []
    started = time.monotonic()
    metrics = ""
    try:
        assert app.http is not None
        url = app.http.url.replace("/metrics", "/api/engines")
        while time.monotonic() - started < 60 and child.poll() is None:
            graph = json.loads(urllib.request.urlopen(url, timeout=10).read())["graph"]
            verdicts = [d for d in graph if d["pid"] == child.pid]
            if any(d["decision"] != "insufficient_data" for d in verdicts):
                # /metrics renders the engines' outputs of its own scrape's snapshot: the same or a later one
                until = time.monotonic() + 5
                while time.monotonic() < until:
                    metrics = urllib.request.urlopen(app.http.url, timeout=10).read().decode()
                    if 'decision="keep"' in metrics:
                        break
                    time.sleep(0.2)
                break
            time.sleep(0.5)
        waited = time.monotonic() - started
        status = finish_probe_child(child)
    finally:
        if child.poll() is None:
            child.kill()
        app.stop()
    return verdicts, waited, status["status"], metrics


def _busy_daemon_and_probe(tmp_path: Path, *ops: str, **env: str) -> tuple[App, Any, threading.Event]:
    """A default App over a stateful fake NVML, the real probe (fake CUPTI) running ``ops`` on its socket,
    and the driver's per-process samples for it: 97 % busy, six a second, until the event is set."""
    from tests.nvml_fake import FakeNvml

    fake = FakeNvml("healthy", gpus=1)
    sock = tmp_path / "probe.sock"
    app = App(load_config(None, env={}), socket_path=str(sock), listen="127.0.0.1:0", nvml_client=fake)
    app.start()
    child = start_probe_child(sock, tmp_path, *ops, **env)
    stop = threading.Event()

    def driver() -> None:
        while not stop.wait(1 / 6):
            fake.add_busy(0, child.pid, time.time_ns() // 1000, 0.97)

    threading.Thread(target=driver, daemon=True).start()
    return app, child, stop


def _poll_verdict(app: App, child: Any, seconds: float, every: float) -> dict[str, Any] | None:
    """The child's first Graph decision other than insufficient_data on /api/engines, while it runs."""
    assert app.http is not None
    url = app.http.url.replace("/metrics", "/api/engines")
    started = time.monotonic()
    while time.monotonic() - started < seconds and child.poll() is None:
        graph = json.loads(urllib.request.urlopen(url, timeout=10).read())["graph"]
        verdict = next((d for d in graph if d["pid"] == child.pid and d["decision"] != "insufficient_data"), None)
        if verdict is not None:
            return verdict  # type: ignore[no-any-return]
        time.sleep(every)
    return None


def test_a_default_daemon_gives_a_launch_bound_process_a_graph_verdict_from_launch_windows(tmp_path: Path) -> None:
    config = load_config(None, env={})
    assert config.sampler.kernel_window_ms == 50 and config.sampler.kernel_window_records == "launches"
    assert not config.probe.kernels
    verdicts, waited, status, metrics = _first_verdict(config, tmp_path)
    assert status["launch_windows"] >= 1 and status["kernel_windows"] == 0
    decided = [d for d in verdicts if d["decision"] != "insufficient_data"]
    assert decided, verdicts
    assert waited < 60
    d = decided[0]
    # 10 launches and a 20 us wait per step; 64 MiB allocated before the loop and none since
    assert d["evidence"] == "launches" and d["stream"] is None and d["op_count"] == 10 and d["reuse_ratio"] == 1.0, d
    # every kernel of a step ran between its first launch and the end of its wait (about 60 us): the
    # mean is far below the default policy's 0.5 ms, so the verdict is "keep", not unknown
    assert d["decision"] == "keep", d
    assert d["mean_kernel_seconds_max"] < 0.5e-3, d
    assert any(r.startswith("fail: mean kernel duration at most") for r in d["reasons"]), d
    exported = {(s.labels["pid"], s.labels["stream"], s.labels["decision"]): s.value
                for f in text_string_to_metric_families(metrics) if f.name == "gpufootprint_graph_advice"
                for s in f.samples}
    assert exported.get((str(d["pid"]), "", "keep")) == 1.0, exported


def test_windows_of_kernel_records_judge_the_same_loop_from_its_kernels(tmp_path: Path) -> None:
    config = load_config(None, env={"GPUFOOTPRINT_SAMPLER__KERNEL_WINDOW_RECORDS": "kernels"})
    verdicts, waited, status, _ = _first_verdict(config, tmp_path)
    assert status["kernel_windows"] >= 1 and status["launch_windows"] == 0
    decided = [d for d in verdicts if d["decision"] != "insufficient_data"]
    assert decided and waited < 60, verdicts
    d = decided[0]
    assert d["evidence"] == "kernels" and d["op_count"] == 10 and d["reuse_ratio"] == 1.0, d
    assert d["decision"] == "keep" and "fail: mean kernel duration 0.002 ms < 0.5 ms" in d["reasons"], d


def test_launch_records_name_the_gpu_the_process_allocates_on_when_buffers_are_forwarded(tmp_path: Path) -> None:
    # GIVEN a process on GPU 1 that starts its CUDA work after the daemon asked for CUPTI's buffers
    # unread (the default): the probe never packs its memory records itself
    config = load_config(None, env={})
    verdicts, _, status, _ = _first_verdict(config, tmp_path, "sleep:2", "alloc:0x10000:67108864:3:1")
    assert status["forwarded_buffers"] > 0
    decided = [d for d in verdicts if d["decision"] != "insufficient_data"]
    # THEN the launch records were stamped with GPU 1 (before: 0), so the reuse ratio is GPU 1's
    assert decided and decided[0]["dev"] == 1 and decided[0]["reuse_ratio"] == 1.0, verdicts


def test_a_default_daemon_follows_long_steps_and_captures_them_with_nvml_busy_time(tmp_path: Path) -> None:
    """The real probe (fake CUPTI) in a loop of 10 launches and a 200 ms wait per step: a 50 ms window
    never holds a step; the default daemon's window follows the steps, NVML's per-process samples (a
    stateful fake driver: 97 % busy, six samples a second) bound the mean kernel from below, and the
    seed's policy captures. ``abtest`` on the probe's recording, with ``/api/nvml`` saved beside it,
    says the same."""
    import subprocess
    import sys

    from tests.conftest import cli_env

    tee = tmp_path / "long_steps.gfp.gz"
    app, child, stop = _busy_daemon_and_probe(tmp_path, "alloc:0x10000:67108864", "long_steps:12:200",
                                              GPUFOOTPRINT_PROBE_FLUSH_MS="100", GPUFOOTPRINT_PROBE_HEARTBEAT_MS="1000",
                                              GPUFOOTPRINT_PROBE_TEE=str(tee))
    try:
        assert app.http is not None
        verdict = _poll_verdict(app, child, 30, 0.3)
        status = finish_probe_child(child)["status"]
        # Saved once the daemon's poller has read NVML past the workload's end (it polls once a second
        # when quiet): a document saved sooner lacks the samples of the last window, and abtest then
        # rightly finds no lower bound there.
        ended_ns = time.time_ns()
        nvml_url = app.http.url.replace("/metrics", "/api/nvml")
        until = time.monotonic() + 20
        while True:
            nvml_doc = urllib.request.urlopen(nvml_url, timeout=10).read()
            samples = json.loads(nvml_doc)["process_busy"].get("0", {}).get(str(child.pid), [])
            if (samples and samples[-1][0] >= ended_ns) or time.monotonic() > until:
                break
            time.sleep(0.2)
    finally:
        stop.set()
        if child.poll() is None:
            child.kill()
        app.stop()
    assert verdict is not None, "no verdict"
    assert verdict["decision"] == "capture" and verdict["evidence"] == "launches" and verdict["op_count"] == 10, verdict
    assert 0.010 < verdict["mean_kernel_seconds_min"] <= verdict["mean_kernel_seconds_max"] < 0.025, verdict
    assert status["launch_windows"] >= 1, status
    # the probe's windows: held open past a step (leases), each closed again
    from gpufootprint.wire.framing import FrameType
    from gpufootprint.wire.sources import TraceFile

    spans = [f.json()["kernel_window"] for f in TraceFile(tee).frames()
             if f.type is FrameType.HEARTBEAT and "kernel_window" in f.json()]
    assert spans and max(w["end_ns"] - w["start_ns"] for w in spans) > 800_000_000, spans
    Path(str(tee) + ".nvml.json").write_bytes(nvml_doc)
    policy = tmp_path / "default.yaml"
    policy.write_text("{}\n")
    ab = subprocess.run([sys.executable, "-m", "gpufootprint", "abtest", str(tee), "--policy", str(policy), "--json"],
                        env=cli_env(), capture_output=True, text=True, timeout=120, check=False)
    assert ab.returncode == 0, ab.stderr
    rows = [r for r in json.loads(ab.stdout)["rows"] if r["pid"] == verdict["pid"]]
    assert [r["policies"]["default"]["decision"] for r in rows] == ["capture"], rows


def test_the_real_probe_in_a_loop_of_2s_steps_gets_a_verdict_from_a_default_daemon_within_two_minutes(
        tmp_path: Path) -> None:
    """The longest steps the advice promises to follow (2 s), the real probe (fake CUPTI) at its own
    defaults and the daemon at the shipped ones: the window must stay open across steps longer than its
    2 s lease (renewed while the probe's sender sleeps between its flushes), and /api/engines must give
    the verdict while the loop still runs, within two minutes of its start."""
    started = time.monotonic()
    app, child, stop = _busy_daemon_and_probe(tmp_path, "alloc:0x10000:67108864", "long_steps:150:2000")
    try:
        verdict = _poll_verdict(app, child, 120, 0.5)
        waited = time.monotonic() - started
        running = child.poll() is None
    finally:
        stop.set()
        child.kill()
        child.wait(timeout=30)
        app.stop()
    assert verdict is not None and running, (verdict, running)
    print(f"2 s steps, the real probe: {verdict['decision']} after {waited:.1f} s")
    assert waited < 120, waited
    assert verdict["evidence"] == "launches" and verdict["op_count"] == 10 and verdict["steps"] >= 3, verdict
    # (0.97 - 0.2) of a 2 s step over 10 launches: the mean kernel at least about 0.15 s
    assert 1.8 < verdict["step_seconds"] < 2.6 and verdict["mean_kernel_seconds_min"] > 0.1, verdict
    assert verdict["decision"] == "capture", verdict["reasons"]


def test_the_probe_closes_a_default_daemons_launch_window_at_its_steps_and_the_verdict_still_comes(
        tmp_path: Path) -> None:
    """Every launch costs the workload while a launch window's switches are on. The daemon reads a window's
    calls only at the probe's next watermark (1 s) and closes it a control round trip later, so a loop of
    20 ms steps held its window about a second for the 4 steps it needed. The daemon now says how many steps
    it wants, and the real probe closes the window once it has counted them: the window lasts those steps
    and a CUPTI delivery, and the verdict comes through /api/engines as before, while the loop runs."""
    from gpufootprint.wire.framing import FrameType
    from gpufootprint.wire.sources import TraceFile

    tee = tmp_path / "short_steps.gfp.gz"
    app, child, stop = _busy_daemon_and_probe(tmp_path, "alloc:0x10000:67108864", "long_steps:25:20",
                                              GPUFOOTPRINT_PROBE_TEE=str(tee))
    try:
        verdict = _poll_verdict(app, child, 25, 0.3)
        running = child.poll() is None
        status = finish_probe_child(child)["status"]
    finally:
        stop.set()
        if child.poll() is None:
            child.kill()
        app.stop()
    assert verdict is not None and running, (verdict, running)
    # 10 launches and a 20 ms wait a step, NVML 97 % busy: the mean kernel at least about 1.5 ms
    assert verdict["decision"] == "capture" and verdict["evidence"] == "launches" and verdict["op_count"] == 10, verdict
    spans = [f.json()["kernel_window"] for f in TraceFile(tee).frames()
             if f.type is FrameType.HEARTBEAT and "kernel_window" in f.json()]
    assert spans and status["launch_windows_counted"] == len(spans), (spans, status)
    assert all(w.get("closed") == "counted" for w in spans), spans
    # the windows' switches were made on the child's main thread (its loop's Python), not the sender's
    assert status["launch_switches_main"] >= len(spans), status
    assert status["launch_switches_fallback"] < status["launch_switches_main"], status
    # 5 waits of about 21 ms and CUPTI's next delivery (flush_ms, 100): far under the second it took before
    lengths_ms = [(w["end_ns"] - w["start_ns"]) / 1e6 for w in spans]
    assert max(lengths_ms) < 600, lengths_ms
