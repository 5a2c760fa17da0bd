"""Every test under tests/integration/ carries the ``integration`` marker, added here by path so a new
file cannot forget it (``-m "not integration"`` then runs the fast unit tests alone); and the ``live``
fixture that test_hostile_peers and test_local_attacks share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A conftest's hook sees the whole session's items, not only this folder's.
    for item in items:
        if _HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture
def live(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Starts in-process daemons (test_hostile_peers.LiveServer), each with a good peer reporting 1 MiB."""
    from tests.integration.test_hostile_peers import GoodPeer, LiveServer

    made: list[tuple[LiveServer, GoodPeer]] = []

    def start(**daemon: Any) -> tuple[LiveServer, GoodPeer]:
        path = str(tmp_path / f"d{len(made)}.sock")
        srv = LiveServer(path, **daemon)
        good = GoodPeer(path)
        srv.wait(lambda: srv.device_bytes(good.pid) == 1 << 20)
        made.append((srv, good))
        return srv, good

    yield start
    for srv, good in made:
        good.close()
        srv.stop()
