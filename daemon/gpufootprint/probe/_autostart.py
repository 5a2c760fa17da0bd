"""Imported by ``gpufootprint_probe.pth`` at every interpreter start.

Does nothing (and imports nothing heavy) unless ``GPUFOOTPRINT_PROBE=1``. Never
raises: a broken probe must not stop Python from starting.
"""

from __future__ import annotations

import os


def maybe_start() -> None:
    if os.environ.get("GPUFOOTPRINT_PROBE", "") not in ("1", "true", "yes", "on"):
        return
    try:
        from gpufootprint import probe

        probe.start()
    except Exception:  # noqa: BLE001, S110 - the workload starts unprobed rather than not at all
        pass


maybe_start()
