"""Writes deploy/k8s/prometheusrule.yaml: deploy/prometheus/rules.yml wrapped in a PrometheusRule
object for the Prometheus Operator, so nobody wraps it by hand (and gets it out of step).

rules.yml stays the one source (promtool tests it, the compose Prometheus loads it); this object
is generated from it, and tests/unit/test_deploy_manifests.py checks that the two agree.

    python deploy/prometheus/generate_prometheusrule.py          # rewrite the object
    python deploy/prometheus/generate_prometheusrule.py --check  # exit 1 if it is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
OUT = ROOT / "deploy" / "k8s" / "prometheusrule.yaml"
HEADER = """\
# GENERATED from deploy/prometheus/rules.yml by deploy/prometheus/generate_prometheusrule.py:
# edit rules.yml and run the generator (a test fails while the two differ).
# For the Prometheus Operator: its ruleSelector must match these labels (many installs select
# on `release: <the operator's release name>`: add that label in your overlay).
"""


def prometheus_rule(groups: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "gpufootprint", "namespace": "gpufootprint",
                         "labels": {"app.kubernetes.io/name": "gpufootprint", "role": "alert-rules"}},
            "spec": {"groups": groups}}


def render() -> str:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return HEADER + yaml.safe_dump(prometheus_rule(groups), sort_keys=False, width=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the object differs from rules.yml")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is out of date: run {Path(__file__).relative_to(ROOT)}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
