"""Structured-record copies on the daemon's and the probe's paths, timed alone (no GPU needed).

numpy copies, masks and gathers a structured dtype field by field; these are the paths that now copy words:
the OOM capture buffer's ``RecentRecords.add`` (a chunk joined from two, as the pipeline applies several
flushes together, and a view into a frame's bytes), the daemon's conversion of a forwarded buffer's 512
MEMORY2 structs to its records (``cupti_layout.convert``; with caching allocators none is stream-ordered,
under cudaMallocAsync all are, in a pool), and the probe's choice of launch-window calls from a
buffer of API structs (``launches.api_records``). Best of 5 repeats; the buffer runs past its size bound,
as on a full node.

  python bench/copy_paths.py [--src DAEMON_DIR]   (--src: the daemon/ of another revision, side by side)
"""

from __future__ import annotations

import platform
import timeit

from _src import src_args

args = src_args(__doc__)

import numpy as np  # noqa: E402

from gpufootprint.oom.recent import RecentRecords  # noqa: E402
from gpufootprint.probe import launches  # noqa: E402
from gpufootprint.records import DTYPES, RecordKind, join  # noqa: E402
from gpufootprint.wire import cupti_layout  # noqa: E402


def best(fn, number: int) -> float:  # type: ignore[no-untyped-def]
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


print(f"{platform.node()} python {platform.python_version()} numpy {np.__version__}; src {args.src}")
mem = DTYPES[RecordKind.MEMORY]
for n in (390, 3000):
    rows = np.zeros(n, mem)
    rows["ts"] = np.arange(n)
    joined = join([rows[: n // 2].copy(), rows[n // 2:].copy()])
    frame_view = np.frombuffer(rows.tobytes(), mem)
    for name, chunk in (("joined chunk", joined), ("frame view", frame_view)):
        recent = RecentRecords(60, 16 << 20, 32 << 20)
        us = best(lambda c=chunk, r=recent: r.add(1, RecordKind.MEMORY, c), 2000)
        print(f"RecentRecords.add, {name:12s} {n:5d} records: {us:7.1f} us")
kind = cupti_layout.DRIVER
table = launches._ROLE_TABLES[kind]
with_role = np.flatnonzero(table)
raw = np.zeros(2048, cupti_layout.API_RAW_DTYPE)
raw["cbid"][::3] = with_role[0]  # a third of the calls have a role in a launch window (a launch, say)
u8 = raw.view(np.uint8)
offsets = range(0, len(u8), raw.dtype.itemsize)
got = len(launches.api_records(u8, offsets, kind, 1, 0))
print(f"launches.api_records, 2,048 API structs, {got} chosen: "
      f"{best(lambda: launches.api_records(u8, offsets, kind, 1, 0), 300):7.1f} us")
structs = np.zeros(512, cupti_layout.RAW_DTYPES[cupti_layout.MEMORY2])
structs["op"][0::2], structs["op"][1::2] = 1, 2
structs["address"], structs["bytes"], structs["mk"], structs["dev"] = np.arange(512) * 4096, 4096, 1, 3
for label, pooled in (("none stream-ordered", 0), ("all in a pool", 1)):
    structs["is_async"] = structs["pool_type"] = pooled
    view = np.frombuffer(structs.tobytes(), structs.dtype)
    print(f"cupti_layout.convert, 512 MEMORY2 structs, {label}: "
          f"{best(lambda v=view: cupti_layout.convert(cupti_layout.MEMORY2, v, 7), 2000):7.1f} us")
