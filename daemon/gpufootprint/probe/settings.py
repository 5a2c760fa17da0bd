"""Probe settings: read from the environment inside the workload.

The daemon's configuration file does not reach a workload, so the probe reads
``GPUFOOTPRINT_PROBE_*`` variables (``gpufootprint run`` sets them from the
``probe:`` section of the daemon's configuration). Bad values fall back to the
default with a warning: the probe must never stop a workload from starting.

``ProbeSettings`` is the options the daemon may set (``ProbeOptions``, wire/probe_options.py,
shared with the daemon's configuration) plus what only a probe knows (where it sends, test and
diagnostic switches).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from gpufootprint.wire.probe_options import (
    COPY_KINDS,
    COPY_MODES,
    DEFAULT_SOCKET,
    KERNEL_WINDOW_KINDS,
    PER_THREAD_BUFFER,
    ProbeOptions,
    _opt,
    copy_kind_names,
    copy_mode,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProbeSettings(ProbeOptions):
    """Every setting of a probe: the daemon's ``ProbeOptions`` and what only the probe sets."""

    socket: str = DEFAULT_SOCKET  # daemon socket ("" = none)
    tee: str = ""  # also write every frame to this file (gzip when it ends in .gz)
    capacity: int = 4096  # records per packing array
    kernel_window_kind: str = _opt("concurrent", choices=KERNEL_WINDOW_KINDS)  # what a sampled window switches on
    # Launch windows (probe/launches.py): the launch calls' per-API switches on while CUDA starts, so the
    # daemon's launch windows can record; 0: none (the daemon then sends this probe none)
    launch_windows: bool = True
    # A launch window's switches made on the program's main thread (probe/mainthread.py), the sender's
    # own thread only when the main thread does not come within 0.25 s; off: always the sender's (before
    # 2026-12-06; left the program's launches slower for good, more with every window)
    launch_switch_on_main: bool = True
    # A heartbeat due within half its period goes out at a forced flush's wake, and a forced flush due within
    # half its period is made at a heartbeat's wake: each wake takes the GIL from the workload once, and
    # apart (a mark or a window's flushes move the flushes off the heartbeats) they woke about twice a second
    coalesce_wakes: bool = True
    copy_kinds: str = ",".join(COPY_KINDS)  # which of ``copies`` (comma-separated)
    # Experimental, off: flush through ctypes (GIL released) instead of cupti-python's
    # wrapper. On the H200 test machine it reached another libcupti copy (records lost,
    # crash at exit); now used only when exactly one libcupti is mapped. See docs/probe.md.
    flush_nogil: bool = False
    # CUPTI_ACTIVITY_ATTR_PER_THREAD_BUFFER: "cupti" leaves CUPTI's default, "on"/"off" set it
    # (a diagnostic: neither changed the lost records that driver_hooks repairs).
    per_thread_buffer: str = _opt("cupti", choices=PER_THREAD_BUFFER)
    # Raw delivery's buffer callbacks in C (probe/nativecallbacks.py), so CUPTI's threads never take the GIL;
    # off, or where the library was not built: ctypes callbacks, which do (the bench's lever, a diagnostic)
    native_callbacks: bool = True
    # The sender's walk of a CUPTI buffer of mixed kinds in C (the same library); off: the Python walk
    native_walk: bool = True
    # The sender's read of a buffer it forwards in one C call of the same library (the walk, the MEMORY2 structs
    # copied into its table's queue, the API records' return values looked at); off: walked in C, the rest in
    # numpy (what the probe did before 2026-12-07 evening). Needs native_walk.
    native_read: bool = True
    # The probe table's pairing of a watermark's MEMORY2 structs by address in one pass of C (the same library,
    # the GIL let go past PAIR_LETS_GIL_GO structs); off: numpy's sort by address and time, holding the GIL
    native_pair: bool = True
    # The sender's wait for its socket's room, once the socket took what it would at once, in one C call of the
    # same library that lets the GIL go for the whole wait; off: Python's poll, which let it go and won it back
    # at each wait for room (about 200 KiB a wait behind busy threads; before 2026-12-07 night)
    native_pump: bool = True
    # CUPTI's buffers read, framed and queued for the daemon by a thread of C on the buffer pool (probe/forwarder.py)
    # while nothing of the sender's own needs them; the sender then wakes for their frames in bulk, not for each
    # buffer. Off by default until its cost is measured on a GPU (docs/performance.md): each buffer woke the sender
    # and was read holding the GIL, as before. Needs native_callbacks and native_read.
    native_forward: bool = False
    raw_verify_walk: bool = False  # tests: walk every raw buffer twice (ours and CUPTI's) and count mismatches

    def __post_init__(self) -> None:
        # Booleans too: copies=True/False, "1"/"0" in the environment (the setting was a bool before).
        mode = copy_mode(str(self.copies))
        object.__setattr__(self, "copies", mode if mode in COPY_MODES else type(self).copies)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> ProbeSettings:
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get("GPUFOOTPRINT_PROBE_" + f.name.upper())
            if raw is None:
                continue
            default = f.default
            try:
                if isinstance(default, bool):
                    values[f.name] = raw.strip().lower() in ("1", "true", "yes", "on")
                elif isinstance(default, int):
                    values[f.name] = int(raw)
                    if values[f.name] < MINIMUMS.get(f.name, 0):
                        raise ValueError("below the minimum")
                else:
                    values[f.name] = raw
            except ValueError:
                log.warning("GPUFOOTPRINT_PROBE_%s=%r is not valid; using %r", f.name.upper(), raw, default)
                values.pop(f.name, None)
        values.update({k: v for k, v in overrides.items() if v is not None})
        for name, choices in CHOICES.items():
            value = values.get(name)
            if value is not None and value not in choices:
                log.warning("GPUFOOTPRINT_PROBE_%s=%r is not one of %s; using %r", name.upper(), value, choices,
                            getattr(cls, name))
                values.pop(name)
        copies = values.get("copies")
        if copies is not None and copy_mode(copies) not in COPY_MODES:
            log.warning("GPUFOOTPRINT_PROBE_COPIES=%r is not one of %s; using %r", copies, COPY_MODES, cls.copies)
            values.pop("copies")
        kinds = values.get("copy_kinds")
        if kinds is not None and not set(copy_kind_names(kinds)) <= set(COPY_KINDS):
            log.warning("GPUFOOTPRINT_PROBE_COPY_KINDS=%r: names must be among %s; using %r", kinds,
                        COPY_KINDS, cls.copy_kinds)
            values.pop("copy_kinds")
        return cls(**values)


# Settings that must be one of a few names (``copies`` also takes booleans: checked on its own).
CHOICES = {f.name: f.metadata["choices"] for f in fields(ProbeSettings)
           if f.metadata.get("choices") and f.name != "copies"}
# Smallest values that work: the probe refuses less (the daemon's configuration too, with ``lo``).
MINIMUMS = {f.name: int(f.metadata["lo"]) for f in fields(ProbeSettings) if f.metadata.get("floor")}
