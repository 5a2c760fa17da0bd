"""The long-running commands: ``start``, ``daemon`` and ``demo``; and ``check-config``."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from gpufootprint.cli.common import (
    check_oom_directory,
    check_socket_dir,
    config_from_args,
    open_app,
    reason,
    setup,
    start_app,
)
from gpufootprint.configload import config_to_dict
from gpufootprint.errors import ConfigError, TraceError
from gpufootprint.signals import on_signal

if TYPE_CHECKING:
    from gpufootprint.app import App
    from gpufootprint.config import Config

log = logging.getLogger("gpufootprint.cli")  # one logger for every command, as before the split
# The daemon's signal and reload lines keep the logger they were written under when app.py handled them.
_signal_log = logging.getLogger("gpufootprint.app")


def cmd_check_config(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    if args.print_config:
        print(yaml.safe_dump(config_to_dict(config), sort_keys=False), end="")
    else:
        print(f"ok: {args.config or 'built-in defaults'}")
    return 0


def log_native_core() -> None:
    """Say whether the daemon's C core serves its per-batch loops: without it (no C compiler at install, or
    turned off) the same results come from the Python paths, at more CPU a record."""
    from gpufootprint.native import ENV, core, load

    if core() is not None:
        log.info("daemon C core: loaded")
    else:
        why = load()[1] or f"{ENV}=0"
        log.warning("daemon C core: not used (%s); the Python paths serve, at more CPU a record", why)


def cmd_daemon(args: argparse.Namespace) -> int:
    from gpufootprint.nvml.pynvml_client import detect_gpu

    stop, hup = threading.Event(), threading.Event()
    install_signal_handlers(stop, hup)  # before anything slow: a SIGHUP while starting must not kill us
    flags = {"exporter.listen": args.listen, "daemon.socket": args.socket,
             "exporter.web_config_file": getattr(args, "web_config_file", None)}
    config = config_from_args(args, flags)
    setup(config, args.verbose)
    check_socket_dir(config.daemon.socket, args.create_socket_dir)
    check_oom_directory(config)
    present, detail = detect_gpu()
    nvml_client = None
    if present and config.nvml.enabled:
        from gpufootprint.nvml.pynvml_client import PynvmlClient

        nvml_client = PynvmlClient()
    app = open_app(config, socket_path=config.daemon.socket, listen=config.exporter.listen,
                    nvml_client=nvml_client)
    app.gpu_present = 1.0 if present else 0.0
    if present:
        log.info("gpu found: %s", detail)
    else:
        log.warning("no GPU: %s; serving probe data and metrics anyway", detail)
    log_native_core()
    start_app(app, config.daemon.socket)
    log.info("serving metrics url=%s", app.http.url if app.http else "-")
    try:
        # SIGHUP re-reads file, env, flags
        wait_for_signal(app, stop, reload=lambda: config_from_args(args, flags), hup=hup)
    finally:
        app.stop()
    return 0


def cmd_start(args: argparse.Namespace) -> int:
    from gpufootprint.nvml.pynvml_client import detect_gpu

    present, detail = detect_gpu()
    if present:
        return cmd_daemon(args)
    notice = (f"gpufootprint: no GPU here ({detail}); starting the demo: real H200 traces replayed "
              "into the daemon. On a GPU node this command runs the daemon.")
    print(notice, file=sys.stderr)
    args.speed, args.trace = None, None
    return cmd_demo(args, notice=notice)


def cmd_demo(args: argparse.Namespace, notice: str | None = None) -> int:
    from gpufootprint.demo import bundled_traces, demo_config, demo_gpu, run_demo
    from gpufootprint.replay import load_frames

    config = config_from_args(args, {"demo.speed": args.speed})
    setup(config, args.verbose)
    listen = args.listen or "127.0.0.1:9878"
    traces = [Path(t) for t in args.trace] if args.trace else (
        [Path(config.demo.trace)] if config.demo.trace else bundled_traces())
    for t in traces:
        if not t.is_file():
            raise ConfigError(f"demo.trace: {t} is not a file")
        frames, problems = load_frames(t)  # a damaged trace fails here, not silently in a feeder thread
        if problems:
            more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
            raise TraceError(problems[0] + more)
        if not frames:
            raise TraceError(f"{t}: no frames (an empty trace)")
    nvml, attach = demo_gpu()  # a simulated H200 in NVML's place, reading the demo's own snapshot
    app = open_app(demo_config(config), socket_path=None, listen=listen, nvml_client=nvml)
    attach(app)
    try:
        return run_demo(app, speed=config.demo.speed, duration=args.duration, traces=traces, notice=notice)
    except OSError as exc:
        raise ConfigError(f"exporter.listen {listen}: cannot serve ({reason(exc)})") from None


# --- the daemon process's signals ------------------------------------------------


def install_signal_handlers(stop: threading.Event, hup: threading.Event) -> None:
    """SIGTERM/SIGINT set ``stop``, SIGHUP sets ``hup``. Call it first thing, before the
    configuration is read and the daemon starts: until then a SIGHUP would kill the process."""

    def _stop(signum: int) -> None:
        _signal_log.info("signal %s: shutting down", signal.Signals(signum).name)
        stop.set()

    def _hup(_signum: int) -> None:
        hup.set()  # the work happens on a reload thread

    # Acted on by the signals thread, not in the handler: the main thread waits on ``stop`` and may hold
    # its lock when the signal comes (gpufootprint/signals.py).
    on_signal(signal.SIGTERM, _stop)
    on_signal(signal.SIGINT, _stop)
    on_signal(signal.SIGHUP, _hup)


def wait_for_signal(app: App, stop: threading.Event, reload: Callable[[], Config] | None = None,
                    hup: threading.Event | None = None) -> None:
    """Until ``stop``: each SIGHUP reloads on a thread of its own (one at a time), so a reload
    that hangs or grows (a hostile file) never delays SIGTERM, which this loop checks every 0.1 s."""
    if hup is None:
        hup = threading.Event()
        install_signal_handlers(stop, hup)
    worker: threading.Thread | None = None
    while not stop.wait(0.1):
        if hup.is_set() and (worker is None or not worker.is_alive()):
            hup.clear()
            if reload is None:
                continue
            worker = threading.Thread(target=app.reload, args=(reload,), name="gpufootprint-reload", daemon=True)
            worker.start()
    if worker is not None and worker.is_alive():
        _signal_log.warning("a configuration reload is still running at shutdown: abandoned")
