"""A bounded HTTP/1.1 server for /metrics: a slow or idle client can never hold a thread.

The standard library's ``ThreadingHTTPServer`` gives every connection a thread that
blocks reading headers, with a timeout per read (not per request), and a listen
backlog of 5: a few thousand sockets that send a header byte at a time exhaust
threads and descriptors before authentication is even looked at. Here one I/O thread
owns every socket while a request is being read (TLS handshakes included), under a
selector, with

* a cap on open connections: past it, the connection that has waited longest without
  a complete request is closed to make room, so a flood of slow sockets churns among
  itself while a scraper that sends its request at once gets through;
* a deadline for the whole request (headers and body), counted from its first byte,
  and an idle deadline for keep-alive connections;
* bounded request size (headers and body);
* a listen backlog of 1024.

Only complete requests reach the worker threads, which run the ordinary
``BaseHTTPRequestHandler`` (routes, auth, encoders unchanged) on the buffered bytes and
write the response with a deadline for the whole write. No library fitted: waitress
reads requests the same way but has no TLS, and cheroot reads headers in its worker
threads (docs/reliability.md).

One module of about 470 lines on purpose: it is one I/O thread's state machine (accept, read,
evict, expire, hand off, take back), and every step reads and writes the same connection table
and deadlines; split in two, each half would reach into the other's state.
"""

from __future__ import annotations

import collections
import errno
import io
import logging
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler
from typing import Any

from gpufootprint.wakepipe import WakePipe

log = logging.getLogger(__name__)

#: Connections open at once (reading, waiting for a worker, or idle between requests).
MAX_CONNECTIONS = 512
#: A request (headers and body) must arrive whole within this many seconds of its first byte.
REQUEST_DEADLINE_S = 10.0
#: A connection with no request in progress is closed after this long.
IDLE_TIMEOUT_S = 75.0  # longer than Prometheus's usual 60 s scrape interval, so keep-alive survives
#: A response must be written whole within this long (a client that does not read holds a worker no longer).
WRITE_DEADLINE_S = 10.0
MAX_REQUEST_BYTES = 64 * 1024
BACKLOG = 1024
WORKERS = 8
ACCEPT_PAUSE_S = 0.5
#: Under the cap, a connection younger than this is never closed to make room for a newer one.
MIN_AGE_S = 0.5

#: (status, reason, headers, body) of a request answered on the I/O thread.
FastAnswer = tuple[int, str, list[tuple[str, str]], bytes]
#: Called on the I/O thread with (method, target, lower-cased headers): an answer that is ready now
#: (a cached /metrics body, /healthz), or None to hand the request to a worker thread.
FastPath = Callable[[str, str, Mapping[str, str]], "FastAnswer | None"]


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    addr: Any
    opened: float
    buf: bytearray = field(default_factory=bytearray)
    started: float | None = None  # monotonic time of the current request's first byte
    last: float = 0.0  # when it last became idle (accepted, or a response was written)
    handshaking: bool = False
    out: bytearray = field(default_factory=bytearray)  # response bytes not yet taken by the socket
    close_after: bool = False
    writing_since: float | None = None


class BoundedHTTPServer:
    """Serves ``handler`` (a ``BaseHTTPRequestHandler`` class) on ``address`` within the bounds above.

    Duck-types what ``MetricsServer`` and the handler use of ``socketserver``'s servers:
    ``server_address``, ``serve_forever``, ``shutdown``, ``server_close``, ``web_config``."""

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], *,
                 max_connections: int = MAX_CONNECTIONS, workers: int = WORKERS,
                 request_deadline_s: float = REQUEST_DEADLINE_S, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 fast: FastPath | None = None) -> None:
        host, port = address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host, port), family=family, backlog=BACKLOG)
        self.socket.setblocking(False)
        self.server_address: tuple[Any, ...] = self.socket.getsockname()
        self.handler = handler
        self.fast = fast
        self.web_config: Any = None
        self.max_connections = max_connections
        self.request_deadline_s = request_deadline_s
        self.idle_timeout_s = idle_timeout_s
        self.accept_errors = 0
        self.evicted = 0  # connections closed to make room under the cap
        self.refused = 0  # connections closed at once: the cap was reached by busy or new ones
        self.timed_out = 0  # requests that missed their deadline, idle connections closed
        self._sel = selectors.DefaultSelector()
        self._conns: collections.OrderedDict[_Conn, None] = collections.OrderedDict()  # oldest waiting first
        self._busy = 0  # connections handed to workers
        self._back: collections.deque[_Conn] = collections.deque()  # keep-alive connections back from workers
        self._wake_pipe = WakePipe()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gpufootprint-http")
        self._stop = threading.Event()
        self._serving = False
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._accept_paused_until = 0.0

    # --- the I/O thread ------------------------------------------------------------------------

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self._serving = True
        self._sel.register(self.socket, selectors.EVENT_READ, None)
        self._sel.register(self._wake_pipe.reader, selectors.EVENT_READ, "wake")
        try:
            while not self._stop.is_set():
                for key, _ in self._sel.select(min(poll_interval, 0.25)):
                    if key.data is None:
                        self._accept()
                    elif key.data == "wake":
                        self._wake_pipe.drain()
                    elif key.data.out:
                        self._flush(key.data)
                    else:
                        self._read(key.data)
                self._take_back()
                self._expire()
        finally:
            self._stopped.set()

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self.socket.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                self.accept_errors += 1
                if exc.errno == errno.EMFILE and self._conns and self._evict():
                    continue  # out of descriptors: one held by a slow client goes to the waiting scrape
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    if self.accept_errors == 1 or self.accept_errors % 100 == 0:
                        log.warning("http accept failed (%d times so far): %s", self.accept_errors, exc)
                    self._sel.unregister(self.socket)  # waiting clients stay in the backlog meanwhile
                    self._accept_paused_until = time.monotonic() + ACCEPT_PAUSE_S
                return
            if len(self._conns) + self._busy >= self.max_connections and not self._evict():
                self.refused += 1
                sock.close()  # every slot is busy or new: this one waits for none
                continue
            sock.setblocking(False)
            now = time.monotonic()
            conn = _Conn(sock, addr, now, last=now)
            tls = self.web_config.current_tls() if self.web_config is not None else None
            if tls is not None:
                try:
                    conn.sock = tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                except (ssl.SSLError, OSError) as exc:
                    self.web_config.handshake_failed(addr, exc)
                    sock.close()
                    continue
                conn.handshaking = True
            self._conns[conn] = None
            self._sel.register(conn.sock, selectors.EVENT_READ, conn)
            if conn.handshaking:
                self._read(conn)  # the ClientHello may be there already

    def _evict(self) -> bool:
        """Close the connection that has waited longest without a complete request, if it has had
        ``MIN_AGE_S`` to send one: a burst of new connections is then refused among itself, and
        cannot push out a scraper accepted a moment before it whose request is still on its way."""
        now = time.monotonic()
        for conn in self._conns:
            if conn.out:
                continue  # being answered
            if now - max(conn.opened, conn.last) < MIN_AGE_S:
                return False
            self.evicted += 1
            self._close(conn)
            return True
        return False

    def _read(self, conn: _Conn) -> None:
        if conn.handshaking:
            try:
                conn.sock.do_handshake()  # type: ignore[attr-defined]
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                if conn.started is None:
                    conn.started = time.monotonic()  # a handshake counts against the request's deadline
                return
            except (ssl.SSLError, OSError) as exc:
                self.web_config.handshake_failed(conn.addr, exc)
                self._close(conn)
                return
            conn.handshaking = False
        while True:
            try:
                data = conn.sock.recv(65536)
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                break
            except OSError:
                self._close(conn)
                return
            if not data:
                self._close(conn)
                return
            if conn.started is None:
                conn.started = time.monotonic()
            conn.buf += data
            if len(conn.buf) > MAX_REQUEST_BYTES:
                self._reply_and_close(conn, b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
                return
            if not isinstance(conn.sock, ssl.SSLSocket) or not conn.sock.pending():
                break
        if self._complete(conn) and not self._answer_here(conn):
            self._dispatch(conn)

    def _answer_here(self, conn: _Conn) -> bool:
        """Answer a plain GET/HEAD on this thread when ``fast`` has the answer ready: no thread
        hand-off, no wait for the GIL behind the workers (500 scrapes at once cost ~0.1 ms each)."""
        if self.fast is None:
            return False
        end = conn.buf.find(b"\r\n\r\n")
        lines = bytes(conn.buf[:end]).decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or parts[0] not in ("GET", "HEAD") or not parts[2].startswith("HTTP/1."):
            return False
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                return False
            headers[name.strip().lower()] = value.strip()
        if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
            return False
        answer = self.fast(parts[0], parts[1], headers)
        if answer is None:
            return False
        code, reason, extra, body = answer
        close = parts[2] != "HTTP/1.1" or headers.get("connection", "").lower() == "close"
        head = [f"HTTP/1.1 {code} {reason}", "Server: gpufootprint", f"Date: {_http_date()}",
                *(f"{k}: {v}" for k, v in extra), f"Content-Length: {len(body)}"]
        if close:
            head.append("Connection: close")
        del conn.buf[:end + 4]
        conn.out += ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
        if parts[0] == "GET":
            conn.out += body
        conn.close_after = close
        conn.started = None
        conn.writing_since = time.monotonic()
        self._flush(conn)
        return True

    def _flush(self, conn: _Conn) -> None:
        while conn.out:
            try:
                n = conn.sock.send(conn.out)
            except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                self._sel.modify(conn.sock, selectors.EVENT_WRITE, conn)
                return
            except OSError:
                self._close(conn)
                return
            del conn.out[:n]
        conn.writing_since = None
        if conn.close_after:
            self._close(conn)
            return
        self._sel.modify(conn.sock, selectors.EVENT_READ, conn)
        conn.last = time.monotonic()
        self._conns.move_to_end(conn)
        if conn.buf:
            conn.started = conn.last
            if self._complete(conn) and not self._answer_here(conn):
                self._dispatch(conn)

    @staticmethod
    def _complete(conn: _Conn) -> bool:
        end = conn.buf.find(b"\r\n\r\n")
        if end < 0:
            return False
        head = bytes(conn.buf[:end]).decode("latin-1").lower()
        length = 0
        for line in head.split("\r\n")[1:]:
            name, _, value = line.partition(":")
            if name.strip() == "content-length":
                try:
                    length = int(value.strip())
                except ValueError:
                    length = 0
        return len(conn.buf) >= end + 4 + length

    def _dispatch(self, conn: _Conn) -> None:
        self._sel.unregister(conn.sock)
        self._conns.pop(conn, None)
        self._busy += 1
        try:
            self._pool.submit(self._serve, conn)
        except RuntimeError:  # shutting down
            self._busy -= 1
            conn.sock.close()

    def _take_back(self) -> None:
        while self._back:
            with self._lock:
                conn = self._back.popleft()
            self._busy -= 1
            if conn.sock.fileno() < 0:
                continue
            if self._stop.is_set():
                conn.sock.close()
                continue
            conn.last = time.monotonic()
            conn.started = time.monotonic() if conn.buf else None
            self._conns[conn] = None
            self._sel.register(conn.sock, selectors.EVENT_READ, conn)
            if self._complete(conn) and not self._answer_here(conn):  # a pipelined request was buffered
                self._dispatch(conn)

    def _expire(self) -> None:
        now = time.monotonic()
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._sel.register(self.socket, selectors.EVENT_READ, None)
        for conn in list(self._conns):
            if conn.writing_since is not None:
                if now - conn.writing_since > WRITE_DEADLINE_S:
                    self.timed_out += 1
                    self._close(conn)
            elif conn.started is not None:
                if now - conn.started > self.request_deadline_s:
                    self.timed_out += 1
                    self._reply_and_close(conn, b"HTTP/1.1 408 Request Timeout\r\n")
            elif now - conn.last > self.idle_timeout_s:
                self.timed_out += 1
                self._close(conn)

    def _reply_and_close(self, conn: _Conn, status: bytes) -> None:
        try:
            conn.sock.send(status + b"Connection: close\r\nContent-Length: 0\r\n\r\n")
        except (OSError, ssl.SSLError):
            pass
        self._close(conn)

    def _close(self, conn: _Conn) -> None:
        self._conns.pop(conn, None)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        try:
            conn.sock.close()
        except OSError:
            pass

    def _wake(self) -> None:
        self._wake_pipe.wake()

    # --- worker threads ------------------------------------------------------------------------

    def _serve(self, conn: _Conn) -> None:
        keep = False
        try:
            conn.sock.settimeout(WRITE_DEADLINE_S)
            data = bytes(conn.buf)
            conn.buf.clear()
            handler = _one_request(self.handler)(conn.sock, conn.addr, self, data)
            keep = not handler.close_connection
            conn.buf += handler.leftover
        except Exception:  # a request must never take the server down
            log.debug("http request from %s failed", conn.addr, exc_info=True)
        if keep:
            try:
                conn.sock.setblocking(False)
            except OSError:
                keep = False
        if not keep:
            try:
                conn.sock.close()
            except OSError:
                pass
        with self._lock:
            self._back.append(conn)
        self._wake()

    # --- lifecycle -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        self._stop.set()
        self._wake()
        if self._serving:
            self._stopped.wait(10)

    def server_close(self) -> None:
        self._stop.set()
        for conn in list(self._conns):
            self._close(conn)
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            self._sel.close()
        except (OSError, RuntimeError):
            pass
        self.socket.close()
        self._wake_pipe.close()

    @property
    def open_connections(self) -> int:
        return len(self._conns) + self._busy


_date: tuple[int, str] = (0, "")


def _http_date() -> str:
    """The Date header, formatted once a second."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, formatdate(now, usegmt=True))
    return _date[1]


_handlers: dict[type[BaseHTTPRequestHandler], Callable[..., Any]] = {}


def _one_request(base: type[BaseHTTPRequestHandler]) -> Callable[..., Any]:
    """``base`` answering exactly one request read from a buffer, writing to the socket."""
    made = _handlers.get(base)
    if made is not None:
        return made

    class OneRequest(base):  # type: ignore[valid-type,misc]
        def __init__(self, sock: socket.socket, addr: Any, server: Any, data: bytes) -> None:
            self._data = data
            self.leftover = b""
            super().__init__(sock, addr, server)

        def setup(self) -> None:
            super().setup()
            reader: Any = getattr(self, "rfile")  # noqa: B009 - set by the base class's setup
            reader.close()  # the socket's reader: open, it would keep the descriptor alive after close()
            self.rfile = io.BytesIO(self._data)

        def handle(self) -> None:
            self.close_connection = True
            self.handle_one_request()
            reader: Any = self.rfile
            self.leftover = self._data[reader.tell():]

    _handlers[base] = OneRequest
    return OneRequest
