"""Exact integer sums of a batch per (small key, frame) cell, a few numpy calls for every cell at once.

Summing a batch per key (a copy kind, say) and per frame was a boolean selection of each key's
records and a ``reduceat`` over their runs of one frame: a dozen numpy calls of fixed cost per key,
and a copy of every column per key. Here each record gets one cell number,
``key * span + (frame - first frame)``, and one ``np.bincount`` per column sums every cell.

``np.bincount`` sums its weights in float64, exact for integers while every partial sum stays below
2**53: the sums are trusted only when the largest value times the number of records is below it,
else (and when the cells would be too many for the records, a batch spread thin over time) the
functions answer None and the caller takes its general path. Cells come back in (key, frame) order,
the order of the per-key loops they replace, and only cells that hold a record.
"""

from __future__ import annotations

import numpy as np

EXACT = 1 << 53  # float64 holds every integer below this


def _exact(columns: list[np.ndarray], n: int) -> bool:
    for col in columns:
        if len(col) and (int(col.min()) < 0 or int(col.max()) * n >= EXACT):
            return False
    return True


def cell_sums(keys: np.ndarray | None, frames: np.ndarray, columns: list[np.ndarray],
              max_cells: int) -> tuple[list[int], list[int], list[int], list[list[int]]] | None:
    """Per occupied cell: its key, its frame, how many records, and each column's sum.

    ``keys``: small non-negative integers, one per record (None: one key, 0); ``frames``: int64
    frame numbers in ascending order; ``columns``: int64 values to sum. None: not exact, not sorted,
    or more than ``max_cells`` cells."""
    n = len(frames)
    if n == 0:
        return [], [], [], [[] for _ in columns]
    f0 = int(frames[0])
    span = int(frames[-1]) - f0 + 1
    n_keys = int(keys.max()) + 1 if keys is not None else 1
    if span < 1 or span * n_keys > max_cells or not _exact(columns, n):
        return None
    rel = frames - f0
    if n > 1 and bool((rel[1:] < rel[:-1]).any()):
        return None
    cell = rel if keys is None else keys.astype(np.intp) * span + rel
    size = span * n_keys
    counts = np.bincount(cell, minlength=size)
    nz = counts.nonzero()[0]
    sums = [np.bincount(cell, weights=col, minlength=size)[nz].astype(np.int64).tolist() for col in columns]
    key, frame = np.divmod(nz, span)
    return key.tolist(), (frame + f0).tolist(), counts[nz].tolist(), sums


def run_starts(idx: np.ndarray) -> np.ndarray:
    """Positions where a run of equal values starts in ``idx`` (non-empty): 0 and every change.

    What ``np.flatnonzero(np.diff(idx, prepend=idx[0] - 1))`` gives, from one comparison: ``np.diff``
    with ``prepend`` joins a copy first and ``flatnonzero`` over integers is slower than over booleans
    (about 13 us against 3 us for 3,686 frame numbers here)."""
    changes = (idx[1:] != idx[:-1]).nonzero()[0]
    starts = np.empty(len(changes) + 1, np.intp)
    starts[0] = 0
    starts[1:] = changes + 1
    return starts


def run_ends(idx: np.ndarray) -> np.ndarray:
    """Positions where a run of equal values ends in ``idx`` (non-empty): every change and the last."""
    changes = (idx[1:] != idx[:-1]).nonzero()[0]
    ends = np.empty(len(changes) + 1, np.intp)
    ends[:-1] = changes
    ends[-1] = len(idx) - 1
    return ends


def key_sums(keys: np.ndarray, columns: list[np.ndarray]) -> tuple[list[int], list[int], list[list[int]]] | None:
    """Per key present (ascending): how many records, and each column's sum. None: not exact."""
    if not _exact(columns, len(keys)):
        return None
    counts = np.bincount(keys)
    nz = counts.nonzero()[0]
    sums = [np.bincount(keys, weights=col, minlength=len(counts))[nz].astype(np.int64).tolist() for col in columns]
    return nz.tolist(), counts[nz].tolist(), sums


__all__ = ["EXACT", "cell_sums", "key_sums", "run_ends", "run_starts"]
