"""Command line: ``gpufootprint daemon|demo|replay|convert|check-config|run|record|abtest|top|report|export``.

Errors become one line on stderr and an exit status (2: configuration or usage, such as a
busy port, an output that cannot be written or a missing socket directory; 1: damaged or empty
input, or a runtime failure); ``-v``, before or after the command, adds the traceback.

This module holds the parser and ``main``; the commands live by job in ``serve`` (start, daemon,
demo, check-config), ``traces`` (replay, convert, abtest), ``launch`` (run, record) and ``views``
(top, report, export), and what they share (options, configuration, one-line checks) in ``common``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from gpufootprint import __version__
from gpufootprint.cli.common import add_common_options
from gpufootprint.cli.launch import cmd_record, cmd_run
from gpufootprint.cli.serve import cmd_check_config, cmd_daemon, cmd_demo, cmd_start
from gpufootprint.cli.traces import cmd_abtest, cmd_convert, cmd_replay
from gpufootprint.cli.views import add_view_commands, cmd_export, cmd_report, cmd_top
from gpufootprint.config import DaemonConfig
from gpufootprint.errors import GpuFootprintError
from gpufootprint.log import setup_logging

log = logging.getLogger("gpufootprint.cli")  # one logger for every command, as before the split


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpufootprint", description="Runtime GPU memory-footprint daemon.")
    parser.add_argument("--version", action="version", version=f"gpufootprint {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="debug logging and tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # --listen is also --web.listen-address, the flag of the Prometheus exporters built on
    # exporter-toolkit (node_exporter and others): charts and scripts written for them pass it.
    p = sub.add_parser("start", help="the main job: the daemon on a GPU node, the demo where there is no GPU")
    add_common_options(p)
    p.add_argument("--listen", "--web.listen-address", dest="listen", metavar="HOST:PORT", help="metrics address")
    p.add_argument("--socket", metavar="PATH", help="probe socket (daemon only)")
    _socket_dir_flag(p)
    p.add_argument("--duration", type=float, metavar="SECONDS", help="demo only: stop after this long")

    p = sub.add_parser("daemon", help="run the node agent: probe socket in, Prometheus metrics out")
    add_common_options(p)
    p.add_argument("--listen", "--web.listen-address", dest="listen", metavar="HOST:PORT",
                   help="metrics address (exporter.listen)")
    p.add_argument("--socket", metavar="PATH", help="probe socket (daemon.socket)")
    _socket_dir_flag(p)
    p.add_argument("--web.config.file", dest="web_config_file", metavar="FILE",
                   help="TLS and basic auth, exporter-toolkit format (exporter.web_config_file)")

    p = sub.add_parser("demo", help="replay bundled real H200 traces in a loop and serve /metrics")
    add_common_options(p)
    p.add_argument("--listen", "--web.listen-address", dest="listen", metavar="HOST:PORT", default=None,
                   help="metrics address (default 127.0.0.1:9878)")
    p.add_argument("--speed", type=float, help="replay speed (demo.speed)")
    p.add_argument("--duration", type=float, metavar="SECONDS", help="stop after this long")
    p.add_argument("--trace", action="append", metavar="FILE", help="loop this trace instead (repeatable)")

    p = sub.add_parser("replay", help="run a recorded trace through the daemon's pipeline")
    add_common_options(p)
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="native or CUPTI-JSONL trace, gzip or plain (several: replayed one after another)")
    p.add_argument("--speed", type=float, default=None, help="X times real time (default: as fast as possible)")
    p.add_argument("--listen", "--web.listen-address", dest="listen", metavar="HOST:PORT",
                   help="serve /metrics while replaying")
    p.add_argument("--linger", type=float, default=0.0, metavar="SECONDS",
                   help="with --listen: keep serving this long after the replay ends")
    p.add_argument("--report-json", metavar="PATH", help="write records, elapsed time and mark states as JSON")

    p = sub.add_parser("convert", help="convert a trace between CUPTI-JSONL and the native format")
    add_common_options(p)
    p.add_argument("input", metavar="IN")
    p.add_argument("-o", "--output", required=True, metavar="OUT",
                   help="output file: *.jsonl[.gz] writes CUPTI-JSONL, anything else native (.gz compresses)")

    p = sub.add_parser("check-config", help="validate the configuration and exit")
    add_common_options(p)
    p.add_argument("--print", dest="print_config", action="store_true", help="print the effective configuration")

    p = sub.add_parser("run", help="run a command with the probe in it and its children (-- CMD ARGS...)")
    add_common_options(p)
    p.add_argument("--socket", metavar="PATH", help="daemon socket the probes connect to")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS")

    p = sub.add_parser("abtest", help="compare CUDA Graph advisor policies on recorded traces")
    add_common_options(p)
    p.add_argument("traces", nargs="+", metavar="TRACE", help="native or CUPTI-JSONL traces with kernel records")
    p.add_argument("--policy", action="append", required=True, metavar="FILE",
                   help="YAML with graph_advisor keys (repeat: A, B, ...)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")

    p = sub.add_parser("record", help="run a command with the probe, writing frames to a file (-- CMD ARGS...)")
    add_common_options(p)
    p.add_argument("-o", "--output", required=True, metavar="FILE")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS")
    add_view_commands(sub)
    return parser


def _socket_dir_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--create-socket-dir", action="store_true",
                   help="create the probe socket's directory if it is missing (default: only the built-in "
                        f"{os.path.dirname(DaemonConfig().socket)})")


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
        # Commands that can stop cleanly catch the signal themselves (replay); elsewhere Ctrl-C
        # still gets its one line, so a silent exit 130 is never the only sign of what happened.
        print(f"gpufootprint {args.command}: interrupted", file=sys.stderr)
        return 130


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

