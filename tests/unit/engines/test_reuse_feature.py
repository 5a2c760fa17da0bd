from __future__ import annotations

import numpy as np

from gpufootprint.features.reuse import ReuseCounter
from gpufootprint.records import MEMORY_DTYPE, MemoryKind


def mem(rows: list[tuple[int, int, int, int]], pid: int = 1, kind: int = MemoryKind.DEVICE) -> np.ndarray:
    """rows: (ts, op, addr, bytes)"""
    r = np.zeros(len(rows), MEMORY_DTYPE)
    for i, (ts, op, addr, size) in enumerate(rows):
        r[i]["ts"], r[i]["op"], r[i]["addr"], r[i]["bytes"], r[i]["mk"], r[i]["pid"] = ts, op, addr, size, kind, pid
    return r


def test_reuse_is_the_share_of_allocations_at_a_freed_address_and_size() -> None:
    c = ReuseCounter()
    # same address and size reused twice; a different size at a freed address is not a reuse
    c.add(mem([(1, 1, 16, 64), (2, 2, 16, 0), (3, 1, 16, 64), (4, 2, 16, 64), (5, 1, 16, 64), (6, 2, 16, 64),
               (7, 1, 16, 128)]))
    assert c.ratio(1) == 2 / 4
    assert c.ratio(1, since=3) == 2 / 3
    assert c.ratio(1, since=100) == 1.0  # nothing allocated since: a static footprint
    assert c.ratio(2) is None  # no memory records: unknown


def test_delivery_order_does_not_matter_and_static_kinds_are_ignored() -> None:
    c = ReuseCounter()
    c.add(mem([(3, 1, 16, 64), (2, 2, 16, 64), (1, 1, 16, 64)]))  # out of order in one batch
    c.add(mem([(0, 1, 99, 8)], kind=MemoryKind.DEVICE_STATIC))
    assert c.ratio(1) == 0.5
