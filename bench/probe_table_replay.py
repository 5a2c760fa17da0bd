"""A recording's memory records through the probe's own table, watermark by watermark: the C pairing
(``gfp_pair``) against numpy's, with what the C pass answered (no CPU timing: see bench/probe_table.py).

The recordings (``tests/data/*.gfp.gz``, the probe's tee) hold the records as the probe's sender packed them,
in delivery order, and its watermarks; each MEMORY batch goes into the table as CUPTI's MEMORY2 structs
(``LiveTable.add_raw``, as a forwarded buffer's do) and each WATERMARK advances it. Prints, per file, the
watermarks the C pass paired, those where it found an address allocated twice in a row in time order (the
record-by-record rule then), those where it sorted an address's records, and whether both tables ended equal.

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
    pairer = nativecallbacks.Pairer()
    answers: Counter[str] = Counter()

    def counted(*args: object) -> object:
        paired = pairer(*args)  # type: ignore[arg-type]
        if paired is not None:
            answers["twice" if paired.twice else "paired"] += 1
        return paired

    c_side, numpy_side = LiveTable(pairer=counted), LiveTable()
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
    return {"watermarks": watermarks, "c_passes": pairer.calls, "paired": answers["paired"],
            "twice": answers["twice"], "sorted_an_address": pairer.unordered,
            "tables_equal": list(c_side.rows.items()) == list(numpy_side.rows.items())
            and c_side.totals() == numpy_side.totals() and c_side.stale_releases == numpy_side.stale_releases}


def main() -> int:
    for path in sys.argv[1:]:
        print(path, replay(path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
