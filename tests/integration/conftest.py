"""Every test under tests/integration/ carries the ``integration`` marker, added here by path so a new
file cannot forget it (``-m "not integration"`` then runs the fast unit tests alone)."""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A conftest's hook sees the whole session's items, not only this folder's.
    for item in items:
        if _HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.integration)
