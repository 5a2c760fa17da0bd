"""Output files that appear whole or not at all.

Every command that writes a file (convert, report, export, replay --report-json) writes
into a hidden temporary file beside the target and renames it over the target only when
the command succeeded: an interrupted command, a damaged input or a full disk leaves
the target as it was (absent, or the previous version), never a partial file that does
not say it is partial. The temporary file sits in the target's directory because a
rename is atomic only within one file system.

Errors name the option and the path in one line (exit 2, ``ConfigError``): an output
that cannot be written is a usage error, as README says.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from gpufootprint.errors import ConfigError


def _temp_beside(option: str, path: str) -> tuple[int, str]:
    target = Path(path)
    try:
        return tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent or ".")
    except OSError as exc:
        raise ConfigError(f"command line {option} {path}: cannot write ({exc.strerror or exc})") from None


def probe_writable(option: str, path: str) -> None:
    """Fail now (one line, exit 2) if ``path`` could not be written the way ``atomic_output`` will
    write it: by creating a file in its directory. ``os.access`` is not enough: root passes it
    for /proc, where no file can be created."""
    fd, tmp = _temp_beside(option, path)
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(tmp)


@contextlib.contextmanager
def atomic_output(option: str, path: str | Path, mode: str = "wb") -> Iterator[IO[Any]]:
    """A file object for ``path``: renamed into place if the block ends normally, removed if it
    raises (any exception, KeyboardInterrupt included). ``*.gz`` paths are gzip-compressed."""
    path = str(path)
    fd, tmp = _temp_beside(option, path)
    committed = False
    try:
        raw = os.fdopen(fd, "wb")
        fh: IO[Any]
        if path.endswith(".gz"):
            # closed below (not a with block: the caller writes between open and close)
            fh = gzip.open(raw, mode if "b" in mode or "t" in mode else mode + "t")  # type: ignore[assignment]  # noqa: SIM115
        elif "b" in mode:
            fh = raw
        else:
            fh = open(raw.fileno(), mode, closefd=False)  # noqa: SIM115 - closed below, before raw
        try:
            yield fh
        except BaseException:
            with contextlib.suppress(Exception):
                fh.close()
                raw.close()
            raise
        fh.close()  # a full disk may show only here (the last buffer): then no rename
        raw.close()
        _keep_mode(path, tmp)
        os.replace(tmp, path)
        committed = True
    except OSError as exc:
        raise ConfigError(f"command line {option} {path}: cannot write ({exc.strerror or exc})") from None
    finally:
        if not committed:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _keep_mode(path: str, tmp: str) -> None:
    """mkstemp makes 0600 files; give the new file what ``open`` would have (umask), or the old one's mode."""
    try:
        mode = os.stat(path).st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    os.chmod(tmp, mode)
