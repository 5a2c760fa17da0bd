"""A probed child process for integration tests: tests/integration/probe_child.py runs the real
probe with a fake CUPTI, steered by ``steps`` and a sync file, and prints its final status as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import cli_env

CHILD = str(Path(__file__).resolve().parent / "integration" / "probe_child.py")


def start_probe_child(sock: str | Path, sync: Path, *steps: str, **env: str) -> subprocess.Popen[str]:
    e = cli_env()
    e.update({"GPUFOOTPRINT_PROBE_SOCKET": str(sock), "GPUFOOTPRINT_PROBE_FLUSH_MS": "20",
              "GPUFOOTPRINT_PROBE_HEARTBEAT_MS": "100", "GPUFOOTPRINT_PROBE_RECONNECT_MAX_MS": "200"})
    e.pop("GPUFOOTPRINT_PROBE", None)
    e.update(env)
    return subprocess.Popen([sys.executable, CHILD, str(sync), *steps], env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish_probe_child(p: subprocess.Popen[str], timeout: float = 60) -> dict[str, Any]:
    """Wait for the child; it must exit 0; its last line of output is its status."""
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])
