"""Command line: ``gpufootprint daemon|demo|replay|convert|check-config|run|record|abtest|top|report|export``.

Errors become one line on stderr and an exit status (2: configuration or usage, such as a
busy port, an output that cannot be written or a missing socket directory; 1: damaged or empty
input, or a runtime failure); ``-v``, before or after the command, adds the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import gzip
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import yaml

from gpufootprint import __version__
from gpufootprint.config import Config, DaemonConfig, config_to_dict, load_config, parse_set_option
from gpufootprint.errors import ConfigError, GpuFootprintError, TraceError
from gpufootprint.log import setup_logging

if TYPE_CHECKING:
    from gpufootprint.app import App
    from gpufootprint.nvml.client import NvmlClient

log = logging.getLogger("gpufootprint.cli")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML configuration file (default: none, built-in defaults)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override one configuration key (repeatable)")
    p.add_argument("--log.level", dest="log_level", choices=("debug", "info", "warning", "error"),
                   help="logging.level")
    p.add_argument("--log.format", dest="log_format", choices=("logfmt", "json"), help="logging.format")
    # SUPPRESS: a -v after the command adds to one given before it instead of resetting it to 0
    p.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                   help="debug logging and tracebacks (also accepted before the command)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpufootprint", description="Runtime GPU memory-footprint daemon.")
    parser.add_argument("--version", action="version", version=f"gpufootprint {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="debug logging and tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("start", help="the main job: the daemon on a GPU node, the demo where there is no GPU")
    _common(p)
    p.add_argument("--listen", metavar="HOST:PORT", help="metrics address")
    p.add_argument("--socket", metavar="PATH", help="probe socket (daemon only)")
    _socket_dir_flag(p)
    p.add_argument("--duration", type=float, metavar="SECONDS", help="demo only: stop after this long")

    p = sub.add_parser("daemon", help="run the node agent: probe socket in, Prometheus metrics out")
    _common(p)
    p.add_argument("--listen", metavar="HOST:PORT", help="metrics address (exporter.listen)")
    p.add_argument("--socket", metavar="PATH", help="probe socket (daemon.socket)")
    _socket_dir_flag(p)
    p.add_argument("--web.config.file", dest="web_config_file", metavar="FILE",
                   help="TLS and basic auth, exporter-toolkit format (exporter.web_config_file)")

    p = sub.add_parser("demo", help="replay bundled real H200 traces in a loop and serve /metrics")
    _common(p)
    p.add_argument("--listen", metavar="HOST:PORT", default=None,
                   help="metrics address (default 127.0.0.1:9878)")
    p.add_argument("--speed", type=float, help="replay speed (demo.speed)")
    p.add_argument("--duration", type=float, metavar="SECONDS", help="stop after this long")
    p.add_argument("--trace", action="append", metavar="FILE", help="loop this trace instead (repeatable)")

    p = sub.add_parser("replay", help="run a recorded trace through the daemon's pipeline")
    _common(p)
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="native or CUPTI-JSONL trace, gzip or plain (several: replayed one after another)")
    p.add_argument("--speed", type=float, default=None, help="X times real time (default: as fast as possible)")
    p.add_argument("--listen", metavar="HOST:PORT", help="serve /metrics while replaying")
    p.add_argument("--linger", type=float, default=0.0, metavar="SECONDS",
                   help="with --listen: keep serving this long after the replay ends")
    p.add_argument("--report-json", metavar="PATH", help="write records, elapsed time and mark states as JSON")

    p = sub.add_parser("convert", help="convert a trace between CUPTI-JSONL and the native format")
    _common(p)
    p.add_argument("input", metavar="IN")
    p.add_argument("-o", "--output", required=True, metavar="OUT",
                   help="output file: *.jsonl[.gz] writes CUPTI-JSONL, anything else native (.gz compresses)")

    p = sub.add_parser("check-config", help="validate the configuration and exit")
    _common(p)
    p.add_argument("--print", dest="print_config", action="store_true", help="print the effective configuration")

    p = sub.add_parser("run", help="run a command with the probe in it and its children (-- CMD ARGS...)")
    _common(p)
    p.add_argument("--socket", metavar="PATH", help="daemon socket the probes connect to")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS")

    p = sub.add_parser("abtest", help="compare CUDA Graph advisor policies on recorded traces")
    _common(p)
    p.add_argument("traces", nargs="+", metavar="TRACE", help="native or CUPTI-JSONL traces with kernel records")
    p.add_argument("--policy", action="append", required=True, metavar="FILE",
                   help="YAML with graph_advisor keys (repeat: A, B, ...)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")

    p = sub.add_parser("record", help="run a command with the probe, writing frames to a file (-- CMD ARGS...)")
    _common(p)
    p.add_argument("-o", "--output", required=True, metavar="FILE")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS")
    _add_view_commands(sub)
    return parser


def _socket_dir_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--create-socket-dir", action="store_true",
                   help="create the probe socket's directory if it is missing (default: only the built-in "
                        f"{os.path.dirname(DaemonConfig().socket)})")


# --- top, report, export: views of a daemon or a recording ---------------------------


def _add_view_commands(sub: Any) -> None:
    from gpufootprint.top import SORT_KEYS

    p = sub.add_parser("top", help="live terminal table of a running daemon's processes (its HTTP API)")
    p.add_argument("--url", default="http://127.0.0.1:9878", metavar="URL",
                   help="the daemon's HTTP address (default http://127.0.0.1:9878)")
    p.add_argument("--once", action="store_true", help="print one frame and exit (for scripts)")
    p.add_argument("--sort", choices=sorted(SORT_KEYS), default="device", help="sort key (default: device)")
    p.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="refresh period (default 1)")
    p.add_argument("--user", metavar="USER:PASSWORD", help="basic auth, when the daemon's web config asks for it")
    p.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                   help="tracebacks (also accepted before the command)")

    p = sub.add_parser("report", help="one self-contained HTML page (with plots) for recordings")
    _common(p)
    p.add_argument("files", nargs="+", metavar="FILE", help="native or CUPTI-JSONL recordings, gzip or plain")
    p.add_argument("-o", "--output", default="report.html", metavar="OUT", help="HTML page (default report.html)")
    p.add_argument("--plot", metavar="PATH", help="also write the footprint plot as PNG or SVG (by suffix)")
    p.add_argument("--title", help="page title")

    p = sub.add_parser("export", help="a recording for PyTorch's memory viewer or Perfetto")
    _common(p)
    p.add_argument("file", metavar="FILE", help="native or CUPTI-JSONL recording (an OOM capture, say)")
    p.add_argument("--to", required=True, choices=["memory-viz", "perfetto"],
                   help="memory-viz: torch.cuda.memory._snapshot() pickle; perfetto: Chrome trace-event JSON")
    p.add_argument("-o", "--output", required=True, metavar="OUT")


def cmd_top(args: argparse.Namespace) -> int:
    from gpufootprint.top import run_live, run_once

    if args.interval <= 0:
        raise ConfigError(f"command line --interval: {args.interval} must be positive")
    if args.once or not sys.stdout.isatty():
        try:
            print(run_once(args.url, args.sort, user=args.user), flush=True)
        except BrokenPipeError:  # `top --once | head`: the reader has all it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    run_live(args.url, args.sort, interval=args.interval, user=args.user)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from gpufootprint.report import write_report

    config = _config(args)
    _setup(config, args.verbose)
    for name in args.files:
        if not Path(name).exists():
            raise GpuFootprintError(f"{name}: no such file")
    _check_output("-o", args.output, args.files)
    if args.plot:
        if Path(args.plot).suffix.lower() not in (".png", ".svg"):
            raise ConfigError(f"command line --plot {args.plot}: the file name must end in .png or .svg")
        _check_output("--plot", args.plot, [*args.files, args.output])
    rec = write_report(args.files, args.output, title=args.title, plot=args.plot)
    print(f"wrote {args.output}" + (f" and {args.plot}" if args.plot else "") +
          f" ({rec.records} records)", file=sys.stderr)
    for problem in rec.problems[:20]:
        print(f"gpufootprint report: error: {problem}", file=sys.stderr)
    return 1 if rec.problems else 0


def cmd_export(args: argparse.Namespace) -> int:
    from gpufootprint.export import write_export
    from gpufootprint.recording import load

    config = _config(args)
    _setup(config, args.verbose)
    if not Path(args.file).exists():
        raise GpuFootprintError(f"{args.file}: no such file")
    _check_output("-o", args.output, [args.file])
    rec = load([args.file], config)
    print(write_export(rec, args.to, args.output), file=sys.stderr)
    for problem in rec.problems[:20]:
        print(f"gpufootprint export: error: {problem}", file=sys.stderr)
    return 1 if rec.problems else 0


def _config(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> Config:
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    verbose = getattr(args, "verbose", 0)
    setup_logging("debug" if verbose else "warning")
    try:
        return int(_COMMANDS[args.command](args) or 0)
    except GpuFootprintError as exc:
        if verbose:
            log.exception("failed")
        print(f"gpufootprint {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


# --- shared checks: every one fails with one line that names the key or the path ---------


def _reason(exc: OSError, other: str = "--listen HOST:PORT") -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"address already in use: is gpufootprint already running? choose another with {other}"
    return exc.strerror or str(exc)


def _open_app(config: Config, *, socket_path: str | None, listen: str | None,
              nvml_client: NvmlClient | None = None) -> App:
    """``App`` binds the metrics port when it is built: a busy port is a one-line error here."""
    from gpufootprint.app import App

    try:
        return App(config, socket_path=socket_path, listen=listen, nvml_client=nvml_client)
    except OSError as exc:
        raise ConfigError(f"exporter.listen {listen}: cannot listen ({_reason(exc)})") from None


def _start_app(app: App, socket_path: str | None) -> None:
    try:
        app.start()
    except OSError as exc:
        if app.http is not None:  # never served: close the bound port (shutdown() would wait forever)
            app.http.httpd.server_close()
        raise ConfigError(f"daemon.socket {socket_path}: cannot listen ({_reason(exc, '--socket PATH')})") from None


def _check_socket_dir(path: str, create: bool) -> None:
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


def _check_output(option: str, path: str, inputs: Sequence[str] = ()) -> None:
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
    if not os.access(parent, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise ConfigError(f"command line {option} {path}: not writable")


def _open_output(option: str, path: str, mode: str) -> IO[Any]:
    try:
        if path.endswith(".gz"):
            return gzip.open(path, mode)  # type: ignore[return-value]
        return open(path, mode)  # the caller closes it
    except OSError as exc:
        raise ConfigError(f"command line {option} {path}: cannot write ({exc.strerror})") from None


def _setup(config: Config, verbose: int) -> None:
    setup_logging("debug" if verbose else config.logging.level, config.logging.format)


# --- commands ---------------------------------------------------------------------


def cmd_check_config(args: argparse.Namespace) -> int:
    config = _config(args)
    if args.print_config:
        print(yaml.safe_dump(config_to_dict(config), sort_keys=False), end="")
    else:
        print(f"ok: {args.config or 'built-in defaults'}")
    return 0


def cmd_daemon(args: argparse.Namespace) -> int:
    from gpufootprint.app import App, detect_gpu

    stop, hup = threading.Event(), threading.Event()
    App.install_signal_handlers(stop, hup)  # before anything slow: a SIGHUP while starting must not kill us
    flags = {"exporter.listen": args.listen, "daemon.socket": args.socket,
             "exporter.web_config_file": getattr(args, "web_config_file", None)}
    config = _config(args, flags)
    _setup(config, args.verbose)
    _check_socket_dir(config.daemon.socket, args.create_socket_dir)
    present, detail = detect_gpu()
    nvml_client = None
    if present and config.nvml.enabled:
        from gpufootprint.nvml.pynvml_client import PynvmlClient

        nvml_client = PynvmlClient()
    app = _open_app(config, socket_path=config.daemon.socket, listen=config.exporter.listen,
                    nvml_client=nvml_client)
    app.gpu_present = 1.0 if present else 0.0
    if present:
        log.info("gpu found: %s", detail)
    else:
        log.warning("no GPU: %s; serving probe data and metrics anyway", detail)
    _start_app(app, config.daemon.socket)
    log.info("serving metrics url=%s", app.http.url if app.http else "-")
    try:
        app.wait_for_signal(stop, reload=lambda: _config(args, flags), hup=hup)  # SIGHUP re-reads file, env, flags
    finally:
        app.stop()
    return 0


def cmd_start(args: argparse.Namespace) -> int:
    from gpufootprint.app import detect_gpu

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

    config = _config(args, {"demo.speed": args.speed})
    _setup(config, args.verbose)
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
    app = _open_app(demo_config(config), socket_path=None, listen=listen, nvml_client=nvml)
    attach(app)
    try:
        return run_demo(app, speed=config.demo.speed, duration=args.duration, traces=traces, notice=notice)
    except OSError as exc:
        raise ConfigError(f"exporter.listen {listen}: cannot serve ({_reason(exc)})") from None


def cmd_replay(args: argparse.Namespace) -> int:
    from gpufootprint.pipeline import Pipeline
    from gpufootprint.replay import replay_file

    config = _config(args)
    _setup(config, args.verbose)
    if args.speed is not None and args.speed <= 0:
        raise ConfigError(f"command line --speed: {args.speed} must be positive")
    for name in args.files:
        if not Path(name).exists():
            raise GpuFootprintError(f"{name}: no such file")
    if args.report_json:
        _check_output("--report-json", args.report_json, args.files)
    app: App | None = None
    guard: Any = contextlib.nullcontext()
    if args.listen:
        app = _open_app(config, socket_path=None, listen=args.listen)
        _start_app(app, None)
        pipeline = app.pipeline
        guard = app.ingest.lock
        print(f"serving {app.http.url if app.http else ''}", file=sys.stderr, flush=True)
    else:
        from gpufootprint.sampler.hub import FeatureHub

        pipeline = Pipeline(config.footprint, hub=FeatureHub(config.features, config.sampler))
    results = []
    try:
        for name in args.files:
            results.append(replay_file(name, pipeline, speed=args.speed, guard=guard,
                                       max_frame_bytes=config.daemon.max_frame_bytes,
                                       on_mark=app.oom.on_mark if app is not None else None))
        if app is not None:
            app.ingest.tick()
            if args.linger > 0:
                time.sleep(args.linger)
    finally:
        if app is not None:
            app.stop()
    marks = [m for r in results for m in r.marks]
    problems = [p for r in results for p in r.problems]
    records = sum(r.records for r in results)
    elapsed = sum(r.elapsed_s for r in results)
    formats = ",".join(sorted({r.format for r in results}))
    if args.report_json:
        report = {"file": results[0].path if len(results) == 1 else [r.path for r in results],
                  "format": formats, "records": records, "elapsed_s": elapsed, "marks": marks,
                  "problems": problems, "ingest_errors": dict(pipeline.errors.counts),
                  "late_records": pipeline.late_records}
        report.update(pipeline.hub.report())  # anomaly_windows, sampler_intervals: the sampler's view of the run
        _write_json(args.report_json, report)
    mismatched = [m["label"] for m in marks if m.get("matches") is False]
    print(f"replayed {records} records ({formats}) in {elapsed:.3f} s; "
          f"{len(marks)} marks, {len(mismatched)} differ from the trace's expectation", file=sys.stderr)
    for problem in problems[:20]:
        print(f"gpufootprint replay: error: {problem}", file=sys.stderr)
    if len(problems) > 20:
        print(f"gpufootprint replay: ... and {len(problems) - 20} more problems", file=sys.stderr)
    return 1 if problems else 0


def cmd_convert(args: argparse.Namespace) -> int:
    from gpufootprint.wire.jsonl import write_jsonl
    from gpufootprint.wire.sources import TraceFile

    out = Path(args.output)
    to_jsonl = ".jsonl" in out.suffixes
    if not Path(args.input).is_file():
        raise TraceError(f"{args.input}: no such file")
    _check_output("-o", args.output, [args.input])
    trace = TraceFile(args.input)
    problems = trace.problems
    compress = out.suffix == ".gz"
    if to_jsonl:
        # Without the end check: convert has always written the whole frames of a file cut
        # inside its last one and said nothing of the cut.
        with _open_output("-o", args.output, "wt" if compress else "w") as text_out:
            n = write_jsonl(trace.frames(check_end=False), text_out)
        what = f"{n} lines"
    else:
        n = 0
        with _open_output("-o", args.output, "wb") as bin_out:
            for chunk in trace.chunks():
                bin_out.write(chunk)
                n += len(chunk)
        what = f"{n} bytes"
    print(f"wrote {out} ({what}, from {trace.format})", file=sys.stderr)
    for problem in problems[:20]:
        print(f"gpufootprint convert: error: {problem}", file=sys.stderr)
    return 1 if problems else 0


def cmd_run(args: argparse.Namespace) -> int:
    from gpufootprint.probe import launcher

    config = _config(args, {"daemon.socket": getattr(args, "socket", None)})
    return launcher.run(_command(args.cmd), socket_path=config.daemon.socket, probe_config=config.probe)


def cmd_record(args: argparse.Namespace) -> int:
    from gpufootprint.probe import launcher

    config = _config(args)
    command = _command(args.cmd)
    _check_output("-o", args.output)
    return launcher.record(command, output=args.output, probe_config=config.probe)


def cmd_abtest(args: argparse.Namespace) -> int:
    from gpufootprint.abtest import load_policy, render_table, run_abtest

    config = _config(args)
    _setup(config, args.verbose)
    policies = [load_policy(p) for p in args.policy]
    names = [p.name for p in policies]
    if len(set(names)) != len(names):
        raise ConfigError(f"command line --policy: policy files need distinct names, got {', '.join(names)}")
    report = run_abtest(args.traces, policies, config)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(render_table(report))
    for problem in report["problems"][:20]:
        print(f"gpufootprint abtest: error: {problem}", file=sys.stderr)
    return 1 if report["problems"] else 0


def _command(cmd: list[str]) -> list[str]:
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ConfigError("command line: give the command to run after --")
    return cmd


def _write_json(path: str, obj: Any) -> None:
    fh: IO[str]
    with (sys.stdout if path == "-" else _open_output("--report-json", path, "w")) as fh:
        json.dump(obj, fh, indent=1)
        fh.write("\n")


_COMMANDS = {
    "start": cmd_start,
    "daemon": cmd_daemon,
    "demo": cmd_demo,
    "replay": cmd_replay,
    "convert": cmd_convert,
    "check-config": cmd_check_config,
    "run": cmd_run,
    "record": cmd_record,
    "abtest": cmd_abtest,
    "top": cmd_top,
    "report": cmd_report,
    "export": cmd_export,
}
