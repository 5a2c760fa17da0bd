"""What every command shares: its common options, the configuration it reads (file < environment
< command line), and the checks that fail with one line naming the key or the path."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpufootprint.config import Config, DaemonConfig
from gpufootprint.configload import load_config, parse_set_option
from gpufootprint.errors import ConfigError, TraceError
from gpufootprint.log import setup_logging
from gpufootprint.outfile import atomic_output, probe_writable
from gpufootprint.signals import on_signal, restore

log = logging.getLogger("gpufootprint.cli")

if TYPE_CHECKING:
    from gpufootprint.app import App
    from gpufootprint.nvml.client import NvmlClient


def add_common_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML configuration file (default: none, built-in defaults)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override one configuration key (repeatable)")
    p.add_argument("--log.level", dest="log_level", choices=("debug", "info", "warning", "error"),
                   help="logging.level")
    p.add_argument("--log.format", dest="log_format", choices=("logfmt", "json"), help="logging.format")
    # SUPPRESS: a -v after the command adds to one given before it instead of resetting it to 0
    p.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                   help="debug logging and tracebacks (also accepted before the command)")


def config_from_args(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> Config:
    overrides: dict[str, Any] = {}
    for text in args.sets:
        key, value = parse_set_option(text)
        overrides[key] = value
    overrides.update({k: v for k, v in (extra or {}).items() if v is not None})
    for key, value in (("logging.level", getattr(args, "log_level", None)),
                       ("logging.format", getattr(args, "log_format", None))):
        if value is not None:
            overrides[key] = value
    return load_config(args.config, overrides=overrides)


def setup(config: Config, verbose: int) -> None:
    setup_logging("debug" if verbose else config.logging.level, config.logging.format)


def reason(exc: OSError, other: str = "--listen HOST:PORT") -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"address already in use: is gpufootprint already running? choose another with {other}"
    return exc.strerror or str(exc)


def open_app(config: Config, *, socket_path: str | None, listen: str | None,
              nvml_client: NvmlClient | None = None) -> App:
    """``App`` binds the metrics port when it is built: a busy port is a one-line error here."""
    from gpufootprint.app import App

    try:
        return App(config, socket_path=socket_path, listen=listen, nvml_client=nvml_client)
    except OSError as exc:
        raise ConfigError(f"exporter.listen {listen}: cannot listen ({reason(exc)})") from None


def start_app(app: App, socket_path: str | None) -> None:
    try:
        app.start()
    except OSError as exc:
        if app.http is not None:  # never served: close the bound port (shutdown() would wait forever)
            app.http.httpd.server_close()
        raise ConfigError(f"daemon.socket {socket_path}: cannot listen ({reason(exc, '--socket PATH')})") from None


def check_socket_dir(path: str, create: bool) -> None:
    """A missing directory is refused with its path; only the built-in one (or --create-socket-dir) is made."""
    parent = Path(path).parent
    if parent.is_dir():
        return
    if create or path == DaemonConfig().socket:
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"daemon.socket {path}: cannot create {parent} ({exc.strerror})") from None
        return
    raise ConfigError(f"daemon.socket {path}: directory {parent} does not exist "
                      "(create it, or pass --create-socket-dir)")


def check_oom_directory(config: Config) -> None:
    """At start, not at the first OOM (whose capture would be lost): can captures be written?
    A directory set on purpose that cannot be written is a configuration error (one line, exit 2);
    the built-in default that cannot be is one warning line, and the daemon runs (events are still
    counted and logged)."""
    from gpufootprint.statedir import default_oom_directory, unwritable

    if not config.oom.enabled:
        return
    directory = config.oom.directory or default_oom_directory()
    why = unwritable(directory)
    if why is None:
        return
    if config.oom.directory:
        raise ConfigError(f"oom.directory {directory}: cannot write there ({why}); mount a volume there, "
                          "choose another directory, or set oom.enabled=false")
    log.warning("oom captures disabled: cannot write the default oom.directory %s (%s); set oom.directory "
                "to a writable directory (OOM events are still counted and logged)", directory, why)


def check_output(option: str, path: str, inputs: Sequence[str] = ()) -> None:
    """Refuse an output that is one of the inputs or cannot be written, before anything is opened."""
    if path == "-":
        return
    out = Path(path)
    for name in inputs:
        same = out.resolve() == Path(name).resolve()
        with contextlib.suppress(OSError):
            same = same or os.path.samefile(out, name)
        if same:
            raise ConfigError(f"command line {option} {path}: is the input file; write to another file")
    parent = out.parent
    if out.is_dir():
        raise ConfigError(f"command line {option} {path}: is a directory")
    if not parent.is_dir():
        raise ConfigError(f"command line {option} {path}: directory {parent} does not exist")
    if out.exists() and not os.access(out, os.W_OK):
        raise ConfigError(f"command line {option} {path}: not writable")
    probe_writable(option, path)  # before the work: /proc passes every access check as root


def write_json(path: str, obj: Any) -> None:
    if path == "-":
        json.dump(obj, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return
    with atomic_output("--report-json", path, "w") as fh:
        json.dump(obj, fh, indent=1)
        fh.write("\n")


def no_frames(name: str) -> TraceError:
    """The error for an input with no frames at all (0 bytes, or a preamble and nothing after):
    nothing to replay, report or export is damage to say, not a success to print."""
    return TraceError(f"{name}: no frames (an empty trace)")


def command_after_dashes(cmd: list[str]) -> list[str]:
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ConfigError("command line: give the command to run after --")
    return cmd



class Interrupt:
    """SIGINT and SIGTERM set ``stop`` (and record which came) while the block runs, so a long
    command can end between two steps and say what it did, rather than die with nothing said or
    written. Outside the main thread (tests calling ``main``) signals cannot be caught: no-op."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.signal: str | None = None
        self._signum = 0
        self._old: dict[int, Any] = {}

    @property
    def exit_code(self) -> int:
        return 128 + self._signum  # the shell's convention for a process ended by a signal

    def _on_signal(self, signum: int) -> None:  # on the signals thread (gpufootprint/signals.py), not in the handler
        if self.signal is None:
            self.signal, self._signum = signal.Signals(signum).name, signum
        self.stop.set()

    def __enter__(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: on_signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

    def __exit__(self, *exc: object) -> None:
        for s, old in self._old.items():
            restore(s, old)
