"""``gpufootprint daemon`` as a user runs it, for the tests: a real process on its own socket and port.

One way to start it, wait for it, scrape it and stop it. Tests get daemons from the ``daemons``
fixture (tests/conftest.py), which stops every daemon it started when the test ends.
"""

from __future__ import annotations

import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import cli_env

T = TypeVar("T")

Samples = dict[str, list[tuple[dict[str, str], float]]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int, *, timeout: float = 5.0, opener: Any = None, scheme: str = "http") -> Samples:
    """Every sample of the daemon's /metrics, by name: [(labels, value), ...]."""
    url = f"{scheme}://127.0.0.1:{port}/metrics"
    with (opener.open(url, timeout=timeout) if opener else urllib.request.urlopen(url, timeout=timeout)) as resp:
        text = resp.read().decode()
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def wait(pred: Callable[[], T], timeout: float = 10.0, step: float = 0.05) -> T:
    """``pred()`` once it is true (a connection refused or a missing key meanwhile counts as not yet)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = pred()
            if last:
                return last
        except (OSError, KeyError):
            pass
        time.sleep(step)
    raise AssertionError(f"condition not met in {timeout} s (last: {last!r})")


class DaemonProcess:
    """One daemon: ``args`` are its settings beyond the socket and the port (``--set KEY=VALUE`` ...);
    its log (stderr) goes to a file beside the test's other files."""

    def __init__(self, tmp: Path, *args: str, config: Path | None = None, nofile: int | None = None,
                 env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        self.port = free_port()
        self.sock = tmp / f"probe-{self.port}.sock"
        cmd = [sys.executable, "-m", "gpufootprint", "daemon", "--socket", str(self.sock),
               "--listen", f"127.0.0.1:{self.port}", *args]
        if config is not None:
            cmd += ["--config", str(config)]
        self.err_path = tmp / f"daemon-{self.port}.log"
        self.err = open(self.err_path, "w")  # noqa: SIM115 - open for the daemon's life, closed by stop()
        limit = None if nofile is None else (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)))
        self.proc = subprocess.Popen(cmd, env=cli_env() if env is None else env, cwd=cwd, stdout=subprocess.DEVNULL,
                                     stderr=self.err, text=True, preexec_fn=limit)  # noqa: PLW1509

    def ready(self, timeout: float = 30.0, **kw: Any) -> DaemonProcess:
        """Once its socket exists and /metrics answers (``kw``: how to scrape it)."""
        wait(lambda: self.sock.exists() and self.metrics(**kw) is not None, timeout)
        return self

    def metrics(self, **kw: Any) -> Samples:
        return scrape(self.port, **kw)

    def log(self) -> str:
        if not self.err.closed:
            self.err.flush()
        return self.err_path.read_text()

    def stop(self) -> int:
        """SIGTERM (after SIGCONT, for a daemon a test stopped), then its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.err.close()
        return int(self.proc.returncode)
