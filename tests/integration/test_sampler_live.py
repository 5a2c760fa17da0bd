"""The sampler end to end: a real child process on the daemon's Unix socket, CONTROL frames back,
and the HTTP routes (/metrics, /api/anomalies) of an App with a fake NVML."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from gpufootprint.configload import load_config
from gpufootprint.hub import FeatureHub
from gpufootprint.ingest.server import IngestServer
from gpufootprint.pipeline import Pipeline

sys.path.insert(0, str(Path(__file__).parents[1]))
from nvml_fake import FakeNvml
from tracegen import quiet_minute_with_spike, write_jsonl

pytestmark = pytest.mark.integration

CHILD = textwrap.dedent('''
    import json, socket, sys, time
    import numpy as np
    from gpufootprint.records import MEMORY_DTYPE, RecordKind
    from gpufootprint.wire.framing import PREAMBLE, FrameDecoder, FrameType, encode_batch, encode_json, encode_watermark
    import os
    s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
    pid = os.getpid()
    s.sendall(PREAMBLE + encode_json(FrameType.HELLO, {"pid": pid, "start_time": 1, "launch_windows": 1}))
    def mem(op, addr, size):
        r = np.zeros(1, MEMORY_DTYPE)
        r["ts"], r["op"], r["mk"], r["addr"], r["bytes"], r["pid"] = time.time_ns(), op, 3, addr, size, pid
        s.sendall(encode_batch(RecordKind.MEMORY, r))
    mem(1, 0x1000, 1 << 30)
    time.sleep(0.4)
    mem(1, 0x2000, 256 << 20)
    time.sleep(0.03)
    mem(2, 0x2000, 256 << 20)
    s.sendall(encode_watermark(time.time_ns()))
    s.settimeout(0.2)
    dec = FrameDecoder(); dec.feed(PREAMBLE)  # the daemon -> probe direction has no preamble
    got = []; end = time.time() + 3.0
    while time.time() < end:
        try:
            data = s.recv(65536)
        except socket.timeout:
            s.sendall(encode_watermark(time.time_ns()))
            continue
        if not data:
            break
        got += [f.json() for f in dec.feed(data) if f.type == FrameType.CONTROL]
    print(json.dumps(got))
''')


@pytest.mark.parametrize("busy", [False, True], ids=["keeping-up", "busy"])
def test_probe_child_gets_flush_interval_controls_and_its_spike_becomes_a_window(tmp_path: Path, monkeypatch,  # type: ignore[no-untyped-def]
                                                                                 busy: bool) -> None:
    """A daemon that keeps up asks the probe for 5 ms flushes while its footprint moves. A busy one (its
    watermarks wait up to ``COALESCE_S`` to be applied together) learns of the spike only after the burst,
    in event time, is over: it asks nothing, but the spike's window is the same. The load is set here, not
    left to the machine: on a loaded test machine the loop can turn busy by itself (a round over the
    connections longer than a 20 ms tick)."""
    from gpufootprint.ingest import tick

    monkeypatch.setattr(tick.LoopLoad, "busy", lambda self, mono: busy)
    config = load_config(env={}, overrides={"daemon.tick_ms": 20, "sampler.kernel_window_ms": 40})
    pipeline = Pipeline(config.footprint, hub=FeatureHub(config.features, config.sampler))
    sock = str(tmp_path / "probe.sock")
    server = IngestServer(config, pipeline, socket_path=sock)
    pipeline.hub.control = server.send_control  # as App wires it
    server.open()
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, sock], capture_output=True, text=True, timeout=30, check=False)
    finally:
        server.stop()
        t.join(10)
    assert out.returncode == 0, out.stderr
    controls = json.loads(out.stdout)
    flushes = [c["ms"] for c in controls if c["op"] == "flush_interval"]
    if busy:
        assert 5 not in flushes, controls  # the burst was over when its records were applied
    else:
        assert 5 in flushes, controls  # the burst asked the probe to flush every 5 ms
    # a launch window opens with a 2 s lease (at least kernel_window_ms) and follows the steps from there
    # and the steps and calls after which the probe closes it by itself (the daemon's defaults)
    assert any(c["op"] == "kernel_window" and c["ms"] == 2000 and c["records"] == "launches"
               and c["steps"] == config.sampler.kernel_window_steps
               and c["max_records"] == config.sampler.kernel_window_max_records for c in controls)
    windows = [w for w in server.snapshot.anomaly_windows if w.peak_bytes == (1 << 30) + (256 << 20)]
    assert len(windows) == 1 and windows[0].reason == "footprint_change"


def test_the_sampler_controls_it_sent_are_counted_in_metrics(tmp_path: Path) -> None:
    from gpufootprint.app import App

    config = load_config(env={}, overrides={"daemon.tick_ms": 20, "sampler.kernel_window_ms": 40,
                                            "exporter.listen": "127.0.0.1:0"})
    sock = str(tmp_path / "probe.sock")
    app = App(config, socket_path=sock, listen="127.0.0.1:0")
    app.start()
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, sock], capture_output=True, text=True, timeout=30, check=False)
        app.ingest.tick()
        app.http.exposition.render()  # type: ignore[union-attr]  # the render thread's work, now
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{app.http.port}/metrics",  # type: ignore[union-attr]
                                         timeout=5).read().decode()
    finally:
        app.stop()
    assert out.returncode == 0, out.stderr
    controls = json.loads(out.stdout)
    sent = {op: sum(1 for c in controls if c["op"] == op) for op in ("flush_interval", "kernel_window")}
    assert sent["flush_interval"] >= 1 and sent["kernel_window"] >= 1, controls
    for op, n in sent.items():
        line = next(ln for ln in metrics.splitlines()
                    if ln.startswith(f'gpufootprint_sampler_controls_total{{op="{op}",result="sent"}} '))
        # every CONTROL frame the child read was counted; one sent as it stopped reading may be too
        assert float(line.rsplit(" ", 1)[1]) >= n, (line, n)


def test_app_serves_anomalies_json_and_sampler_and_nvml_metrics(tmp_path: Path) -> None:
    from gpufootprint.app import App
    from gpufootprint.replay import replay_file

    lines, facts = quiet_minute_with_spike(minute_ms=5_000, spike_at_ms=2_000)
    path = write_jsonl(tmp_path / "spike.jsonl.gz", lines)
    config = load_config(env={}, overrides={"exporter.listen": "127.0.0.1:0"})
    fake = FakeNvml("field_unsupported")
    fake.add_process(0, 4242, 2 << 30)
    app = App(config, socket_path=None, listen="127.0.0.1:0", nvml_client=fake)  # type: ignore[arg-type]
    app.start()
    try:
        replay_file(path, app.pipeline, guard=app.ingest.lock)
        base = f"http://127.0.0.1:{app.http.port}"  # type: ignore[union-attr]
        # A tick in busy mode publishes no new snapshot within a second of the last one (the loop's own
        # CPU share decides: a loaded machine can tip it), and the NVML thread's first poll may come after
        # the replay on a loaded machine, so the replay's end and the NVML view are asked for until they show.
        deadline = time.monotonic() + 3.0
        while True:
            app.ingest.tick()
            app.http.exposition.render()  # type: ignore[union-attr]  # the render thread's work, now
            anomalies = json.load(urllib.request.urlopen(base + "/api/anomalies", timeout=5))
            spike = [a for a in anomalies
                     if a["start"] <= facts["spike_start"] and a["end"] >= facts["spike_end"]]
            metrics = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
            if (spike and "gpufootprint_nvml_field_supported{" in metrics) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        app.stop()
    assert len(spike) == 1 and spike[0]["peak_bytes"] == facts["peak"]
    assert set(spike[0]) == {"start", "end", "reason", "peak_bytes", "pid", "gpu"}
    assert 'gpufootprint_anomaly_windows_total{reason="footprint_change"}' in metrics
    assert 'gpufootprint_sampler_mode{mode="quiet",pid="4242",source="trace"} 1.0' in metrics
    assert 'gpufootprint_nvml_field_supported{field="pcie",gpu="0"} 0.0' in metrics
    assert 'gpufootprint_nvml_process_used_bytes{gpu="0",pid="4242",source="nvml"}' in metrics
    assert "gpufootprint_frame_peak_bytes{" in metrics


def test_migrations_route_joins_migration_windows_with_the_pcie_sample_of_the_same_window(tmp_path: Path) -> None:
    from gpufootprint.app import App
    from gpufootprint.replay import replay_file
    from tracegen import MS, T0, cpy, mem, um

    lines = [{"k": "meta", "format": "cupti-jsonl", "version": 1, "pid": 4242}, mem(T0, 1, 0x1000, 1 << 20, mk=5)]
    for i in range(40):  # 2 s of UM traffic: 4 migrations + 1 copy every 50 ms
        t = T0 + i * 50 * MS + MS
        lines += [um(t, 1, 65536), um(t + MS, 2, 65536), um(t + 2 * MS, 3, 1), um(t + 3 * MS, 4, 2), cpy(t, 1, 4096)]
    path = write_jsonl(tmp_path / "um.jsonl", lines)
    config = load_config(env={})
    app = App(config, socket_path=None, listen=None, nvml_client=FakeNvml("healthy"))  # type: ignore[arg-type]
    app.nvml.start()  # type: ignore[union-attr]
    replay_file(path, app.pipeline)
    app.ingest.tick()
    last_window = (T0 + 39 * 50 * MS) // (50 * MS) * 50 * MS
    app.nvml.gpus[0].pcie.append((last_window - 50 * MS + 7 * MS, 5e9, 1e9))  # type: ignore[union-attr]
    rows = app.routes["/api/migrations"]()
    assert rows and all(r["pid"] == 4242 and r["gpu"] == 0 for r in rows)
    assert all(r["frequency_hz"] == (1 + 1 + 1 + 2 + 1) / 0.05 for r in rows)
    with_pcie = [r for r in rows if r["pcie_tx_bytes_per_second"] is not None]
    assert len(with_pcie) == 1 and with_pcie[0]["start"] == last_window - 50 * MS
    assert with_pcie[0]["pcie_rx_bytes_per_second"] == 1e9


def test_replay_report_json_has_anomaly_windows_and_sampler_intervals(tmp_path: Path) -> None:
    from tests.conftest import cli_env

    lines, facts = quiet_minute_with_spike(minute_ms=10_000, spike_at_ms=5_000)
    path = write_jsonl(tmp_path / "spike.jsonl.gz", lines)
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "gpufootprint", "replay", str(path), "--report-json", str(report),
                           "--set", "sampler.max_ms=160"], capture_output=True, text=True, env=cli_env(),
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    body = json.loads(report.read_text())
    spike = [w for w in body["anomaly_windows"] if w["start"] <= facts["spike_start"] and w["end"] >= facts["spike_end"]]
    assert len(spike) == 1 and spike[0]["peak_bytes"] == facts["peak"] and spike[0]["pid"] == 4242
    runs = body["sampler_intervals"]["4242"]
    assert {r["mode"] for r in runs} == {"burst", "steady", "quiet"}
    assert max(r["interval_ms"] for r in runs) == 160  # the config reached the sampler
    assert all(a["end"] == b["start"] for a, b in itertools.pairwise(runs))  # contiguous history
