"""The ingest loop: probe connections on a Unix socket, injected streams, ticks.

Everything that mutates the pipeline runs on this one thread, so the footprint
needs no locks. Sockets are non-blocking under a selector; a peer that breaks
the wire format is cut off alone, with a counted reason. Other threads (the
demo's feeder, tests) hand frames in through ``inject``.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import grp
import logging
import os
import queue
import resource
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
from gpufootprint.errors import ConfigError, FrameError
from gpufootprint.ingest.pipeline import Pipeline
from gpufootprint.ingest.session import MarkCallback, Session
from gpufootprint.ingest.validate import Guard, Limits
from gpufootprint.snapshot import EMPTY_SNAPSHOT, GpuState, PipelineSnapshot
from gpufootprint.records import DTYPES, RecordKind
from gpufootprint.serverstats import ServerStats, TickHealth
from gpufootprint.probe import rawrecords
from gpufootprint.wire.framing import Frame, FrameDecoder, FrameType, cupti_buffer, encode_json

if TYPE_CHECKING:
    from gpufootprint.nvml.poller import NvmlPoller

log = logging.getLogger(__name__)

_RECV = 256 * 1024
_LIVENESS_S = 2.0  # how often disconnected probe pids are checked for having exited
#: At most one resync request per process this often (a late record or a drift asked for it).
RESYNC_REQUEST_EVERY_S = 5.0
#: A probe that sends watermarks is advanced by the daemon's clock only after this long without one
#: (at least; five of its declared watermark periods when longer): it has hung or stopped flushing.
SILENT_PROBE_S = 10.0
_PEERCRED = struct.Struct("3i")
#: Descriptors kept free for everything but probe connections (/metrics scrapes, /proc reads, the
#: Kubernetes API, logs): at most this many, a quarter of RLIMIT_NOFILE when that is small.
FD_RESERVE = 32
#: After accept() fails for want of descriptors, the listener is not selected for this long.
ACCEPT_PAUSE_S = 0.5


@dataclass
class Connection:
    sock: socket.socket
    decoder: FrameDecoder
    session: Session
    pid: int
    uid: int
    opened: float = field(default_factory=time.monotonic)
    # issue 7: the protocol's order (HELLO first, one GOODBYE last, RESYNC_BEGIN/END paired)
    hello: bool = False
    goodbye: bool = False
    resync: bool = False
    records: int = 0  # records received in BATCH frames outside resyncs (the probe counts these as sent)
    unsent: bytes = b""  # tail of a CONTROL frame the socket did not take at once (at most one frame)
    resync_records: int = 0
    verify_asked: bool = False  # the probe was asked for TOTALS with its watermarks


class _BatchMerger:
    """Hands one read's frames to the session, joining runs of BATCH frames of one kind.

    The pipeline's cost is mostly per batch (sorting, frames, sampler), not per record, so when
    the daemon falls behind and one read holds many small batches of a connection, they are
    applied as one: the busier the daemon, the larger its batches. Watermarks between them are
    reduced to the highest, applied after the joined batch (records it covers are applied at
    once, as before; only ``late`` counting differs). Resync contents, damaged batches and every
    other frame go through one by one, in order.
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.run: list[Frame] = []
        self.mark: Frame | None = None
        self.mark_ts = -1

    def add(self, frame: Frame) -> None:
        ftype = frame.type
        if ftype is FrameType.BATCH and not self.conn.resync and self._whole(frame):
            if self.run and self.run[0].tag != frame.tag:
                self.flush()
            self.run.append(frame)
        elif ftype is FrameType.WATERMARK and len(frame.payload) == 8 and self.run:
            ts = int.from_bytes(frame.payload, "little")
            if ts > self.mark_ts:
                self.mark, self.mark_ts = frame, ts
        else:
            self.flush()
            self.conn.session.handle(frame)

    def flush(self) -> None:
        run, mark = self.run, self.mark
        self.run, self.mark, self.mark_ts = [], None, -1
        if len(run) == 1:
            self.conn.session.handle(run[0])
        elif run:
            joined = b"".join(f.payload for f in run)
            self.conn.session.handle(Frame(FrameType.BATCH, run[0].tag, joined, run[0].offset))
        if mark is not None:
            self.conn.session.handle(mark)

    @staticmethod
    def _whole(frame: Frame) -> bool:
        try:
            return len(frame.payload) % DTYPES[RecordKind(frame.tag)].itemsize == 0
        except ValueError:
            return False


def _records_in(frame: Frame) -> int:
    """Records a BATCH or CUPTI_BUFFER frame carries (0 when it cannot tell)."""
    if frame.type is FrameType.CUPTI_BUFFER:
        try:
            _pid, data = cupti_buffer(frame)
        except FrameError:
            return 0
        offsets = rawrecords.walk(data, len(data))
        return sum(len(v) for k, v in offsets.items() if k in rawrecords.RECORD_KIND) if offsets else 0
    try:
        return len(frame.payload) // DTYPES[RecordKind(frame.tag)].itemsize
    except ValueError:
        return 0


def _decoder_reason(error: Exception) -> str:
    """A short, bounded label for why a stream broke (the message itself goes to the log)."""
    text = str(error)
    for needle, reason in (("wire version", "bad_version"), ("preamble", "bad_preamble"),
                           ("exceeds the limit", "frame_too_large"), ("checksum", "bad_checksum"),
                           ("unknown frame type", "bad_frame_type")):
        if needle in text:
            return reason
    return "bad_frame"


class RateLimitedLog:
    """At most ``burst`` lines per ``period`` seconds per key, then one summary: a flood of bad
    peers must not turn into a flood of log lines."""

    def __init__(self, burst: int = 10, period: float = 60.0) -> None:
        self.burst, self.period = burst, period
        self._window: dict[str, tuple[float, int]] = {}

    def __call__(self, key: str, level: int, msg: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        start, n = self._window.get(key, (now, 0))
        if now - start > self.period:
            if n > self.burst:
                log.log(level, "%d more %s events in the last %.0f s not logged", n - self.burst, key, now - start)
            start, n = now, 0
        n += 1
        self._window[key] = (start, n)
        if n <= self.burst:
            log.log(level, msg, *args, exc_info=exc_info)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, from the kernel (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


def lock_socket_path(path: str) -> int:
    """Hold ``<socket>.lock`` with flock for the daemon's lifetime: a second daemon on the same path
    refuses to start instead of replacing a live one's socket. The kernel drops the lock when the
    holder dies, so a stale lock file never blocks a restart."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = ""
        try:
            holder = Path(f"{path}.lock").read_text().strip()
        except OSError:
            pass
        who = f" (pid {holder})" if holder.isdigit() else ""
        raise ConfigError(f"daemon.socket: {path} is in use by another gpufootprint daemon{who}; "
                          "stop it or choose another socket") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def bind_probe_socket(path: str, mode: str, group: str | None) -> socket.socket:
    """Create the listening socket owner-only (or group-accessible) before anyone can connect.
    Call with the path's lock held (``lock_socket_path``): the socket found there is then a dead
    daemon's, safe to replace."""
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
    sock.listen(socket.SOMAXCONN)  # probes of a whole node may start within milliseconds
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
        # issue 7: refused connections, accept failures, records received per pid, config reloads
        self.refused: Counter[str] = Counter()
        self.accept_errors = 0
        self.loop_errors = 0
        self.received: dict[int, list[int]] = {}  # pid -> [records, resync records]
        self.config_reloads: Counter[str] = Counter()
        self.config_last_reload_ok = 1.0
        self.stats = ServerStats()
        self._buffered = 0  # partial-frame bytes held by all decoders
        self._accept_paused_until = 0.0
        self._fd_ceiling = 0  # a probe connection whose descriptor is at or above it is refused (0: no check)
        self._next_liveness = 0.0
        self._rlog = RateLimitedLog()
        self._resync_asked: dict[int, float] = {}  # pid -> monotonic time of the last resync request
        self.resync_requests = 0
        self.guard = Guard(Limits.from_config(config.daemon))
        self.quarantines = 0
        self.tick_errors = 0
        self._tick_failed = False
        self._last_ok_wall = 0.0
        self._last_ok_mono = 0.0
        self._lock_fd = -1
        self._socket_ino: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket we created
        # Called on the ingest thread with each new snapshot (the engines); may call send().
        self.on_snapshot: Callable[[PipelineSnapshot], None] | None = None

    # --- lifecycle ----------------------------------------------------------------

    def open(self) -> None:
        if self.socket_path:
            dc = self.config.daemon
            self._lock_fd = lock_socket_path(self.socket_path)
            try:
                self._listener = bind_probe_socket(self.socket_path, dc.socket_mode, dc.socket_group)
            except BaseException:
                os.close(self._lock_fd)
                self._lock_fd = -1
                raise
            st = os.stat(self.socket_path)
            self._socket_ino = (st.st_dev, st.st_ino)
            self._sel.register(self._listener, selectors.EVENT_READ, "listen")
            log.info("listening for probes socket=%s mode=%s", self.socket_path, dc.socket_mode)
            self._fd_ceiling = fd_ceiling()
            if self._fd_ceiling and self._fd_ceiling - self._listener.fileno() < dc.max_connections:
                log.warning("RLIMIT_NOFILE=%d leaves room for about %d probe connections, fewer than "
                            "daemon.max_connections=%d; further ones are refused (fd_limit)",
                            resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                            self._fd_ceiling - self._listener.fileno(), dc.max_connections)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")

    def run(self) -> None:
        next_tick = time.monotonic()
        while not self.stop_event.is_set():
            try:
                next_tick = self._iterate(next_tick, self.config.daemon.tick_ms / 1000)
            except Exception:  # noqa: BLE001 - the loop must outlive any one bug (issue 7)
                self.loop_errors += 1
                self._rlog("loop_error", logging.ERROR, "ingest loop iteration failed (%d so far)", self.loop_errors,
                           exc_info=True)
                time.sleep(0.01)
        self._shutdown()

    def _iterate(self, next_tick: float, tick_s: float) -> float:
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
        return next_tick

    def stop(self) -> None:
        self.stop_event.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _shutdown(self) -> None:
        closed = len(self._conns)
        for conn in list(self._conns.values()):
            self._close(conn, "daemon_shutdown")
        if self._listener is not None:
            self._sel.unregister(self._listener)
            self._listener.close()
            if self.socket_path:
                self._remove_own_socket()
        self.tick()  # the final flush: what the closed sessions applied is in the last snapshot
        log.info("shut down cleanly connections_closed=%d pending_records=%d", closed,
                 sum(p.pending_records for p in self.pipeline.processes.values()))

    def _remove_own_socket(self) -> None:
        """Unlink the socket only if it is still the one this daemon bound (same inode), then let
        the lock go: a successor that took the path over keeps its socket."""
        assert self.socket_path
        try:
            st = os.lstat(self.socket_path)
            if (st.st_dev, st.st_ino) == self._socket_ino:
                os.unlink(self.socket_path)
            else:
                log.info("socket %s belongs to another daemon now: left in place", self.socket_path)
        except OSError:
            pass
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def health(self) -> TickHealth:
        age = time.monotonic() - self._last_ok_mono if self._last_ok_mono else float("inf")
        return TickHealth(self._last_ok_wall, age, self.tick_errors, self._tick_failed)

    def ready(self) -> bool:
        """/readyz: a snapshot was published, the last tick succeeded, and not too long ago."""
        return self.published.is_set() and self.health().healthy(self.config.daemon.tick_stall_seconds)

    # --- the pipeline's clock -------------------------------------------------------

    def tick(self) -> None:
        """Advance live processes' watermarks by the clock, expire, publish a snapshot.

        A failure is counted (``tick_errors``) and makes /readyz fail until a tick succeeds again;
        the snapshot is not replaced, and its age, computed at scrape time, grows.
        """
        try:
            with self.lock:
                self._tick()
        except Exception:
            self.tick_errors += 1
            self._tick_failed = True
            self._rlog("tick_error", logging.ERROR, "tick failed (%d so far); the last good snapshot stays, "
                       "/readyz fails", self.tick_errors, exc_info=True)
            return
        self._tick_failed = False
        self._last_ok_wall = time.time()
        self._last_ok_mono = time.monotonic()

    def clock_lag_ns(self, hello: dict[str, Any]) -> int:
        """How far behind the daemon's clock a live probe's records are applied without its word.

        A probe's WATERMARK frames move its watermark as soon as it sends them. The clock is the
        fallback for a probe that has gone quiet; it must not overtake records still on their
        way, so it waits for the reorder window or, for a probe whose HELLO says it sends a
        watermark only every ``watermark_ms``, for two and a half of those.
        """
        lag = self.config.footprint.reorder_window_ms
        declared = hello.get("watermark_ms")
        if isinstance(declared, (int, float)) and not isinstance(declared, bool) and 0 < declared <= 60_000:
            lag = max(lag, int(2.5 * declared))
        return lag * 1_000_000

    def silent_after_s(self, hello: dict[str, Any]) -> float:
        """How long a probe that sends watermarks may go without one before the clock advances it."""
        declared = hello.get("watermark_ms")
        if isinstance(declared, (int, float)) and not isinstance(declared, bool) and 0 < declared <= 60_000:
            return max(SILENT_PROBE_S, 5 * declared / 1000)
        return SILENT_PROBE_S

    def _tick(self) -> None:
        self._enforce_timeouts()
        now = self._clock_ns()
        mono = time.monotonic()
        for pid, proc in list(self.pipeline.processes.items()):
            if proc.source == "probe" and proc.exited_at is None:
                if proc.watermarked and mono - proc.watermark_at < self.silent_after_s(proc.info):
                    continue  # its watermarks say when records are complete; the clock cannot know
                try:
                    self.pipeline.advance(pid, now - self.clock_lag_ns(proc.info))
                except Exception as exc:  # noqa: BLE001 - one process's state must not stop everyone's tick
                    self.quarantine(pid, exc)
        self._request_resyncs(mono)
        self.pipeline.expire()
        self._bound_processes()
        limits = Limits.from_config(self.config.daemon)  # SIGHUP may have changed them
        if limits != self.guard.limits:
            self.guard.limits = limits
            for conn in self._conns.values():
                conn.session.limits = limits
        self.guard.recount(self.pipeline.processes)
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
        self.snapshot = dataclasses.replace(self._pipeline_snapshot(now / 1e9), daemon=daemon_values, **extra)
        self._publish_stats()
        self.published.set()
        if self.on_snapshot is not None:
            try:
                self.on_snapshot(self.snapshot)
            except Exception:  # noqa: BLE001 - an engine bug must not stop ingest
                log.exception("snapshot consumer failed")

    def _pipeline_snapshot(self, wall: float) -> PipelineSnapshot:
        """The pipeline's snapshot; if building it fails, the processes whose own state fails are
        quarantined and it is built again without them (a failure that remains fails the tick)."""
        try:
            return self.pipeline.snapshot(wall)
        except Exception:  # noqa: BLE001 - find the process at fault
            found = False
            for pid, proc in list(self.pipeline.processes.items()):
                try:
                    for dev, fp in list(proc.devices.items()):
                        self.pipeline.device_state(pid, dev)
                        self.pipeline.hub.device_features(pid, dev, proc.applied_to, fp.pool_reserved_bytes,
                                                          fp.async_device_bytes)
                except Exception as exc:  # noqa: BLE001
                    self.quarantine(pid, exc)
                    found = True
            if not found:
                raise
            return self.pipeline.snapshot(wall)

    def quarantine(self, pid: int, exc: BaseException) -> None:
        """Drop one process's state after it broke a tick: counted, logged, marked in
        ``gpufootprint_daemon_quarantined_process``; its later records are dropped until it exits."""
        reason = type(exc).__name__
        self.quarantines += 1
        self.guard.quarantined[pid] = reason
        self.pipeline.processes.pop(pid, None)
        self.pipeline.hub.forget(pid)
        self._rlog("quarantine", logging.ERROR, "pid=%d quarantined: its state broke a tick (%s: %s); the other "
                   "processes go on", pid, reason, exc)

    def _bound_processes(self) -> None:
        """Past daemon.max_processes, forget the processes that exited longest ago first."""
        procs = self.pipeline.processes
        excess = len(procs) - self.config.daemon.max_processes
        if excess <= 0:
            return
        exited = sorted((p.exited_at, pid) for pid, p in procs.items() if p.exited_at is not None)
        for _, pid in exited[:excess]:
            del procs[pid]
            self.pipeline.hub.forget(pid)
        self.pipeline.errors.add("process_limit", f"more than daemon.max_processes="
                                 f"{self.config.daemon.max_processes} processes: {min(excess, len(exited))} exited "
                                 "ones forgotten early", min(excess, len(exited)))

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
        limit = self.config.daemon.max_connections
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                self.accept_errors += 1
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors: the listener stays readable, so stop selecting it for a
                    # moment instead of spinning; waiting peers sit in the backlog.
                    self._pause_accepting(ACCEPT_PAUSE_S)
                self._rlog("accept_error", logging.WARNING, "accept failed: %s", exc)
                return
            if self._fd_ceiling and sock.fileno() >= self._fd_ceiling:
                # Descriptors are allocated lowest first: every one below this is in use. The last
                # FD_RESERVE stay for /metrics and files, so the daemon stays observable in a flood.
                self.refused["fd_limit"] += 1
                self._rlog("refused", logging.WARNING, "probe connection refused: the last %d file descriptors "
                           "under RLIMIT_NOFILE are kept for /metrics and files", FD_RESERVE)
                sock.close()
                continue
            if len(self._conns) >= limit:
                self.refused["max_connections"] += 1
                self._rlog("refused", logging.WARNING, "probe connection refused: daemon.max_connections=%d reached",
                           limit)
                sock.close()
                continue
            try:
                sock.setblocking(False)
                pid, uid, _gid = peer_credentials(sock)
            except OSError as exc:
                self.refused["peer_credentials"] += 1
                self._rlog("refused", logging.WARNING, "probe connection refused: no peer credentials (%s)", exc)
                sock.close()
                continue
            session = Session(self.pipeline, source="probe", name=f"probe pid={pid}", peer_pid=pid,
                              on_mark=self._on_mark)
            session.future_limit_ns = self._future_limit_ns  # issue 7: clock steps
            session.guard, session.limits = self.guard, self.guard.limits
            conn = Connection(sock, FrameDecoder(self.config.daemon.max_frame_bytes), session, pid, uid)
            self._conns[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)
            self.connections_total += 1
            self._rlog("connected", logging.INFO, "probe connected pid=%d uid=%d", pid, uid)

    def _pause_accepting(self, seconds: float) -> None:
        if self._listener is None or self._accept_paused_until:
            return
        try:
            self._sel.unregister(self._listener)
        except (KeyError, ValueError):
            return
        self._accept_paused_until = time.monotonic() + seconds

    def _future_limit_ns(self) -> int:
        return self._clock_ns() + int(self.config.daemon.max_future_seconds * 1e9)

    def _enforce_timeouts(self) -> None:
        now = time.monotonic()
        if self._accept_paused_until and now >= self._accept_paused_until and self._listener is not None:
            self._sel.register(self._listener, selectors.EVENT_READ, "listen")
            self._accept_paused_until = 0.0
        if now >= self._next_liveness:
            # A probe that lost its connection without a GOODBYE while its pid was still alive (or a
            # zombie) stays "running" until this notices the pid is gone.
            self._next_liveness = now + _LIVENESS_S
            connected = {c.pid for c in self._conns.values()}
            for pid, proc in list(self.pipeline.processes.items()):
                if proc.source == "probe" and proc.exited_at is None and pid not in connected \
                        and not _pid_alive(pid):
                    self.pipeline.process_exited(pid)
            for pid in [p for p in self.guard.quarantined if p not in connected and not _pid_alive(p)]:
                del self.guard.quarantined[pid]
        for conn in [c for c in self._conns.values() if c.unsent]:
            self._flush_unsent(conn)
        timeout = self.config.daemon.hello_timeout_seconds
        if timeout > 0:
            for conn in [c for c in self._conns.values() if not c.hello and now - c.opened > timeout]:
                self._cut(conn, "hello_timeout", f"no HELLO within {timeout:g} s")

    def _read(self, conn: Connection) -> None:
        if conn.sock.fileno() < 0:
            return  # cut off earlier in this round (memory_limit picks the largest holder)
        try:
            data = conn.sock.recv(_RECV)
        except BlockingIOError:
            return
        except OSError as exc:
            # A peer that exits with our CONTROL frames unread resets the socket: after its
            # GOODBYE that is still a clean end.
            self._close(conn, "goodbye" if conn.goodbye else "socket_error")
            if not conn.goodbye:
                log.info("probe pid=%d socket error: %s", conn.pid, exc)
            return
        if not data:
            if conn.decoder.pending:
                self._cut(conn, "truncated_frame", f"stream ended inside a frame ({conn.decoder.pending} bytes "
                                                   f"left over at byte {conn.decoder.offset})")
            else:
                self._close(conn, "goodbye" if conn.goodbye else "eof")
            return
        before = conn.decoder.pending
        frames = conn.decoder.feed(data)
        self._buffered += conn.decoder.pending - before
        try:
            merger = _BatchMerger(conn)
            for frame in frames:
                reason = self._order(conn, frame)
                if reason is not None:
                    merger.flush()  # what came before the violation still counts
                    self._cut(conn, reason, f"byte {frame.offset}: {frame.type.name} frame {_ORDER_TEXT[reason]}")
                    return
                merger.add(frame)
            merger.flush()
        except Exception as exc:  # noqa: BLE001 - a probe must never be able to crash the daemon
            log.exception("probe pid=%d: frame handling failed", conn.pid)
            self._cut(conn, "internal_error", f"frame handling failed ({type(exc).__name__})")
            return
        if conn.decoder.error is not None:
            self._cut(conn, _decoder_reason(conn.decoder.error), str(conn.decoder.error))
            return
        if self._buffered > self.config.daemon.max_buffered_bytes:
            hog = max(self._conns.values(), key=lambda c: c.decoder.pending)
            self._cut(hog, "memory_limit", f"holds {hog.decoder.pending} bytes of partial frames while all "
                                           f"connections hold {self._buffered} (daemon.max_buffered_bytes="
                                           f"{self.config.daemon.max_buffered_bytes})")

    def _order(self, conn: Connection, frame: Frame) -> str | None:
        """Why this frame breaks the protocol's order on a live connection, or None (and note it)."""
        ftype = frame.type
        if conn.goodbye:
            return "frame_after_goodbye"
        if not conn.hello:
            if ftype is not FrameType.HELLO:
                return "frame_before_hello"
            conn.hello = True
            return None
        if ftype is FrameType.HELLO:
            return "duplicate_hello"
        if ftype is FrameType.CONTROL:
            return "unexpected_frame"
        if ftype is FrameType.RESYNC_BEGIN:
            if conn.resync:
                return "resync_mismatch"
            conn.resync = True
        elif ftype is FrameType.RESYNC_END:
            if not conn.resync:
                return "resync_mismatch"
            conn.resync = False
        elif ftype is FrameType.GOODBYE:
            conn.goodbye = True
        elif ftype is FrameType.WATERMARK and not conn.verify_asked:
            # A probe that sends watermarks is asked, once, for its table's totals with each of them,
            # and told that this daemon reads CUPTI buffers itself (CUPTI_BUFFER frames). A probe that
            # does not know the op counts it and goes on; an older daemon never asks, so never meets
            # either frame.
            conn.verify_asked = True
            self.send_control(conn.pid, {"op": "verify", "cupti_buffers": 2})
        elif ftype is FrameType.BATCH or ftype is FrameType.CUPTI_BUFFER:
            n = _own_records(frame, conn.pid, conn.session.ns_pid)
            counts = self.received.setdefault(conn.pid, [0, 0])
            if conn.resync:
                conn.resync_records += n
                counts[1] += n
            else:
                conn.records += n
                counts[0] += n
        return None

    def _cut(self, conn: Connection, reason: str, detail: str) -> None:
        """Cut one bad peer off: counted under ``reason``, logged (rate-limited), others untouched."""
        conn.session.problem(_SESSION_REASONS.get(reason, reason), f"probe pid={conn.pid}: {detail}")
        self._rlog("cut:" + reason, logging.WARNING, "probe pid=%d cut off reason=%s: %s", conn.pid, reason, detail)
        self._close(conn, reason)

    def _publish_stats(self) -> None:
        # Forget the received counts of pids the pipeline has forgotten (bounded memory).
        live = {c.pid for c in self._conns.values()}
        for pid in [p for p in self.received if p not in live and p not in self.pipeline.processes]:
            del self.received[pid]
        self.stats = ServerStats(
            connections_total=self.connections_total,
            disconnects=tuple(sorted(self.disconnects.items())), refused=tuple(sorted(self.refused.items())),
            accept_errors=self.accept_errors, buffered_bytes=self._buffered,
            received=tuple((pid, r[0], r[1]) for pid, r in sorted(self.received.items())),
            config_reloads=tuple(sorted(self.config_reloads.items())),
            config_last_reload_ok=self.config_last_reload_ok, resync_requests=self.resync_requests,
            quarantined=tuple(sorted(self.guard.quarantined.items())), quarantines=self.quarantines)

    def _poll_nvml(self) -> None:
        assert self.nvml is not None
        live = [pid for pid, p in self.pipeline.processes.items() if p.source == "probe" and p.exited_at is None]
        self.nvml.set_interval(self.pipeline.hub.fastest_interval_s(live))
        if not self.nvml.threaded:  # the daemon polls on the NVML thread; tests poll here
            self.nvml.maybe_poll()

    def _request_resyncs(self, mono: float) -> None:
        """Ask the probes of processes whose state a late record or a drift made doubtful for their table."""
        wanted = self.pipeline.resync_wanted
        if not wanted:
            return
        for pid in list(wanted):
            if mono - self._resync_asked.get(pid, -RESYNC_REQUEST_EVERY_S) < RESYNC_REQUEST_EVERY_S:
                continue  # asked recently: the answer is on its way; ask again later if still wanted
            wanted.discard(pid)
            if self.send_control(pid, {"op": "resync", "reason": "verify"}):
                self._resync_asked[pid] = mono
                self.resync_requests += 1
        for pid in [p for p in self._resync_asked if p not in self.pipeline.processes]:
            del self._resync_asked[pid]

    def send_control(self, pid: int, body: dict[str, Any]) -> bool:
        """A CONTROL frame (contract: flush_interval, kernel_window, ...) to one probe."""
        return self.send(pid, encode_json(FrameType.CONTROL, body))

    def send(self, pid: int, payload: bytes) -> bool:
        """Best-effort control message to a probe; never blocks the ingest thread."""
        for conn in self._conns.values():
            if conn.pid == pid:
                if conn.unsent and not self._flush_unsent(conn):
                    return False  # the tail of an earlier frame is still waiting: drop this one whole
                try:
                    n = conn.sock.send(payload)
                except (BlockingIOError, OSError):
                    return False
                if n < len(payload):  # keep the tail, or the probe would see a torn frame
                    conn.unsent = payload[n:]
                return True
        return False

    def _flush_unsent(self, conn: Connection) -> bool:
        try:
            n = conn.sock.send(conn.unsent)
        except (BlockingIOError, OSError):
            return False
        conn.unsent = conn.unsent[n:]
        return not conn.unsent

    def _close(self, conn: Connection, reason: str) -> None:
        self.disconnects[reason] += 1
        self._buffered -= conn.decoder.pending
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        self._conns.pop(conn.sock.fileno(), None)
        conn.sock.close()
        try:
            conn.session.close()
        except Exception:  # noqa: BLE001 - closing one stream must not stop the loop
            log.exception("probe pid=%d: closing its session failed", conn.pid)
        # Without a goodbye the process may still run (the probe will reconnect
        # and resync); if it is gone, the driver freed its memory.
        if not _pid_alive(conn.pid):
            self.pipeline.process_exited(conn.pid)


_ORDER_TEXT = {
    "frame_after_goodbye": "after GOODBYE",
    "frame_before_hello": "before HELLO",
    "duplicate_hello": "twice on one connection",
    "unexpected_frame": "from a probe (daemon -> probe only)",
    "resync_mismatch": "out of place (RESYNC_BEGIN and RESYNC_END must pair)",
}
# The gpufootprint_ingest_errors_total reason a cut-off counts under (its own name if not listed):
# wire damage stays "bad_frame", order violations "unexpected_frame", as before issue 7.
_SESSION_REASONS = {"bad_preamble": "bad_frame", "bad_version": "bad_frame", "frame_too_large": "bad_frame",
                    "bad_checksum": "bad_frame", "bad_frame_type": "bad_frame",
                    "frame_before_hello": "unexpected_frame", "frame_after_goodbye": "unexpected_frame",
                    "duplicate_hello": "unexpected_frame", "resync_mismatch": "unexpected_frame"}


def _own_records(frame: Frame, pid: int, ns_pid: int | None) -> int:
    """Records of a BATCH or CUPTI_BUFFER that speak for the peer (the rest are dropped as
    pid_mismatch, so they are not "received" from this probe either)."""
    if frame.type is FrameType.CUPTI_BUFFER:
        try:
            claimed, _data = cupti_buffer(frame)
        except FrameError:
            return 0
        return _records_in(frame) if claimed == pid or (ns_pid is not None and claimed == ns_pid) else 0
    try:
        recs = frame.records()
    except Exception:  # noqa: BLE001 - a damaged batch is counted by the session
        return 0
    pids = recs["pid"]
    mine = pids == pid
    if ns_pid is not None:
        mine |= pids == ns_pid
    return int(mine.sum())


def fd_ceiling() -> int:
    """The lowest descriptor number a probe connection may not have: RLIMIT_NOFILE's soft limit less
    the reserve (0 when there is no limit to speak of)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft > 1 << 24:
        return 0
    return soft - min(FD_RESERVE, soft // 4)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (killed, not yet reaped by its parent) holds no GPU memory any more
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True
