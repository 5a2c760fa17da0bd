"""The bursts test's one try (``test_ordering._bursts_behind_busy_threads``) run again and again beside CPU-bound
processes: how often the probe drops records when its process cannot have the CPU (docs/known-issues.md).

  python -m tests.integration.starved_tries TRIES HOGS [none|probe|daemon] [ENV=VALUE ...]

``probe``: the probe's process reniced to -15 (root); ``daemon``: the test's daemon threads reniced instead.
ENV=VALUE pairs go to the probe's process (e.g. GPUFOOTPRINT_PROBE_NATIVE_PUMP=0). Prints each try's outcome
(ok, or FAIL with the records dropped) and the count.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tests.integration import test_ordering as t
from tests.native import shim


def main() -> int:
    tries, hogs = int(sys.argv[1]), int(sys.argv[2])
    mode = sys.argv[3] if len(sys.argv) > 3 else "none"
    env = dict(kv.split("=", 1) for kv in sys.argv[4:])
    base = Path(tempfile.mkdtemp(prefix="gfp-starved-"))
    compiled = shim.build(base)
    daemon_class, child = t.Daemon, t.child

    class Reniced(daemon_class):  # type: ignore[misc,valid-type]
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            if mode == "daemon":
                for th in threading.enumerate():
                    if th is not threading.main_thread() and th.native_id is not None:
                        os.setpriority(os.PRIO_PROCESS, th.native_id, -15)

    def started(*a: Any, **k: Any) -> Any:
        p = child(*a, **{**k, **env})
        if mode == "probe":
            def renice() -> None:  # its threads as they start (each thread's nice value is its own)
                for _ in range(40):
                    try:
                        for tid in os.listdir(f"/proc/{p.pid}/task"):
                            os.setpriority(os.PRIO_PROCESS, int(tid), -15)
                    except OSError:
                        pass
                    time.sleep(0.05)
            threading.Thread(target=renice, daemon=True).start()
        return p

    t.Daemon, t.child = Reniced, started  # type: ignore[misc]
    outcomes = []
    for i in range(tries):
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
        where = base / f"try{i}"
        where.mkdir()
        try:
            failure = t._bursts_behind_busy_threads(where, compiled, **env)
        except Exception as exc:  # noqa: BLE001 - a try that could not finish is reported as such
            failure = f"{exc!r}"
        finally:
            for b in busy:
                b.kill()
                b.wait()
        dropped = re.findall(r"'records_dropped': (\d+)", failure or "")
        outcomes.append("ok" if failure is None else f"FAIL{dropped or [failure[:80]]}")
        print(time.strftime("%H:%M:%S"), outcomes[-1], flush=True)
    failed = sum(o != "ok" for o in outcomes)
    print(f"{failed} of {tries} tries failed beside {hogs} busy processes (mode {mode}, env {env or 'default'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
