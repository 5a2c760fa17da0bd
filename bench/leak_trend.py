"""The leak engine's judgement of one device with its trend window full (no GPU needed).

At every snapshot (ten a second; one a second while ingest is busy) the leak engine adds each device's
footprint to its trend and reads the trend's least-squares slope and, past the warm-up, its segment floors,
over ``leaks.growth_window_seconds`` (240 s: 2,400 samples at ten snapshots a second). This fills one trend at
that cadence and times ``LeakTracker.evaluate`` of one process on one GPU (its snapshots built before the
timing; until 2026-12-07 03:40 UTC they were built inside it, about 12 us each), best of 5 x 200; then a node's
snapshot in warm-up (256 processes on 8 GPUs, the first seconds of each trend), best of 5.

  python bench/leak_trend.py [--src DAEMON_DIR]   (--src: the daemon/ of another revision, side by side)
"""

from __future__ import annotations

import platform
import time
import timeit

from _src import src_args

args = src_args(__doc__)

from gpufootprint.config import LeaksConfig  # noqa: E402
from gpufootprint.engines.leaks import LeakTracker  # noqa: E402
from gpufootprint.snapshot import DeviceSnapshot, PipelineSnapshot, ProcessSnapshot  # noqa: E402

print(f"{platform.node()} python {platform.python_version()}; src {args.src}")
cfg = LeaksConfig()
S = 1_000_000_000


def snap(i: int, procs: int = 1, gpus: int = 1) -> PipelineSnapshot:
    return PipelineSnapshot(taken_at=i / 10, processes=tuple(process(i, p, gpus) for p in range(procs)),
                            records_ingested={}, ingest_errors={}, late_records=0, window_peak_seconds=60.0)


def process(i: int, p: int, gpus: int) -> ProcessSnapshot:
    return ProcessSnapshot(pid=1 + p, source="probe", exited=False, info={},
                           devices=tuple(device(i + p, d) for d in range(gpus)), pending_records=0,
                           as_of_ns=10**18 + i * S // 10)


def device(i: int, d: int) -> DeviceSnapshot:
    size = (1 << 30) + (i % 50) * 4096  # a footprint that moves but does not grow
    return DeviceSnapshot(
        dev=d, live_bytes={"device": size}, device_bytes=size, async_device_bytes=0, pool_reserved_bytes=0,
        pool_used_bytes=0, window_peak_bytes=size, live_allocations=1, allocations={}, releases={},
        allocated_bytes={}, released_bytes={}, memcpy_count={}, memcpy_bytes={}, memcpy_seconds={}, memset_count=0,
        memset_bytes=0, kernel_count=0, kernel_seconds=0.0, um_count={}, um_value={})


tracker = LeakTracker(cfg)
samples = int(cfg.growth_window_seconds * 10)
for i in range(samples + 10):
    tracker.evaluate(snap(i))
# The snapshots are built before the timing (about 12 us each, more than the engine's own work now).
ahead = iter([snap(i) for i in range(samples + 10, samples + 10 + 5 * 200)])


def one() -> None:
    tracker.evaluate(next(ahead))


us = min(timeit.repeat(one, number=200, repeat=5)) / 200 * 1e6
print(f"evaluate, one device, {len(tracker.trends[(1, 0)].points)} samples in the trend: {us:8.1f} us")

# A node in warm-up: each snapshot adds a sample to 2,048 trends of a few samples and reads their slopes.
node = [snap(i, 256, 8) for i in range(15)]
best = float("inf")
for _ in range(5):
    warm = LeakTracker(cfg)
    for s in node[:10]:
        warm.evaluate(s)
    t0 = time.process_time()
    for s in node[10:]:
        warm.evaluate(s)
    best = min(best, (time.process_time() - t0) / 5)
print(f"evaluate, 256 processes x 8 GPUs in warm-up (11-15 samples a trend): {best * 1e3:8.2f} ms a snapshot, "
      f"{best / 2048 * 1e6:6.2f} us a device")
