"""Runs of CUPTI-JSONL lines that differ only in their numbers, parsed as one block.

A JSONL trace is written by one program, so its lines of one kind share their text but for
the digits: ``{"k": "mem", "ts": 17..., "op": 1, ...}``. ``json.loads`` costs about 10 us a line
on a small machine; a run of lines with the same *shape* (the line with its digits taken out)
is instead checked and parsed with a few calls over the whole block:

* the shape, with a 0 put in each value slot, must parse as a JSON object whose "k" names a
  kind without strings (not ``kern``) and whose other values are all that 0 (so no negative
  number, float, boolean, null or string hides in a slot), without a repeated key;
* in every line, the digit runs must sit exactly in the shape's slots, one each (a digit inside
  a key or the "k" string would give the same shape), none with a leading zero (not JSON);
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


@dataclass(frozen=True)
class Shape:
    kind: RecordKind
    offsets: np.ndarray  # per slot: its position in the shape (digits removed), int64
    keys: tuple[str, ...]  # per slot: its JSON key
    length: int  # bytes of the shape (without the newline)


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
    return Shape(kind, np.asarray(offsets, np.int64), tuple(keys), len(shape))


def parse_run(block: bytes, n_lines: int, shape: Shape,
              fields: tuple[tuple[str, str, bool], ...], default_pid: int) -> np.ndarray | None:
    """The records of ``n_lines`` lines of ``shape`` (``block``: the lines joined by newlines, the
    last one without), or None when any of them must be read one by one."""
    s = len(shape.offsets)
    if not block or block[0] in DIGITS or block[-1] in DIGITS:
        return None  # a line of a JSON object starts with "{" and ends with "}"
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
    if len(values) != n_lines * s:
        return None
    table = values.reshape(n_lines, s)
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


__all__ = ["DIGITS", "Shape", "parse_run", "parse_shape"]
