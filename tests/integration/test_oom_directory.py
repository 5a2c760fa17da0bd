"""``oom.directory`` is checked when the daemon starts, not at the first OOM (whose capture would
then be lost), and its default works without root (issue 30, item 3). Run as a user runs it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpufootprint.cli.common import check_oom_directory
from gpufootprint.configload import load_config
from gpufootprint.errors import ConfigError
from gpufootprint.statedir import SYSTEM_OOM_DIRECTORY, default_oom_directory

from tests.conftest import cli_env
from tests.daemon_process import scrape, wait

pytestmark = pytest.mark.integration


def test_an_unwritable_oom_directory_set_on_purpose_stops_the_daemon_at_start(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "gpufootprint", "daemon", "--listen", "127.0.0.1:0", "--socket",
                        str(tmp_path / "p.sock"), "--set", "oom.directory=/proc/gpufootprint-oom"], env=cli_env(),
                       cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("gpufootprint daemon: error: oom.directory /proc/gpufootprint-oom: "
                                                   "cannot write there"), r.stderr


def test_a_writable_oom_directory_is_made_at_start_before_any_oom(tmp_path: Path, daemons) -> None:  # type: ignore[no-untyped-def]
    where = tmp_path / "captures" / "oom"
    p = daemons("--set", f"oom.directory={where}", cwd=tmp_path)
    try:
        assert wait(lambda: scrape(p.port).get("gpufootprint_up") is not None or where.is_dir(), timeout=30)
        assert where.is_dir() and list(where.iterdir()) == []  # made, and the write check left nothing behind
    finally:
        p.stop()
    assert "oom captures disabled" not in p.log(), p.log()


def test_the_default_is_var_lib_for_root_and_the_xdg_state_directory_otherwise(tmp_path: Path) -> None:
    assert default_oom_directory(0, {}) == SYSTEM_OOM_DIRECTORY
    assert default_oom_directory(1000, {"XDG_STATE_HOME": str(tmp_path)}) == str(tmp_path / "gpufootprint" / "oom")
    home = default_oom_directory(1000, {})
    assert home == str(Path("~/.local/state/gpufootprint/oom").expanduser())
    assert load_config(None, env={}).oom.directory == ""  # empty: the default for whoever runs the daemon


def test_without_root_the_default_is_written_under_the_users_state_directory(tmp_path: Path, daemons) -> None:  # type: ignore[no-untyped-def]
    if os.geteuid() == 0:
        pytest.skip("running as root here, where the default is /var/lib/gpufootprint/oom (checked above); "
                    "the interpreter of this venv is not readable by another user, so no non-root daemon can run")
    env = {**cli_env(), "XDG_STATE_HOME": str(tmp_path / "state")}
    p = daemons(env=env, cwd=tmp_path)
    try:
        assert wait(lambda: (tmp_path / "state" / "gpufootprint" / "oom").is_dir(), timeout=30)
    finally:
        p.stop()
    assert "oom captures disabled" not in p.log(), p.log()


def test_an_unwritable_default_is_one_warning_line_and_the_daemon_runs(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    # The default itself (no explicit key) where it cannot be written, as a non-root user with no home.
    monkeypatch.setattr("gpufootprint.statedir.default_oom_directory", lambda: "/proc/gpufootprint/oom")
    with caplog.at_level(logging.WARNING, logger="gpufootprint.cli"):
        check_oom_directory(load_config(None, env={}))
    (record,) = [r for r in caplog.records if "oom captures disabled" in r.getMessage()]
    assert "/proc/gpufootprint/oom" in record.getMessage()
    with pytest.raises(ConfigError, match="oom.directory /proc/x: cannot write there"):
        check_oom_directory(load_config(None, env={}, overrides={"oom.directory": "/proc/x"}))
