"""The ``raw`` delivery's side in the sender thread: one CUPTI buffer, as the callbacks (rawcallbacks.py)
queued it, walked, then packed here or forwarded.

A buffer is walked by ``cupti_layout.walk`` (by CUPTI's own walk where ours cannot, or
to check ours: ``raw_verify_walk``). Its records are packed into our record batches,
unless the daemon said it reads CUPTI's buffers itself: then a buffer of memory and
pool records goes to it as CUPTI wrote it (one copy into the frame, no conversion in
the workload's process), and the probe keeps only the MEMORY2 structs its own table
needs. Sender thread only.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from gpufootprint.probe.arming import CuptiArming
from gpufootprint.probe.link import FileSink, SocketLink
from gpufootprint.probe.livetable import LiveTable
from gpufootprint.probe.nativecallbacks import Read, Walker, kind_mask
from gpufootprint.probe.oom import OomWatch
from gpufootprint.probe.packing import Packer
from gpufootprint.probe.rawcallbacks import view
from gpufootprint.probe.resync import ResyncSchedule
from gpufootprint.records import MemoryKind
from gpufootprint.wire import cupti_layout, framing

#: CUPTI record kinds a forwarded buffer may hold (memory, pool, and the per-API records of the
#: mapping hooks and the allocation calls, which the daemon skips): anything else (kernels, whose
#: names are pointers into this process; copies) is read here as before. A daemon that says
#: ``cupti_buffers: 1`` steps over DRIVER records only; ``2`` over RUNTIME records too.
FORWARDABLE_V1 = frozenset({cupti_layout.MEMORY2, cupti_layout.MEMORY_POOL, cupti_layout.DRIVER})
FORWARDABLE = FORWARDABLE_V1 | {cupti_layout.RUNTIME}


def memory_seen(packer: Packer, cupti: CuptiArming, recs: np.ndarray, in_gap: bool) -> None:
    """What a batch of memory records (MEMORY2 structs or our records: both name ``dev`` and ``mk``) tells the
    sender: the device an API record (OOM, launch) is stamped with, and whether unified memory needs its
    counters."""
    packer.api_dev = int(recs["dev"][-1])
    if cupti.um_wanted and bool((recs["mk"] == MemoryKind.MANAGED).any()):
        cupti.configure_unified_memory(in_gap)


class RawBufferReader:
    def __init__(self, *, pid: int, verify_walk: bool, packer: Packer, table: LiveTable, oom: OomWatch,
                 cupti: CuptiArming, resyncs: ResyncSchedule, counters: Counter[str],
                 dropped_by_reason: Counter[str], clock_ns: Callable[[], int], walker: Walker | None = None,
                 errors: list[str] | None = None, native_read: bool = True) -> None:
        self.pid = pid
        self.errors = errors
        self.verify_walk = verify_walk
        self.packer = packer
        self.table = table
        self.oom = oom
        self.cupti = cupti
        self.resyncs = resyncs
        self.counters = counters
        self.dropped_by_reason = dropped_by_reason
        self._clock_ns = clock_ns
        self.forward_seconds = 0.0  # CPU time framing forwarded buffers (part of callback_seconds)
        # The walk in C (probe/nativecallbacks.py) where the library loaded: a buffer whose kinds are mixed
        # unevenly costs the Python walk a loop step a record (PyTorch's cache off: about 2 us a record)
        self.walker = walker
        # A forwarded buffer read in one C call (``Walker.read``: the walk, the MEMORY2 structs copied into the
        # table's queue, the API records' return values looked at) where the walker loaded; off: walked in C,
        # the rest in numpy (what the probe did before 2026-12-07 evening; the bench's lever)
        self.native_read = native_read and walker is not None
        # Forwarded buffers with a checksum: False once the daemon said it takes them without (its
        # level, framing.CUPTI_BUFFERS_UNCHECKED), until the next connection.
        self.checked = True

    def read(self, address: int, valid: int, *, forward_to: SocketLink | None, forwardable: frozenset[int],
             tee: FileSink | None, in_gap: bool) -> None:
        """Read one CUPTI buffer's records into batches (or forward it) and give the buffer back.

        ``forward_to``: the connected link, when the daemon reads CUPTI's buffers itself;
        ``forwardable``: the kinds it reads or steps over in them."""
        raw = self.cupti.raw
        assert raw is not None
        try:
            buf = view(address, valid)
            if forward_to is not None and self.native_read:
                assert self.walker is not None
                got = self.walker.read(address, valid, self.table.pending_raw)
                # A buffer our walk cannot read, or with kinds the daemon does not read (kernels: their names are
                # pointers into this process), or (``verify_walk``) whose walk CUPTI's contradicts, goes the way
                # below, which counts and says the disagreement (the structs written past the queue's end were
                # not taken into it).
                if got is not None and not got.kinds & ~kind_mask(forwardable) \
                        and (not self.verify_walk or self._agrees_with_cupti(address, valid, got)):
                    self._forward_read(forward_to, tee, in_gap, buf, valid, got)
                    self.counters["raw_buffers"] += 1
                    self.counters["native_reads"] += 1
                    return
            if forward_to is not None and not self.verify_walk \
                    and cupti_layout.uniform_kind(buf, valid) == cupti_layout.MEMORY2:
                # Allocation churn fills whole buffers with MEMORY2 records: no walk needed.
                self._forward(forward_to, tee, in_gap, buf, valid, None)
                self.counters["raw_buffers"] += 1
                return
            offsets, ours = self._walk(buf, address, valid)
            if offsets is None:
                self.counters["raw_buffers_unreadable"] += 1
            elif forward_to is not None and ours and offsets.keys() <= forwardable:
                # Only what our walk reads goes out unread: the daemon walks it the same way. A buffer read
                # by CUPTI's walk instead is packed here (the daemon could not walk it, and dropped it whole).
                self._forward(forward_to, tee, in_gap, buf, valid, offsets)
            else:
                n = self.packer.pack_raw(buf, valid, offsets)
                self.counters["raw_records"] += n
                self.packer.flush()
            self.counters["raw_buffers"] += 1
        finally:
            raw.give_back(address)

    def _agrees_with_cupti(self, address: int, valid: int, got: Read) -> bool:
        """``verify_walk`` for the C read: CUPTI's own walk of the buffer gives the same offsets (counted as
        verified); False where it does not or cannot walk it (counted by the walk below, which reads it again)."""
        backend = self.cupti.backend
        reference = backend.walk_raw(address, valid) if backend is not None else None
        if reference is None or reference != {k: list(v) for k, v in got.offsets().items()}:
            return False
        self.counters["raw_walks_verified"] += 1
        return True

    def _walk(self, buf: memoryview, address: int,
              valid: int) -> tuple[Mapping[int, Sequence[int]] | None, bool]:
        """Each kind's record offsets: our walk (in C where the library loaded, for a buffer of more than one
        kind), CUPTI's where ours cannot (or to check ours); and whether they are our walk's (the daemon's)."""
        # A buffer of one kind is one look and a view of its bytes whichever walk; looked at once here.
        offsets: Mapping[int, Sequence[int]] | None = cupti_layout.uniform_runs(buf, valid)
        if offsets is None and self.walker is not None:
            offsets = self.walker(address, valid)
            self.counters["native_walks"] += offsets is not None
        if offsets is None:
            offsets = cupti_layout.walk(buf, valid)
        ours = offsets is not None
        if self.verify_walk or offsets is None:
            backend = self.cupti.backend
            reference = backend.walk_raw(address, valid) if backend is not None else None
            if offsets is None:
                self.counters["raw_walk_fallbacks"] += 1
                self._note_walks("our walk cannot read it", buf, valid, reference)
                offsets = reference
            elif reference is not None:
                self.counters["raw_walks_verified"] += 1
                if reference != {k: list(v) for k, v in offsets.items()}:
                    self.counters["raw_walk_mismatches"] += 1
                    self._note_walks("our walk and CUPTI's disagree", buf, valid, reference)
                    offsets, ours = reference, False
        return offsets, ours

    def _note_walks(self, what: str, buf: memoryview, valid: int,
                    reference: Mapping[int, Sequence[int]] | None) -> None:
        """A buffer read by CUPTI's walk instead of ours: the bytes past CUPTI's last record counted
        (``raw_walk_unread_bytes``: their records, if any, are lost here and at the daemon alike, and no
        resync brings them back), and the first few said in the probe's errors: where a record-by-record
        walk stops, what CUPTI's walk found and up to which byte."""
        sizes = cupti_layout.walk_sizes()
        # A kind we cannot size counts as ending where it starts: the unread bytes are then an upper bound.
        end = max((int(v[-1]) + sizes.get(k, 0) for k, v in (reference or {}).items() if len(v)), default=0)
        self.counters["raw_walk_unread_bytes"] += max(0, valid - end)
        if self.errors is None or len(self.errors) >= 20:
            return
        found = ", ".join(f"{len(v)} of kind {k}" for k, v in (reference or {}).items()) or "nothing"
        self.errors.append(f"walk: a CUPTI buffer {what} ({cupti_layout.walk_stop(buf, valid)}); CUPTI's walk "
                           f"found {found}, up to byte {end} of {valid}: packed here, not forwarded")

    def _forward(self, link: SocketLink, tee: FileSink | None, in_gap: bool, buf: memoryview, valid: int,
                 offsets: Mapping[int, Sequence[int]] | None) -> None:
        """One CUPTI buffer to the daemon as it is: no conversion in the workload's process.

        ``offsets`` None: the buffer holds MEMORY2 records only, back to back."""
        u8 = np.frombuffer(buf, dtype=np.uint8, count=valid)
        size = cupti_layout.RAW_DTYPES[cupti_layout.MEMORY2].itemsize
        if offsets is None:
            offsets = {cupti_layout.MEMORY2: range(0, valid, size)}
        n = sum(len(v) for k, v in offsets.items() if k in cupti_layout.RECORD_KIND)
        mem = offsets.get(cupti_layout.MEMORY2)
        if mem is not None and len(mem):
            structs = cupti_layout.gather(u8, cupti_layout.MEMORY2, mem)
            self.table.add_raw(structs, self.pid)
            memory_seen(self.packer, self.cupti, structs, in_gap)
        for api_kind in cupti_layout.API_KINDS:  # failed allocations are found here, before the buffer leaves
            api = offsets.get(api_kind)
            if api is not None and len(api):
                self.oom.api_rows(u8, api, api_kind)
                # a launch window's calls go on as records of their own (the daemon steps over these)
                self.packer.put_launch_rows(u8, api, api_kind)
        if tee is not None:
            self._tee(tee, buf, valid, offsets)
        self._send(link, buf, valid, n, structs if mem is not None and len(mem) else None)

    def _forward_read(self, link: SocketLink, tee: FileSink | None, in_gap: bool, buf: memoryview, valid: int,
                      got: Read) -> None:
        """``_forward`` for a buffer ``Walker.read`` read: its MEMORY2 structs already copied into the table's
        queue (taken in here), its API records' return values already looked at. The offsets are built only
        for what reads them: a failed call, a failure waiting to be judged, a launch window, a recording."""
        structs = None
        if got.memory2:
            structs = got.keep()
            self.table.raw_pid = self.pid
            memory_seen(self.packer, self.cupti, structs, in_gap)
        walked: tuple[Mapping[int, Sequence[int]], np.ndarray] | None = None  # offsets and bytes, made if asked for
        for api_kind, failed in got.failed_calls.items():
            if not got.holds(api_kind):
                continue
            wanted = self.oom.reads_calls(failed=failed > 0)
            if wanted or self.packer.launch_window_open() or tee is not None:
                if walked is None:
                    walked = got.offsets(), np.frombuffer(buf, dtype=np.uint8, count=valid)
                offsets, u8 = walked
                if wanted:
                    self.oom.api_rows(u8, offsets[api_kind], api_kind)
                self.packer.put_launch_rows(u8, offsets[api_kind], api_kind)
        if tee is not None:
            self._tee(tee, buf, valid, walked[0] if walked is not None else got.offsets())
        self._send(link, buf, valid, got.records, structs)

    def _tee(self, tee: FileSink, buf: memoryview, valid: int, offsets: Mapping[int, Sequence[int]]) -> None:
        """Recordings keep the plain BATCH frames every reader knows."""
        u8 = np.frombuffer(buf, dtype=np.uint8, count=valid)
        for ck, offs in offsets.items():
            kind = cupti_layout.RECORD_KIND.get(ck)
            if kind is not None:
                recs = cupti_layout.convert(ck, cupti_layout.gather(u8, ck, offs), self.pid)
                try:
                    tee.put(framing.encode_batch(kind, recs))
                except OSError:
                    self.counters["tee_errors"] += 1

    def _send(self, link: SocketLink, buf: memoryview, valid: int, n: int, structs: np.ndarray | None) -> None:
        """One forwarded buffer's frame to the link; ``n`` the records the daemon counts in it, ``structs``
        its MEMORY2 structs (for the resync a dropped buffer needs), if any."""
        self.counters["raw_records"] += n
        self.counters["forwarded_buffers"] += 1
        if not self.checked:
            self.counters["forwarded_unchecked"] += 1
        t0 = time.thread_time()
        parts = framing.cupti_buffer_parts(self.pid, buf[:valid], checked=self.checked)
        self.forward_seconds += time.thread_time() - t0
        if link.put_parts(parts, records=n):
            self.counters["records_sent"] += n
            self.counters["batches_sent"] += 1
        else:
            self.counters["records_dropped"] += n
            self.dropped_by_reason["buffer_full"] += n
            if structs is not None:
                self.resyncs.dropped(int(structs["timestamp"].max()))
            elif n:
                self.resyncs.dropped(self._clock_ns())
