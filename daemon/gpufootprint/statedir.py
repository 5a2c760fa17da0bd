"""Where the daemon keeps files of its own (OOM captures), and whether it can.

``oom.directory`` left empty (the default) means: ``/var/lib/gpufootprint/oom`` when running as root
(a node install by the package manager or an init system), else the XDG state directory
(``$XDG_STATE_HOME/gpufootprint/oom``, ``~/.local/state/gpufootprint/oom``): a daemon installed
with ``pip install --user`` or run by a developer can write there, and /var/lib it cannot. The
container image sets /var/lib/gpufootprint/oom explicitly (and the DaemonSet mounts a volume there).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

SYSTEM_OOM_DIRECTORY = "/var/lib/gpufootprint/oom"


def default_oom_directory(euid: int | None = None, env: Mapping[str, str] | None = None) -> str:
    euid = os.geteuid() if euid is None else euid
    env = os.environ if env is None else env
    if euid == 0:
        return SYSTEM_OOM_DIRECTORY
    state = env.get("XDG_STATE_HOME") or str(Path("~/.local/state").expanduser())
    return str(Path(state) / "gpufootprint" / "oom")


def unwritable(directory: str) -> str | None:
    """Why no capture could be written into ``directory`` (made if missing), or None when one can:
    a file is created and removed, as a capture will be (an existing directory of another user
    passes ``mkdir`` and fails only there)."""
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-check.", dir=directory)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None
