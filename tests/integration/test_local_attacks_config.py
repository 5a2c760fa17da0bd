"""Local attacks and accidents outside the probe socket: hostile config files, signals at bad moments,
a full disk under ``record``, the 257th probe of a recording, ``gzip;q=0``. Real processes throughout."""

from __future__ import annotations

import gzip
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from gpufootprint.errors import ConfigError
from gpufootprint.wire.framing import FrameDecoder, FrameType

from tests.conftest import ROOT, cli_env
from tests.integration.test_faults import _SETTINGS, _metrics, _value, _wait
from tests.probe_process import CHILD

BOMB = """a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def _check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpufootprint", "check-config", "--config", str(path)],
                          env=cli_env(), capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("case,expect", [
    ("bomb", "anchors and aliases are not accepted"),
    ("deep", "nested deeper than 32 levels"),
    ("large", "larger than the limit"),
])
def test_check_config_refuses_hostile_yaml_in_one_line_quickly(tmp_path: Path, case: str, expect: str) -> None:
    path = tmp_path / "c.yaml"
    if case == "bomb":
        path.write_text(BOMB)
        assert len(BOMB) < 800
    elif case == "deep":
        path.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    else:
        path.write_text("daemon:\n  tick_ms: 100\n" + "# padding\n" * 5_000_000)  # 50 MB
    t0 = time.monotonic()
    r = _check_config(path)
    assert time.monotonic() - t0 < 30
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and expect in lines[0] and str(path) in lines[0], r.stderr


def test_an_alias_in_the_middle_names_its_line() -> None:
    from gpufootprint.yamlsafe import load_yaml

    with pytest.raises(ConfigError, match=r"^c.yaml:3: anchors and aliases"):
        load_yaml("daemon:\n  tick_ms: 100\nx: &x 1\n", "c.yaml")
    assert load_yaml("daemon: {tick_ms: 100}\nlist: [1, [2, [3]]]\n", "c.yaml") == {
        "daemon": {"tick_ms": 100}, "list": [1, [2, [3]]]}


def test_a_yaml_bomb_through_sighup_is_refused_and_sigterm_is_honoured(daemons, tmp_path: Path) -> None:
    cfg = tmp_path / "gpufootprint.yaml"
    cfg.write_text("daemon:\n  max_connections: 50\n")
    d = daemons(*_SETTINGS, config=cfg).ready()
    cfg.write_text(BOMB)
    d.proc.send_signal(signal.SIGHUP)
    _wait(lambda: _value(d.metrics(), "gpufootprint_daemon_config_reloads_total", result="refused") == 1)
    refused = [ln for ln in d.log().splitlines() if "config reload refused" in ln]
    assert len(refused) == 1 and "anchors and aliases" in refused[0]
    rss_kib = int(next(ln for ln in Path(f"/proc/{d.proc.pid}/status").read_text().splitlines()
                       if ln.startswith("VmRSS")).split()[1])
    assert rss_kib < 400 * 1024
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(15) == 0


def test_sigterm_is_honoured_while_a_reload_is_still_running(daemons, tmp_path: Path) -> None:
    # GIVEN a config on a FIFO nobody writes: the reload blocks opening it, as a slow file system would
    fifo = tmp_path / "slow.yaml"
    cfg = tmp_path / "gpufootprint.yaml"
    cfg.write_text("daemon:\n  max_connections: 50\n")
    d = daemons(*_SETTINGS, config=cfg).ready()
    cfg.unlink()
    os.mkfifo(fifo)
    cfg.symlink_to(fifo)
    d.proc.send_signal(signal.SIGHUP)
    time.sleep(1.0)
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(15) == 0
    assert "shutting down" in d.log()


def test_sighup_while_the_daemon_is_starting_does_not_kill_it(tmp_path: Path) -> None:
    from tests.daemon_process import free_port

    # GIVEN a daemon held inside its start-up: its config file is a FIFO nobody has written yet
    port = free_port()
    sock = tmp_path / "p.sock"
    fifo = tmp_path / "c.yaml"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-m", "gpufootprint", "daemon", "--socket", str(sock), "--listen",
                             f"127.0.0.1:{port}", "--set", "nvml.enabled=false", "--config", str(fifo)],
                            env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not _handles_sighup(proc.pid):
            assert time.monotonic() < deadline and proc.poll() is None, "SIGHUP never handled"
            time.sleep(0.005)
        # WHEN SIGHUP comes before the config is even read
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.3)
        assert proc.poll() is None, "killed by SIGHUP during start-up"
        with open(fifo, "w") as fh:
            fh.write("daemon:\n  max_connections: 50\n")
        # THEN it starts and serves; the SIGHUP's reload (blocked on the FIFO again) never holds up SIGTERM
        _wait(lambda: sock.exists() and _metrics(port) is not None)
        assert proc.poll() is None
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err[-2000:]


def _handles_sighup(pid: int) -> bool:
    caught = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("SigCgt"))
    return bool(int(caught.split()[1], 16) & (1 << (signal.SIGHUP - 1)))


# --- record ---------------------------------------------------------------------------------------------


def test_record_onto_a_filling_disk_ends_on_a_whole_frame_and_counts_every_lost_record(tmp_path: Path) -> None:
    out = tmp_path / "rec.gfp"
    script = (f"import subprocess, sys\nr = subprocess.run([sys.executable, {CHILD!r}, {str(tmp_path)!r}, "
              "'burst:20000', 'mark:m'])\nsys.exit(7 if r.returncode == 0 else 1)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "daemon"), GPUFOOTPRINT_PROBE_FLUSH_MS="20")
    limit = 300_000  # RLIMIT_FSIZE: writes past it come back short, then fail with EFBIG, as a full disk does

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    r = subprocess.run([sys.executable, "-m", "gpufootprint", "record", "-o", str(out), "--", sys.executable, "-c",
                        script], env=env, capture_output=True, text=True, timeout=120, preexec_fn=small_files, check=False)
    assert r.returncode == 7, r.stderr[-2000:]
    import json

    st = json.loads(r.stdout.strip().splitlines()[-1])["status"]
    lost = [ln for ln in r.stderr.splitlines() if ln.startswith("gpufootprint record: error:")]
    assert len(lost) == 1, r.stderr[-2000:]
    n_lost = int(re.search(r"\((\d+) records\) lost", lost[0]).group(1))  # type: ignore[union-attr]
    # THEN the file holds whole frames only, and written + lost = sent
    decoder = FrameDecoder()
    written = 0
    for frame in decoder.feed(out.read_bytes()):
        if frame.type is FrameType.BATCH:
            written += len(frame.records())
    decoder.close()  # raises on a torn last frame
    assert out.stat().st_size <= limit
    assert written + n_lost == st["records_sent"] == 40000, (written, n_lost, st)


def test_the_relay_of_record_survives_its_257th_probe(tmp_path: Path) -> None:
    from gpufootprint.launcher import Relay
    from gpufootprint.records import RecordKind
    from gpufootprint.wire.framing import PREAMBLE, encode_batch, encode_json

    relay = Relay(str(tmp_path / "r.gfp"))
    relay.start()
    import numpy as np
    from gpufootprint.records import KERNEL_DTYPE

    k = np.zeros(1, KERNEL_DTYPE)
    k["start"], k["end"], k["name_id"], k["pid"] = 1, 2, 5, 1
    try:
        for i in range(260):
            s = socket.socket(socket.AF_UNIX)
            s.connect(relay.socket_path)
            s.sendall(PREAMBLE + encode_json(FrameType.STRINGS, {"5": f"k{i}"})
                      + encode_batch(RecordKind.KERNEL, k))
            s.close()
        _wait(lambda: relay.frames >= 520, timeout=30)
        assert relay._thread.is_alive()
    finally:
        relay.close()


def test_gzip_with_q_zero_is_not_sent_gzipped(daemons) -> None:
    d = daemons(*_SETTINGS).ready()
    for header, gz in [("gzip;q=0", False), ("gzip", True), ("identity, gzip;q=0.5", True), ("*;q=0", False),
                       ("br, *", True), ("gzip ; q=0.0", False)]:
        req = urllib.request.Request(f"http://127.0.0.1:{d.port}/metrics", headers={"Accept-Encoding": header})
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = resp.read()
            assert (resp.headers.get("Content-Encoding") == "gzip") is gz, header
            assert b"gpufootprint_" in (gzip.decompress(body) if gz else body)
