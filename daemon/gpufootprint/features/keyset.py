"""A set of 64-bit keys that answers for a whole numpy array at once.

The reuse tracker asks, per batch, "was this key freed before?" for every allocation and adds
every release's key. A Python ``set`` costs about 100 ns a key on a small CI machine (an int
object per key, and a hash table lookup from the interpreter); this open-addressing table lives
in one numpy array and probes all the keys of a batch together, a few numpy calls per probe
round (at a load of at most one half, most keys are settled in the first round).

Keys are arbitrary ``uint64`` values; 0 marks an empty slot, so the key 0 is kept in a flag.
The table doubles when it would pass half full and starts small again on ``clear``, so its
memory follows the keys it holds (16 to 32 bytes a key, less than a Python set of ints).
"""

from __future__ import annotations

import numpy as np

_MIX = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: the top bits of key * MIX pick the slot
_MIX_INT = int(_MIX)
_U64 = (1 << 64) - 1
_MIN_BITS = 10
#: ``find`` takes its first probe round without selections from this many keys on (where a batch
#: usually has no key 0), and probes the last keys still probing one by one in Python from this few.
_ROUND_ONE_MIN = 64
_PYTHON_TAIL = 8


class KeySet:
    def __init__(self) -> None:
        self._alloc(_MIN_BITS)
        self.size = 0  # distinct keys held
        self._zero = False

    def _alloc(self, bits: int) -> None:
        self._bits = bits
        self._table = np.zeros(1 << bits, np.uint64)
        self._shift = np.uint64(64 - bits)
        self._mask = np.int64((1 << bits) - 1)
        self._shift_int, self._mask_int = 64 - bits, (1 << bits) - 1  # the same, for one key at a time
        # The table's slots read and written one at a time as Python ints (half the cost of ``item``).
        self._slots = self._table.data

    def __len__(self) -> int:
        return self.size

    def clear(self) -> None:
        self._alloc(_MIN_BITS)
        self.size = 0
        self._zero = False

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return ((keys * _MIX) >> self._shift).astype(np.int64)

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Per key, its slot in the table, or -1 when absent (the key 0: -2 when present)."""
        keys = keys.astype(np.uint64, copy=False)
        table, mask = self._table, self._mask
        # (np.count_nonzero for all/any: no Python wrapper or reduction setup, about 0.3 us less a call.)
        if len(keys) >= _ROUND_ONE_MIN and np.count_nonzero(keys) == len(keys):
            # The first round over the whole batch without selections (most keys settle in it); the
            # keys still probing go on below, the last few of them in Python.
            slot = self._home(keys)
            seen = table[slot]
            hit = seen == keys
            out = np.where(hit, slot, -1)
            todo = ((seen != 0) & ~hit).nonzero()[0]
            slot, want = (slot[todo] + 1) & mask, keys[todo]
        else:
            out = np.full(len(keys), -1, np.int64)
            todo = keys.nonzero()[0]
            slot = self._home(keys[todo])
            want = keys[todo]
        while len(todo):
            if len(todo) <= _PYTHON_TAIL:
                self._find_tail(todo.tolist(), slot.tolist(), want.tolist(), out)
                break
            seen = table[slot]
            hit = seen == want
            out[todo[hit]] = slot[hit]
            go_on = (seen != 0) & ~hit  # an occupied slot of another key: probe the next one
            todo, slot, want = todo[go_on], (slot[go_on] + 1) & mask, want[go_on]
        if self._zero:
            out[keys == 0] = -2
        return out

    def _find_tail(self, todo: list[int], slots: list[int], want: list[int], out: np.ndarray) -> None:
        """``find``'s probing for a few keys, one at a time (a numpy round costs a few calls each)."""
        table, mask = self._table, self._mask_int
        for i, slot, key in zip(todo, slots, want):
            while True:
                seen = table.item(slot)
                if seen == key:
                    out[i] = slot
                    break
                if seen == 0:
                    break
                slot = (slot + 1) & mask

    def contains(self, keys: np.ndarray) -> np.ndarray:
        found: np.ndarray = self.find(keys) != -1
        return found

    def add(self, keys: np.ndarray) -> np.ndarray:
        """Add every key; returns each key's slot (-2 for the key 0)."""
        keys = keys.astype(np.uint64, copy=False)
        if 2 * (self.size + len(keys)) > len(self._table):
            self._grow(self.size + len(keys))
        out = np.full(len(keys), -2, np.int64)
        table, mask = self._table, self._mask
        whole = len(keys) >= _ROUND_ONE_MIN and np.count_nonzero(keys) == len(keys)  # first round without selections
        todo = np.arange(len(keys)) if whole else keys.nonzero()[0]
        if len(todo) < len(keys):
            if not self._zero:
                self.size += 1
            self._zero = True
        slot = self._home(keys if whole else keys[todo])
        want = keys if whole else keys[todo]
        while len(todo):
            seen = table[slot]
            empty = seen == 0
            if np.count_nonzero(empty):
                # Claim the empty slots; where two different keys claimed one, the last write won and
                # the other sees a foreign key below and probes on. Equal keys write the same value.
                claimed = slot[empty]
                table[claimed] = want[empty]
                # Every claimed slot was empty and now holds a key: the distinct ones are new keys.
                filled = np.sort(claimed)
                self.size += 1 + int(np.count_nonzero(filled[1:] != filled[:-1]))
                seen = table[slot]
            hit = seen == want
            if whole:  # every key is in its own place: no positions to look up
                whole = False
                out = np.where(hit, slot, -2)
                go = (~hit).nonzero()[0]
                todo, slot, want = go, (slot[go] + 1) & mask, want[go]
                continue
            out[todo[hit]] = slot[hit]
            go_on = ~hit
            todo, slot, want = todo[go_on], (slot[go_on] + 1) & mask, want[go_on]
        return out

    # One key at a time, in Python: a batch of a few keys costs a dozen numpy calls of a few
    # microseconds each in ``find``/``add``, and one probe here well under one. Same table, same
    # slots as the array methods would pick for a single key.

    def reserve(self, n: int) -> None:
        """Make room for ``n`` more keys, as ``add`` does for a batch of ``n`` before adding it."""
        if 2 * (self.size + n) > len(self._table):
            self._grow(self.size + n)

    def has(self, key: int) -> bool:
        """Whether the key (a Python int in [0, 2**64)) is held."""
        if key == 0:
            return self._zero
        table, mask = self._slots, self._mask_int
        slot = ((key * _MIX_INT) & _U64) >> self._shift_int
        while True:
            seen = table[slot]
            if seen == key:
                return True
            if seen == 0:
                return False
            slot = (slot + 1) & mask

    def add_one(self, key: int) -> None:
        """Add one key (a Python int in [0, 2**64))."""
        if key == 0:
            if not self._zero:
                self.size += 1
            self._zero = True
            return
        if 2 * (self.size + 1) > len(self._table):
            self._grow(self.size + 1)
        table, mask = self._slots, self._mask_int
        slot = ((key * _MIX_INT) & _U64) >> self._shift_int
        while True:
            seen = table[slot]
            if seen == key:
                return
            if seen == 0:
                table[slot] = key
                self.size += 1
                return
            slot = (slot + 1) & mask

    def _grow(self, need: int) -> None:
        held = self._table[self._table != 0]
        bits = self._bits
        while (1 << bits) < 2 * need:
            bits += 1
        self._alloc(bits)
        self.size = int(self._zero)  # the key 0 lives in its flag, not in the table
        if len(held):
            self.add(held)


__all__ = ["KeySet"]
