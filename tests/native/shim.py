"""Building tests/native/cupti_threads.c (C threads that call CUPTI's buffer callbacks as CUPTI does) with the
system's C compiler, the one that builds the probe's library at install: for tests/unit/test_probe_native.py
and bench/callback_cost.py. And the daemon's C core of another build, or another file, in its place
(``core_of_abi``, ``core_at``) for the tests of its refusals."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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


def core_of_abi(out_dir: Path, abi: int) -> Path:
    """A ``libgfp-core.so`` in ``out_dir`` that says it is of ABI ``abi`` and has nothing else: a library of
    another build (RuntimeError without a compiler)."""
    cc = compiler()
    if not cc:
        raise RuntimeError("no C compiler (CC, cc or gcc) for a libgfp-core.so of another build")
    src = out_dir / "old.c"
    src.write_text(f"int gfp_core_abi(void) {{ return {abi}; }}\n")
    lib = out_dir / "libgfp-core.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, capture_output=True)
    return lib


@contextmanager
def core_at(monkeypatch: Any, lib: Path) -> Iterator[None]:
    """The daemon's C core loaded from ``lib`` inside the block (its cached load forgotten before and after, so
    the block's load is the file's and later tests get the real one again)."""
    from gpufootprint import native

    monkeypatch.setattr(native, "LIBRARY", lib)
    native.load.cache_clear()
    try:
        yield
    finally:
        native.load.cache_clear()
