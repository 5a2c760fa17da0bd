"""Faults, as a user meets them. A real daemon process, real signals, real child probes.

Daemon restart with live probes is proven in tests/integration/test_probe_link.py
(test_daemon_restart_mid_run_resyncs_the_footprint_and_counts_what_was_lost); NVML errors in
tests/unit/test_nvml.py (the fake's scenarios: field unsupported, GPU lost, no driver, Xid).
"""

from __future__ import annotations

import grp
import json
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from base64 import b64encode
from pathlib import Path
from typing import Any

import pytest
from gpufootprint.errors import ConfigError
from gpufootprint.ingest.transport import bind_probe_socket
from gpufootprint.records import RecordKind
from gpufootprint.wire.framing import PREAMBLE, FrameType, encode_batch, encode_json
from gpufootprint.wire.sources import TraceFile

from tests.conftest import ALLOC, DATA, ROOT, cli_env, mem, mem_batch
from tests.daemon_process import free_port, scrape
from tests.probe_process import CHILD, finish_probe_child, start_probe_child


def _if(value: Any, pred: Any) -> Any:
    """``value`` where ``pred(value)`` holds, else None (what a wait polls for)."""
    return value if pred(value) else None



def _metrics(port: int, opener: Any = None, scheme: str = "http") -> dict[str, list[tuple[dict[str, str], float]]]:
    return scrape(port, opener=opener, scheme=scheme)


def _value(m: dict[str, Any], name: str, **labels: str) -> float | None:
    for lab, v in m.get(name, []):
        if all(lab.get(k) == val for k, val in labels.items()):
            return v
    return None


def _wait(pred, timeout: float = 15.0):  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        try:
            last = pred()
            if last:
                return last
        except (OSError, KeyError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"not reached in {timeout} s (last {last!r})")


# What every daemon of these tests runs with: records applied as they come, no NVML.
_SETTINGS = ("--set", "footprint.reorder_window_ms=0", "--set", "nvml.enabled=false")


def probe_child(sock: str | Path, sync: Path, *steps: str, **env: str) -> subprocess.Popen[str]:
    return start_probe_child(sock, sync, *steps, **env)


def finish(p: subprocess.Popen[str]) -> dict[str, Any]:
    return finish_probe_child(p, timeout=90)


def _touch_when(path: Path, timeout: float = 30) -> None:
    _wait(path.exists, timeout)


# --- SIGTERM, SIGHUP --------------------------------------------------------------------------


def test_sigterm_shuts_down_cleanly_applies_what_is_pending_and_removes_the_socket(daemons, tmp_path: Path) -> None:
    d = daemons(*_SETTINGS, "--set", "footprint.reorder_window_ms=600000").ready()
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(d.sock))
    pid = os.getpid()
    now = time.time_ns()
    s.sendall(PREAMBLE + encode_json(FrameType.HELLO, {"pid": pid, "start_time": 1})
              + encode_batch(RecordKind.MEMORY, mem_batch([mem(now, ALLOC, 0x1000, 1 << 20, pid=pid)])))
    _wait(lambda: _value(d.metrics(), "gpufootprint_pending_records", pid=str(pid)) == 1)
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(15) == 0
    assert not d.sock.exists()
    s.settimeout(5)
    assert s.recv(1) == b"", "the probe sees the daemon hang up (it will reconnect and resync)"
    log = d.log()
    assert "signal SIGTERM: shutting down" in log
    assert "shut down cleanly" in log and "pending_records=0" in log, log[-2000:]
    assert "Traceback" not in log


def _write_config(path: Path, text: str) -> None:
    path.write_text(text)


def test_sighup_applies_a_new_config_and_refuses_an_invalid_one_keeping_the_old(daemons, tmp_path: Path) -> None:
    cfg = tmp_path / "gpufootprint.yaml"
    _write_config(cfg, "daemon:\n  max_connections: 50\n")
    d = daemons(*_SETTINGS, config=cfg).ready()
    # GIVEN a valid change: at most one connection
    _write_config(cfg, "daemon:\n  max_connections: 1\n  socket_mode: '0666'\n")
    d.proc.send_signal(signal.SIGHUP)
    m = _wait(lambda: _if(d.metrics(), lambda m: (
            _value(m, "gpufootprint_daemon_config_reloads_total", result="applied") == 1)))
    assert _value(m, "gpufootprint_daemon_config_last_reload_successful") == 1
    first, second = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
    first.connect(str(d.sock))
    first.sendall(PREAMBLE + encode_json(FrameType.HELLO, {"pid": os.getpid(), "start_time": 1}))
    time.sleep(0.3)
    second.connect(str(d.sock))
    second.settimeout(5)
    assert second.recv(1) == b"", "the limit applied live"
    _wait(lambda: _value(d.metrics(), "gpufootprint_daemon_connections_refused_total", reason="max_connections") == 1)
    assert "needs_restart=daemon.socket_mode" in d.log()
    assert oct(d.sock.stat().st_mode & 0o777) == "0o600", "socket_mode needs a restart: unchanged"
    # WHEN the file becomes invalid
    _write_config(cfg, "daemon:\n  max_connections: -5\n")
    d.proc.send_signal(signal.SIGHUP)
    m = _wait(lambda: _if(d.metrics(), lambda m: (
            _value(m, "gpufootprint_daemon_config_reloads_total", result="refused") == 1)))
    # THEN it is refused in one log line, the old configuration stays, the daemon serves on
    assert _value(m, "gpufootprint_daemon_config_last_reload_successful") == 0
    refused = [ln for ln in d.log().splitlines() if "config reload refused" in ln]
    assert len(refused) == 1 and "daemon.max_connections" in refused[0] and "-5" in refused[0]
    third = socket.socket(socket.AF_UNIX)
    third.connect(str(d.sock))
    third.settimeout(5)
    assert third.recv(1) == b"", "still max_connections=1"
    _write_config(cfg, "daemon:\n  max_connections: [\n")  # broken YAML: refused too
    d.proc.send_signal(signal.SIGHUP)
    _wait(lambda: _value(d.metrics(), "gpufootprint_daemon_config_reloads_total", result="refused") == 2)
    assert d.proc.poll() is None
    first.close()
    assert d.stop() == 0


# --- a probe killed mid-frame; nothing lost uncounted ------------------------------------------------

_MID_FRAME = r"""
import os, socket, sys, time
sys.path[:0] = [{root!r}, {daemon!r}]
import numpy as np
from gpufootprint.records import MEMORY_DTYPE, RecordKind
from gpufootprint.wire.framing import PREAMBLE, FrameType, encode_batch, encode_json
pid = os.getpid()
s = socket.socket(socket.AF_UNIX); s.connect({sock!r})
recs = np.zeros(200_000, MEMORY_DTYPE)  # a ~10 MiB frame
recs["pid"], recs["ts"], recs["op"], recs["mk"], recs["bytes"] = pid, time.time_ns(), 1, 3, 4096
recs["addr"] = np.arange(len(recs)) * 4096 + 0x1000
frame = encode_batch(RecordKind.MEMORY, recs)
s.sendall(PREAMBLE + encode_json(FrameType.HELLO, {{"pid": pid, "start_time": 1}}))
s.sendall(frame[: len(frame) // 2])
print(len(frame), flush=True)
time.sleep(60)
"""


def test_a_probe_killed_in_the_middle_of_a_large_frame_is_counted_and_forgotten(daemons) -> None:
    d = daemons(*_SETTINGS, "--set", "footprint.process_grace_seconds=0.5").ready()
    code = _MID_FRAME.format(root=str(ROOT), daemon=str(ROOT / "daemon"), sock=str(d.sock))
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=cli_env())
    assert child.stdout is not None and int(child.stdout.readline()) > 8 << 20
    _wait(lambda: _value(d.metrics(), "gpufootprint_daemon_buffered_bytes") > 4 << 20)
    child.send_signal(signal.SIGKILL)
    child.wait()
    m = _wait(lambda: _if(d.metrics(), lambda m: (
            _value(m, "gpufootprint_daemon_disconnects_total", reason="truncated_frame") == 1)))
    assert _value(m, "gpufootprint_daemon_buffered_bytes") == 0
    # Its pid is gone, so it is marked exited and, after the grace, forgotten.
    _wait(lambda: all(lab.get("pid") != str(child.pid) for lab, _ in d.metrics().get("gpufootprint_device_bytes", [])
                      + d.metrics().get("gpufootprint_watermark_timestamp_seconds", [])))
    assert d.proc.poll() is None


def test_probe_sent_and_dropped_reconcile_with_what_the_daemon_received_across_a_stall(daemons,
                                                                                        tmp_path: Path) -> None:
    # GIVEN a probe with a small (1 MiB) send buffer reporting to a daemon that stalls (SIGSTOP) mid-run
    d = daemons(*_SETTINGS).ready()
    sync = tmp_path / "sync"
    sync.mkdir()
    p = probe_child(d.sock, sync, "burst:500", "sleep:0.5", "touch:ready", "wait:stopped", "burst:20000",
                    "touch:burst_done", "wait:resumed", "burst:500", "sleep:0.5",
                    GPUFOOTPRINT_PROBE_BUFFER_BYTES="1048576")
    _touch_when(sync / "ready")
    d.proc.send_signal(signal.SIGSTOP)
    (sync / "stopped").touch()
    _touch_when(sync / "burst_done", 60)
    d.proc.send_signal(signal.SIGCONT)
    (sync / "resumed").touch()
    st = finish(p)["status"]
    # THEN every record the workload made is either sent or dropped (probe side) ...
    made = 2 * (500 + 20000 + 500)
    assert st["records_sent"] + st["records_dropped"] == made
    assert st["records_dropped"] > 0, "the stall made the probe shed records (counted)"
    # ... and what the probe counts as sent is exactly what the daemon received
    m = _wait(lambda: _if(d.metrics(), lambda m: (
            _value(m, "gpufootprint_probe_records_sent_total", pid=str(p.pid)) == st["records_sent"]
            and _value(m, "gpufootprint_daemon_disconnects_total", reason="goodbye"))))
    assert _value(m, "gpufootprint_daemon_records_received_total", pid=str(p.pid)) == st["records_sent"]
    assert _value(m, "gpufootprint_probe_records_dropped_total", pid=str(p.pid)) == st["records_dropped"]
    assert _value(m, "gpufootprint_daemon_disconnects_total", reason="goodbye") == 1


# --- out of file descriptors ------------------------------------------------------------------------

NOFILE = 128


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _knock(path: Path) -> socket.socket | None:
    """A non-blocking connect to the probe socket: None while the daemon's listen backlog is full."""
    s = socket.socket(socket.AF_UNIX)
    s.setblocking(False)
    try:
        s.connect(str(path))
    except BlockingIOError:
        s.close()
        return None
    return s


def _idle_http(port: int) -> socket.socket:
    """A TCP connection to /metrics that never sends a request (the server holds a descriptor for it)."""
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex(("127.0.0.1", port))
    return s


def test_out_of_file_descriptors_the_daemon_keeps_a_reserve_counts_accept_errors_without_spinning_and_recovers(
        daemons) -> None:
    from tests.integration.test_hostile_peers import GoodPeer

    # GIVEN a daemon allowed 128 descriptors (more probe connections than that are allowed by
    # daemon.max_connections) and a good probe connected to it
    d = daemons(*_SETTINGS, "--set", "daemon.hello_timeout_seconds=0", nofile=NOFILE).ready()
    good = GoodPeer(str(d.sock))
    blocks = good.blocks

    def good_bytes(m: dict[str, Any]) -> float | None:
        return _value(m, "gpufootprint_device_bytes", pid=str(good.pid))

    _wait(lambda: good_bytes(d.metrics()) == blocks << 20)
    # WHEN a flood of connections asks for more descriptors than the limit
    flood: list[socket.socket] = []
    end = time.monotonic() + 30
    while len(flood) < NOFILE + 40 and time.monotonic() < end:
        s = _knock(d.sock)
        if s is None:
            time.sleep(0.005)  # the backlog is full until the daemon's next accept round
        else:
            flood.append(s)
    assert len(flood) == NOFILE + 40
    # THEN the daemon keeps descriptors in reserve: the connections past it are refused and counted,
    # /metrics still answers during the flood and the good probe goes on reporting
    m = _wait(lambda: _if(d.metrics(), lambda m: (
            _value(m, "gpufootprint_daemon_connections_refused_total", reason="fd_limit"))))
    held = _value(m, "gpufootprint_daemon_probe_connections")
    assert held is not None and NOFILE // 2 < held < NOFILE - 8, held
    blocks = good.step()
    _wait(lambda: good_bytes(d.metrics()) == blocks << 20)

    # WHEN the reserve is used up as well (HTTP connections that never send a request, each holding
    # a descriptor) and more probes knock: accept() fails with EMFILE on both sockets
    idle: list[socket.socket] = []
    end = time.monotonic() + 30
    while _open_fds(d.proc.pid) < NOFILE and time.monotonic() < end:
        try:
            idle.append(socket.create_connection(("127.0.0.1", d.port), timeout=1))
        except OSError:
            pass  # the accept queue is full until the server's next accept
    assert _open_fds(d.proc.pid) == NOFILE
    idle += [_idle_http(d.port) for _ in range(8)]  # and some wait in the server's accept queue
    knocks = [k for k in (_knock(d.sock) for _ in range(20)) if k is not None]
    assert knocks
    t0, cpu0 = time.monotonic(), _cpu_seconds(d.proc.pid)
    blocks = good.step()  # the good probe reports while the daemon has no descriptor left
    time.sleep(3.0)  # a measuring window, not a synchronisation: what does the daemon burn meanwhile?
    cpu = (_cpu_seconds(d.proc.pid) - cpu0) / (time.monotonic() - t0)
    # THEN it does not spin: a failed accept pauses that listener instead of retrying at once
    assert cpu < 0.3, f"the daemon used {cpu:.2f} cores while out of descriptors"
    for s in idle:
        s.close()
    m = _wait(lambda: d.metrics())  # descriptors are free again: /metrics answers
    exhausted_s = time.monotonic() - t0
    errors = _value(m, "gpufootprint_daemon_accept_errors_total")
    assert errors is not None and 1 <= errors <= exhausted_s / 0.5 + 4, (errors, exhausted_s)
    _wait(lambda: good_bytes(d.metrics()) == blocks << 20)
    assert _value(d.metrics(), "gpufootprint_daemon_disconnects_total") in (None, 0.0)

    # WHEN the flood leaves, THEN a new probe connects and is counted
    for s in flood + knocks:
        s.close()
    _wait(lambda: _value(d.metrics(), "gpufootprint_daemon_probe_connections") == 1, timeout=30)
    newcomer = GoodPeer(str(d.sock))
    m = _wait(lambda: _if(d.metrics(), lambda m: (
            _value(m, "gpufootprint_device_bytes", pid=str(newcomer.pid)) == 1 << 20)))
    assert _value(m, "gpufootprint_daemon_probe_connections") == 2
    assert _value(m, "gpufootprint_daemon_records_received_total", pid=str(newcomer.pid)) == 1
    good.close()
    newcomer.close()
    assert d.proc.poll() is None


# --- fuzz: mutated real frames at a live daemon while a good probe reports --------------------------


def _real_frames() -> list[bytes]:
    from gpufootprint.wire.framing import FrameDecoder, encode

    dec = FrameDecoder()
    frames: list[bytes] = []
    for chunk in TraceFile(DATA / "h200_probe_caching.gfp.gz").chunks():
        frames += [encode(f.type, f.payload, f.tag) for f in dec.feed(chunk)]
    return frames


def _mutate(rng: random.Random, frames: list[bytes]) -> bytes:
    start = rng.randrange(len(frames))
    picked = frames[start:start + rng.randint(1, 6)]
    if rng.random() < 0.7:
        picked.insert(0, encode_json(FrameType.HELLO, {"pid": 1, "start_time": 1}))
    data = bytearray(PREAMBLE + b"".join(picked))
    op = rng.choice(["flip", "truncate", "length", "type", "splice", "shuffle", "garbage", "preamble", "none"])
    if op == "flip":
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif op == "truncate":
        data = data[: rng.randrange(1, len(data))]
    elif op == "length" and len(data) > 12:
        at = len(PREAMBLE)
        data[at:at + 4] = rng.choice([0, 1, 7, 0xFFFF, 0x7FFF_FFFF, 0xFFFF_FFFF]).to_bytes(4, "little")
    elif op == "type" and len(data) > 12:
        data[len(PREAMBLE) + 4] = rng.randrange(256)
    elif op == "splice":
        other = rng.choice(frames)
        cut = rng.randrange(len(data))
        data = data[:cut] + other + data[cut:]
    elif op == "shuffle":
        rng.shuffle(picked)
        data = bytearray(PREAMBLE + b"".join(picked))
    elif op == "garbage":
        data += rng.randbytes(rng.randint(1, 2048))
    elif op == "preamble":
        data[rng.randrange(8)] ^= 0xFF
    return bytes(data)


def test_fuzzed_real_frames_never_crash_the_daemon_and_a_good_probe_keeps_reporting(daemons,
                                                                                    tmp_path: Path) -> None:
    d = daemons(*_SETTINGS, "--set", "daemon.hello_timeout_seconds=2").ready()
    sync = tmp_path / "sync"
    sync.mkdir()
    good = probe_child(d.sock, sync, "alloc:0x1000:1000", "mark:m", "touch:up", "wait:fuzzed",
                       "alloc:0x2000:2000", "sleep:0.3")
    _touch_when(sync / "up")
    rng = random.Random(20261202)
    frames = _real_frames()
    n = 300
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(d.sock))
        s.settimeout(5)
        try:
            s.sendall(_mutate(rng, frames))
            s.shutdown(socket.SHUT_WR)
            s.recv(1)  # the daemon has read it all (or cut it off)
        except OSError:
            pass  # cut off while sending: exactly what a bad peer should get
        s.close()
    (sync / "fuzzed").touch()
    st = finish(good)["status"]
    assert st["records_dropped"] == 0 and st["reconnects"] == 0, "the good probe was never disturbed"
    # (fuzzed peers may end with a valid GOODBYE too: wait for the good probe's own end)
    m = _wait(lambda: _if(d.metrics(), lambda m: (
            _value(m, "gpufootprint_live_bytes", pid=str(good.pid)) is None
            and _value(m, "gpufootprint_daemon_records_received_total", pid=str(good.pid)) == st["records_sent"]
            and sum(v for _, v in m.get("gpufootprint_daemon_disconnects_total", [])) == n + 1)))
    assert d.proc.poll() is None
    disc = {lab["reason"]: v for lab, v in m["gpufootprint_daemon_disconnects_total"]}
    assert sum(disc.values()) == n + 1, disc  # every connection ended exactly once, with a reason
    assert _value(m, "gpufootprint_daemon_connections_total") == n + 1
    assert _value(m, "gpufootprint_daemon_buffered_bytes") == 0
    assert _value(m, "gpufootprint_daemon_records_received_total", pid=str(good.pid)) == st["records_sent"]
    assert "Traceback" not in d.log()
    assert d.stop() == 0


# --- identity: socket permissions -----------------------------------------------------------------


def test_socket_is_owner_only_by_default_and_group_accessible_when_configured(tmp_path: Path) -> None:
    owner = bind_probe_socket(str(tmp_path / "a.sock"), "0600", None)
    assert oct((tmp_path / "a.sock").stat().st_mode & 0o777) == "0o600"
    owner.close()
    group = grp.getgrgid(os.getgid()).gr_name
    shared = bind_probe_socket(str(tmp_path / "b.sock"), "0660", group)
    st = (tmp_path / "b.sock").stat()
    assert oct(st.st_mode & 0o777) == "0o660" and st.st_gid == os.getgid()
    shared.close()
    with pytest.raises(ConfigError, match="no group named"):
        bind_probe_socket(str(tmp_path / "c.sock"), "0660", "no-such-group-gfp")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a socket"):
        bind_probe_socket(str(tmp_path / "file"), "0600", None)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a peer as another user")
@pytest.mark.parametrize(("mode", "allowed"), [("0600", False), ("0666", True)])
def test_another_user_can_connect_only_when_the_mode_allows_it(tmp_path: Path, mode: str, allowed: bool) -> None:
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="gfp-perm-", dir="/tmp"))  # pytest's tmp_path is 0700: nobody can't enter
    os.chmod(d, 0o755)
    path = str(d / "p.sock")
    listener = bind_probe_socket(path, mode, None)
    code = ("import os, socket, sys\nos.setgid(65534); os.setuid(65534)\n"
            f"s = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect({path!r}); print('connected')\n"
            "except PermissionError: print('denied')\n")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False)
    finally:
        listener.close()
        shutil.rmtree(d, ignore_errors=True)
    assert r.stdout.strip() == ("connected" if allowed else "denied"), r.stderr


# --- TLS and basic auth on /metrics ----------------------------------------------------------------


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "server.crt", tmp / "server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "2", "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    return cert, key


def _opener(cert: Path, user: str | None = None, password: str | None = None) -> urllib.request.OpenerDirector:
    ctx = ssl.create_default_context(cafile=str(cert))
    handlers: list[Any] = [urllib.request.HTTPSHandler(context=ctx)]
    opener = urllib.request.build_opener(*handlers)
    if user is not None:
        token = b64encode(f"{user}:{password}".encode()).decode()
        opener.addheaders = [("Authorization", f"Basic {token}")]
    return opener


def test_web_config_file_serves_tls_with_basic_auth_and_sighup_rotates_the_users(daemons, tmp_path: Path) -> None:
    import bcrypt

    cert, _key = _self_signed(tmp_path)
    web = tmp_path / "web.yaml"
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=10)).decode().replace("$2b$", "$2y$", 1)
    web.write_text(f"tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
                   f"http_server_config:\n  headers:\n    X-Content-Type-Options: nosniff\n"
                   f"basic_auth_users:\n  prometheus: {hashed}\n")
    d = daemons(*_SETTINGS, "--web.config.file", str(web))
    ok = _opener(cert, "prometheus", "s3cret")
    d.ready(opener=ok, scheme="https")
    assert "gpufootprint_build_info" in d.metrics(opener=ok, scheme="https")
    for opener in (_opener(cert), _opener(cert, "prometheus", "wrong"), _opener(cert, "nobody", "s3cret")):
        with pytest.raises(urllib.error.HTTPError) as exc:
            opener.open(f"https://127.0.0.1:{d.port}/metrics", timeout=5)
        assert exc.value.code == 401 and exc.value.headers["WWW-Authenticate"].startswith("Basic")
    with _opener(cert).open(f"https://127.0.0.1:{d.port}/healthz", timeout=5) as resp:
        assert resp.status == 200 and resp.headers["X-Content-Type-Options"] == "nosniff"
    with pytest.raises(OSError):  # plain HTTP to the TLS port gets nothing (URLError or a reset)
        urllib.request.urlopen(f"http://127.0.0.1:{d.port}/metrics", timeout=5)
    # SIGHUP with a new password: the old one stops working
    hashed2 = bcrypt.hashpw(b"n3w", bcrypt.gensalt(rounds=4)).decode()
    web.write_text(web.read_text().replace(hashed, hashed2))
    d.proc.send_signal(signal.SIGHUP)
    new = _opener(cert, "prometheus", "n3w")
    _wait(lambda: d.metrics(opener=new, scheme="https"))
    with pytest.raises(urllib.error.HTTPError):
        ok.open(f"https://127.0.0.1:{d.port}/metrics", timeout=5)
    assert d.stop() == 0


@pytest.mark.parametrize(("text", "where"), [
    ("tls_server_config:\n  cert_file: nope.crt\n  key_file: nope.key\n", "cannot load"),
    ("tls_server_config:\n  cert_file: a\n", "key_file: required"),
    ("tls_server_config:\n  cert_file: a\n  key_file: b\n  cipher_suites: [X]\n", "cipher_suites: not supported"),
    ("basic_auth_users:\n  bob: plaintext\n", "basic_auth_users.bob: expected a bcrypt hash"),
    ("surprise: 1\n", "surprise: unknown key"),
])
def test_a_bad_web_config_file_stops_the_daemon_at_start_naming_the_key(tmp_path: Path, text: str, where: str) -> None:
    web = tmp_path / "web.yaml"
    web.write_text(text)
    r = subprocess.run([sys.executable, "-m", "gpufootprint", "daemon", "--socket", str(tmp_path / "s.sock"),
                        "--listen", f"127.0.0.1:{free_port()}", "--web.config.file", str(web)],
                       env=cli_env(), capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and where in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


# --- a full disk under `record` ---------------------------------------------------------------------


def _tmpfs(tmp: Path) -> Path | None:
    mnt = tmp / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True,
                       check=False)
    return mnt if r.returncode == 0 else None


@pytest.mark.parametrize("target", ["/dev/full", "tmpfs-64k"])
def test_record_onto_a_full_disk_never_breaks_the_workload_and_counts_the_loss(tmp_path: Path, target: str) -> None:
    mnt = None
    if target == "/dev/full":
        out = "/dev/full"
    else:
        mnt = _tmpfs(tmp_path)
        if mnt is None:
            pytest.skip("cannot mount a tmpfs here (not root); the /dev/full case covers the same path")
        out = str(mnt / "rec.gfp")
    try:
        script = (f"import subprocess, sys\nr = subprocess.run([sys.executable, {CHILD!r}, {str(tmp_path)!r}, "
                  "'burst:20000', 'mark:m'])\nsys.exit(7 if r.returncode == 0 else 1)\n")
        env = dict(os.environ, PYTHONPATH=str(ROOT / "daemon"), GPUFOOTPRINT_PROBE_FLUSH_MS="20")
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "gpufootprint", "record", "-o", out, "--", sys.executable, "-c",
                            script], env=env, capture_output=True, text=True, timeout=120, check=False)
        elapsed = time.monotonic() - t0
    finally:
        if mnt is not None:
            subprocess.run(["umount", str(mnt)], check=False)
    assert r.returncode == 7, r.stderr[-2000:]  # the workload's own exit status
    st = json.loads(r.stdout.strip().splitlines()[-1])["status"]
    assert st["records_sent"] == 40000 and st["records_dropped"] == 0, "the relay kept reading: nothing backed up"
    lost = [ln for ln in r.stderr.splitlines() if ln.startswith("gpufootprint record: error:")]
    assert len(lost) == 1 and "No space left on device" in lost[0] and "lost" in lost[0], r.stderr[-2000:]
    assert elapsed < 60
