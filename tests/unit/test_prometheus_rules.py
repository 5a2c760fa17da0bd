"""deploy/prometheus/rules.yml: promtool check rules and the promtool unit tests.

promtool comes from Debian's `prometheus` package; missing under CI=true is a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
TESTS = ROOT / "deploy" / "prometheus" / "tests" / "rules_test.yml"


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is missing: apt-get install -y prometheus")
        pytest.skip("promtool is missing: apt-get install -y prometheus")
    return found


def test_rules_file_is_valid() -> None:
    result = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    import yaml

    groups = yaml.safe_load(RULES.read_text())["groups"]
    n = sum(len(g["rules"]) for g in groups)
    assert n >= 13 and f"SUCCESS: {n} rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = subprocess.run([promtool(), "test", "rules", str(TESTS)], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_unit_tests_cover_every_alert() -> None:
    import yaml

    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r}
    tested = {t["alertname"] for case in yaml.safe_load(TESTS.read_text())["tests"]
              for t in case.get("alert_rule_test", [])}
    assert alerts == tested
