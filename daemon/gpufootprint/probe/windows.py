"""Kernel and launch windows: what the daemon's CONTROL ``kernel_window`` switches on in CUPTI, and for how long.

A window of kernel records switches on KERNEL or CONCURRENT_KERNEL (``kernel_window_kind``), one of
launch records CUPTI's per-API switches of the launch and wait calls (probe/launches.py); at its end
what it switched on goes off again, a flush takes its records out, and a HEARTBEAT carrying the
window (id, start_ns, end_ns) tells the daemon the span its records cover. At most one window is open:
asked for the other records, the open one ends first.

The launch switches record only if they were on when CUDA started (H200, 2026-12-03), so a probe
started before CUDA *primes* them (``launch_priming``, set by ``Probe.start``) until the first CUPTI
record shows CUDA is up; a profiler's hand-back ends launch windows for good (``Probe.takeover_end``).

Sender thread only, like the sender it belongs to (probe/sender.py): the window reads and moves the
sender's backend, gap state, packer and sinks, so it holds the sender rather than copies of them.
"""

from __future__ import annotations

import time
from types import CodeType
from typing import TYPE_CHECKING, Any

from gpufootprint.probe.mainthread import MainThreadCall
from gpufootprint.records import LaunchSteps
from gpufootprint.wire import framing
from gpufootprint.wire.cupti_layout import CONCURRENT_KERNEL, KERNEL
from gpufootprint.wire.framing import FrameType

if TYPE_CHECKING:
    from gpufootprint.probe.sender import Sender

#: ``window_enabled`` of a launch window: CUPTI's per-API switches of probe/launches.py, not a kind.
LAUNCH_WINDOW = "launches"
#: While a launch window waits for its count, a forced flush at least this often (Windows.counting).
COUNT_FLUSH_S = 0.1
#: How long the sender waits for the main thread to switch a launch window's calls on or off before it
#: switches them itself (probe/mainthread.py): a step's backward or a long synchronize holds the main
#: thread in C, and a window must not stay open (every launch recorded) much longer than asked.
MAIN_SWITCH_WAIT_S = 0.25


def cupti_callback_codes() -> list[CodeType]:
    """The probe's Python that CUPTI calls on the program's threads (buffer callbacks), perhaps holding
    its lock: no launch switch is made on the main thread from inside these (probe/mainthread.py)."""
    from gpufootprint.probe.intake import Intake
    from gpufootprint.probe.rawcallbacks import RawDelivery

    return [RawDelivery._requested.__code__, RawDelivery._completed.__code__, Intake.requested.__code__,
            Intake.completed.__code__, Intake.raw_completed.__code__]


class Windows:
    def __init__(self, sender: Sender, kernel_window_kind: str) -> None:
        self.sender = sender
        self.kernel_window: dict[str, Any] | None = None
        self.kernel_window_end = 0.0
        self.window_kind = KERNEL if kernel_window_kind == "serial" else CONCURRENT_KERNEL
        # What the open window switched on, if anything: a CUPTI kind, or LAUNCH_WINDOW (the per-API switches
        # of probe/launches.py).
        self.window_enabled: int | str | None = None
        self.launch_priming = False  # the launch calls' per-API switches are on until CUDA is up (core.start)
        self.launch_windows_ok = False  # they were on when CUDA started: launch windows record (core.start)
        # The open launch window closes once the packer has counted this many whole steps or calls (0: no
        # bound); counted_id: the last window closed that way, whose renewals open nothing.
        self.steps_wanted = 0
        self.records_wanted = 0
        self.counted_id = 0
        self.counted_from = 0.0  # monotonic time before which the count does not close it (min_ms)
        # A launch window's switches go through the program's main thread (probe/mainthread.py): switched
        # from the sender's thread they left the program's launches slower for good.
        self.main_thread = MainThreadCall(cupti_callback_codes()) if sender.settings.launch_switch_on_main else None

    def open_kernel_window(self, ms: int, wid: int, records: str = "kernels", steps: int = 0,
                           max_records: int = 0, min_ms: int = 0) -> None:
        """A window of kernel records (``records="kernels"``: KERNEL or CONCURRENT_KERNEL, whichever
        ``kernel_window_kind`` says) or of launch records (``"launches"``: probe/launches.py).

        A launch window with ``steps`` (or ``max_records``) closes as soon as the probe has packed
        that many whole steps (or calls), whatever its lease says, once it has been open ``min_ms``:
        the daemon reads them only a watermark later, and every launch costs the workload while the
        switches are on. Its later lease renewals and its close (the same id) then open nothing."""
        s = self.sender
        ms = max(1, min(ms, 60_000))
        if self.kernel_window is not None and self.kernel_window.get("records", "kernels") != records:
            self.close_kernel_window()  # the other records were asked for: that window ends here
        if self.kernel_window is None and records == "launches" and wid and wid == self.counted_id:
            return  # already closed here at its steps: a renewal or close sent before the daemon read them
        if self.window_enabled == LAUNCH_WINDOW and not self.launch_windows_ok:
            # A profiler had CUPTI since it opened: its switches are off for good and it records nothing.
            self.close_kernel_window()
            s.counters["kernel_windows_refused"] += 1
            return
        if self.kernel_window is None:
            kind: int | str | None
            if records == "launches":
                if not self.launch_windows_ok:
                    s.counters["kernel_windows_refused"] += 1  # CUDA was up before the probe (core.start)
                    return
                kind = LAUNCH_WINDOW
            else:
                # With kernels always on the records already flow: the window enables nothing more (a
                # serial KERNEL beside CONCURRENT_KERNEL would serialise every kernel from then on).
                kind = None if s.cupti.kernels_always else self.window_kind
            if s.in_gap or s._backend is None or (kind is not None and not self.switch_window(kind, True)):
                s.counters["kernel_windows_refused"] += 1
                return
            self.window_enabled = kind
            self.kernel_window = {"id": wid, "start_ns": s._clock_ns(), "records": records}
            if kind == LAUNCH_WINDOW:
                s.packer.launch_span = (self.kernel_window["start_ns"], None)
                s.packer.launch_steps = LaunchSteps() if steps or max_records else None
                self.counted_from = time.monotonic() + max(0, min(min_ms, 60_000)) / 1000
            s.counters["launch_windows" if kind == LAUNCH_WINDOW else "kernel_windows"] += 1
        else:
            self.kernel_window["id"] = wid
        if self.window_enabled == LAUNCH_WINDOW:
            self.steps_wanted, self.records_wanted = steps, max_records
        self.kernel_window_end = time.monotonic() + ms / 1000
        s._wake.set()

    def counting(self) -> bool:
        """Whether an open launch window waits for a count of steps or calls, with only host-side records
        on. CUPTI's flush period hands over only full buffers, so a loop of few launches a step would
        show them only at the next watermark's forced flush (1 s): the sender forces a flush every
        ``COUNT_FLUSH_S`` meanwhile. Not while kernel or copy records are on (a forced flush writes the
        ones still running without times), nor once a profiler has had CUPTI (the switches are off for
        good: nothing will be counted)."""
        s = self.sender
        return (self.window_enabled == LAUNCH_WINDOW and bool(self.steps_wanted or self.records_wanted)
                and self.launch_windows_ok and not s.in_gap and not s.cupti.kernels_always and not s.cupti.copy_kinds)

    def counted_enough(self) -> bool:
        """Whether the open launch window holds the steps (or calls) the daemon asked for, and has been
        open for the shortest window it asked for."""
        counted = self.sender.packer.launch_steps
        if counted is None or self.window_enabled != LAUNCH_WINDOW or time.monotonic() < self.counted_from:
            return False
        return bool((self.steps_wanted and counted.steps >= self.steps_wanted)
                    or (self.records_wanted and counted.records >= self.records_wanted))

    def records_seen(self) -> bool:
        """Whether any CUPTI record came in: CUDA is up."""
        s = self.sender
        return s.intake.records_out > 0 or s.counters["raw_records"] > 0

    def end_launch_priming(self) -> None:
        s = self.sender
        self.launch_priming = False
        if self.window_enabled != LAUNCH_WINDOW and not s.in_gap and s._backend is not None:
            s._backend.launch_api_records(False)

    def switch_window(self, kind: int | str, on: bool) -> bool:
        backend = self.sender._backend
        assert backend is not None
        if kind == LAUNCH_WINDOW:
            main = self.main_thread
            if main is None:
                return backend.launch_api_records(on)
            fallbacks = main.fallbacks
            ok = bool(main.run(lambda: backend.launch_api_records(on), MAIN_SWITCH_WAIT_S))
            self.sender.counters["launch_switches_fallback" if main.fallbacks > fallbacks
                                 else "launch_switches_main"] += 1
            return ok
        assert isinstance(kind, int)
        return backend.enable(kind) if on else backend.disable(kind)

    def close_kernel_window(self) -> None:
        s = self.sender
        window, self.kernel_window = self.kernel_window, None
        if window is None:
            return
        counted_enough = self.counted_enough()
        kind, self.window_enabled = self.window_enabled, None
        window["end_ns"] = s._clock_ns()
        if counted_enough:
            window["closed"] = "counted"  # by its steps or calls here, not by its lease
            self.counted_id = int(window["id"])
            s.counters["launch_windows_counted"] += 1
        if kind == LAUNCH_WINDOW:
            # Calls until now are the window's; switching off takes CUPTI a while (calls made meanwhile
            # are recorded but dropped: the window is exactly [start_ns, end_ns]).
            s.packer.launch_span = (window["start_ns"], window["end_ns"])
        if not s.in_gap and s._backend is not None and kind is not None:
            self.switch_window(kind, False)  # exactly what the window switched on
        s._flush_and_drain()
        s.packer.launch_span = None  # the window's calls are in
        s.packer.launch_steps = None
        self.steps_wanted = self.records_wanted = 0
        body = s._heartbeat()
        body["kernel_window"] = window
        s._emit(framing.encode_json(FrameType.HEARTBEAT, body), must=True)
