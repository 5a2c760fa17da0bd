"""top, report, export: views of a daemon or a recording."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from gpufootprint.cli.common import add_common_options, check_output, config_from_args, setup
from gpufootprint.errors import ConfigError, GpuFootprintError, TraceError


def add_view_commands(sub: Any) -> None:
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
    add_common_options(p)
    p.add_argument("files", nargs="+", metavar="FILE", help="native or CUPTI-JSONL recordings, gzip or plain")
    p.add_argument("-o", "--output", default="report.html", metavar="OUT", help="HTML page (default report.html)")
    p.add_argument("--plot", metavar="PATH", help="also write the footprint plot as PNG or SVG (by suffix)")
    p.add_argument("--title", help="page title")

    p = sub.add_parser("export", help="a recording for PyTorch's memory viewer or Perfetto")
    add_common_options(p)
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
    from gpufootprint.report import plots_available, write_report

    config = config_from_args(args)
    setup(config, args.verbose)
    for name in args.files:
        if not Path(name).exists():
            raise GpuFootprintError(f"{name}: no such file")
    check_output("-o", args.output, args.files)
    if args.plot:
        if Path(args.plot).suffix.lower() not in (".png", ".svg"):
            raise ConfigError(f"command line --plot {args.plot}: the file name must end in .png or .svg")
        check_output("--plot", args.plot, [*args.files, args.output])
    rec = write_report(args.files, args.output, title=args.title, plot=args.plot)
    if rec.problems:
        # The page is written on purpose (it shows what could be read and lists every problem);
        # the terminal gets one line that says so, not a "wrote" line followed by errors.
        print(f"gpufootprint report: error: {_first(rec.problems)}; {args.output} shows what could be read "
              "and lists the problems", file=sys.stderr)
        return 1
    hint = "" if plots_available() else \
        "; no plots: matplotlib is not installed here (pip install 'gpufootprint[report]')"
    print(f"wrote {args.output}" + (f" and {args.plot}" if args.plot else "") +
          f" ({rec.records} records{hint})", file=sys.stderr)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from gpufootprint.export import write_export
    from gpufootprint.recording import load

    config = config_from_args(args)
    setup(config, args.verbose)
    if not Path(args.file).exists():
        raise GpuFootprintError(f"{args.file}: no such file")
    check_output("-o", args.output, [args.file])
    rec = load([args.file], config)
    if rec.problems:
        # A viewer's file cannot say it is partial: nothing is written for a damaged recording
        # (`gpufootprint report` shows what could be read, with the problems).
        raise TraceError(f"{_first(rec.problems)}; nothing written to {args.output}")
    print(write_export(rec, args.to, args.output), file=sys.stderr)
    return 0


def _first(problems: list[str]) -> str:
    return problems[0] + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else "")
