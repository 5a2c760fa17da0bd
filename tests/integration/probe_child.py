"""A workload child for the probe's CPU integration tests.

It runs the real probe (``gpufootprint.probe.start``) over the fake CUPTI of
tests/probe_fakes.py, the one fake, standing in for the GPU. Steps come from
the command line; ``wait:NAME`` waits for a file in the sync directory, so the
test can stop and restart the daemon at known points.

  python probe_child.py SYNC_DIR STEP [STEP ...]
  steps: alloc:ADDR:SIZE[:KIND]  free:ADDR:SIZE  copy:N  kernel:NAME  mark:LABEL
         wait:NAME  touch:NAME  sleep:SECONDS  burst:N (N allocations and frees)  connected
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import probe_fakes
from gpufootprint import probe


def main() -> int:
    sync, steps = sys.argv[1], sys.argv[2:]
    # The raw delivery (CUPTI's buffers as bytes) is the probe's default; FAKE_DELIVERY=objects
    # drives cupti-python's record-object callbacks instead.
    cls = probe_fakes.FakeCupti if os.environ.get("FAKE_DELIVERY") == "objects" else probe_fakes.FakeRawCupti
    fake = cls(shuffle=True, buffer_records=16)
    t0 = time.perf_counter()
    ok = probe.start(backend=fake, discover_devices=False)
    start_s = time.perf_counter() - t0
    if not ok:
        print(json.dumps({"error": probe.current().errors if probe.current() else None}), flush=True)
        return 3
    workload_s = 0.0
    for step in steps:
        op, _, arg = step.partition(":")
        t = time.perf_counter()
        if op == "alloc":
            parts = arg.split(":")
            fake.alloc(int(parts[0], 0), int(parts[1]), mk=int(parts[2]) if len(parts) > 2 else 3)
        elif op == "free":
            a, s = arg.split(":")
            fake.free(int(a, 0), int(s))
        elif op == "copy":
            fake.emit(probe_fakes.memcpy_record(int(arg)))
        elif op == "kernel":
            fake.emit(probe_fakes.kernel_record(arg))
        elif op == "burst":
            for i in range(int(arg)):
                fake.alloc(0x7000_0000 + i * 4096, 4096)
                fake.free(0x7000_0000 + i * 4096, 4096)
        elif op == "mark":
            probe.mark(arg)
        elif op == "wait":
            end = time.monotonic() + 30
            while not os.path.exists(os.path.join(sync, arg)) and time.monotonic() < end:
                time.sleep(0.01)
        elif op == "touch":
            open(os.path.join(sync, arg), "w").close()
        elif op == "sleep":
            time.sleep(float(arg))
        elif op == "connected":
            end = time.monotonic() + 20
            before = probe.status()["resyncs"]
            while time.monotonic() < end and not (probe.status()["connected"] and probe.status()["resyncs"] > before - 1
                                                  and probe.status()["reconnects"] >= 1):
                time.sleep(0.01)
            time.sleep(0.1)
        workload_s += time.perf_counter() - t
    probe.stop()
    print(json.dumps({"status": probe.status(), "start_s": start_s, "workload_s": workload_s,
                      "lost_while_disabled": fake.lost_while_disabled}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
