"""Runs of CUPTI-JSONL lines that differ only in their numbers, parsed as one block.

A JSONL trace is written by one program, so its lines of one kind share their text but for
the digits: ``{"k": "mem", "ts": 17..., "op": 1, ...}``. ``json.loads`` costs about 10 us a line
on a small machine; a run of lines with the same *shape* (the line with its digits taken out)
is instead checked and parsed with a few calls over the whole block:

* the shape, with a 0 put in each value slot, must parse as a JSON object whose "k" names a
  kind without strings (not ``kern``) and whose other values are all that 0 (so no negative
  number, float, boolean, null or string hides in a slot), without a repeated key;
* in every line, the digit runs must sit exactly in the shape's slots, one each (a digit inside
  a key or the "k" string would give the same shape), none with a leading zero (not JSON). Where
  the shape allows (``Shape.by_context``), this is checked from the bytes either side of each
  digit run, without finding the runs: in the shape, a slot is the only place between a byte of
  ``PREV`` (": " or ":") and a byte of ``NEXT`` ("," or "}"), and a line of the shape is the shape
  with digit runs put in, so a run with such bytes either side is in a slot. Every run so placed
  and as many runs as slots (counted in the digits-and-colons text the numbers are read from,
  where a colon starts each slot) leaves one run in each slot. Otherwise each run's place in the
  line is computed and compared;
* the numbers must fit their fields (more than 20 digits, or a 20-digit one past 2**64 - 1,
  or a value past its field's width, is left to the line-by-line reader, which names it).

Anything else returns None and the caller reads the lines one by one, so every record,
problem and batch boundary is exactly what the line-by-line reader makes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpufootprint.records import DTYPES, RecordKind

DIGITS = b"0123456789"
_TO_SPACE = bytes(c if 48 <= c <= 57 else 32 for c in range(256))  # every non-digit byte -> a space
_TO_ONE = bytes(1 if 48 <= c <= 57 else 0 for c in range(256))  # a digit -> 1, any other byte -> 0
_SLOT = re.compile(rb":(\s*)(?=\s*[,}])")
_U64_MAX = b"18446744073709551615"
#: The bytes a digit run in a slot may follow and precede (see the module doc).
PREV = b": "
NEXT = b",}"
# Digits kept, a colon made a space, every other byte deleted: a line of 270 bytes becomes one of
# some 75 in which each slot's number follows its colon's space. np.fromstring reads it at about
# a third of the cost of the same numbers with every other byte made a space (it steps over each
# separator byte), and the translate costs what making the spaces did.
_COLON_TO_SPACE = bytes(32 if c == 58 else c for c in range(256))
_NOT_DIGIT_OR_COLON = bytes(c for c in range(256) if not 48 <= c <= 58)


@dataclass(frozen=True)
class Shape:
    kind: RecordKind
    offsets: np.ndarray  # per slot: its position in the shape (digits removed), int64
    keys: tuple[str, ...]  # per slot: its JSON key
    length: int  # bytes of the shape (without the newline)
    by_context: bool  # the slots are the only places between a byte of PREV and one of NEXT


def parse_shape(shape: bytes, kinds: dict[str, RecordKind], fields: dict[RecordKind, tuple[tuple[str, str, bool], ...]]
                ) -> Shape | None:
    """The slots of a line shape, or None when lines of that shape must be read one by one."""
    if b"\n" in shape:
        return None
    offsets: list[int] = []
    filled = bytearray()
    at = 0
    for m in _SLOT.finditer(shape):
        filled += shape[at:m.end()] + b"0"
        at = m.end()
        offsets.append(m.end())
    filled += shape[at:]
    pairs: list[tuple[str, Any]] = []

    def keep_pairs(kv: list[tuple[str, Any]]) -> dict[str, Any]:
        pairs.extend(kv)  # every key of every object: a repeated or nested key makes more pairs than keys
        return dict(kv)

    try:
        obj = json.loads(bytes(filled), object_pairs_hook=keep_pairs)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict) or len(pairs) != len(obj):
        return None  # a nested object, or a repeated key
    tag = obj.get("k")
    kind = kinds.get(tag) if isinstance(tag, str) else None
    if kind is None or kind is RecordKind.KERNEL:
        return None
    keys = [k for k, _ in pairs if k != "k"]
    if len(keys) != len(offsets) or any(type(obj[k]) is not int or obj[k] != 0 for k in keys):
        return None
    if any(key not in keys for _, key, required in fields[kind] if required):
        return None
    # Where a digit run could be put in and have PREV before it, NEXT after: only in the slots, or
    # the runs of this shape are placed by position (no newline is in PREV or NEXT, so the ends of
    # a line are not such places either).
    between = [p for p in range(1, len(shape)) if shape[p - 1] in PREV and shape[p] in NEXT]
    return Shape(kind, np.asarray(offsets, np.int64), tuple(keys), len(shape), between == offsets)


def parse_run(block: bytes, n_lines: int, shape: Shape,
              fields: tuple[tuple[str, str, bool], ...], default_pid: int,
              scratch: Scratch | None = None) -> np.ndarray | None:
    """The records of ``n_lines`` lines of ``shape`` (``block``: the lines joined by newlines, the
    last one without), or None when any of them must be read one by one. ``scratch``: work arrays
    to reuse (one per reader: they are not shared between threads)."""
    s = len(shape.offsets)
    if not block or block[0] in DIGITS or block[-1] in DIGITS:
        return None  # a line of a JSON object starts with "{" and ends with "}"
    table = _by_context(block, n_lines * s, scratch or Scratch()) if shape.by_context else None
    if table is None:
        # Not placed by context, or a number that may not fit: the exact check by position
        # (np.fromstring makes every number past 2**64 - 1 that value, so only it is suspect).
        table = _by_position(block, n_lines, shape)
        if table is None:
            return None
    table = table.reshape(n_lines, s)
    slot_of = {key: j for j, key in enumerate(shape.keys)}
    dtype = DTYPES[shape.kind]
    recs = np.zeros(n_lines, dtype)
    for fname, key, _ in fields:
        j = slot_of.get(key)
        if j is None:
            if fname == "pid" and default_pid:
                recs["pid"] = default_pid
            continue
        col = table[:, j]
        if dtype[fname].itemsize < 8 and int(col.max()) >= 1 << (8 * dtype[fname].itemsize):
            return None  # too large for its field: the line-by-line reader names the line
        recs[fname] = col
    return recs


class Scratch:
    """Work arrays kept from one run to the next: a fresh array the size of a block is fresh
    memory the kernel must map and zero, and for the ten passes of the context check that cost
    more than the passes themselves (40 ms against 16 ms for 100,000 lines)."""

    def __init__(self) -> None:
        self._u8 = np.empty(0, np.uint8)
        self._bools = np.empty((3, 0), np.bool_)

    def arrays(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if len(self._u8) < n:
            size = max(n, 2 * len(self._u8))
            self._u8 = np.empty(size, np.uint8)
            self._bools = np.empty((3, size), np.bool_)
        return self._u8[:n], self._bools[0, :n], self._bools[1, :n], self._bools[2, :n]


def _by_context(block: bytes, n_numbers: int, scratch: Scratch) -> np.ndarray | None:
    """The numbers of a run whose slots are placed by context (module doc), or None when the
    block is not plainly canonical or holds 18446744073709551615 (which may stand for more)."""
    u8 = np.frombuffer(block, np.uint8)
    x, digit, before_ok, after_ok = scratch.arrays(len(block))
    np.subtract(u8, np.uint8(48), out=x)  # uint8 arithmetic wraps: a byte that is no digit gives 10 or more
    np.less(x, np.uint8(10), out=digit)
    np.less_equal(x, np.uint8(10), out=before_ok)  # a digit or ":" (48 + 10)
    space = x.view(np.bool_)  # x is not needed any more
    before_ok |= np.equal(u8, np.uint8(32), out=space)
    np.equal(u8, np.uint8(44), out=after_ok)
    after_ok |= np.equal(u8, np.uint8(125), out=space)
    after_ok |= digit
    # A digit after a byte not in PREV (nor a digit), or before one not in NEXT (a bool a > b is
    # a and not b), each written over the operand it no longer needs.
    bad_before = np.greater(digit[1:], before_ok[:-1], out=before_ok[:-1])
    bad_after = np.greater(digit[:-1], after_ok[1:], out=after_ok[1:])
    bad_before |= bad_after
    if bool(bad_before.any()):
        return None
    text = block.translate(_COLON_TO_SPACE, _NOT_DIGIT_OR_COLON)
    values = np.fromstring(text, dtype=np.uint64, sep=" ")
    if len(values) != n_numbers:
        return None  # a slot without digits
    t8 = np.frombuffer(text, np.uint8)
    # Each number follows a space: a space, "0", then a digit is a leading zero (not JSON).
    if bool(((t8[:-2] == 32) & (t8[1:-1] == 48) & (t8[2:] != 32)).any()):
        return None
    if bool((values == np.uint64(0xFFFF_FFFF_FFFF_FFFF)).any()):
        return None
    return values


def _by_position(block: bytes, n_lines: int, shape: Shape) -> np.ndarray | None:
    """The numbers of a run, each digit run's place in its line computed and compared with the
    shape's slots; None when the block is not plainly canonical."""
    s = len(shape.offsets)
    # Digit runs from the edges of a 0/1 map of the block (one translate, then two passes in numpy).
    digit = np.frombuffer(block.translate(_TO_ONE), np.int8)
    edges = np.flatnonzero(digit[1:] != digit[:-1]) + 1
    starts, ends = edges[0::2], edges[1::2]
    if len(starts) != n_lines * s or len(ends) != len(starts):
        return None
    lengths = ends - starts
    # Where each digit run sits in the shape: its offset less the digits before it, less the lines before.
    non_digits_before = starts - (np.cumsum(lengths) - lengths)
    expect = (np.arange(n_lines, dtype=np.int64) * (shape.length + 1))[:, None] + shape.offsets[None, :]
    if not np.array_equal(non_digits_before.reshape(n_lines, s), expect):
        return None
    u8 = np.frombuffer(block, np.uint8)
    if bool(((u8[starts] == 48) & (lengths > 1)).any()) or int(lengths.max(initial=0)) > 20:
        return None  # a leading zero (not JSON), or a number past 2**64
    for i in np.flatnonzero(lengths == 20).tolist():
        if block[starts[i]:ends[i]] > _U64_MAX:
            return None
    values = np.fromstring(block.translate(_TO_SPACE), dtype=np.uint64, sep=" ")
    return values if len(values) == n_lines * s else None


__all__ = ["DIGITS", "NEXT", "PREV", "Scratch", "Shape", "parse_run", "parse_shape"]
