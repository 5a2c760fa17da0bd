"""How long the daemon's walk of one forwarded CUPTI buffer takes at its largest (16 MiB), on record
patterns a hostile local process could craft to defeat the walk's run detection.

A probe's CUPTI_BUFFER frame is walked record by record where records of one kind do not come in runs
(wire/cupti_layout.py). The walk before 2026-12-06 (e29a2e6) looked for the end of a run over the
whole rest of the buffer each time, so runs of about 10 records of alternating kinds made it
quadratic: 16-24 s of the daemon's one ingest thread for one 16 MiB frame (review of 2026-12-06, this
2-core VM). This prints, per pattern, the walk and the gather of every record (16,384 at a time, as
ingest/session.py decodes), in ms. Last, what naming the place a refused frame stops costs (``walk_stop``,
for the daemon's error): a 16 MiB frame of the smallest records (RUNTIME API, the most to walk) whose last
record's kind is unknown, walked to it.

Usage: python bench/walk_hostile.py [PATTERN...] [--base-tree DIR]
(``--base-tree``: also time the cupti_layout of another checkout, e.g. a ``git worktree`` of e29a2e6^.)
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))

from gpufootprint.wire import cupti_layout as K  # noqa: E402

FRAME = 16 << 20


def build(kinds: Iterator[int], total: int = FRAME) -> bytes:
    out = bytearray()
    for k in kinds:
        size = K._SIZES[k]
        if len(out) + size > total:
            break
        rec = bytearray(size)
        rec[0:4] = int(k).to_bytes(4, "little")
        out += rec
    return bytes(out)


def runs(kinds: list[int], length: int) -> Iterator[int]:
    i = 0
    while True:
        for _ in range(length):
            yield kinds[i % len(kinds)]
        i += 1


def cycles(cycle: list[int], reps: int, breaker: int) -> Iterator[int]:
    while True:
        for _ in range(reps):
            yield from cycle
        yield breaker


def randoms(kinds: list[int], seed: int = 1) -> Iterator[int]:
    r = random.Random(seed)
    while True:
        yield r.choice(kinds)


PATTERNS = {
    "memory2_only": lambda: runs([K.MEMORY2], 1),
    "runs10_memset_memcpy": lambda: runs([K.MEMSET, K.MEMCPY], 10),
    "runs10_driver_runtime": lambda: runs([K.DRIVER, K.RUNTIME], 10),
    "runs3_driver_runtime": lambda: runs([K.DRIVER, K.RUNTIME], 3),
    "cycle4x3_breaker": lambda: cycles([K.DRIVER, K.RUNTIME, K.MEMORY_POOL, K.MEMSET], 3, K.MEMCPY),
    "cycle2x6_breaker": lambda: cycles([K.DRIVER, K.RUNTIME], 6, K.MEMSET),
    "random5": lambda: randoms([K.DRIVER, K.RUNTIME, K.MEMORY_POOL, K.MEMSET, K.MEMCPY]),
}


def layout_of(tree: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("base_layout", Path(tree) / "daemon/gpufootprint/wire/cupti_layout.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def time_walk(mod: ModuleType, buf: bytes) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    offsets = mod.walk(memoryview(buf), len(buf))
    t1 = time.perf_counter()
    u8 = np.frombuffer(buf, np.uint8)
    n = 0
    for kind, offs in offsets.items():
        for at in range(0, len(offs), 16_384):
            n += len(mod.gather(u8, kind, offs[at:at + 16_384]))
    return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3, n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("patterns", nargs="*", default=list(PATTERNS), choices=[[], *PATTERNS])
    ap.add_argument("--base-tree")
    args = ap.parse_args()
    mods = [("this tree", K)] + ([("base", layout_of(args.base_tree))] if args.base_tree else [])
    print(f"{platform.node()} python {platform.python_version()} numpy {np.__version__}; 16 MiB frames")
    for name in args.patterns or list(PATTERNS):
        buf = build(PATTERNS[name]())
        for label, mod in mods:
            walk_ms, gather_ms, n = time_walk(mod, buf)
            print(f"{name:24s} {label:9s} walk {walk_ms:9.1f} ms  gather {gather_ms:8.1f} ms  records {n}", flush=True)
    refused = bytearray(build(iter([K.RUNTIME] * (FRAME // K._SIZES[K.RUNTIME]))))
    last = len(refused) - K._SIZES[K.RUNTIME]
    refused[last:last + 4] = (999).to_bytes(4, "little")
    t0 = time.perf_counter()
    where = K.walk_stop(bytes(refused), len(refused))
    print(f"walk_stop of a refused 16 MiB frame: {(time.perf_counter() - t0) * 1e3:.1f} ms ({where})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
