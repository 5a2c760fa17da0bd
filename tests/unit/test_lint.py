"""ruff stays clean on the package and on the tests, and the import contracts hold.

The contracts (pyproject.toml, ``[tool.importlinter]``; docs/architecture.md) are the package's
floors as one layers contract, the probe beside the daemon, the exporter reading snapshots only,
and the doors to pynvml, CUPTI and prometheus_client. import-linter checks them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = [sys.executable, "-c", ("import sys; from importlinter.cli import lint_imports_command; "
                "sys.exit(lint_imports_command())")]


def test_ruff_is_clean_on_the_package() -> None:
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "daemon/"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_is_clean_on_the_tests() -> None:
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "tests/"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_import_contracts_hold() -> None:
    proc = subprocess.run([*LINT_IMPORTS, "--no-cache", str(ROOT / "pyproject.toml")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout, proc.stdout


# One import that breaks each contract, in the module it is added to, and the contract's id.
BREAKS = {
    "floors": ("footprint/table.py", "import gpufootprint.exporter.http"),
    "floors-ingest-below-pipeline": ("pipeline.py", "from gpufootprint.ingest import session"),
    "probe-beside": ("probe/link.py", "from gpufootprint import pipeline"),
    "probe-alone": ("ingest/session.py", "from gpufootprint.probe import intake"),
    "exporter-reads-snapshots": ("exporter/collector.py", "from gpufootprint.ingest.server import IngestServer"),
    "nvml-door": ("probe/untracked.py", "import pynvml"),
    "cupti-in-probe": ("features/frames.py", "from cupti import cupti"),
    "metrics-in-exporter": ("engines/graph.py", "import prometheus_client"),
}


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_each_import_contract_catches_an_import_that_breaks_it(case: str, tmp_path: Path) -> None:
    # A copy of the package with one import added: the contracts must fail on it, naming the import.
    module, line = BREAKS[case]
    pkg = tmp_path / "gpufootprint"
    shutil.copytree(ROOT / "daemon" / "gpufootprint", pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    target = pkg / module
    target.write_text(target.read_text() + "\n" + line + "\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([*LINT_IMPORTS, "--no-cache", str(ROOT / "pyproject.toml")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 broken" in proc.stdout, proc.stdout
    importer = "gpufootprint." + module.removesuffix(".py").replace("/", ".")
    assert importer in proc.stdout, proc.stdout
