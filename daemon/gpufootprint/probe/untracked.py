"""NVML's view of the process, for the ``untracked`` kind.

When CUDA was initialised before the probe, allocations made earlier are never
reported by CUPTI (records are not retroactive). NVML's per-process used memory
minus what CUPTI reports live is what the probe cannot see; the probe exports it
as the synthetic kind ``untracked``. NVML also counts the CUDA context itself,
which is part of the same blind spot.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from gpufootprint.nvml import processes
from gpufootprint.probe.livetable import LiveTable
from gpufootprint.records import MEMORY_DTYPE

log = logging.getLogger(__name__)
_state: dict[str, Any] = {}


#: The initial pid namespace's inode (PROC_PID_INIT_INO in the kernel): a fixed number.
_INIT_PID_NS = "pid:[4026531836]"


def in_own_pid_namespace(link: str = "/proc/self/ns/pid") -> bool:
    """True inside a container with its own pid namespace (not ``hostPID``/``--pid=host``)."""
    try:
        return os.readlink(link) != _INIT_PID_NS
    except OSError:
        return False  # no /proc: nothing known, keep the old behaviour


def nvml_used_bytes(pid: int, devices: list[dict[str, Any]]) -> dict[int, int] | None:
    """{cuda device index: bytes NVML says ``pid`` uses}; None when NVML is unavailable, or when
    this process's pid is not the one NVML reports.

    NVML reports processes by their pid in the host's pid namespace. Inside a container with a
    pid namespace of its own the probe knows only its container pid, so it would never find itself
    (no figure) or, worse, find a host process that happens to have the same number (a wrong
    figure). There the probe gives no ``untracked`` figure; the daemon, which sees host pids,
    exports NVML's per-process figure (``gpufootprint_nvml_process_used_bytes``, docs/probe.md).
    """
    if in_own_pid_namespace():
        if not _state.get("said"):
            _state["said"] = True
            log.info("untracked kind off: own pid namespace, NVML reports host pids (the daemon's "
                     "gpufootprint_nvml_process_used_bytes has the figure)")
        return None
    return processes.used_bytes_by_device(pid, devices)


def untracked_records(table: LiveTable, used: Mapping[int, int], ts: int, pid: int) -> np.ndarray:
    """MEMORY records that set each device's untracked figure to NVML's ``used`` minus what the
    table holds resident (never below zero), stamped ``ts``."""
    return np.concatenate([table.untracked_records(dev, max(0, nbytes - table.resident_bytes_now(dev)), ts, pid)
                           for dev, nbytes in used.items()] or [np.zeros(0, dtype=MEMORY_DTYPE)])
