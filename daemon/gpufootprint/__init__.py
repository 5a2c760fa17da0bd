"""gpufootprint: a CUPTI-driven runtime GPU memory-footprint daemon.

Importing the package needs no GPU, no driver and no CUPTI: the GPU libraries are
imported lazily by the probe and the NVML source only.
"""

from __future__ import annotations

__version__ = "0.1.0"
