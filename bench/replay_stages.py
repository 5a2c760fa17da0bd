"""Where a replay's time goes, stage by stage: perf-counter timers around the pipeline's stages.

Replays FILE with ``replay_file`` (full pipeline: frames and sampler on) ROUNDS times in one process,
importing the package from SRC (a tree, or a ``git archive`` of a base revision), with a timer around
each stage below; each timer counts its stage's own time (the timed stages it calls are taken out).
Prints the mean per replay, most expensive first. cProfile (``bench/profile_replay.py``) charges every
Python call far more than a numpy call; a dozen timers around whole stages cost next to nothing.

Usage: python bench/replay_stages.py SRC FILE [ROUNDS]
"""

from __future__ import annotations

import functools
import importlib
import sys
import time
from collections import Counter
from typing import Any

STAGES = [
    ("wire.framing", "FrameDecoder", "feed"),
    ("ingest.session", None, "check_fields"),
    ("ingest.session", "Session", "_records"),
    ("pipeline", "Pipeline", "submit"),
    ("pipeline", "Pipeline", "advance"),
    ("pipeline", "Pipeline", "_apply"),
    ("pipeline", None, "_sorted"),
    ("footprint.table", "DeviceFootprint", "_apply_memory_bulk"),
    ("footprint.table", "DeviceFootprint", "_apply_memory_native"),  # (from 2026-12-08: the C core's)
    ("footprint.table", "DeviceFootprint", "_apply_memory_each"),
    ("footprint.table", "DeviceFootprint", "apply_memcpy"),
    ("footprint.table", "DeviceFootprint", "note_pool_config"),
    ("footprint.peaks", "FramePeaks", "add"),
    ("features.frames", "FrameBuilder", "on_levels"),
    ("features.frames", "FrameBuilder", "on_memory"),
    ("features.frames", "FrameBuilder", "on_memcpy"),
    ("features.reuse", "ReuseTracker", "add"),
    ("sampler.state", "ProcessSampler", "add_levels"),
    ("sampler.state", "ProcessSampler", "advance"),
]


def main() -> None:
    src, path = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    sys.path.insert(0, src + "/daemon")
    own: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    inner: list[float] = []  # time of timed stages called by the one running, per level

    def timed(fn: Any, label: str) -> Any:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            inner.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - t0
                own[label] += spent - inner.pop()
                calls[label] += 1
                if inner:
                    inner[-1] += spent
        return run

    for mod_name, cls_name, name in STAGES:
        mod = importlib.import_module("gpufootprint." + mod_name)
        owner = getattr(mod, cls_name) if cls_name else mod
        if hasattr(owner, name):
            setattr(owner, name, timed(getattr(owner, name), f"{cls_name or mod_name}.{name}"))
    from gpufootprint.config import FootprintConfig
    from gpufootprint.hub import FeatureHub
    from gpufootprint.pipeline import Pipeline
    from gpufootprint.replay import replay_file

    total = 0.0
    records = 0
    for _ in range(rounds):
        pipeline = Pipeline(FootprintConfig(), hub=FeatureHub())
        t0 = time.perf_counter()
        records = replay_file(path, pipeline).records
        total += time.perf_counter() - t0
    print(f"{total / rounds * 1e3:.1f} ms a replay of {records:,} records ({records * rounds / total:,.0f} a second, "
          f"timers included), {rounds} replays")
    for label, spent in own.most_common():
        print(f"  {spent / rounds * 1e3:7.1f} ms  {100 * spent / total:5.1f} %  {label} ({calls[label] // rounds} calls)")
    print(f"  {(total - sum(own.values())) / rounds * 1e3:7.1f} ms  {100 * (1 - sum(own.values()) / total):5.1f} %  "
          f"the rest (the replay loop, session dispatch, the hub, ...)")


if __name__ == "__main__":
    main()
