"""The ingest loop: probe connections on a Unix socket, injected streams, ticks.

(About 460 lines: the one loop and the connection state it owns; the socket setup, the frame
order, the tick's steps and the per-stream decoding are their own modules already.)

Everything that mutates the pipeline runs on this one thread, so the footprint
needs no locks. Sockets are non-blocking under a selector; a peer that breaks
the wire format is cut off alone, with a counted reason. Other threads (the
demo's feeder, tests) hand frames in through ``inject``.

The socket is ``transport.py``'s, the frame-order rules and batch merging are
``protocol.py``'s, what a tick does is ``tick.py``'s; this module runs them.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpufootprint.config import Config
from gpufootprint.ingest.protocol import (
    ORDER_TEXT,
    SESSION_REASONS,
    BatchMerger,
    Connection,
    ResyncRequests,
    control_allowed,
    count_received,
    decoder_reason,
    order_violation,
    probe_connection,
    verify_request,
    wants_verify,
)
from gpufootprint.ingest.session import MarkCallback, Session
from gpufootprint.ingest.tenants import Holder, make_room, tenant_of
from gpufootprint.ingest.tick import (
    LoopLoad,
    TickRecord,
    advance_by_clock,
    bound_processes,
    gpu_states,
    pipeline_snapshot,
)
from gpufootprint.ingest.transport import RECV_BYTES, ProbeListener, RateLimitedLog, pid_alive, send_whole
from gpufootprint.ingest.validate import Guard, Limits
from gpufootprint.pipeline import Pipeline
from gpufootprint.serverstats import ServerStats, TickHealth
from gpufootprint.snapshot import EMPTY_SNAPSHOT, PipelineSnapshot
from gpufootprint.wakepipe import WakePipe
from gpufootprint.wire.framing import Frame, FrameType, encode_json

if TYPE_CHECKING:
    from gpufootprint.nvml.poller import NvmlPoller

log = logging.getLogger(__name__)

_LIVENESS_S = 2.0  # how often disconnected probe pids are checked for having exited
#: While the ingest loop is busy (``_Load``), a probe's watermarks may wait this long so that several of
#: its flushes are applied as one, and the snapshot is rebuilt this often instead of at every tick.
COALESCE_S = 1.0


class IngestServer:
    def __init__(self, config: Config, pipeline: Pipeline, *, socket_path: str | None,
                 clock_ns: Callable[[], int] = time.time_ns,
                 extra_daemon_values: Callable[[], dict[str, float]] | None = None,
                 on_mark: MarkCallback | None = None,
                 nvml: NvmlPoller | None = None) -> None:
        self.config = config
        self.pipeline = pipeline
        self.nvml = nvml  # polled from this thread when it has no thread of its own (tests)
        self.socket_path = socket_path
        self._clock_ns = clock_ns
        self._extra = extra_daemon_values
        self._on_mark = on_mark  # called on the ingest thread with each probe MARK's state (tests, reports)
        self._sel = selectors.DefaultSelector()
        self._rlog = RateLimitedLog()
        self._listener = ProbeListener(socket_path, self._sel, self._rlog) if socket_path else None
        self._conns: dict[int, Connection] = {}
        self._inbox: queue.SimpleQueue[tuple[Session, Frame | None]] = queue.SimpleQueue()
        self._wake = WakePipe()
        self.stop_event = threading.Event()
        # Held while the pipeline changes; only needed when another thread (replay
        # --listen) drives the pipeline directly instead of through inject().
        self.lock = threading.Lock()
        self.snapshot: PipelineSnapshot = EMPTY_SNAPSHOT
        self.published = threading.Event()
        self.disconnects: Counter[str] = Counter()
        self.connections_total = 0
        self.loop_errors = 0
        self.received: dict[int, list[int]] = {}  # pid -> [records, resync records]
        self.config_reloads: Counter[str] = Counter()
        self.config_last_reload_ok = 1.0
        self.stats = ServerStats()
        self._buffered = 0  # partial-frame bytes held by all decoders
        self._next_liveness = 0.0
        self._resyncs = ResyncRequests()
        self.guard = Guard(Limits.from_config(config.daemon))
        pipeline.waiting_room = self.guard.waiting_room  # a waiting watermark follows the process's share now
        self.quarantines = 0
        self._ticks = TickRecord()
        # Called on the ingest thread with each new snapshot (the engines); may call send().
        self.on_snapshot: Callable[[PipelineSnapshot], None] | None = None
        self.load = LoopLoad()
        self._snapshot_at = -1e9  # monotonic seconds of the last snapshot built

    # --- lifecycle ----------------------------------------------------------------

    def open(self) -> None:
        if self._listener is not None:
            dc = self.config.daemon
            self._listener.open(dc.socket_mode, dc.socket_group, dc.max_connections)
        self._sel.register(self._wake.reader, selectors.EVENT_READ, "wake")

    # Counted by the listener; read here by the stats and the tests.
    @property
    def refused(self) -> Counter[str]:
        return self._listener.refused if self._listener is not None else Counter()

    @property
    def accept_errors(self) -> int:
        return self._listener.accept_errors if self._listener is not None else 0

    @property
    def resync_requests(self) -> int:
        return self._resyncs.sent

    @property
    def tick_errors(self) -> int:
        return self._ticks.errors

    def run(self) -> None:
        next_tick = time.monotonic()
        self.load.bind_thread(threading.get_ident())
        while not self.stop_event.is_set():
            try:
                next_tick = self._iterate(next_tick, self.config.daemon.tick_ms / 1000)
            except Exception:  # noqa: BLE001 - the loop must outlive any one bug: it is the daemon
                self.loop_errors += 1
                self._rlog("loop_error", logging.ERROR, "ingest loop iteration failed (%d so far)", self.loop_errors,
                           exc_info=True)
                time.sleep(0.01)
        self._shutdown()

    def _iterate(self, next_tick: float, tick_s: float) -> float:
        wake = next_tick if self.nvml is None or self.nvml.threaded else min(next_tick, self.nvml.next_due())
        timeout = max(0.0, wake - time.monotonic())
        events = self._sel.select(timeout)
        woke = time.monotonic()
        for key, _ in events:
            if key.data == "listen":
                self._accept()
            elif key.data == "wake":
                self._wake.drain()
            else:
                self._read(key.data)
                if not self.load.is_busy and time.monotonic() - woke > tick_s:
                    # One round over the connections already took longer than a tick: busy now, not
                    # at the next tick (a node's probes starting together can make that round last
                    # seconds, each watermark applied on its own).
                    self.load.is_busy = True
                    self.pipeline.coalesce_s = COALESCE_S
        self._drain_inbox()
        if time.monotonic() >= next_tick:
            self.tick()
            next_tick = time.monotonic() + tick_s
        elif self.nvml is not None:
            self._poll_nvml()  # between ticks, at the sampler's cadence
        self.load.worked(time.monotonic() - woke)
        return next_tick

    def stop(self) -> None:
        self.stop_event.set()
        self._wake.wake()

    def _shutdown(self) -> None:
        closed = len(self._conns)
        for conn in list(self._conns.values()):
            self._close(conn, "daemon_shutdown")
        if self._listener is not None:
            self._listener.close()
        self._snapshot_at = -1e9
        self.tick()  # the final flush: what the closed sessions applied is in the last snapshot
        log.info("shut down cleanly connections_closed=%d pending_records=%d", closed,
                 sum(p.pending_records for p in self.pipeline.processes.values()))

    def health(self) -> TickHealth:
        return self._ticks.health(self.loop_errors)

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
        except Exception:  # noqa: BLE001 - counted and logged (exc_info) by _rlog; the last snapshot stays served
            self._ticks.failed()
            self._rlog("tick_error", logging.ERROR, "tick failed (%d so far); the last good snapshot stays, "
                       "/readyz fails", self._ticks.errors, exc_info=True)
            return
        self._ticks.succeeded()

    def _tick(self) -> None:
        self._enforce_timeouts()
        now = self._clock_ns()
        mono = time.monotonic()
        advance_by_clock(self.pipeline, now, mono, self.config.footprint.reorder_window_ms, self.quarantine)
        busy = self.load.busy(mono) and not self.stop_event.is_set()  # the last tick applies everything
        self.pipeline.coalesce_s = COALESCE_S if busy else 0.0
        self.pipeline.apply_due(failed=self.quarantine)
        self._resyncs.request(self.pipeline, self.send_control, mono)
        self.pipeline.expire()
        bound_processes(self.pipeline, self.config.daemon.max_processes, self.guard.census.tenant)
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
            extra["gpus"] = gpu_states(nvml_snap)
        if busy and mono - self._snapshot_at < COALESCE_S and self.published.is_set():
            # Busy: most tables changed since the last snapshot only if a second has passed (their
            # watermarks wait that long), and 2,048 of them cost a tenth of a second to build.
            self._publish_stats()
            return
        self._snapshot_at = mono
        self.snapshot = dataclasses.replace(pipeline_snapshot(self.pipeline, now / 1e9, self.quarantine),
                                            daemon=daemon_values, **extra)
        self._publish_stats()
        self.published.set()
        if self.on_snapshot is not None:
            try:
                self.on_snapshot(self.snapshot)
            except Exception:  # an engine bug must not stop ingest
                log.exception("snapshot consumer failed")

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

    # --- injected streams (demo, tests) ---------------------------------------------

    def inject(self, session: Session, frame: Frame | None) -> None:
        """Hand a frame to the ingest thread; ``None`` closes the session."""
        self._inbox.put((session, frame))
        self._wake.wake()

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
        for sock, pid, uid in self._listener.accept():
            tenant = tenant_of(pid, uid, self.config.kubernetes.proc_root)
            if not self._room_for(sock, pid, uid, tenant):
                continue
            conn = probe_connection(sock, pid, uid, tenant, self.pipeline, self.guard,
                                    self.config.daemon.max_frame_bytes, on_mark=self._on_mark,
                                    future_limit_ns=self._future_limit_ns)
            self._conns[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)
            self.connections_total += 1
            self._rlog("connected", logging.INFO, "probe connected pid=%d uid=%d tenant=%s", pid, uid, tenant)

    def _room_for(self, sock: socket.socket, pid: int, uid: int, tenant: str) -> bool:
        """Whether a new peer fits ``daemon.max_connections``: at the bound, a peer under its tenant's
        (and process's) share takes the place of the newest idle connection of whoever holds the most;
        one at its share is refused (closed at once, counted)."""
        limit = self.config.daemon.max_connections
        holders = [Holder(key, c.pid, c.tenant, c.opened, c.records == 0 and not c.resync_records)
                   for key, c in self._conns.items()]
        choice = make_room(holders, pid, tenant, limit)
        if choice is True:
            return True
        if choice is False:
            assert self._listener is not None
            self._listener.refused["max_connections"] += 1
            self.guard.census.uid_of.setdefault(pid, uid)
            self.guard.offenders.note(uid, tenant, pid, "max_connections", 1, "tenant")
            self._rlog("refused", logging.WARNING, "probe connection refused: pid=%d tenant=%s is at its share of "
                       "daemon.max_connections=%d", pid, tenant, limit)
            sock.close()
            return False
        victim = self._conns[choice.key]
        self.guard.offenders.note(victim.uid, victim.tenant, victim.pid, "max_connections", 1, "tenant")
        self._cut(victim, "share_evicted", f"its tenant {victim.tenant} holds more than its share of "
                                           f"daemon.max_connections={limit}: its newest idle connection makes "
                                           f"room for pid {pid} of {tenant}")
        return True

    def _future_limit_ns(self) -> int:
        return self._clock_ns() + int(self.config.daemon.max_future_seconds * 1e9)

    def _enforce_timeouts(self) -> None:
        now = time.monotonic()
        if self._listener is not None:
            self._listener.resume_if_due(now)
        if now >= self._next_liveness:
            # A probe that lost its connection without a GOODBYE while its pid was still alive (or a
            # zombie) stays "running" until this notices the pid is gone.
            self._next_liveness = now + _LIVENESS_S
            connected = {c.pid for c in self._conns.values()}
            for pid, proc in list(self.pipeline.processes.items()):
                if proc.source == "probe" and proc.exited_at is None and pid not in connected \
                        and not pid_alive(pid):
                    self.pipeline.process_exited(pid)
            for pid in [p for p in self.guard.quarantined if p not in connected and not pid_alive(p)]:
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
            data = conn.sock.recv(RECV_BYTES)
        except BlockingIOError:
            return
        except ConnectionResetError:
            # A peer that exits with our CONTROL frames unread resets the socket rather than ending it;
            # the kernel hands over all it sent first, so this is its end of stream like any other.
            data = b""
        except OSError as exc:
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
            merger = BatchMerger(conn)
            for frame in frames:
                reason = self._order(conn, frame)
                if reason is not None:
                    merger.flush()  # what came before the violation still counts
                    self._cut(conn, reason, f"byte {frame.offset}: {frame.type.name} frame {ORDER_TEXT[reason]}")
                    return
                merger.add(frame)
            merger.flush()
        except Exception as exc:  # a probe must never be able to crash the daemon
            log.exception("probe pid=%d: frame handling failed", conn.pid)
            self._cut(conn, "internal_error", f"frame handling failed ({type(exc).__name__})")
            return
        if conn.decoder.error is not None:
            self._cut(conn, decoder_reason(conn.decoder.error), str(conn.decoder.error))
            return
        if self._buffered > self.config.daemon.max_buffered_bytes:
            hog = max(self._conns.values(), key=lambda c: c.decoder.pending)
            self._cut(hog, "memory_limit", f"holds {hog.decoder.pending} bytes of partial frames while all "
                                           f"connections hold {self._buffered} (daemon.max_buffered_bytes="
                                           f"{self.config.daemon.max_buffered_bytes})")

    def _order(self, conn: Connection, frame: Frame) -> str | None:
        """Why this frame breaks the protocol's order on a live connection, or None (and note it)."""
        reason = order_violation(conn, frame)
        if reason is None:
            if wants_verify(conn, frame) and not self._send_on(conn, encode_json(FrameType.CONTROL,
                                                                               verify_request(conn))):
                conn.verify_asked = False  # asked again at its next watermark
            count_received(conn, frame, self.received)
        return reason

    def _cut(self, conn: Connection, reason: str, detail: str) -> None:
        """Cut one bad peer off: counted under ``reason``, logged (rate-limited), others untouched."""
        conn.session.problem(SESSION_REASONS.get(reason, reason), f"probe pid={conn.pid}: {detail}")
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
            quarantined=tuple(sorted(self.guard.quarantined.items())), quarantines=self.quarantines,
            share_refusals=tuple(sorted(self.guard.offenders.refused.items())))

    def _poll_nvml(self) -> None:
        assert self.nvml is not None
        live = [pid for pid, p in self.pipeline.processes.items() if p.source == "probe" and p.exited_at is None]
        self.nvml.set_interval(self.pipeline.hub.fastest_interval_s(live))
        if not self.nvml.threaded:  # the daemon polls on the NVML thread; tests poll here
            self.nvml.maybe_poll()

    def send_control(self, pid: int, body: dict[str, Any]) -> bool:
        """A CONTROL frame (contract: flush_interval, kernel_window, ...) to one probe; False when its
        probe cannot take it (a launch window to a probe that does not open them)."""
        for conn in self._conns.values():
            if conn.pid == pid and not control_allowed(conn, body):
                return False
        return self.send(pid, encode_json(FrameType.CONTROL, body))

    def send(self, pid: int, payload: bytes) -> bool:
        """Best-effort control message to a probe; never blocks the ingest thread."""
        for conn in self._conns.values():
            if conn.pid == pid:
                return self._send_on(conn, payload)
        return False

    def _send_on(self, conn: Connection, payload: bytes) -> bool:
        """``send`` on one connection: the answer to its own frame goes to it, not to another of its pid's."""
        if conn.unsent and not self._flush_unsent(conn):
            return False  # the tail of an earlier frame is still waiting: drop this one whole
        tail = send_whole(conn.sock, payload)
        if tail is None:
            return False
        conn.unsent = tail  # kept, or the probe would see a torn frame
        return True

    def _flush_unsent(self, conn: Connection) -> bool:
        tail = send_whole(conn.sock, conn.unsent)
        if tail is None:
            return False
        conn.unsent = tail
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
        self.guard.census.disconnect(conn.pid, any(c.pid == conn.pid for c in self._conns.values()))
        try:
            conn.session.close()
        except Exception:  # closing one stream must not stop the loop
            log.exception("probe pid=%d: closing its session failed", conn.pid)
        # Without a goodbye the process may still run (the probe will reconnect
        # and resync); if it is gone, the driver freed its memory.
        if not pid_alive(conn.pid):
            self.pipeline.process_exited(conn.pid)
