"""Building tests/native/cupti_threads.c (C threads that call CUPTI's buffer callbacks as CUPTI does) with the
system's C compiler, the one that builds the probe's library at install: for tests/unit/test_probe_native.py
and bench/callback_cost.py."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("cupti_threads.c")


def compiler() -> str | None:
    """``$CC``, else ``cc`` or ``gcc`` on the PATH; None where there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(out_dir: Path) -> Path:
    """The shim as a shared library in ``out_dir`` (RuntimeError without a compiler)."""
    cc = compiler()
    if not cc:
        raise RuntimeError("no C compiler (CC, cc or gcc) for tests/native/cupti_threads.c")
    out = out_dir / "libcupti_threads.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-pthread", "-o", str(out), str(SOURCE)], check=True,
                   capture_output=True)
    return out
