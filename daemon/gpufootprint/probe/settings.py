"""Probe settings: read from the environment inside the workload.

The daemon's configuration file does not reach a workload, so the probe reads
``GPUFOOTPRINT_PROBE_*`` variables (``gpufootprint run`` sets them from the
``probe:`` section of the daemon's configuration). Bad values fall back to the
default with a warning: the probe must never stop a workload from starting.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/run/gpufootprint/probe.sock"
FLUSH_MODES = ("forced", "period")
COPY_KINDS = ("memcpy", "memcpy2", "memset")  # names for ``copy_kinds``
COPY_MODES = ("off", "always")
PER_THREAD_BUFFER = ("cupti", "on", "off")
HOOKS_VIA = ("subscriber", "activity")  # how ``driver_hooks`` keeps CUPTI recording mappings
DELIVERIES = ("raw", "objects")
# Which CUPTI kind a kernel window enables: CONCURRENT_KERNEL (CUPTI instruments the kernels' code
# to time them) or the serial KERNEL kind (kernels run one at a time while it is on, uninstrumented).
KERNEL_WINDOW_KINDS = ("concurrent", "serial")
# Settings that must be one of a few names (``copies`` also takes booleans: checked on its own).
CHOICES = {"flush_mode": FLUSH_MODES, "delivery": DELIVERIES, "per_thread_buffer": PER_THREAD_BUFFER,
           "driver_hooks_via": HOOKS_VIA, "kernel_window_kind": KERNEL_WINDOW_KINDS}
# Smallest values that work (the daemon's config refuses less, with the same bounds):
# a socket buffer under one full packing array's frame (4096 x 80 bytes) would drop every batch.
MINIMUMS = {"buffer_bytes": 1 << 20, "cupti_buffer_bytes": 1 << 12, "raw_buffers": 4}


@dataclass(frozen=True)
class ProbeSettings:
    socket: str = DEFAULT_SOCKET  # daemon socket ("" = none)
    tee: str = ""  # also write every frame to this file (gzip when it ends in .gz)
    # "forced": a forced CUPTI flush (and watermark) every flush_ms, from the sender thread.
    # "period": CUPTI's own worker thread hands over full buffers every flush_ms
    # (cuptiActivityFlushPeriod); a forced flush and watermark only every watermark_ms,
    # and for marks, resyncs and the profiler hand-over. See docs/performance.md.
    flush_mode: str = "period"  # measured on the H200 2026-12-02: docs/performance.md
    flush_ms: int = 100  # flush cadence (the sampler may change it): forced, or CUPTI's period
    watermark_ms: int = 1000  # "period" mode: forced flush and watermark cadence
    heartbeat_ms: int = 1000
    buffer_bytes: int = 16 << 20  # bytes of frames waiting for the socket before records are dropped
    cupti_buffer_bytes: int = 64 << 10  # host buffer handed to CUPTI per request (small: full sooner)
    device_buffer_bytes: int = 4 << 20  # CUPTI_ACTIVITY_ATTR_DEVICE_BUFFER_SIZE (0: CUPTI's defaults, untouched)
    device_buffer_pool_limit: int = 2  # CUPTI_ACTIVITY_ATTR_DEVICE_BUFFER_POOL_LIMIT
    kernels: bool = False  # CONCURRENT_KERNEL always on (recording traces); else only in sampled windows
    kernel_window_kind: str = "concurrent"  # KERNEL_WINDOW_KINDS: what a sampled window switches on
    unified_memory: bool = True  # configure UNIFIED_MEMORY_COUNTER at the first managed allocation (core.py says why)
    torch_hook: bool = True  # watch torch.profiler taking CUPTI away
    # After a torch.profiler session under the probe, end the process with its exit status as
    # soon as C's exit handlers start, skipping the C-level teardown in which such processes
    # aborted 3-6 times in 10 on the H200 (docs/probe.md, "exit abort").
    skip_c_teardown_after_profiler: bool = True
    untracked_ms: int = 2000  # NVML poll for the untracked kind (only when CUDA started before the probe)
    reconnect_max_ms: int = 5000  # backoff ceiling
    capacity: int = 4096  # records per packing array
    bulk_pack: bool = True  # read MEMORY2/MEMCPY/MEMSET as raw structs (checked; falls back to attributes)
    # MEMCPY, MEMCPY2 and MEMSET records (not needed for the footprint itself): "off" or
    # "always". Enabled, they cost 3-9% on launch-bound steps even when no copy happens
    # (CUPTI's launch path; H200, docs/performance.md runs 6-8), so they are opt-in.
    copies: str = "off"
    copy_kinds: str = ",".join(COPY_KINDS)  # which of them (comma-separated)
    # Experimental, off: flush through ctypes (GIL released) instead of cupti-python's
    # wrapper. On the H200 test machine it reached another libcupti copy (records lost,
    # crash at exit); now used only when exactly one libcupti is mapped. See docs/probe.md.
    flush_nogil: bool = False
    # "raw": CUPTI's buffers go to the sender thread as bytes (ctypes callbacks on the
    # one mapped libcupti; read in bulk there). "objects": cupti-python's callbacks,
    # which build a Python object per record on CUPTI's thread. "raw" falls back to
    # "objects" where it cannot register (two libcupti copies). docs/performance.md.
    delivery: str = "raw"
    raw_buffers: int = 256  # raw delivery: CUPTI host buffers at most; past it CUPTI drops (and counts) records
    # Without driver-API hooks on cuMemMap/cuMemUnmap, CUPTI 13.0 on the H200 lost the MEMORY2
    # records of virtual-memory mappings made on threads other than the main one (expandable
    # segments). docs/probe.md, "Lost records". How the hooks are set (driver_hooks_via):
    # "activity": cuptiActivityEnableDriverApi for the two calls (no subscriber: a profiler or
    # another tool keeps CUPTI's one subscriber place; CUPTI also writes a DRIVER record per
    # call, counted and not sent). "subscriber": cuptiSubscribe with a C no-op callback (takes
    # that place; handed to torch.profiler for its session). Both kept every mapping on the H200.
    driver_hooks: bool = True
    driver_hooks_via: str = "activity"
    # CUPTI_ACTIVITY_ATTR_PER_THREAD_BUFFER: "cupti" leaves CUPTI's default, "on"/"off" set it
    # (a diagnostic: neither changed the lost records above).
    per_thread_buffer: str = "cupti"
    # Raw delivery: hand CUPTI's buffers of memory and pool records to the daemon unread, when the
    # daemon says it reads them (it does since it sends the "cupti_buffers" control); the probe keeps
    # only the MEMORY2 structs it needs for its own table. Off: every buffer is converted here.
    forward_buffers: bool = True
    # CUPTI's per-API activity records for the driver's and the runtime's allocation entry points
    # (cuMemAlloc*, cuMemCreate, cudaMalloc*, cudaMallocAsync/FromPool, managed and host
    # allocations): a call that returns out-of-memory becomes an OOM MARK for the daemon's
    # capture (probe/oom.py), whatever the framework (docs/oom.md).
    oom_records: bool = True
    # The stream-ordered entry points too (cudaMallocAsync, cuMemAllocFromPoolAsync and their
    # variants): a record per allocation under a stream-ordered allocator (probe/oom.py), so opt-in.
    oom_records_async: bool = False
    # PyTorch's out-of-memory observer (once torch has initialised CUDA): requested bytes and the
    # allocator's figures; on the H200 it reported every PyTorch OOM.
    oom_torch_observer: bool = True
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

    def to_env(self) -> dict[str, str]:
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out["GPUFOOTPRINT_PROBE_" + f.name.upper()] = ("1" if v else "0") if isinstance(v, bool) else str(v)
        return out


_COPY_MODE_ALIASES = {"true": "always", "1": "always", "yes": "always", "on": "always",
                      "false": "off", "0": "off", "no": "off"}


def copy_mode(value: str) -> str:
    """A ``copies`` value as one of COPY_MODES where it is one ("1", "false", "True" ... included)."""
    v = value.strip().lower()
    return _COPY_MODE_ALIASES.get(v, v)


def copy_kind_names(value: str) -> list[str]:
    """``"memcpy, memset"`` -> ``["memcpy", "memset"]`` (empty items dropped)."""
    return [v.strip().lower() for v in value.split(",") if v.strip()]
