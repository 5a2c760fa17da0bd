"""Shared by bench/probe_wake_gil.py and bench/probe_pump_gil.py: the probe's own ``SocketLink`` connected to a reader
process, Python threads that hold the GIL whenever they run (a framework's threads between calls), and the probe's C
library or a clear exit without it."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))

from gpufootprint.probe import nativecallbacks
from gpufootprint.probe.link import SocketLink

# The daemon's side: a process that reads whatever comes (the link's peer, inherited by its descriptor).
_READER = "import socket, sys\npeer = socket.socket(fileno=int(sys.argv[1]))\nwhile peer.recv(1 << 18):\n    pass\n"


@contextmanager
def linked(**link_args: Any) -> Iterator[SocketLink]:
    """A connected ``SocketLink(path, **link_args)`` whose peer a reader process drains; closed after."""
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "d.sock")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(1)
        link = SocketLink(path, backoff_max_s=1.0, on_control=lambda f: None, **link_args)
        assert link.try_connect()
        peer, _ = server.accept()
        reader = subprocess.Popen([sys.executable, "-c", _READER, str(peer.fileno())], pass_fds=(peer.fileno(),))
        peer.close()
        try:
            yield link
        finally:
            link.close("bench")
            reader.wait(timeout=30)
            server.close()


class Spinners:
    """``n`` Python threads spinning, each holding the GIL whenever it runs; ``stop`` returns their loops in all."""

    def __init__(self, n: int) -> None:
        self._stop = threading.Event()
        self._loops = [0] * n
        self._threads = [threading.Thread(target=self._spin, args=(i,)) for i in range(n)]
        for t in self._threads:
            t.start()

    def _spin(self, i: int) -> None:
        while not self._stop.is_set():
            self._loops[i] += sum(range(200)) > 0

    def stop(self) -> int:
        self._stop.set()
        for t in self._threads:
            t.join()
        return sum(self._loops)


def library() -> Any:
    """The probe's C library, bound; exits with its reason where it is not built or does not load."""
    lib, why = nativecallbacks.load()
    if lib is None:
        print(f"no C library: {why}")
        raise SystemExit(1)
    return lib


def machine() -> str:
    return f"{platform.node()} {platform.machine()} cpus={os.cpu_count()} python {platform.python_version()}"
