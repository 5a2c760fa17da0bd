"""ruff stays clean on the package: its findings are fixed or carry a reason, and the stage bans hold
(engines/, features/, footprint/ import no pynvml, cupti or prometheus_client; exporter/ imports
nothing from gpufootprint.ingest; see the ruff.toml beside each)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_is_clean_on_the_package() -> None:
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "daemon/"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_enforces_the_stage_bans() -> None:
    # The bans only hold if ruff finds each stage's ruff.toml: a module that breaks one must fail.
    pkg = ROOT / "daemon" / "gpufootprint"
    cases = {pkg / "engines": "import pynvml\n", pkg / "features": "from cupti import cupti\n",
             pkg / "footprint": "import prometheus_client\n",
             pkg / "exporter": "from gpufootprint.ingest.server import IngestServer\n"}
    for folder, line in cases.items():
        # ruff reads the source from stdin and takes the config that --stdin-filename's folder has.
        proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                               "--stdin-filename", str(folder / "_ban_check.py"), "-"], cwd=ROOT, input=line,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 1 and "TID251" in proc.stdout, (folder.name, proc.stdout + proc.stderr)
