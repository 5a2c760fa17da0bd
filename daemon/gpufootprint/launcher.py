"""``gpufootprint run`` and ``gpufootprint record``: start a command with the probe in it.

Both put ``bootstrap/`` (a ``sitecustomize``) first on the children's PYTHONPATH
and set ``GPUFOOTPRINT_PROBE=1``, so the command and every Python process it
starts (``torchrun`` workers, ``multiprocessing`` spawn children, subprocesses)
start a probe before their first CUDA call. ``run`` points the probes at the
daemon's socket; ``record`` points them at a relay in this process that writes
every probe's frames into one file, the same frames a daemon would receive.
"""

from __future__ import annotations

import gzip
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

import numpy as np

from gpufootprint.errors import GpuFootprintError
from gpufootprint.records import DTYPES, RecordKind, copy_records
from gpufootprint.wire import framing
from gpufootprint.wire.framing import PREAMBLE, Frame, FrameDecoder, FrameType
from gpufootprint.wire.probe_options import ProbeOptions

log = logging.getLogger(__name__)

BOOTSTRAP_DIR = str(Path(__file__).resolve().parent / "probe" / "bootstrap")


def probe_env(socket_path: str, base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    paths = [BOOTSTRAP_DIR]
    pkg_parent = str(Path(__file__).resolve().parents[2])
    if Path(pkg_parent).name not in ("site-packages", "dist-packages"):
        paths.append(pkg_parent)  # a source checkout: children must import gpufootprint too
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["GPUFOOTPRINT_PROBE"] = "1"
    env["GPUFOOTPRINT_PROBE_SOCKET"] = socket_path
    env.update(extra)
    return env


def _spawn(cmd: list[str], env: dict[str, str]) -> int:
    try:
        child = subprocess.Popen(cmd, env=env)
    except OSError as exc:
        raise GpuFootprintError(f"cannot start {cmd[0]!r}: {exc.strerror}") from None

    def forward(signum: int, _frame: object) -> None:
        try:
            child.send_signal(signum)
        except OSError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        rc = child.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 128 - rc if rc < 0 else rc


def settings_env(probe_config: ProbeOptions | None) -> dict[str, str]:
    """GPUFOOTPRINT_PROBE_* variables from the daemon configuration's ``probe:`` section."""
    return probe_config.to_env() if probe_config is not None else {}


def run(cmd: list[str], socket_path: str, probe_config: ProbeOptions | None = None) -> int:
    """Run ``cmd`` probed, reporting to the daemon at ``socket_path``; returns its exit status."""
    if not Path(socket_path).exists():
        log.warning("no daemon socket at %s yet: the probes will keep retrying, dropping and counting", socket_path)
    env = probe_env(socket_path)
    env.update(settings_env(probe_config))
    return _spawn(cmd, env)


# --- record: a relay that writes every probe's frames to one file ---------------------


class Relay:
    """Accepts probe connections and writes their frames into one native stream.

    A file has no per-connection context, so the relay keeps each probe's frames
    self-describing: watermarks (which apply to a whole stream) are left out,
    a resync block is written whole, and kernel-name ids of the second and later
    probes are moved to their own range.
    """

    def __init__(self, output: str) -> None:
        self.output = output
        self._dir = tempfile.mkdtemp(prefix="gpufootprint-record-")
        self.socket_path = os.path.join(self._dir, "probe.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.socket_path)
        os.chmod(self.socket_path, 0o600)
        self._listener.listen(64)
        self._listener.setblocking(False)
        # A write that fails (disk full) loses the frame, counted; the relay keeps reading so
        # the probes never back up into the workload.
        self.frames_lost = 0
        self.records_lost = 0
        self.write_error: str | None = None
        raw: IO[bytes] = open(output, "wb", buffering=0)  # noqa: SIM115 - unbuffered: a failed write is one frame
        self._raw = raw
        # A write may be short (a disk filling up, RLIMIT_FSIZE): _WholeWrites finishes it or raises.
        whole = _WholeWrites(raw)
        self._fh: IO[bytes] = gzip.GzipFile(fileobj=whole, mode="wb", compresslevel=6) if output.endswith(".gz") else whole  # type: ignore[assignment]
        self._plain = not output.endswith(".gz")
        self._put(PREAMBLE, 0)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._stop = threading.Event()
        self._open = 0
        self._seen = 0
        self.frames = 0
        self.problems: list[str] = []
        self._thread = threading.Thread(target=self._loop, name="gpufootprint-record", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        while not (self._stop.is_set() and self._open == 0):
            for key, _ in self._sel.select(0.05):
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.fileobj, key.data)  # type: ignore[arg-type]

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        sock.setblocking(False)
        # Kernel-name ids of the n-th probe move to their own range (n << 24); the 8 bits above the
        # ids hold 256 probes, so the ranges wrap past that (names of probes 256 apart may then
        # mix in one file) instead of overflowing the 32-bit id.
        state = {"decoder": FrameDecoder(), "index": self._seen % 256, "resync": None}
        self._seen += 1
        self._open += 1
        self._sel.register(sock, selectors.EVENT_READ, state)

    def _read(self, sock: socket.socket, state: dict) -> None:  # type: ignore[type-arg]
        try:
            data = sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            for frame in state["decoder"].feed(data):
                self._write(frame, state)
            if state["decoder"].error is None:
                return
            self.problems.append(str(state["decoder"].error))
        self._sel.unregister(sock)
        sock.close()
        self._open -= 1

    def _put(self, data: bytes, records: int) -> None:
        if self.write_error is None:
            start = self._raw.tell() if self._plain else -1
            try:
                self._fh.write(data)
                return
            except OSError as exc:  # ENOSPC, EIO, EFBIG...: from here on the file cannot be trusted
                if start >= 0:
                    # Part of this frame may be on disk: cut it off, so the file ends on a whole frame
                    # and the loss counted (this frame on) is exact.
                    try:
                        os.ftruncate(self._raw.fileno(), start)
                        self._raw.seek(start)
                    except OSError:
                        pass
                self.write_error = f"{self.output}: {exc.strerror or exc}"
                log.error("record: cannot write %s (%s); the workload goes on, frames from here on are counted as "
                          "lost", self.output, exc.strerror or exc)
        self.frames_lost += 1
        self.records_lost += records

    def _write(self, frame: Frame, state: dict) -> None:  # type: ignore[type-arg]
        if frame.type is FrameType.WATERMARK:
            return
        data = framing.encode(frame.type, frame.payload, frame.tag)
        shift = state["index"] << 24
        if shift and frame.type is FrameType.STRINGS:
            body = frame.json()
            data = framing.encode_json(FrameType.STRINGS, {str(int(k) | shift): v for k, v in body.items()
                                                           if k.isdigit()})
        elif shift and frame.type is FrameType.BATCH and frame.tag == RecordKind.KERNEL:
            recs = copy_records(frame.records())
            recs["name_id"] |= np.uint32(shift)
            data = framing.encode_batch(RecordKind.KERNEL, recs)
        if frame.type is FrameType.RESYNC_BEGIN:
            state["resync"] = [data]
            return
        if state["resync"] is not None:
            state["resync"].append(data)
            if frame.type is FrameType.RESYNC_END:
                for part in state["resync"]:
                    self._put(part, 0)
                self.frames += len(state["resync"])
                state["resync"] = None
            return
        records = 0
        if frame.type is FrameType.BATCH:
            try:
                records = len(frame.payload) // DTYPES[RecordKind(frame.tag)].itemsize
            except ValueError:
                pass
        self._put(data, records)
        self.frames += 1

    def close(self, linger_s: float = 5.0) -> None:
        """Stop after the connected probes hang up (or ``linger_s``)."""
        end = time.monotonic() + linger_s
        while self._open and time.monotonic() < end:
            time.sleep(0.02)
        self._stop.set()
        self._open = 0
        self._thread.join(2.0)
        self._sel.close()
        self._listener.close()
        for fh in (self._fh, self._raw) if self._raw is not self._fh else (self._fh,):
            try:
                fh.close()
            except OSError as exc:  # the last buffered bytes did not fit either
                if self.write_error is None:
                    self.write_error = f"{self.output}: {exc.strerror or exc}"
                    log.error("record: cannot finish %s (%s)", self.output, exc.strerror or exc)
        try:
            os.unlink(self.socket_path)
            os.rmdir(self._dir)
        except OSError:
            pass


class _WholeWrites:
    """A file object whose ``write`` writes everything or raises: a raw file's write may take only
    part of the data (a full disk returns a short count before it returns ENOSPC)."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            n = self._raw.write(view)
            if not n:  # nothing taken and no error: treat as a full disk rather than spin
                raise OSError(28, os.strerror(28))
            view = view[n:]
        return len(data)

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:
        self._raw.close()

    def fileno(self) -> int:
        return self._raw.fileno()

    @property
    def closed(self) -> bool:
        return self._raw.closed


def record(cmd: list[str], output: str, probe_config: ProbeOptions | None = None) -> int:
    """Run ``cmd`` probed, writing every probe's frames to ``output`` (.gz compresses)."""
    try:
        relay = Relay(output)
    except OSError as exc:
        raise GpuFootprintError(f"cannot write {output}: {exc.strerror}") from None
    relay.start()
    try:
        env = probe_env(relay.socket_path)
        env.update(settings_env(probe_config))
        rc = _spawn(cmd, env)
    finally:
        relay.close()
        log.info("recorded frames=%d file=%s", relay.frames, output)
        if relay.write_error is not None:
            # The workload's exit status stays the command's; the loss is said once, on stderr.
            print(f"gpufootprint record: error: {relay.write_error}; {relay.frames_lost} frames "
                  f"({relay.records_lost} records) lost, the recording is incomplete", file=sys.stderr)
    if relay.frames == 0:
        # No probe ever connected (no GPU, no CUPTI, or a command that is not Python): an empty
        # file is not a recording, and a zero exit would hide it. Nor is it left behind: a file
        # holding only the preamble would later read as a recording of nothing.
        try:
            os.unlink(output)
        except OSError:
            pass
        print(f"gpufootprint record: error: {output}: empty recording, no probe connected (no GPU or CUPTI "
              "here, or the command does not start Python); no file kept", file=sys.stderr)
        return rc or 1
    return rc
