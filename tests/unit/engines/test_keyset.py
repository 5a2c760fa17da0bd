from __future__ import annotations

import numpy as np
from gpufootprint.features.keyset import KeySet


def test_keyset_is_a_set_of_uint64_keys() -> None:
    rng = np.random.default_rng(5)
    ks = KeySet()
    ref: set[int] = set()
    for _ in range(200):
        # small key ranges: many duplicates and collisions; the key 0 and keys with high bits too
        keys = rng.integers(0, 3000, size=int(rng.integers(0, 400)), dtype=np.uint64)
        keys[::7] <<= np.uint64(50)
        probe = rng.integers(0, 3000, size=300, dtype=np.uint64)
        assert ks.contains(probe).tolist() == [int(k) in ref for k in probe.tolist()]
        slots = ks.add(keys)
        ref.update(keys.tolist())
        assert len(ks) == len(ref)
        assert (ks.find(keys) == slots).all()
        if rng.random() < 0.05:
            ks.clear()
            ref.clear()
    assert ks.contains(np.array([], np.uint64)).tolist() == []
