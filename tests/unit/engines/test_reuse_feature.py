from __future__ import annotations

import numpy as np

from gpufootprint.features.reuse import ReuseTracker, steady_ratio
from gpufootprint.records import MEMORY_DTYPE, MemoryKind


def mem(rows: list[tuple[int, int, int, int]], pid: int = 1, kind: int = MemoryKind.DEVICE) -> np.ndarray:
    """rows: (ts, op, addr, bytes)"""
    r = np.zeros(len(rows), MEMORY_DTYPE)
    for i, (ts, op, addr, size) in enumerate(rows):
        r[i]["ts"], r[i]["op"], r[i]["addr"], r[i]["bytes"], r[i]["mk"], r[i]["pid"] = ts, op, addr, size, kind, pid
    return r


def test_reuse_is_the_share_of_allocations_at_a_freed_address_and_size() -> None:
    c = ReuseTracker()
    # same address and size reused twice (the first release omits its size); a different size at
    # a freed address is not a reuse
    c.add(mem([(1, 1, 16, 64), (2, 2, 16, 0), (3, 1, 16, 64), (4, 2, 16, 64), (5, 1, 16, 64), (6, 2, 16, 64),
               (7, 1, 16, 128)]))
    assert c.ratio == 2 / 4
    assert steady_ratio(c.events(), c.allocations, 3) == 2 / 3
    assert steady_ratio(c.events(), c.allocations, 100) == 1.0  # nothing allocated since: a static footprint
    assert ReuseTracker().ratio is None  # no memory records: unknown
    assert steady_ratio(ReuseTracker().events(), 0, 3) is None


def test_delivery_order_does_not_matter_and_only_device_allocations_count() -> None:
    c = ReuseTracker()
    c.add(mem([(3, 1, 16, 64), (2, 2, 16, 64), (1, 1, 16, 64)]))  # out of order in one batch
    # module globals and pinned host memory are not what a graph replays
    c.add(mem([(4, 1, 99, 8)], kind=MemoryKind.DEVICE_STATIC))
    c.add(mem([(5, 1, 98, 8)], kind=MemoryKind.PINNED))
    assert c.ratio == 0.5 and c.allocations == 2


def test_kept_history_is_bounded_but_totals_are_not() -> None:
    c = ReuseTracker(history=10)
    for i in range(50):
        c.add(mem([(2 * i, 1, 16, 64), (2 * i + 1, 2, 16, 64)]))
    assert c.allocations == 50 and c.reused == 49
    assert 10 <= len(c.events()) <= 20 and not c.events().flags.writeable
