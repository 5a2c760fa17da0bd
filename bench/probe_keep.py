"""The probe's struct queue at a watermark that leaves every other struct waiting (no GPU needed).

CUPTI fills a buffer per thread, so with several allocating threads what a watermark leaves waiting is not the
queue's tail but structs spread through it; ``StructQueue.keep`` then gathers them. This times that gather
for MEMORY2 structs (128 bytes, 15 fields), best of 5 x 200, less the queue's own append.

  python bench/probe_keep.py [--src DAEMON_DIR]   (--src: the daemon/ of another revision, side by side)
"""

from __future__ import annotations

import platform
import timeit

from _src import src_args

args = src_args(__doc__)

import numpy as np  # noqa: E402

from gpufootprint.probe.livetable import StructQueue  # noqa: E402
from gpufootprint.wire import cupti_layout  # noqa: E402

raw = cupti_layout.RAW_DTYPES[cupti_layout.MEMORY2]
print(f"{platform.node()} python {platform.python_version()} numpy {np.__version__}; src {args.src}")
for n in (512, 8192, 28160):
    structs = np.zeros(n, raw)
    every_other = np.zeros(n, bool)
    every_other[1::2] = True

    def appended() -> StructQueue:
        q = StructQueue(raw)
        q.append(structs)
        return q

    both = min(timeit.repeat(lambda: appended().keep(every_other), number=200, repeat=5)) / 200
    alone = min(timeit.repeat(appended, number=200, repeat=5)) / 200
    print(f"{n:6d} structs: keep every other {1e6 * (both - alone):8.1f} us")
