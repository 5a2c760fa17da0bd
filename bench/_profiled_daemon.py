"""``python -m gpufootprint ARGS`` with the ingest thread under cProfile (bench/load.py --profile-ingest).

  python bench/_profiled_daemon.py OUT.pstats daemon --socket ... (the daemon's own arguments)

The ingest loop (``IngestServer.run``) runs under ``cProfile`` and its statistics are written to OUT.pstats
when the loop ends (the daemon's orderly stop on SIGTERM). cProfile's own overhead, about twice the cost of
each Python call, inflates the CPU the daemon uses: read shares from it, and CPU from a run without it.
"""

from __future__ import annotations

import cProfile
import sys
from typing import Any

from gpufootprint.cli import main
from gpufootprint.ingest import server

out = sys.argv[1]
_run = server.IngestServer.run


def _profiled_run(self: Any, *args: Any, **kwargs: Any) -> Any:
    prof = cProfile.Profile()
    prof.enable()
    try:
        return _run(self, *args, **kwargs)
    finally:
        prof.disable()
        prof.dump_stats(out)


server.IngestServer.run = _profiled_run  # type: ignore[method-assign]
raise SystemExit(main(sys.argv[2:]))
