"""The ingest guard's admission of one probe's MEMORY batch (``Guard.admit``), per batch size (no GPU needed).

Every live batch passes the guard before the pipeline: its device share, its live-allocation share (with the
releases of the batch's own allocations, ``_released_here``) and its pending share. This times ``admit`` of
allocation/release pairs on one GPU the process already has, for 2, 16 and 512 records (a flush of an
ordinary node, and a full CUPTI buffer of allocation churn), and its device check alone, best of 5 x 2,000.

  python bench/guard_admit.py [--src DAEMON_DIR]   (--src: the daemon/ of another revision, side by side)
"""

from __future__ import annotations

import platform
import timeit

from _src import src_args

args = src_args(__doc__)

import numpy as np  # noqa: E402

from gpufootprint.config import Config  # noqa: E402
from gpufootprint.ingest.validate import Guard, Limits  # noqa: E402
from gpufootprint.pipeline import Pipeline  # noqa: E402
from gpufootprint.records import MEMORY_DTYPE, RecordKind  # noqa: E402

print(f"{platform.node()} python {platform.python_version()} numpy {np.__version__}; src {args.src}")
cfg = Config()
guard = Guard(Limits.from_config(cfg.daemon))
pipeline = Pipeline(cfg.footprint)
proc = pipeline.process(7, "probe")
guard.census.connect(7, 1000, "bench")
first = np.zeros(2, MEMORY_DTYPE)  # the process's GPU 0 opened, as after its first batch
first["op"], first["addr"], first["pid"], first["bytes"], first["mk"], first["ts"] = [1, 2], 0x99000, 7, 4096, 3, [1, 2]
pipeline.submit(RecordKind.MEMORY, first)
pipeline.advance(7, 10)


def ignore(*_: object) -> None:
    pass


def best(fn: object) -> float:
    return min(timeit.repeat(fn, number=2000, repeat=5)) / 2000 * 1e6  # type: ignore[arg-type]


for n in (2, 16, 512):
    recs = np.zeros(n, MEMORY_DTYPE)
    recs["op"][0::2], recs["op"][1::2] = 1, 2
    recs["addr"] = np.repeat(np.arange(n // 2) * 4096 + 0x1000, 2)
    recs["pid"], recs["bytes"], recs["mk"] = 7, 4096, 3
    # In time order, as a probe's buffer is (each release after its allocation), and after the process's
    # watermark (10): records at or before it would be late ones.
    recs["ts"] = np.arange(11, n + 11)

    def admit(recs: np.ndarray = recs, n: int = n) -> None:
        guard.admit(proc, RecordKind.MEMORY, recs, ignore, ignore)
        guard.pending.add(7, -n, guard.census)  # as the pipeline's apply gives the pending share back

    def devices(recs: np.ndarray = recs) -> None:
        guard.admit_devices(proc, recs, ignore)

    print(f"{n:4d} records: admit {best(admit):6.1f} us, of which the device check {best(devices):5.1f} us")
