"""What a probe's recording itself says at a quiet point: the device allocations its records leave live.

When the daemon's live view and a framework's own figure differ at a quiet point, the question is whose
loss it is. If the records, replayed in time order, leave the same bytes live as the daemon read, the daemon
was faithful to what it got, and the difference is records that never came (a release CUPTI never wrote:
docs/known-issues.md); if they do not, the daemon lost or misread something. The GPU tests say which in
their failure message.
"""

from __future__ import annotations

from pathlib import Path

from gpufootprint import recording
from gpufootprint.records import MemoryKind


def live_at(path: str | Path, label: str) -> tuple[int, dict[int, tuple[int, int]]]:
    """(the mark's pid, {address: (bytes, time)}) of the device allocations live at mark ``label`` when the
    recording's records (and resyncs) of that pid are applied in time order (``recording.tables_at``: a double
    allocation keeps the first, where the daemon keeps the second; the two differ only if their sizes do)."""
    rec = recording.load([path])
    (mark,) = [m for m in rec.marks if m.get("label") == label]
    pid = int(mark["pid"])
    table = recording.tables_at(rec, pid, int(mark.get("dev", 0)), int(mark["ts"]))
    return pid, {addr: (size, ts) for addr, (size, kind, ts) in table.items() if kind == MemoryKind.DEVICE}


def whose_loss(path: str | Path, label: str, daemon_bytes: int, framework_bytes: int) -> str:
    """One line for a failure message: the records' own live bytes at ``label`` beside the daemon's and the
    framework's, and which side the difference is on."""
    _, live = live_at(path, label)
    replayed = sum(size for size, _ in live.values())
    if replayed != daemon_bytes:
        return (f"{label}: the records leave {replayed} B live, the daemon read {daemon_bytes} B: the daemon lost "
                f"or misread records")
    return (f"{label}: the records leave {replayed} B live, as the daemon read, against the framework's "
            f"{framework_bytes} B: records that never came ({len(live)} allocations live in them)")
