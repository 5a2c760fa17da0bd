"""The in-process CUPTI probe.

Three ways in:

* ``gpufootprint run -- CMD`` (a bootstrap ``sitecustomize`` on the children's
  PYTHONPATH; every Python process it starts, and theirs, is probed),
* ``GPUFOOTPRINT_PROBE=1`` with the ``gpufootprint_probe.pth`` startup hook the
  package installs,
* ``import gpufootprint.probe; gpufootprint.probe.start()``.

Start it before the first CUDA call: CUPTI's records are not retroactive (what
was allocated before is reported as the ``untracked`` kind, from NVML).
The probe never raises into the workload: ``start`` returns False when it
cannot run (no driver, no CUPTI) and the workload goes on unprobed.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

from gpufootprint.probe.core import Probe
from gpufootprint.probe.settings import ProbeSettings

__all__ = ["Probe", "ProbeSettings", "current", "mark", "start", "status", "stop"]

_lock = threading.Lock()
_probe: Probe | None = None


def start(*, socket: str | None = None, tee: str | None = None, backend: Any = None,
          discover_devices: bool = True, **settings: Any) -> bool:
    """Start the probe once per process (later calls return the first one's result)."""
    global _probe
    with _lock:
        if _probe is not None and _probe.pid == os.getpid() and _probe.started:
            return True
        probe = Probe(ProbeSettings.from_env(socket=socket, tee=tee, **settings), backend,
                      discover_devices=discover_devices)
        _probe = probe
        ok = probe.start()
        if ok:
            atexit.register(probe.stop_at_exit)
            if probe.settings.torch_hook:
                try:
                    from gpufootprint.probe import takeover

                    takeover.install(probe)
                except Exception as exc:  # noqa: BLE001
                    probe.errors.append(f"torch hook: {exc}")
        return ok


def stop() -> None:
    if _probe is not None and _probe.pid == os.getpid():
        _probe.stop()


def mark(label: str, dev: int = 0, **extra: Any) -> dict[str, Any] | None:
    """Put a synchronised mark in the stream (call after ``torch.cuda.synchronize()``)."""
    if _probe is None or _probe.pid != os.getpid():
        return None
    return _probe.mark(label, dev, **extra)


def status() -> dict[str, Any]:
    if _probe is None or _probe.pid != os.getpid():
        return {"started": False}
    return _probe.status()


def current() -> Probe | None:
    return _probe if _probe is not None and _probe.pid == os.getpid() else None


def _after_fork_in_child() -> None:
    # CUDA and CUPTI are not usable in a child forked from a CUDA process, and the
    # sender thread did not survive the fork: a forked child runs unprobed.
    global _probe, _lock
    if _probe is not None:
        # PyTorch's global optimizer hooks are the parent's, inherited: its hook must not read here
        _probe.sender.torch_numbers.close()
    _probe = None
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
