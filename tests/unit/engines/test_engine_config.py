from __future__ import annotations

import pytest
from gpufootprint.configload import load_config
from gpufootprint.errors import ConfigError


def write(tmp_path, text: str):  # type: ignore[no-untyped-def]
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_are_the_issue_policy_and_thresholds() -> None:
    c = load_config(env={})
    assert (c.graph_advisor.min_op_count, c.graph_advisor.min_mean_kernel_ms, c.graph_advisor.min_reuse) == (8, 0.5, 0.7)
    assert (c.degradation.low_utilization, c.degradation.low_utilization_seconds,
            c.degradation.memory_quota_ratio) == (0.30, 300.0, 0.80)
    assert c.cost.prices["H200"] > 0 and c.budgets.rules == []


@pytest.mark.parametrize("rule, message", [
    ("{scope: cluster, name: x, bytes: 1}", "budgets.rules[0].scope: 'cluster' is not one of"),
    ("{scope: pod, name: x}", "budgets.rules[0]: give exactly one of bytes or fraction"),
    ("{scope: pod, name: x, bytes: 1, fraction: 0.5}", "budgets.rules[0]: give exactly one of bytes or fraction"),
    ("{scope: pod, name: x, bytes: -1}", "budgets.rules[0].bytes: expected a non-negative integer"),
    ("{scope: pod, name: x, fraction: 1.5}", "budgets.rules[0].fraction: expected a number in [0.0, 1.0]"),
    ("{scope: pod, name: x, bytes: 1, soft_action: yes please}", "budgets.rules[0].soft_action: expected true"),
    ("{scope: pod, name: x, bytes: 1, hard: true}", "budgets.rules[0].hard: unknown key"),
])
def test_bad_budget_rule_names_file_and_key_path(tmp_path, rule: str, message: str) -> None:  # type: ignore[no-untyped-def]
    p = write(tmp_path, f"budgets:\n  rules:\n    - {rule}\n")
    with pytest.raises(ConfigError) as err:
        load_config(p, env={})
    assert str(p) in str(err.value) and message in str(err.value)


def test_bad_price_and_threshold_name_their_keys(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=r"cost.prices.H200: expected a non-negative float"):
        load_config(write(tmp_path, "cost:\n  prices: {H200: cheap}\n"), env={})
    with pytest.raises(ConfigError, match=r"graph_advisor.min_reuse: 1.5 is above the maximum 1"):
        load_config(write(tmp_path, "graph_advisor:\n  min_reuse: 1.5\n"), env={})
    c = load_config(env={"GPUFOOTPRINT_LEAKS__MIN_AGE_SECONDS": "60"})
    assert c.leaks.min_age_seconds == 60.0


def test_a_user_price_table_replaces_the_example_one(tmp_path) -> None:  # type: ignore[no-untyped-def]
    c = load_config(write(tmp_path, "cost:\n  prices: {H200: 2.5}\n  default_model: H200\n"), env={})
    assert c.cost.prices == {"H200": 2.5} and c.cost.default_model == "H200"
