"""The ingest loop: probe connections on a Unix socket, injected streams, ticks.

Everything that mutates the pipeline runs on this one thread, so the footprint
needs no locks. Sockets are non-blocking under a selector; a peer that breaks
the wire format is cut off alone, with a counted reason. Other threads (the
demo's feeder, tests) hand frames in through ``inject``.
"""

from __future__ import annotations

import dataclasses
import grp
import logging
import os
import queue
import selectors
import socket
import stat
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpufootprint.config import Config
from gpufootprint.errors import ConfigError
from gpufootprint.ingest.pipeline import Pipeline
from gpufootprint.ingest.session import MarkCallback, Session
from gpufootprint.snapshot import EMPTY_SNAPSHOT, GpuState, PipelineSnapshot
from gpufootprint.wire.framing import Frame, FrameDecoder, FrameType, encode_json

if TYPE_CHECKING:
    from gpufootprint.nvml.poller import NvmlPoller

log = logging.getLogger(__name__)

_RECV = 256 * 1024
_PEERCRED = struct.Struct("3i")


@dataclass
class Connection:
    sock: socket.socket
    decoder: FrameDecoder
    session: Session
    pid: int
    uid: int
    opened: float = field(default_factory=time.monotonic)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, from the kernel (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


def bind_probe_socket(path: str, mode: str, group: str | None) -> socket.socket:
    """Create the listening socket owner-only (or group-accessible) before anyone can connect."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() or target.is_symlink():
        if not stat.S_ISSOCK(target.lstat().st_mode):
            raise ConfigError(f"daemon.socket: {path} exists and is not a socket")
        target.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # no window in which the socket is more open than asked
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    if group:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            sock.close()
            raise ConfigError(f"daemon.socket_group: no group named {group!r}") from None
        os.chown(path, -1, gid)
    os.chmod(path, int(mode, 8))
    sock.listen(128)
    sock.setblocking(False)
    return sock


class IngestServer:
    def __init__(self, config: Config, pipeline: Pipeline, *, socket_path: str | None,
                 clock_ns: Callable[[], int] = time.time_ns,
                 extra_daemon_values: Callable[[], dict[str, float]] | None = None,
                 on_mark: MarkCallback | None = None,
                 nvml: NvmlPoller | None = None) -> None:
        self.config = config
        self.pipeline = pipeline
        # Issue 4: the sampler sends CONTROL frames through us; NVML is polled from this thread.
        self.nvml = nvml
        self.pipeline.hub.control = self.send_control
        self.socket_path = socket_path
        self._clock_ns = clock_ns
        self._extra = extra_daemon_values
        self._on_mark = on_mark  # called on the ingest thread with each probe MARK's state (tests, reports)
        self._sel = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._conns: dict[int, Connection] = {}
        self._inbox: queue.SimpleQueue[tuple[Session, Frame | None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.stop_event = threading.Event()
        # Held while the pipeline changes; only needed when another thread (replay
        # --listen) drives the pipeline directly instead of through inject().
        self.lock = threading.Lock()
        self.snapshot: PipelineSnapshot = EMPTY_SNAPSHOT
        self.published = threading.Event()
        self.disconnects: Counter[str] = Counter()
        self.connections_total = 0
        # Called on the ingest thread with each new snapshot (the engines); may call send().
        self.on_snapshot: Callable[[PipelineSnapshot], None] | None = None

    # --- lifecycle ----------------------------------------------------------------

    def open(self) -> None:
        if self.socket_path:
            dc = self.config.daemon
            self._listener = bind_probe_socket(self.socket_path, dc.socket_mode, dc.socket_group)
            self._sel.register(self._listener, selectors.EVENT_READ, "listen")
            log.info("listening for probes socket=%s mode=%s", self.socket_path, dc.socket_mode)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")

    def run(self) -> None:
        tick_s = self.config.daemon.tick_ms / 1000
        next_tick = time.monotonic()
        while not self.stop_event.is_set():
            wake = next_tick if self.nvml is None or self.nvml.threaded else min(next_tick, self.nvml.next_due())
            timeout = max(0.0, wake - time.monotonic())
            for key, _ in self._sel.select(timeout):
                if key.data == "listen":
                    self._accept()
                elif key.data == "wake":
                    self._drain_wake()
                else:
                    self._read(key.data)
            self._drain_inbox()
            if time.monotonic() >= next_tick:
                self.tick()
                next_tick = time.monotonic() + tick_s
            elif self.nvml is not None:
                self._poll_nvml()  # between ticks, at the sampler's cadence
        self._shutdown()

    def stop(self) -> None:
        self.stop_event.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _shutdown(self) -> None:
        for conn in list(self._conns.values()):
            self._close(conn, "daemon_shutdown")
        if self._listener is not None:
            self._sel.unregister(self._listener)
            self._listener.close()
            if self.socket_path:
                try:
                    os.unlink(self.socket_path)
                except OSError:
                    pass
        self.tick()

    # --- the pipeline's clock -------------------------------------------------------

    def tick(self) -> None:
        """Advance live processes' watermarks by the clock, expire, publish a snapshot."""
        with self.lock:
            self._tick()

    def _tick(self) -> None:
        now = self._clock_ns()
        horizon = now - self.config.footprint.reorder_window_ms * 1_000_000
        for pid, proc in list(self.pipeline.processes.items()):
            if proc.source == "probe" and proc.exited_at is None:
                self.pipeline.advance(pid, horizon)
        self.pipeline.expire()
        daemon_values: dict[str, float] = {"probe_connections": len(self._conns)}
        if self._extra is not None:
            daemon_values.update(self._extra())
        extra: dict[str, Any] = {}
        if self.nvml is not None:
            self._poll_nvml()
            nvml_snap = self.nvml.snapshot()
            extra["nvml"] = nvml_snap
            # The engines' view of each GPU (model for prices, size, utilisation for advice).
            extra["gpus"] = tuple(GpuState(index=g.index, model=g.model, uuid=g.uuid, total_bytes=g.memory_total_bytes,
                                           utilization_ratio=g.utilization_ratio) for g in nvml_snap.gpus)
        self.snapshot = dataclasses.replace(self.pipeline.snapshot(now / 1e9), daemon=daemon_values, **extra)
        self.published.set()
        if self.on_snapshot is not None:
            try:
                self.on_snapshot(self.snapshot)
            except Exception:  # noqa: BLE001 - an engine bug must not stop ingest
                log.exception("snapshot consumer failed")

    # --- injected streams (demo, tests) ---------------------------------------------

    def inject(self, session: Session, frame: Frame | None) -> None:
        """Hand a frame to the ingest thread; ``None`` closes the session."""
        self._inbox.put((session, frame))
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full: the loop is awake anyway

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _drain_inbox(self) -> None:
        while True:
            try:
                session, frame = self._inbox.get_nowait()
            except queue.Empty:
                return
            with self.lock:
                if frame is None:
                    session.close()
                else:
                    session.handle(frame)

    # --- probe connections ----------------------------------------------------------

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                log.warning("accept failed: %s", exc)
                return
            sock.setblocking(False)
            pid, uid, _gid = peer_credentials(sock)
            session = Session(self.pipeline, source="probe", name=f"probe pid={pid}", peer_pid=pid,
                              on_mark=self._on_mark)
            conn = Connection(sock, FrameDecoder(self.config.daemon.max_frame_bytes), session, pid, uid)
            self._conns[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)
            self.connections_total += 1
            log.info("probe connected pid=%d uid=%d", pid, uid)

    def _read(self, conn: Connection) -> None:
        try:
            data = conn.sock.recv(_RECV)
        except BlockingIOError:
            return
        except OSError as exc:
            self._close(conn, "socket_error")
            log.info("probe pid=%d socket error: %s", conn.pid, exc)
            return
        if not data:
            self._close(conn, "eof")
            return
        for frame in conn.decoder.feed(data):
            conn.session.handle(frame)
        if conn.decoder.error is not None:
            conn.session.problem("bad_frame", f"probe pid={conn.pid}: {conn.decoder.error}")
            self._close(conn, "bad_frame")

    def _poll_nvml(self) -> None:
        assert self.nvml is not None
        live = [pid for pid, p in self.pipeline.processes.items() if p.source == "probe" and p.exited_at is None]
        self.nvml.set_interval(self.pipeline.hub.fastest_interval_s(live))
        if not self.nvml.threaded:  # the daemon polls on the NVML thread; tests poll here
            self.nvml.maybe_poll()

    def send_control(self, pid: int, body: dict[str, Any]) -> bool:
        """A CONTROL frame (contract: flush_interval, kernel_window, ...) to one probe."""
        return self.send(pid, encode_json(FrameType.CONTROL, body))

    def send(self, pid: int, payload: bytes) -> bool:
        """Best-effort control message to a probe; never blocks the ingest thread."""
        for conn in self._conns.values():
            if conn.pid == pid:
                try:
                    conn.sock.send(payload)
                    return True
                except (BlockingIOError, OSError):
                    return False
        return False

    def _close(self, conn: Connection, reason: str) -> None:
        self.disconnects[reason] += 1
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        self._conns.pop(conn.sock.fileno(), None)
        conn.sock.close()
        conn.session.close()
        # Without a goodbye the process may still run (the probe will reconnect
        # and resync); if it is gone, the driver freed its memory.
        if not _pid_alive(conn.pid):
            self.pipeline.process_exited(conn.pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
