"""The probe's options: the settings the daemon's configuration hands to probes.

They cross from the daemon's side to the workload's as ``GPUFOOTPRINT_PROBE_*`` variables
(``gpufootprint run`` sets them from the ``probe:`` section of the daemon's configuration;
``to_env`` writes them, ``probe/settings.py`` reads them), so, like the frames, they live
here between the two: the daemon's configuration (config.py) and the probe both import
this module, and neither imports the other.

One schema for both sides: ``ProbeOptions`` holds every setting the daemon's
configuration may set (name, type, default, bounds, choices, doc); the daemon's
``ProbeConfig`` is that class, and the probe's ``ProbeSettings`` adds what only a
probe knows (where it sends, test and diagnostic switches). The daemon's configuration
refuses a value outside ``lo``/``hi`` with an error; the probe itself refuses
only what cannot work (``floor``) and otherwise trusts its environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

DEFAULT_SOCKET = "/run/gpufootprint/probe.sock"
FLUSH_MODES = ("period", "forced")
COPY_KINDS = ("memcpy", "memcpy2", "memset")  # names for ``copy_kinds``
COPY_MODES = ("off", "always")
PER_THREAD_BUFFER = ("cupti", "on", "off")
HOOKS_VIA = ("subscriber", "activity")  # how ``driver_hooks`` keeps CUPTI recording mappings
DELIVERIES = ("raw", "objects")
# Which CUPTI kind a kernel window enables: CONCURRENT_KERNEL (CUPTI instruments the kernels' code
# to time them) or the serial KERNEL kind (kernels run one at a time while it is on, uninstrumented).
KERNEL_WINDOW_KINDS = ("concurrent", "serial")


def _opt(default: Any, *, lo: float | None = None, hi: float | None = None, choices: tuple[str, ...] | None = None,
         floor: bool = False, doc: str = "") -> Any:
    """A setting: the metadata keys are those of config.py's ``_spec`` (the daemon validates with them);
    ``floor``: ``lo`` is also the smallest value that works, and the probe refuses less."""
    return field(default=default, metadata={"lo": lo, "hi": hi, "choices": choices, "doc": doc, "floor": floor})


@dataclass(frozen=True)
class ProbeOptions:
    """The settings the daemon's configuration hands to probes (its ``probe:`` section)."""

    # "forced": a forced CUPTI flush (and watermark) every flush_ms, from the sender thread.
    # "period": CUPTI's own worker thread hands over full buffers every flush_ms
    # (cuptiActivityFlushPeriod); a forced flush and watermark only every watermark_ms,
    # and for marks, resyncs and the profiler hand-over. See docs/performance.md.
    # Measured on the H200 2026-12-02: docs/performance.md.
    flush_mode: str = _opt("period", choices=FLUSH_MODES,
                           doc="period: CUPTI's own thread delivers buffers every flush_ms, forced flush only every "
                               "watermark_ms; forced: a forced flush every flush_ms (docs/performance.md)")
    flush_ms: int = _opt(100, lo=1, hi=1000, doc="flush cadence (the sampler may change it)")
    watermark_ms: int = _opt(1000, lo=10, hi=60_000, doc="period mode: forced flush and WATERMARK cadence")
    heartbeat_ms: int = _opt(1000, lo=10, hi=60_000, doc="probe counters to the daemon")
    # Smallest values that work (floor): a socket buffer under one full packing array's frame
    # (4096 x 80 bytes) would drop every batch.
    buffer_bytes: int = _opt(16 << 20, lo=1 << 20, hi=1 << 30, floor=True,
                             doc="frames waiting for the socket before records are dropped (at least 1 MiB: "
                                 "one packing array's frame is up to 4096 x 80 bytes)")
    cupti_buffer_bytes: int = _opt(64 << 10, lo=1 << 12, hi=1 << 28, floor=True,
                                   doc="host buffer per CUPTI request (small: buffers complete sooner)")
    # The probe also takes 0: CUPTI's defaults, untouched (the daemon's configuration does not offer it).
    device_buffer_bytes: int = _opt(4 << 20, lo=1 << 16, hi=1 << 28, doc="CUPTI device buffer size")
    device_buffer_pool_limit: int = _opt(2, lo=1, hi=64, doc="CUPTI device buffers at most")
    kernels: bool = _opt(False, doc="CONCURRENT_KERNEL always on (else only in sampled windows)")
    # Configured at the first managed allocation, not at start: probe/arming.py says why.
    unified_memory: bool = _opt(True, doc="configure UNIFIED_MEMORY_COUNTER at the first managed allocation")
    torch_hook: bool = _opt(True, doc="give CUPTI to torch.profiler and take it back")
    # Skips the C-level teardown in which such processes aborted 3-6 times in 10 on the H200.
    skip_c_teardown_after_profiler: bool = _opt(True, doc="after a torch.profiler session, end the process with its "
                                                          "exit status before the C-level teardown (docs/probe.md)")
    # Only polled when CUDA started before the probe.
    untracked_ms: int = _opt(2000, lo=100, hi=600_000, doc="NVML poll for the untracked kind")
    reconnect_max_ms: int = _opt(5000, lo=10, hi=600_000, doc="reconnect backoff ceiling")
    bulk_pack: bool = _opt(True, doc="read MEMORY2/MEMCPY/MEMSET as raw structs (checked; else attributes)")
    # MEMCPY, MEMCPY2 and MEMSET records (not needed for the footprint itself): "off" or
    # "always". Enabled, they cost 3-9% on launch-bound steps even when no copy happens
    # (CUPTI's launch path; H200, docs/performance.md runs 6-8), so they are opt-in.
    copies: str = _opt("off", choices=COPY_MODES,
                       doc="MEMCPY, MEMCPY2 and MEMSET records, for the copy metrics and frames: off, or always "
                           "(costs 3-9% on launch-bound steps, docs/performance.md)")
    # "raw": CUPTI's buffers go to the sender thread as bytes (ctypes callbacks on the
    # one mapped libcupti; read in bulk there). "objects": cupti-python's callbacks,
    # which build a Python object per record on CUPTI's thread. "raw" falls back to
    # "objects" where it cannot register (two libcupti copies). docs/performance.md.
    delivery: str = _opt("raw", choices=DELIVERIES,
                         doc="raw: CUPTI's buffers read as bytes on the probe's sender thread; objects: "
                             "cupti-python's per-record objects on CUPTI's thread (docs/performance.md)")
    # Without driver-API hooks on cuMemMap/cuMemUnmap, CUPTI 13.0 on the H200 lost the MEMORY2
    # records of virtual-memory mappings made on threads other than the main one (expandable
    # segments). docs/probe.md, "Lost records". How the hooks are set (driver_hooks_via):
    # "activity": cuptiActivityEnableDriverApi for the two calls (no subscriber: a profiler or
    # another tool keeps CUPTI's one subscriber place; CUPTI also writes a DRIVER record per
    # call, counted and not sent). "subscriber": cuptiSubscribe with a C no-op callback (takes
    # that place; handed to torch.profiler for its session). Both kept every mapping on the H200.
    driver_hooks: bool = _opt(True, doc="driver-API hooks on cuMemMap/cuMemUnmap: without them CUPTI lost the records "
                                        "of mappings made on threads other than the main one (docs/probe.md, lost "
                                        "records)")
    driver_hooks_via: str = _opt("activity", choices=HOOKS_VIA,
                                 doc="activity: CUPTI's per-API activity switch (no subscriber; a profiler keeps "
                                     "its place); subscriber: CUPTI's one callback subscription, with a C no-op")
    # Raw delivery: hand CUPTI's buffers of memory and pool records to the daemon unread, when the
    # daemon says it reads them (it does since it sends the "cupti_buffers" control); the probe keeps
    # only the MEMORY2 structs it needs for its own table. Off: every buffer is converted here.
    forward_buffers: bool = _opt(True, doc="raw delivery: buffers of memory and pool records go to the daemon as "
                                           "CUPTI wrote them, read there instead of in the workload's process "
                                           "(docs/probe.md)")
    # Past raw_buffers, CUPTI drops (and counts) records.
    raw_buffers: int = _opt(256, lo=4, hi=4096, floor=True,
                            doc="raw delivery: CUPTI host buffers at most (x cupti_buffer_bytes); past it CUPTI "
                                "drops and counts records")
    # CUPTI's per-API activity records for the driver's and the runtime's allocation entry points
    # (cuMemAlloc*, cuMemCreate, cudaMalloc*, cudaMallocAsync/FromPool, managed and host
    # allocations): a call that returns out-of-memory becomes an OOM MARK for the daemon's
    # capture (probe/oom.py), whatever the framework (docs/oom.md).
    oom_records: bool = _opt(True, doc="CUPTI API records of the driver's and the runtime's allocation calls: a "
                                       "call that fails with out-of-memory is an OOM event, whatever the framework "
                                       "(docs/oom.md)")
    # The stream-ordered entry points too (cudaMallocAsync, cuMemAllocFromPoolAsync and their
    # variants): a record per allocation under a stream-ordered allocator (probe/oom.py), so opt-in.
    oom_records_async: bool = _opt(False, doc="the same for the stream-ordered allocation calls (cudaMallocAsync, "
                                              "cuMemAllocFromPoolAsync): a record per allocation under a "
                                              "stream-ordered allocator, so off by default (docs/oom.md)")
    # PyTorch's out-of-memory observer (once torch has initialised CUDA): requested bytes and the
    # allocator's figures; on the H200 it reported every PyTorch OOM.
    oom_torch_observer: bool = _opt(True, doc="PyTorch's out-of-memory observer: requested bytes and the "
                                              "allocator's figures at each PyTorch OOM (docs/oom.md)")
    # PyTorch's allocated and reserved bytes, read after optimizer steps on the workload's thread: the
    # allocator slack metric. Off by default: PyTorch takes its allocator's mutex for them holding the GIL,
    # and CUPTI may ask the probe's (Python) buffer callback for a buffer, needing the GIL, on another of
    # the workload's threads inside cudaMalloc under that mutex: a thread of the program allocating while
    # the optimizer steps could then hang both (probe/torchnumbers.py).
    torch_numbers: bool = _opt(False, doc="PyTorch's allocated and reserved bytes after optimizer steps, for "
                                          "gpufootprint_allocator_slack_bytes; only where no other thread of "
                                          "the program allocates CUDA memory while the optimizer steps "
                                          "(docs/probe.md)")

    def to_env(self) -> dict[str, str]:
        """The GPUFOOTPRINT_PROBE_* variables that give a probe these values (``from_env`` reads them)."""
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
