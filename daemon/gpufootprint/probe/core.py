"""The probe: CUPTI callbacks -> packer -> queue -> sender thread -> socket/file.

Threads and their duties, and where each lives:

* CUPTI's thread (or whichever thread CUPTI flushes on) packs records or queues
  buffers and returns (probe/intake.py). No locks held across CUPTI, no I/O, no
  flush, never raises.
* The sender thread owns everything else (probe/sender.py): the live table,
  frames to the sinks, flushes and watermarks, heartbeats, kernel windows,
  control messages, reconnects and resyncs.
* The workload's threads only call ``mark`` (optional) and, through the
  torch.profiler hook, hand CUPTI over and take it back (here).

``Probe`` holds one ``Sender`` and adds its lifecycle: start (arm CUPTI,
probe/arming.py), stop, and the workload's entry points. The sender's kernel and
launch windows are a room of their own (probe/windows.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from gpufootprint.probe import arming, hostinfo
from gpufootprint.probe.backend import Backend
from gpufootprint.probe.link import FileSink
from gpufootprint.probe.nativecallbacks import callbacks_kind
from gpufootprint.probe.sender import NvmlUsed, Sender
from gpufootprint.probe.settings import ProbeSettings
from gpufootprint.probe.windows import LAUNCH_WINDOW
from gpufootprint.wire import framing
from gpufootprint.wire.cupti_layout import CONCURRENT_KERNEL
from gpufootprint.wire.framing import FrameType

log = logging.getLogger(__name__)


class Probe:
    def __init__(self, settings: ProbeSettings, backend: Backend | None = None, *,
                 discover_devices: bool = True, clock_ns: Callable[[], int] = time.time_ns,
                 nvml_used: NvmlUsed | None = None) -> None:
        self.settings = settings
        self.pid = os.getpid()
        self.sender = Sender(settings, backend, self.pid, clock_ns, nvml_used)
        self._discover = discover_devices
        self.libcupti: list[str] = []
        self.versions: dict[str, Any] = {}
        self._thread: threading.Thread | None = None
        self.started = False

    # What the workload's side (probe/__init__.py, probe/takeover.py) reads of the sender's state.

    @property
    def errors(self) -> list[str]:
        return self.sender.errors

    @property
    def counters(self) -> Counter[str]:
        return self.sender.counters

    @property
    def in_gap(self) -> bool:
        return self.sender.in_gap

    # --- lifecycle ----------------------------------------------------------------

    def start(self) -> bool:
        """Arm CUPTI and start the sender. False (and the workload untouched) on any failure."""
        if self.started:
            return True
        s = self.sender
        try:
            if s._backend is None:
                from gpufootprint.probe.backend import CuptiBackend

                s._backend = CuptiBackend(self.settings.flush_nogil)
            s.cupti.backend = s._backend
            if self._discover:
                # Never CUDA's first call: the devices now only if the workload started CUDA already,
                # else the sender's heartbeat looks them up once it has (a META to the daemon).
                s.devices, s.cuda_before = hostinfo.started_cuda_devices()
                s.discover_pending = not s.devices
            # configure() is the first CUPTI call (cupti-python maps its libcupti); the
            # versions are read from that copy afterwards.
            s.own_device_bytes = s._backend.configure(self.settings.device_buffer_bytes,
                                                      self.settings.device_buffer_pool_limit)
            self.versions = s._backend.versions()
            want = {"on": True, "off": False}.get(self.settings.per_thread_buffer)
            self.versions["cupti_per_thread_buffer"] = s._backend.per_thread_buffer(want)
            self.libcupti = s._backend.libcupti_paths()
            s.cupti.arm(s.intake.requested, s.intake.completed, s.flush_s)
            if self.settings.kernels and s._backend.enable(CONCURRENT_KERNEL):
                s.cupti.kernels_always = True
            if self.settings.launch_windows and not s.cuda_before and s._backend.launch_api_records(True):
                # CUPTI writes per-API records of the launch calls only if their switches were on when
                # CUDA started (H200, 2026-12-03: switched on later they gave no record and left launches
                # about 10 % slower for good). On until the first record shows CUDA is up, then off:
                # launch windows switch them on again (probe/launches.py).
                s.windows.launch_priming = s.windows.launch_windows_ok = True
        except Exception as exc:  # noqa: BLE001 - no CUPTI, no driver: the workload runs unprobed
            s.errors.append(f"start: {exc}")
            log.warning("gpufootprint probe not started: %s", exc)
            return False
        s.hello = hostinfo.hello(self.pid, self.versions, s.devices, s.cuda_before)
        # How often this probe promises a watermark: a daemon that advances probes by its
        # own clock must wait at least this long (docs/performance.md, late records).
        s.hello["flush_mode"] = self.settings.flush_mode
        s.hello["delivery"] = "raw" if s.raw is not None else "objects"
        s.hello["callbacks"] = callbacks_kind(s.raw)
        s.hello["copies"] = "always" if s.cupti.copy_kinds else "off"
        # The highest forwarded-buffer level this probe reads (a daemon answers with at most this):
        # 2 = buffers may hold RUNTIME API records. A probe that says nothing is read as 1.
        s.hello["cupti_buffers"] = framing.CUPTI_BUFFERS_LEVEL
        # This probe opens launch windows (probe/launches.py) when asked: a daemon sends them only to a
        # probe that says so (an older one would read the request as a window of kernel records). Not
        # when CUDA was up before the probe: the switches would record nothing and slow launches.
        s.hello["launch_windows"] = 1 if s.windows.launch_windows_ok else 0
        s.hello["watermark_ms"] = (self.settings.watermark_ms if s.period else self.settings.flush_ms)
        if self.settings.tee:
            try:
                s.tee = FileSink(self.settings.tee)
            except OSError as exc:
                s.errors.append(f"tee: {exc}")
            else:
                s.tee.put(framing.encode_json(FrameType.HELLO, s.hello))
        self.started = True
        self._thread = threading.Thread(target=s._run, name="gpufootprint-probe", daemon=True)
        self._thread.start()
        return True

    def stop(self, timeout: float = 3.0) -> None:
        """Final flush, GOODBYE, close. Safe to call twice and from atexit."""
        if not self.started or self.sender._stop.is_set():
            return
        self.sender.torch_numbers.close()  # its hook stays in PyTorch's steps: no more readings there
        self.sender._stop.set()
        self.sender._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def stop_at_exit(self) -> None:
        """``stop`` from the interpreter's atexit; after a profiler session, skip the C teardown too."""
        self.stop()
        if self.settings.skip_c_teardown_after_profiler and self.counters["profiler_gaps"] > 0:
            arming.skip_c_teardown()

    # --- the workload's API --------------------------------------------------------------

    def mark(self, label: str, dev: int = 0, timeout: float = 5.0, **extra: Any) -> dict[str, Any] | None:
        """A synchronised point: flush, then a MARK frame after every earlier record.

        Call it after ``torch.cuda.synchronize()``. Blocks the caller up to ``timeout``
        (marks are for tests and traces, not hot loops). Returns the mark as sent.
        """
        if not self.started:
            return None
        body: dict[str, Any] = {"label": label, "ts": self.sender._clock_ns(), "pid": self.pid, "dev": dev, **extra}
        self.sender.queue_and_wait("mark", body, timeout)
        return body

    def status(self) -> dict[str, Any]:
        s = self.sender
        return {"started": self.started, "connected": bool(s.link and s.link.connected),
                "in_gap": s.in_gap, "flush_mode": self.settings.flush_mode, "libcupti": self.libcupti,
                "delivery": "raw" if s.raw is not None else "objects", "callbacks": callbacks_kind(s.raw),
                "sender_errors": s.counters["sender_errors"],
                # not in heartbeats (a daemon keeps a bounded number of counters): it is 0 or equal to
                # forwarded_buffers, by the level the daemon answered
                "forwarded_unchecked": s.counters["forwarded_unchecked"], **s._counter_values()}

    # --- torch.profiler hand-over (workload thread) ----------------------------------------

    def takeover_begin(self) -> None:
        s = self.sender
        if not self.started or s.in_gap:
            return
        s.queue_and_wait("gap_begin", None, 2.0)
        s.in_gap = True  # even if the sender was slow: no CUPTI calls from it now
        s._gap_started_ns = time.monotonic_ns()

    def takeover_end(self, before: list[tuple[int, int, int]], after_fn: Callable[[], list[tuple[int, int, int]]]) -> None:
        s = self.sender
        if not self.started or not s.in_gap:
            return
        try:
            assert s._backend is not None
            # Hand every buffer still inside CUPTI to the callbacks registered now (the
            # profiler's): a buffer the profiler allocated must never reach ours.
            s._backend.flush(True)
            s.cupti.arm(s.intake.requested, s.intake.completed, s.flush_s)
            if s.cupti.um_configured:
                s._backend.configure_unified_memory()
            if s.cupti.kernels_always:
                s._backend.enable(CONCURRENT_KERNEL)
            w = s.windows
            if w.kernel_window is not None and w.window_enabled not in (None, LAUNCH_WINDOW):
                w.switch_window(w.window_enabled, True)  # the window still open gets its kind back
            if w.launch_windows_ok or w.launch_priming:
                # The launch calls' switches record only if on when CUDA started (probe/launches.py): once
                # a profiler has had CUPTI (and perhaps torn it down), switching them on again would record
                # nothing and slow every launch. Off for good, and no launch window from now on.
                w.launch_windows_ok = w.launch_priming = False
                s._backend.launch_api_records(False)
                s.counters["launch_windows_ended"] += 1
        except Exception as exc:  # noqa: BLE001
            s.errors.append(f"re-arm: {exc}")
        after = after_fn()
        s.queue_and_wait("gap_end", (before, after), 2.0)
