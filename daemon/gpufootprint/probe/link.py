"""Where the probe's frames go: the daemon's Unix socket, and optionally a file.

Two twins with one interface, ``Sink`` (memray's SocketDestination/FileDestination):
the same bytes, so a recorded file replays exactly like a live connection, and
whatever is written to both (a resync) is written by one function. The
socket link never blocks: frames wait in a bounded byte buffer; a frame that does
not fit is dropped and counted; when the daemon is away the link reconnects with
exponential backoff and tells its owner, who then sends a full resync.
"""

from __future__ import annotations

import ctypes
import errno
import gzip
import logging
import math
import os
import random
import select
import socket
import time
from collections import Counter, deque
from collections.abc import Callable
from itertools import repeat
from typing import IO, Any, Protocol

import numpy as np

from gpufootprint.wire.framing import PREAMBLE, Frame, FrameDecoder

log = logging.getLogger(__name__)

_SEND_MOST = 1 << 20  # bytes offered to one send
_RECV_BYTES = 1 << 16  # control frames read at a time
_AGAIN = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR)
_WAIT_MOST_MS = (1 << 31) - 1  # gfp_pump's timeout is a C int32 of milliseconds


class Sink(Protocol):
    def put(self, frame: bytes, *, must: bool = False, records: int = 0, mark: bool = False) -> bool:
        """Queue or write one frame; False when it was dropped. ``must``: never dropped for want of
        room; ``records``/``mark``: what the frame carries, counted as lost if it never leaves."""
        ...


class FileSink:
    """Every frame, in order, to a file (``record`` and ``tee``). Never drops; a failed write raises."""

    def __init__(self, path: str) -> None:
        self.path = path
        raw: IO[bytes] = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._fh: IO[bytes] = gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=4) if path.endswith(".gz") else raw  # type: ignore[assignment]
        self._raw = raw
        self._fh.write(PREAMBLE)
        self.bytes_written = len(PREAMBLE)

    def write(self, frame: bytes) -> None:
        self._fh.write(frame)
        self.bytes_written += len(frame)

    def put(self, frame: bytes, *, must: bool = False, records: int = 0, mark: bool = False) -> bool:
        self.write(frame)
        return True

    def close(self) -> None:
        try:
            self._fh.close()
        finally:
            if self._raw is not self._fh:
                self._raw.close()


class SocketLink:
    def __init__(self, path: str, *, buffer_bytes: int, backoff_max_s: float,
                 on_control: Callable[[Frame], None], clock: Callable[[], float] = time.monotonic,
                 native: Any = None, native_pump: bool = True) -> None:
        self.path = path
        # The probe's C library (nativecallbacks.load), through ctypes.PyDLL: non-blocking send and recv that keep
        # the GIL (None: Python's socket calls, which let it go and must win it back behind busy threads).
        self._native = native
        # The same library's wait for the socket's room through ctypes.CDLL: the GIL let go once for the whole
        # wait, not at each poll (nativecallbacks.load binds it; None without the library or with native_pump off)
        self._pump = getattr(native, "gfp_pump_nogil", None) if native_pump else None
        self._rbuf = bytearray(_RECV_BYTES)
        # held for the link's life: the bytearray cannot be resized (nor its memory move) while it is
        self._rpin = (ctypes.c_char * _RECV_BYTES).from_buffer(self._rbuf) if native else None
        self._raddr = ctypes.addressof(self._rpin) if self._rpin is not None else 0
        self.buffer_bytes = buffer_bytes
        self.backoff_max_s = backoff_max_s
        self._on_control = on_control
        self._clock = clock
        self._sock: socket.socket | None = None
        self._out = bytearray()
        self._decoder: FrameDecoder | None = None
        self._backoff = 0.05
        self._next_try = 0.0
        self.connects = 0
        self.connections: Counter[str] = Counter()  # result -> n (ok, refused, missing, error)
        self.disconnects: Counter[str] = Counter()  # reason -> n
        self.bytes_sent = 0
        self.frames_dropped = 0
        # (stream offset where the frame ends, records, is a mark) per buffered frame that
        # carries either, so a broken connection can say what it lost.
        self._ledger: deque[tuple[int, int, int]] = deque()
        self._put_total = 0  # bytes queued on this connection
        self._sent_total = 0  # bytes the socket took on this connection
        self.lost_records = 0
        self.lost_marks = 0

    @property
    def connected(self) -> bool:
        return self._sock is not None

    @property
    def buffered(self) -> int:
        return len(self._out)

    def try_connect(self) -> bool:
        """Connect if the backoff allows; True when a new connection was made."""
        if self._sock is not None or not self.path:
            return False
        now = self._clock()
        if now < self._next_try:
            return False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            result = {errno.ENOENT: "missing", errno.ECONNREFUSED: "refused",
                      errno.EACCES: "denied", errno.EAGAIN: "busy"}.get(exc.errno or 0, "error")
            self.connections[result] += 1
            self._next_try = now + self._backoff * (0.5 + random.random())
            self._backoff = min(self._backoff * 2, self.backoff_max_s)
            return False
        self._sock = sock
        self._out.clear()
        self._out += PREAMBLE
        self._put_total = len(PREAMBLE)
        self._sent_total = 0
        self._decoder = FrameDecoder()
        self._decoder.feed(PREAMBLE)  # the daemon sends bare frames
        self._backoff = 0.05
        self.connects += 1
        self.connections["ok"] += 1
        return True

    def put(self, frame: bytes, *, must: bool = False, records: int = 0, mark: bool = False) -> bool:
        """Queue a frame; False (dropped) when not connected or the buffer is full."""
        return self.put_parts((frame,), must=must, records=records, mark=mark)

    def put_parts(self, parts: tuple[bytes | memoryview, ...], *, must: bool = False, records: int = 0,
                  mark: bool = False) -> bool:
        """``put`` for one frame given as consecutive parts (each copied once, into the send buffer)."""
        if self._sock is None:
            return False
        size = sum(len(p) for p in parts)
        if not must and len(self._out) + size > self.buffer_bytes:
            self.frames_dropped += 1
            return False
        self._put_total += size
        if records or mark:
            self._ledger.append((self._put_total, records, int(mark)))
        for part in parts:
            self._out += part
        return True

    def put_chunk(self, data: memoryview, ends: np.ndarray, records: np.ndarray) -> bool:
        """Whole frames framed elsewhere (the C forwarder's: probe/forwarder.py), each ending at ``ends[i]`` in
        ``data`` with ``records[i]`` records: never dropped for want of room (the forwarder kept to what the
        buffer had room for when it was told), each counted as lost if it never leaves."""
        if self._sock is None:
            return False
        base = self._put_total
        self._put_total += len(data)
        self._ledger.extend(zip((ends + base).tolist(), records.tolist(), repeat(0)))
        self._out += data
        return True

    def _sent(self, n: int) -> None:
        self._sent_total += n
        ledger = self._ledger
        while ledger and ledger[0][0] <= self._sent_total:
            ledger.popleft()

    def pump(self, wait_s: float = 0.0) -> None:
        """Send what the socket takes and read control frames. ``wait_s`` > 0: while frames remain, wait
        up to that long in all for the socket to take more (the sender's thread, the GIL let go meanwhile).

        The kernel holds about 200 KiB of a Unix socket's data: a sender that sent only that much a wake
        moved about 5 MB a second behind busy Python threads, each wake costing it a wait for the GIL, and
        a churning process's CUPTI fills 14 MB a second (the H100's four PyTorch threads under
        cudaMallocAsync): the rest piled up to the send buffer's bound and was dropped, with a daemon idle."""
        sock = self._sock
        if sock is None:
            return
        end = self._clock() + wait_s if wait_s > 0 else 0.0
        poller: select.poll | None = None
        try:
            while self._out:
                try:
                    n = self._send(sock)
                except BlockingIOError:
                    left = end - self._clock()
                    if left <= 0:
                        break
                    if self._pump is None:
                        if poller is None:
                            poller = select.poll()
                            poller.register(sock, select.POLLOUT)
                        poller.poll(max(1, math.ceil(left * 1000)))  # poll's unit is the millisecond
                        continue
                    n = self._wait_and_send(sock, left)  # 0: the wait ran out with nothing taken
                if n <= 0:
                    break
                del self._out[:n]
                self.bytes_sent += n
                self._sent(n)
        except OSError as exc:
            self.close("send_error" if exc.errno not in (errno.EPIPE, errno.ECONNRESET) else "peer_closed")
            return
        try:
            while True:
                data = self._recv(sock)
                if not data:
                    self.close("peer_closed")
                    return
                assert self._decoder is not None
                for frame in self._decoder.feed(data):
                    self._on_control(frame)
                if self._decoder.error is not None:
                    self.close("bad_control")
                    return
        except BlockingIOError:
            pass
        except OSError:
            self.close("recv_error")

    def _send(self, sock: socket.socket) -> int:
        """One non-blocking send of the buffer's head; BlockingIOError when the socket takes nothing now."""
        if self._native is None:
            # through a view: slicing the bytearray would copy up to 1 MiB before each send
            with memoryview(self._out) as view, view[:_SEND_MOST] as chunk:
                return sock.send(chunk)
        send = self._native.gfp_send
        return self._on_out(lambda at, n: send(sock.fileno(), at, min(n, _SEND_MOST)))

    def _wait_and_send(self, sock: socket.socket, wait_s: float) -> int:
        """What waits, sent as the socket finds room, for up to ``wait_s``, in one C call that lets the GIL go
        (``gfp_pump``): the bytes sent (0: none in that time). Behind busy Python threads each wait for room
        in Python won the GIL back after it, up to a switch interval, longer where the CPU is shared, for about
        200 KiB a wait (what the kernel holds of a Unix socket); a CUPTI burst of several MB needs many."""
        pump = self._pump
        assert pump is not None
        wait_ms = min(max(1, math.ceil(wait_s * 1000)), _WAIT_MOST_MS)
        return self._on_out(lambda at, n: pump(sock.fileno(), at, n, wait_ms))

    def _on_out(self, call: Callable[[int, int], int]) -> int:
        """``call(address, length)`` of the send buffer, a C call of the library, checked as ``_send`` answers.
        Only this (the sender's) thread touches the buffer; the view's export keeps it from being resized or moved
        while the call runs (without the GIL, for ``gfp_pump``)."""
        with memoryview(self._out) as view:
            head = ctypes.c_char.from_buffer(view)  # its address; let go before the view is
            try:
                n = int(call(ctypes.addressof(head), len(view)))
            finally:
                del head
        return _checked(n)

    def _recv(self, sock: socket.socket) -> bytes:
        """One non-blocking read of control frames (b"": the peer closed); BlockingIOError when none wait."""
        if self._native is None:
            return sock.recv(_RECV_BYTES)
        n = _checked(int(self._native.gfp_recv(sock.fileno(), self._raddr, _RECV_BYTES)))
        with memoryview(self._rbuf) as view:
            return bytes(view[:n])

    def await_control(self, timeout_s: float, done: Callable[[], bool]) -> None:
        """Send what is queued and read control frames until ``done()``, waiting up to ``timeout_s`` in all
        for the daemon's answer (the sender's thread, the GIL let go while it waits)."""
        end = self._clock() + timeout_s
        poller: select.poll | None = None
        while self._sock is not None:
            self.pump()
            left = end - self._clock()
            if done() or self._sock is None or left <= 0:
                return
            if poller is None:
                poller = select.poll()
            poller.register(self._sock, select.POLLIN | (select.POLLOUT if self._out else 0))
            poller.poll(max(1, math.ceil(left * 1000)))  # poll's unit is the millisecond

    def close(self, reason: str) -> None:
        if self._sock is None:
            return
        try:
            self._sock.close()
        finally:
            self._sock = None
            self._decoder = None
            self._out.clear()
            for _end, records, mark in self._ledger:
                self.lost_records += records
                self.lost_marks += mark
            self._ledger.clear()
            self.disconnects[reason] += 1
            self._next_try = self._clock() + self._backoff

    def drain(self, timeout_s: float) -> None:
        """At exit: give the socket up to ``timeout_s`` to take what is buffered. The wait is ``pump``'s (one
        C call where the library loaded): a loop of a send and a 2 ms sleep won the GIL back after every sleep,
        about 200 KiB a time, and a starved machine's stop ran out of time with frames still buffered."""
        end = self._clock() + timeout_s
        while self._sock is not None and self._out:
            left = end - self._clock()
            if left <= 0:
                break
            self.pump(left)


def _checked(n: int) -> int:
    """A byte count from the C library's send or recv, or the OSError its -errno names."""
    if n >= 0:
        return n
    if -n in _AGAIN:
        raise BlockingIOError(-n, os.strerror(-n))
    raise OSError(-n, os.strerror(-n))
