"""Bad input on the probe socket. Real Unix sockets, the real IngestServer, a real good peer.

Each test connects a good peer (a child process speaking the protocol, as a probe would)
and then misbehaves on other connections. What must hold every time: the bad peer is
cut off with its own counted reason, the good peer's footprint keeps moving, the daemon
thread is still running.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gpufootprint.configload import load_config
from gpufootprint.ingest.server import IngestServer
from gpufootprint.pipeline import Pipeline
from gpufootprint.records import RecordKind
from gpufootprint.wire.framing import (
    PREAMBLE,
    UNCHECKED,
    FrameDecoder,
    FrameType,
    encode_batch,
    encode_json,
    encode_watermark,
)

from tests.conftest import ALLOC, FREE, ROOT, cli_env, mem, mem_batch


class LiveServer:
    def __init__(self, path: str, **daemon: Any) -> None:
        overrides = {"footprint.reorder_window_ms": 0, **{f"daemon.{k}": v for k, v in daemon.items()}}
        cfg = load_config(env={}, overrides=overrides)
        self.pipeline = Pipeline(cfg.footprint)
        self.server = IngestServer(cfg, self.pipeline, socket_path=path)
        self.pipeline.hub.control = self.server.send_control  # as App wires it
        self.server.open()
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(10)

    def wait(self, pred, timeout: float = 10.0):  # type: ignore[no-untyped-def]
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            value = pred()
            if value:
                return value
            time.sleep(0.01)
        raise AssertionError(f"not reached in {timeout} s; disconnects={dict(self.server.disconnects)}")

    def device_bytes(self, pid: int) -> int:
        snap = self.server.snapshot
        return sum(d.device_bytes for p in snap.processes if p.pid == pid for d in p.devices)


# A good peer: allocates one more 1 MiB block each time it reads a line, until stdin closes.
_GOOD = r"""
import socket, sys, time
sys.path[:0] = [{root!r}, {daemon!r}]
from tests.conftest import mem, mem_batch, ALLOC
from gpufootprint.records import RecordKind
from gpufootprint.wire.framing import PREAMBLE, FrameType, encode_batch, encode_json, encode_watermark
import os
pid = os.getpid()
s = socket.socket(socket.AF_UNIX); s.connect({sock!r})
s.sendall(PREAMBLE + encode_json(FrameType.HELLO, {{"pid": pid, "start_time": 1}}))
n = 0
while True:
    n += 1
    now = time.time_ns()
    s.sendall(encode_batch(RecordKind.MEMORY, mem_batch([mem(now, ALLOC, 0x10000 * n, 1 << 20, pid=pid)]))
              + encode_watermark(now))
    print(n, flush=True)
    if not sys.stdin.readline():
        break
s.sendall(encode_json(FrameType.GOODBYE, {{"counters": {{}}}}))
s.close()
"""


class GoodPeer:
    def __init__(self, sock: str) -> None:
        code = _GOOD.format(root=str(ROOT), daemon=str(ROOT / "daemon"), sock=sock)
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=cli_env())
        self.blocks = self._read()
        self.pid = self.proc.pid

    def _read(self) -> int:
        assert self.proc.stdout is not None
        return int(self.proc.stdout.readline())

    def step(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        self.blocks = self._read()
        return self.blocks

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.communicate("", timeout=10)


def _good_still_reports(srv: LiveServer, good: GoodPeer) -> None:
    n = good.step()
    srv.wait(lambda: srv.device_bytes(good.pid) == n << 20)
    assert srv.thread.is_alive()


def _hello(pid: int = 1) -> bytes:
    return encode_json(FrameType.HELLO, {"pid": pid, "start_time": 2})


def _batch(pid: int) -> bytes:
    return encode_batch(RecordKind.MEMORY, mem_batch([mem(time.time_ns(), ALLOC, 0x5000, 4096, pid=pid)]))


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.settimeout(5)
    return s


def _connect_retrying(path: str, timeout: float = 10.0) -> socket.socket:
    """A full listen backlog refuses a Unix connect with EAGAIN until the daemon accepts: retry."""
    end = time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(path)
            return s
        except BlockingIOError:
            s.close()
            if time.monotonic() > end:
                raise
            time.sleep(0.001)


_HEADER = struct.Struct("<IBBH")


def _raw_frame(length: int, ftype: int, payload: bytes = b"") -> bytes:
    head = _HEADER.pack(length, ftype, 0, 0)
    return head + zlib.crc32(payload, zlib.crc32(head)).to_bytes(4, "little") + payload


def _unchecked(frame: bytes) -> bytes:
    """``frame`` marked as carrying no checksum."""
    out = bytearray(frame)
    out[5] |= UNCHECKED
    out[8:12] = bytes(4)
    return bytes(out)


def _bad_checksum() -> bytes:
    frame = bytearray(_hello())
    frame[-2] ^= 0x55
    return PREAMBLE + bytes(frame)


CASES = {
    "random bytes": (lambda pid: os.urandom(4096), "bad_preamble"),
    "wrong wire version": (lambda pid: b"GPUFP" + bytes([9]) + b"\r\n" + _hello(pid), "bad_version"),
    "absurd length": (lambda pid: PREAMBLE + _raw_frame(0xFFFF_FFF0, FrameType.BATCH), "frame_too_large"),
    "damaged payload": (lambda pid: _bad_checksum(), "bad_checksum"),
    # only a forwarded CUPTI buffer may come without a checksum (framing.UNCHECKED)
    "unchecked BATCH": (lambda pid: PREAMBLE + _hello(pid) + _unchecked(_batch(pid)), "bad_checksum"),
    "unknown frame type": (lambda pid: PREAMBLE + _hello(pid) + _raw_frame(3, 200, b"abc"), "bad_frame_type"),
    "BATCH before HELLO": (lambda pid: PREAMBLE + _batch(pid), "frame_before_hello"),
    "two HELLOs": (lambda pid: PREAMBLE + _hello(pid) + _hello(pid), "duplicate_hello"),
    "RESYNC_END without BEGIN": (lambda pid: PREAMBLE + _hello(pid) + encode_json(FrameType.RESYNC_END, {}),
                                 "resync_mismatch"),
    "RESYNC_BEGIN twice": (lambda pid: PREAMBLE + _hello(pid) + encode_json(FrameType.RESYNC_BEGIN, {"ts": 1}) * 2,
                           "resync_mismatch"),
    "GOODBYE twice": (lambda pid: PREAMBLE + _hello(pid) + encode_json(FrameType.GOODBYE, {}) * 2,
                      "frame_after_goodbye"),
    "CONTROL from a probe": (lambda pid: PREAMBLE + _hello(pid) + encode_json(FrameType.CONTROL, {"op": "resync"}),
                             "unexpected_frame"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_bad_peer_is_cut_off_alone_with_its_reason_and_the_good_peer_goes_on(live, case: str) -> None:
    srv, good = live()
    payload, reason = CASES[case]
    bad = _connect(srv.server.socket_path)
    bad.sendall(payload(os.getpid()))
    assert bad.recv(1) == b"", "the daemon closes the bad peer"
    bad.close()
    srv.wait(lambda: srv.server.disconnects[reason] == 1)
    assert sum(srv.server.disconnects.values()) == 1, dict(srv.server.disconnects)
    _good_still_reports(srv, good)
    assert len(srv.server._conns) == 1


def test_a_peer_that_dies_inside_a_frame_is_counted_as_truncated(live) -> None:
    srv, good = live()
    bad = _connect(srv.server.socket_path)
    frame = _batch(os.getpid())
    bad.sendall(PREAMBLE + _hello() + frame[: len(frame) // 2])
    bad.close()
    srv.wait(lambda: srv.server.disconnects["truncated_frame"] == 1)
    _good_still_reports(srv, good)


def test_a_peer_that_connects_and_never_speaks_is_cut_off_after_the_hello_timeout(live) -> None:
    srv, good = live(hello_timeout_seconds=0.3)
    silent = _connect(srv.server.socket_path)
    half = _connect(srv.server.socket_path)
    half.sendall(PREAMBLE[:3])  # a slow-loris: a few bytes, then nothing
    t0 = time.monotonic()
    assert silent.recv(1) == b"" and half.recv(1) == b""
    assert 0.25 < time.monotonic() - t0 < 5
    assert srv.server.disconnects["hello_timeout"] == 2
    _good_still_reports(srv, good)  # it sent its HELLO long ago: never timed out


def test_thousands_of_connections_past_max_connections_are_refused_politely_and_counted(live) -> None:
    srv, good = live(max_connections=200, hello_timeout_seconds=120)
    socks = []
    for _ in range(2000):
        socks.append(_connect_retrying(srv.server.socket_path))
    srv.wait(lambda: sum(srv.server.refused.values()) + len(srv.server._conns) >= 2001, timeout=30)
    assert len(srv.server._conns) == 200
    assert srv.server.refused["max_connections"] == 2001 - 200
    assert sum(srv.server.disconnects.values()) == 0
    _good_still_reports(srv, good)
    for s in socks:
        s.close()
    srv.wait(lambda: len(srv.server._conns) == 1, timeout=30)
    # Room again: a new peer is accepted.
    again = _connect(srv.server.socket_path)
    again.sendall(PREAMBLE + _hello())
    srv.wait(lambda: len(srv.server._conns) == 2)
    again.close()


def test_partial_frames_are_bounded_per_connection_and_in_total(live) -> None:
    # Each hog announces an 8 MiB frame (allowed: under max_frame_bytes) and sends 400 KiB of it.
    srv, good = live(max_buffered_bytes=1 << 20)
    hogs = []
    for _ in range(3):
        h = _connect(srv.server.socket_path)
        h.sendall(PREAMBLE + _hello() + _raw_frame(8 << 20, FrameType.BATCH) + b"\0" * (400 << 10))
        hogs.append(h)
        time.sleep(0.2)
    srv.wait(lambda: srv.server.disconnects["memory_limit"] >= 1)
    assert srv.server._buffered <= 1 << 20
    assert srv.server.disconnects["memory_limit"] == 1, "only the holder that broke the bound goes"
    _good_still_reports(srv, good)
    for h in hogs:
        h.close()
    srv.wait(lambda: srv.server._buffered == 0)


def test_records_stamped_far_in_the_future_are_clamped_and_counted_not_stalling_the_stream(live) -> None:
    srv, good = live(max_future_seconds=60)
    s = _connect(srv.server.socket_path)
    pid = os.getpid()
    now = time.time_ns()
    year = 365 * 86400 * 10**9
    s.sendall(PREAMBLE + _hello(pid))
    s.sendall(encode_batch(RecordKind.MEMORY, mem_batch([mem(now + year, ALLOC, 0xA000, 1 << 20, pid=pid)])))
    srv.wait(lambda: srv.pipeline.errors.counts.get("future_timestamp", 0) == 1)  # the step, then normal time
    s.sendall(encode_batch(RecordKind.MEMORY, mem_batch([mem(now - year, ALLOC, 0xB000, 2 << 20, pid=pid)])))
    s.sendall(encode_batch(RecordKind.MEMORY, mem_batch([mem(now + 1000, FREE, 0xA000, 1 << 20, pid=pid)])))
    s.sendall(encode_watermark(now + 2000))
    srv.wait(lambda: srv.pipeline.errors.counts.get("future_timestamp", 0) == 1)
    srv.wait(lambda: srv.device_bytes(pid) == 2 << 20)
    proc = srv.pipeline.processes[pid]
    # The clamp held the watermark near the real clock: not a year ahead.
    assert proc.applied_to < time.time_ns() + 120 * 10**9
    assert sum(srv.server.disconnects.values()) == 0
    s.close()
    _good_still_reports(srv, good)


def test_an_exception_inside_frame_handling_cuts_off_that_peer_only(live, monkeypatch) -> None:
    srv, good = live()
    from gpufootprint.ingest.session import Session

    real = Session._mark

    def broken(self, mark):  # type: ignore[no-untyped-def]
        if mark.get("label") == "boom":
            raise ZeroDivisionError("a bug")
        return real(self, mark)

    monkeypatch.setattr(Session, "_mark", broken)
    bad = _connect(srv.server.socket_path)
    bad.sendall(PREAMBLE + _hello() + encode_json(FrameType.MARK, {"label": "boom", "ts": 1, "pid": 1, "dev": 0}))
    assert bad.recv(1) == b""
    srv.wait(lambda: srv.server.disconnects["internal_error"] == 1)
    _good_still_reports(srv, good)


def test_heartbeat_counter_names_and_hello_fields_are_bounded_before_they_reach_labels(live) -> None:
    srv, good = live()
    s = _connect(srv.server.socket_path)
    pid = os.getpid()
    counters: dict[str, Any] = {f"disconnects_x{i}": 1 for i in range(500)}
    counters['disconnects_evil"} 1\ninjected_metric{a="'] = 1
    s.sendall(PREAMBLE + encode_json(FrameType.HELLO, {"pid": pid, "start_time": 3, "host": "h" * 100_000 + "\n",
                                                       "pod": "p\x00od", "Not An Identifier": "x"}))
    s.sendall(encode_json(FrameType.HEARTBEAT, {"pid": pid, "counters": counters}))
    srv.wait(lambda: srv.pipeline.processes.get(pid) and srv.pipeline.processes[pid].probe_counters)
    proc = srv.pipeline.processes[pid]
    assert len(proc.probe_counters) <= 96  # ingest/session.py _MAX_COUNTERS
    assert all(k.isidentifier() and k.islower() for k in proc.probe_counters)
    assert len(proc.info["host"]) == 256 and "\n" not in proc.info["host"]
    assert proc.info["pod"] == "p?od" and "Not An Identifier" not in proc.info
    s.close()
    _good_still_reports(srv, good)


def test_label_values_are_cut_with_a_hash_and_cleaned_at_scrape_time() -> None:
    from gpufootprint.exporter.cardinality import safe_label_value, sanitize_label_values
    from prometheus_client.core import GaugeMetricFamily

    a, b = "x" * 300 + "a", "x" * 300 + "b"
    assert len(safe_label_value(a, 64)) == 64 and safe_label_value(a, 64) != safe_label_value(b, 64)
    assert safe_label_value("ok\nthen\x7f", 64) == "ok?then?"
    g = GaugeMetricFamily("m", "h", labels=["pid", "name"])
    g.add_metric(["1", a], 1.0)
    g.add_metric(["2", "fine"], 2.0)
    (out,) = sanitize_label_values([g], 64)
    assert [len(s.labels["name"]) for s in out.samples] == [64, 4]
    assert np.isclose(sum(s.value for s in out.samples), 3.0)


def test_control_frames_to_a_probe_that_does_not_read_are_never_torn(tmp_path: Path) -> None:
    from gpufootprint.wire.framing import FrameDecoder

    cfg = load_config(env={})
    srv = IngestServer(cfg, Pipeline(cfg.footprint), socket_path=str(tmp_path / "c.sock"))
    srv.open()
    peer = _connect(str(tmp_path / "c.sock"))
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    srv._accept()
    body = {"op": "flush_interval", "ms": 5, "pad": "x" * 3000}
    sent = sum(srv.send_control(os.getpid(), body) for _ in range(2000))  # far more than the socket takes
    assert 0 < sent < 2000, "some were refused whole while the socket was full"
    peer.setblocking(False)
    data = bytearray()
    for _ in range(200):
        srv._enforce_timeouts()  # where the ingest loop flushes a kept tail
        try:
            while chunk := peer.recv(1 << 16):
                data += chunk
        except BlockingIOError:
            pass
        if not any(c.unsent for c in srv._conns.values()):
            break
    try:
        while chunk := peer.recv(1 << 16):
            data += chunk
    except BlockingIOError:
        pass
    dec = FrameDecoder()
    dec.feed(PREAMBLE)
    frames = dec.feed(bytes(data))
    assert dec.error is None and dec.pending == 0, "no torn frame"
    assert len(frames) == sent and all(f.json()["ms"] == 5 for f in frames)
    peer.close()
    srv.stop()


def test_a_probe_that_exits_after_goodbye_with_control_frames_unread_ends_cleanly(live) -> None:
    srv, _good = live()
    s = _connect(srv.server.socket_path)
    s.sendall(PREAMBLE + _hello(os.getpid()) + encode_json(FrameType.GOODBYE, {}))
    srv.wait(lambda: any(c.goodbye for c in list(srv.server._conns.values())))
    assert srv.server.send_control(os.getpid(), {"op": "flush_interval", "ms": 5})  # never read
    s.close()  # unread data: the daemon's recv sees a reset, not an EOF
    srv.wait(lambda: srv.server.disconnects["goodbye"] == 1)
    assert srv.server.disconnects["socket_error"] == 0


def test_a_probe_asked_at_its_hello_that_dies_mid_frame_with_the_ask_unread_is_a_truncated_frame(live) -> None:
    """A probe whose HELLO names its buffer level gets the daemon's verify CONTROL at once; one killed
    before it read it leaves data unread, and the kernel resets the socket instead of ending it. Its end
    is still what it sent: cut inside a frame, or ended between frames without a GOODBYE."""
    srv, _good = live()
    pid = os.getpid()
    cut = _connect(srv.server.socket_path)
    cut.sendall(PREAMBLE + encode_json(FrameType.HELLO, {"pid": pid, "start_time": 2, "cupti_buffers": 3}))
    cut.settimeout(10)
    assert cut.recv(1, socket.MSG_PEEK)  # the ask is in this peer's queue, unread
    frame = _batch(pid)
    cut.sendall(frame[:len(frame) // 2])
    cut.close()  # the verify CONTROL unread: a reset
    srv.wait(lambda: srv.server.disconnects["truncated_frame"] == 1)
    ended = _connect(srv.server.socket_path)
    ended.sendall(PREAMBLE + encode_json(FrameType.HELLO, {"pid": pid + 1, "start_time": 2, "cupti_buffers": 3}))
    ended.settimeout(10)
    assert ended.recv(1, socket.MSG_PEEK)
    ended.close()
    srv.wait(lambda: srv.server.disconnects["eof"] == 1)
    assert srv.server.disconnects["socket_error"] == 0


def test_the_ask_at_a_hello_goes_to_that_connection_when_its_pid_has_another(live) -> None:
    """A reconnect whose old connection the daemon has not yet seen end, or two processes that both read
    as pid 0 (a daemon without the host's pid namespace): the ask answers the HELLO on its own connection."""
    srv, _good = live()
    hello = PREAMBLE + encode_json(FrameType.HELLO, {"pid": os.getpid(), "start_time": 2, "cupti_buffers": 3})
    first, second = _connect(srv.server.socket_path), _connect(srv.server.socket_path)
    for s in (first, second):
        s.settimeout(10)
        s.sendall(hello)
        dec = FrameDecoder()
        dec.feed(PREAMBLE)  # the daemon sends bare frames
        frames: list[Any] = []
        while not frames:
            data = s.recv(1 << 16)
            assert data, "the connection ended without the ask"
            frames = dec.feed(data)
        assert frames[0].type is FrameType.CONTROL and frames[0].json()["op"] == "verify", frames
    first.close()
    second.close()
