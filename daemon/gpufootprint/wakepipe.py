"""A socket pair a selector loop waits on, so another thread can end its wait at once.

Both of the daemon's loops use it: the ingest loop (probe sockets) and the HTTP server's loop
(exporter/bounded.py). It lives beside them, not in either room, since the exporter may not
import from ingest/.
"""

from __future__ import annotations

import socket


class WakePipe:
    """``reader`` goes into the loop's selector; ``wake`` from any thread makes it readable."""

    def __init__(self) -> None:
        self.reader, self._writer = socket.socketpair()
        self.reader.setblocking(False)
        self._writer.setblocking(False)

    def wake(self) -> None:
        try:
            self._writer.send(b"x")
        except OSError:
            pass  # the pipe is full (BlockingIOError): the loop is awake anyway; or it is closed

    def drain(self) -> None:
        try:
            while self.reader.recv(4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        self.reader.close()
        self._writer.close()
