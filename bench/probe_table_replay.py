"""A recording's memory records through the probe's own table, watermark by watermark: the C pairing
(``gfp_pair``) against numpy's, with what the C pass answered (no CPU timing: see bench/probe_table.py).

The recordings (``tests/data/*.gfp.gz``, the probe's tee) hold the records as the probe's sender packed them,
in delivery order, and its watermarks; each MEMORY batch goes into the table as CUPTI's MEMORY2 structs
(``LiveTable.add_raw``, as a forwarded buffer's do) and each WATERMARK advances it. Prints, per file, the C
passes, the watermarks applied as they answered, those each side applied record by record (64 structs or more),
the passes that sorted an address's records, and whether both tables ended equal.

Usage: python bench/probe_table_replay.py FILE.gfp.gz [...]
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))

import numpy as np  # noqa: E402

from gpufootprint.probe import nativecallbacks  # noqa: E402
from gpufootprint.probe.livetable import LiveTable  # noqa: E402
from gpufootprint.records import RecordKind  # noqa: E402
from gpufootprint.wire import cupti_layout  # noqa: E402
from gpufootprint.wire.framing import FrameType  # noqa: E402
from gpufootprint.wire.sources import TraceFile  # noqa: E402

RAW = cupti_layout.RAW_DTYPES[cupti_layout.MEMORY2]
FIELDS = (("timestamp", "ts"), ("address", "addr"), ("bytes", "bytes"), ("dev", "dev"), ("ctx", "ctx"),
          ("stream", "stream"), ("corr", "corr"), ("op", "op"), ("mk", "mk"), ("is_async", "is_async"))


def as_structs(recs: np.ndarray) -> np.ndarray:
    out = np.zeros(len(recs), RAW)
    for theirs, ours in FIELDS:
        out[theirs] = recs[ours]
    return out


def replay(path: str) -> dict[str, object]:
    """Per recording: watermarks; C passes (a queue of 64 structs or more); watermarks applied as the C pass
    answered (``paired_in_c``); watermarks each side applied record by record (an address allocated twice in a
    row, or one already live: both sides must decide the same); C passes that sorted an address's records; and
    whether the two tables ended equal."""
    pairer = nativecallbacks.Pairer()
    c_side, numpy_side = LiveTable(pairer=pairer), LiveTable()
    by_record: dict[str, int] = {"c": 0, "numpy": 0}
    for name, table in (("c", c_side), ("numpy", numpy_side)):
        inner = table._apply_raw_each

        def counted(ready: np.ndarray, _inner: object = inner, _name: str = name) -> None:
            if len(ready) >= 64:  # the bulk path's bound: below it both sides go record by record
                by_record[_name] += 1
            _inner(ready)  # type: ignore[operator]

        table._apply_raw_each = counted  # type: ignore[method-assign]
    watermarks = 0
    for frame in TraceFile(path).frames():
        if frame.type is FrameType.BATCH and RecordKind(frame.tag) == RecordKind.MEMORY:
            structs = as_structs(frame.records())
            for table in (c_side, numpy_side):
                table.add_raw(structs, pid=1)
        elif frame.type is FrameType.WATERMARK:
            watermarks += 1
            for table in (c_side, numpy_side):
                table.advance(frame.watermark())
    return {"watermarks": watermarks, "c_passes": pairer.calls, "applied_in_c": getattr(c_side, "paired_in_c", None),  # None: a tree before it was counted
            "record_by_record_c": by_record["c"], "record_by_record_numpy": by_record["numpy"],
            "sorted_an_address": pairer.unordered,
            "tables_equal": list(c_side.rows.items()) == list(numpy_side.rows.items())
            and c_side.totals() == numpy_side.totals() and c_side.stale_releases == numpy_side.stale_releases}


def main() -> int:
    for path in sys.argv[1:]:
        print(path, replay(path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
