"""When this process started, on the wall clock.

The cost ledger prices a GPU from the daemon's start. Taking "now" when the App is built started
it after the imports, the configuration and NVML's start (about 0.5 s later than the process:
issue 30); the kernel's own start time of the process is the start a reader compares with
(``process_start_time_seconds``, ``ps``).
"""

from __future__ import annotations

import os
import time


def process_start_wall(stat_path: str = "/proc/self/stat") -> float:
    """Seconds since the epoch at which this process started; now where /proc cannot say."""
    try:
        with open(stat_path) as fh:
            # Fields after the command name (which may hold spaces and parentheses): state is the
            # 3rd field of the line, starttime (clock ticks since boot) the 22nd.
            after = fh.read().rsplit(")", 1)[1].split()
        started_ticks = int(after[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()
    return time.time() - max(0.0, age)
