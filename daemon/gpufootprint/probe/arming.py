"""What the probe switches on in CUPTI, and how it switches it all off again.

Arming registers the buffer callbacks (raw ctypes ones where the backend can, else
cupti-python's), enables the activity kinds, sets the driver-API hooks and the OOM
records, and CUPTI's delivery period; quiescing undoes each, before a torch.profiler
session takes CUPTI and at exit. Every refusal is counted, never raised: a probe
with fewer switches still runs. Sender thread (and ``start``) only.
"""

from __future__ import annotations

import ctypes
import logging
from collections import Counter
from collections.abc import Callable

from gpufootprint.probe.backend import ALWAYS_ON, FOOTPRINT_ONLY, Backend, Completed, Requested, copy_kinds
from gpufootprint.probe.nativecallbacks import Delivery, NativeDelivery
from gpufootprint.probe.rawcallbacks import RawDelivery
from gpufootprint.probe.settings import ProbeSettings
from gpufootprint.probe.wakeup import Wakeup
from gpufootprint.wire.cupti_layout import CONCURRENT_KERNEL, KERNEL, UNIFIED_MEMORY_COUNTER

log = logging.getLogger(__name__)


class CuptiArming:
    def __init__(self, settings: ProbeSettings, counters: Counter[str],
                 on_raw_buffer: Callable[[int, int], None], wakeup: Wakeup | None = None) -> None:
        self.settings = settings
        self.counters = counters
        self._wakeup = wakeup  # the sender's: the C callbacks write to its fd
        self._native: NativeDelivery | None = None  # the C callbacks' pool, once made
        self.backend: Backend | None = None  # set by Probe.start (CUPTI is loaded there, not before)
        self._on_raw_buffer = on_raw_buffer
        # Raw delivery (settings.delivery == "raw" and the backend can register it):
        # CUPTI's buffers reach the sender as bytes. None: cupti-python's objects.
        self.raw: Delivery | None = None
        self._raw_tried = False
        # "period": CUPTI's worker delivers full buffers every flush interval; forced flushes
        # (which stall the workload while they run) only every watermark interval.
        self.period = settings.flush_mode == "period"
        # Copies and memsets (settings.copies): off by default. Enabled, they cost 3-9% on
        # launch-bound steps even when no copy happens, and enabling them only in short windows
        # cost as much (H200, docs/performance.md runs 6-8).
        self.copy_kinds = copy_kinds(settings.copy_kinds) if settings.copies == "always" else ()
        self.kinds = FOOTPRINT_ONLY + self.copy_kinds
        self.hooks_missing = False  # the driver-API hooks were refused; retried every heartbeat
        self.kernels_always = False  # settings.kernels, and CUPTI took it
        # UNIFIED_MEMORY_COUNTER is configured when the process first allocates managed
        # memory, not at start: without managed memory it has nothing to count, and it is one
        # CUPTI state fewer in the many processes that never use any (docs/probe.md).
        self.um_wanted = settings.unified_memory
        self.um_configured = False

    def arm(self, requested: Requested, completed: Completed, flush_s: float) -> None:
        assert self.backend is not None
        if not self._arm_raw():
            self.backend.register(requested, completed)
        for kind in self.kinds:
            if not self.backend.enable(kind):
                self.counters[f"kind_unavailable_{kind}"] += 1
        self.hooks(True)
        self.oom_records(True)
        if self.period:
            self.set_period(flush_s)

    def quiesce(self) -> None:
        """Our kinds off and CUPTI's periodic delivery back to its default (sender thread)."""
        assert self.backend is not None
        for kind in (*ALWAYS_ON, CONCURRENT_KERNEL, KERNEL, UNIFIED_MEMORY_COUNTER):
            self.backend.disable(kind)
        self.hooks(False)
        self.oom_records(False)
        if self.period:
            self.set_period(0)

    def oom_records(self, on: bool) -> None:
        if self.backend is not None and self.settings.oom_records \
                and not self.backend.oom_api_records(on, self.settings.oom_records_async) and on:
            self.counters["oom_records_unavailable"] += 1

    def hooks(self, on: bool) -> None:
        """The driver-API hooks that keep CUPTI recording mappings on every thread (wire/probe_options.py says how)."""
        if self.backend is None or not self.settings.driver_hooks:
            return
        hooks = (self.backend.driver_api_records if self.settings.driver_hooks_via == "activity"
                 else self.backend.driver_hooks)
        if hooks(on):
            self.counters["driver_hooks"] = 1 if on else 0
            self.hooks_missing = False
        elif on:
            # Refused (subscriber: another tool or a profiler holds CUPTI's one place; activity:
            # CUPTI refused the switch): asked again every heartbeat.
            self.counters["driver_hooks"] = 0
            if self.hooks_missing:
                return
            self.hooks_missing = True
            self.counters["driver_hooks_unavailable"] += 1
            if self.counters["driver_hooks_unavailable"] == 1:
                log.warning("gpufootprint probe: no CUPTI driver-API hooks (%s); mappings made on threads "
                            "other than the main one may be missed (docs/probe.md)", self.backend_reason())

    def backend_reason(self) -> str:
        """The backend's latest error line, for a one-line warning."""
        errors = self.backend.errors if self.backend is not None else ()
        return str(errors[-1]) if errors else "no reason given"

    def _arm_raw(self) -> bool:
        """Register the raw callbacks; False (cupti-python's objects instead) where that cannot be done."""
        if self.settings.delivery != "raw" or self.backend is None:
            return False
        if self.raw is None:
            if self._raw_tried:
                return False
            self._raw_tried = True
            self.raw = self._new_raw()
        if self.backend.register_raw(self.raw):
            return True
        self.counters["raw_delivery_unavailable"] += 1
        if self.counters["raw_delivery_unavailable"] == 1:
            log.warning("gpufootprint probe: raw delivery unavailable (%s); using cupti-python's record objects",
                        self.backend_reason())
        if self.counters["raw_buffers"] == 0:
            self.raw = None  # never worked here: objects from now on
        return False

    def _new_raw(self) -> Delivery:
        """The C callbacks where the library loads (CUPTI's threads never take the GIL), else the ctypes thunks."""
        s = self.settings
        if s.native_callbacks:
            wake_fd = self._wakeup.fd if self._wakeup is not None else None
            why = "no eventfd for the sender's wake-up"
            if wake_fd is not None:
                try:
                    native = NativeDelivery(s.cupti_buffer_bytes, s.raw_buffers, wake_fd)
                    assert self._wakeup is not None
                    self._wakeup.pinned = True  # C writes to its fd until retire_wakeup
                    self._native = native  # retired at the end even if raw delivery is given up meanwhile
                    return native
                except (OSError, MemoryError) as exc:
                    why = str(exc)
            self.counters["native_callbacks_unavailable"] += 1
            log.warning("gpufootprint probe: C buffer callbacks unavailable (%s); using ctypes callbacks, which "
                        "take the GIL on CUPTI's threads (docs/probe.md)", why)
        return RawDelivery(s.cupti_buffer_bytes, s.raw_buffers, self._on_raw_buffer)

    def retire_wakeup(self) -> None:
        """The sender has ended: the C callbacks stop writing to its wake-up, which then closes."""
        if self._native is not None:
            self._native.retire()
        if self._wakeup is not None:
            self._wakeup.close()

    def configure_unified_memory(self, in_gap: bool) -> None:
        """The first managed allocation was seen: unified-memory counters from now on (sender thread)."""
        if in_gap or self.backend is None:
            return  # the profiler holds CUPTI; the hand-back configures them
        self.um_wanted = False
        if self.backend.configure_unified_memory():
            self.um_configured = True
            self.counters["unified_memory_configured"] += 1
        else:
            self.counters["unified_memory_unsupported"] += 1

    def set_period(self, seconds: float) -> None:
        # int() stays: before NumPy 2, round() of a numpy float is a float.
        if self.backend is not None and not self.backend.flush_period(
                int(round(seconds * 1000))):  # noqa: RUF046
            self.counters["flush_period_failures"] += 1


def skip_c_teardown() -> bool:
    """From now on, C's exit() ends the process at once, with its status: nothing registered before runs.

    glibc calls an ``on_exit`` handler as ``handler(status, arg)`` and runs handlers newest
    first; registering libc's own ``_exit`` therefore ends the process with exit()'s status
    before the static destructors and atexit handlers of the libraries loaded earlier (CUPTI,
    Kineto, the CUDA runtime) run. Python has finalised by then (its buffers are flushed);
    C stdio buffers are flushed here. False where there is no ``on_exit`` (not glibc).
    """
    try:
        libc = ctypes.CDLL(None)
        on_exit, fflush, exit_now = libc.on_exit, libc.fflush, libc._exit
    except (OSError, AttributeError):
        return False
    on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    on_exit.restype = ctypes.c_int
    fflush.argtypes = [ctypes.c_void_p]
    fflush(None)
    return int(on_exit(ctypes.cast(exit_now, ctypes.c_void_p), None)) == 0
