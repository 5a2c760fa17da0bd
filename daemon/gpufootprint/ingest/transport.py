"""The probe socket as a transport: one daemon per path, the socket's mode, accept with limits,
best-effort sends (the loop's self-wake pipe is gpufootprint.wakepipe, shared with the HTTP server).

Nothing here knows frames or the pipeline: a change to socket hardening stays in this module.
The ingest loop (``server.py``) decides what an accepted peer becomes.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import logging
import os
import resource
import selectors
import socket
import stat
import struct
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from gpufootprint.errors import ConfigError

# One log name for the whole ingest loop, whichever of its modules writes the line: the lines
# read as before the loop was split, and a filter on the logger keeps working.
log = logging.getLogger("gpufootprint.ingest.server")

#: Bytes asked of one recv() on a probe connection.
RECV_BYTES = 256 * 1024
_PEERCRED = struct.Struct("3i")
#: Descriptors kept free for everything but probe connections (/metrics scrapes, /proc reads, the
#: Kubernetes API, logs): at most this many, a quarter of RLIMIT_NOFILE when that is small.
FD_RESERVE = 32
#: After accept() fails for want of descriptors, the listener is not selected for this long.
ACCEPT_PAUSE_S = 0.5


class RateLimitedLog:
    """At most ``burst`` lines per ``period`` seconds per key, then one summary: a flood of bad
    peers must not turn into a flood of log lines."""

    def __init__(self, burst: int = 10, period: float = 60.0, logger: logging.Logger = log) -> None:
        self.burst, self.period = burst, period
        self._log = logger
        self._window: dict[str, tuple[float, int]] = {}

    def __call__(self, key: str, level: int, msg: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        start, n = self._window.get(key, (now, 0))
        if now - start > self.period:
            if n > self.burst:
                self._log.log(level, "%d more %s events in the last %.0f s not logged", n - self.burst, key,
                              now - start)
            start, n = now, 0
        n += 1
        self._window[key] = (start, n)
        if n <= self.burst:
            self._log.log(level, msg, *args, exc_info=exc_info)


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


def fd_ceiling() -> int:
    """The lowest descriptor number a probe connection may not have: RLIMIT_NOFILE's soft limit less
    the reserve (0 when there is no limit to speak of)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft > 1 << 24:
        return 0
    return soft - min(FD_RESERVE, soft // 4)


def pid_alive(pid: int) -> bool:
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


def send_whole(sock: socket.socket, payload: bytes) -> bytes | None:
    """Send without blocking; the tail the socket did not take (b"" when all went), or None when
    nothing could be sent. A caller keeps the tail, or the peer would see a torn frame."""
    try:
        n = sock.send(payload)
    except (BlockingIOError, OSError):
        return None
    return payload[n:]


class ProbeListener:
    """The listening socket at ``path``: its flock, its mode, accept with the daemon's limits, and
    its removal at the end (only while it is still this daemon's).

    Counts what it refused (``refused`` by reason, ``accept_errors``) for the metrics.
    """

    def __init__(self, path: str, sel: selectors.BaseSelector, rlog: RateLimitedLog) -> None:
        self.path = path
        self._sel = sel
        self._rlog = rlog
        self.sock: socket.socket | None = None
        self.refused: Counter[str] = Counter()
        self.accept_errors = 0
        self._lock_fd = -1
        self._ino: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket we created
        self._paused_until = 0.0
        self._fd_ceiling = 0  # a probe connection whose descriptor is at or above it is refused (0: no check)

    def open(self, mode: str, group: str | None, max_connections: int) -> None:
        self._lock_fd = lock_socket_path(self.path)
        try:
            self.sock = bind_probe_socket(self.path, mode, group)
        except BaseException:
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise
        st = os.stat(self.path)
        self._ino = (st.st_dev, st.st_ino)
        self._sel.register(self.sock, selectors.EVENT_READ, "listen")
        log.info("listening for probes socket=%s mode=%s", self.path, mode)
        self._fd_ceiling = fd_ceiling()
        if self._fd_ceiling and self._fd_ceiling - self.sock.fileno() < max_connections:
            log.warning("RLIMIT_NOFILE=%d leaves room for about %d probe connections, fewer than "
                        "daemon.max_connections=%d; further ones are refused (fd_limit)",
                        resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                        self._fd_ceiling - self.sock.fileno(), max_connections)

    def accept(self) -> Iterator[tuple[socket.socket, int, int]]:
        """The peers waiting in the backlog, as (socket, pid, uid), one at a time; those the
        descriptor reserve or missing credentials keep out are closed and counted. Whether a peer
        fits ``daemon.max_connections`` is the ingest loop's choice: it needs the peer's tenant
        (``tenants.py``)."""
        assert self.sock is not None
        while True:
            try:
                sock, _ = self.sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                self.accept_errors += 1
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors: the listener stays readable, so stop selecting it for a
                    # moment instead of spinning; waiting peers sit in the backlog.
                    self._pause(ACCEPT_PAUSE_S)
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
            try:
                sock.setblocking(False)
                pid, uid, _gid = peer_credentials(sock)
            except OSError as exc:
                self.refused["peer_credentials"] += 1
                self._rlog("refused", logging.WARNING, "probe connection refused: no peer credentials (%s)", exc)
                sock.close()
                continue
            yield sock, pid, uid

    def _pause(self, seconds: float) -> None:
        if self.sock is None or self._paused_until:
            return
        try:
            self._sel.unregister(self.sock)
        except (KeyError, ValueError):
            return
        self._paused_until = time.monotonic() + seconds

    def resume_if_due(self, now: float) -> None:
        if self._paused_until and now >= self._paused_until and self.sock is not None:
            self._sel.register(self.sock, selectors.EVENT_READ, "listen")
            self._paused_until = 0.0

    def close(self) -> None:
        """Stop listening; unlink the socket only if it is still the one this daemon bound (same
        inode), then let the lock go: a successor that took the path over keeps its socket."""
        if self.sock is None:
            return
        try:
            self._sel.unregister(self.sock)
        except (KeyError, ValueError):
            pass
        self.sock.close()
        try:
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._ino:
                os.unlink(self.path)
            else:
                log.info("socket %s belongs to another daemon now: left in place", self.path)
        except OSError:
            pass
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
