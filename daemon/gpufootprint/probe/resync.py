"""The probe's table sent whole (a resync), to any sink, and when one is due.

A resync is RESYNC_BEGIN, the live table as MEMORY batches, RESYNC_END: after a
connect (the daemon knows nothing of this process yet), after a torch.profiler
gap (the table changed while CUPTI was away), when the daemon asks, and after
records were dropped while connected (the daemon's copy misses them).
"""

from __future__ import annotations

import numpy as np

from gpufootprint.probe.link import Sink
from gpufootprint.records import RecordKind
from gpufootprint.wire import framing
from gpufootprint.wire.framing import FrameType

#: Records per MEMORY batch of a resync (a frame of 4096 x 80 bytes fits any socket buffer the settings allow).
CHUNK = 4096
#: Resyncs that repair records dropped while connected: at most this often (under a sustained
#: overload a resync is more load).
DROP_RESYNC_EVERY_S = 2.0


def send_table(sink: Sink, arr: np.ndarray, *, ts: int, reason: str, pid: int) -> None:
    """The table ``arr`` (as of its watermark ``ts``) between RESYNC_BEGIN and RESYNC_END."""
    sink.put(framing.encode_json(FrameType.RESYNC_BEGIN, {"ts": ts, "reason": reason, "entries": len(arr),
                                                          "pid": pid}), must=True)
    send_records(sink, arr)
    sink.put(framing.encode_json(FrameType.RESYNC_END, {"ts": ts, "pid": pid}), must=True)


def send_records(sink: Sink, arr: np.ndarray) -> None:
    """MEMORY records as ordinary batches, never dropped for want of room."""
    for i in range(0, len(arr), CHUNK):
        sink.put(framing.encode_batch(RecordKind.MEMORY, arr[i:i + CHUNK]), must=True)


class ResyncSchedule:
    """When the sender owes the daemon a resync (sender thread only)."""

    def __init__(self) -> None:
        self.requested = False  # the daemon asked, or the table split a range it had sent whole
        # Records dropped while connected (the daemon stopped reading): a resync repairs them once
        # the table holds them (its watermark passes the newest dropped) and the socket has room.
        self.after_ns = 0
        self._drop_resync_at = -DROP_RESYNC_EVERY_S  # monotonic time of the last one

    def dropped(self, newest_ns: int) -> None:
        """Records stamped up to ``newest_ns`` were dropped while connected."""
        self.after_ns = max(self.after_ns, newest_ns)

    def take_requested(self, connected: bool) -> bool:
        if self.requested and connected:
            self.requested = False
            return True
        return False

    def take_dropped(self, now: float, table_ts: int, connected: bool, room: bool) -> bool:
        """True (and the debt cleared) when the dropped records can be repaired now: the table holds
        them, the socket has ``room``, and the last such resync is a few seconds old."""
        if self.after_ns and table_ts >= self.after_ns and connected and room \
                and now - self._drop_resync_at >= DROP_RESYNC_EVERY_S:
            self.after_ns = 0
            self._drop_resync_at = now
            return True
        return False
