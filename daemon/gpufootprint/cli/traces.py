"""Commands on recorded traces: ``replay`` (through the daemon's pipeline), ``convert``, ``abtest``."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpufootprint.cli.common import (
    Interrupt,
    check_output,
    config_from_args,
    no_frames,
    open_app,
    setup,
    start_app,
    write_json,
)
from gpufootprint.errors import ConfigError, GpuFootprintError, TraceError
from gpufootprint.outfile import atomic_output

if TYPE_CHECKING:
    from collections.abc import Iterator

    from gpufootprint.app import App
    from gpufootprint.wire.framing import Frame


def cmd_replay(args: argparse.Namespace) -> int:
    from gpufootprint.pipeline import Pipeline
    from gpufootprint.replay import replay_file

    config = config_from_args(args)
    setup(config, args.verbose)
    if args.speed is not None and args.speed <= 0:
        raise ConfigError(f"command line --speed: {args.speed} must be positive")
    for name in args.files:
        if not Path(name).exists():
            raise GpuFootprintError(f"{name}: no such file")
    if args.report_json:
        check_output("--report-json", args.report_json, args.files)
    # Ctrl-C and SIGTERM end the replay between two frames: what was replayed is reported (and
    # the report says it is partial) instead of the process dying with nothing written. Caught
    # from here on, so once "serving" is printed a signal is always this clean stop.
    interrupt = Interrupt()
    app: App | None = None
    results = []
    with interrupt:
        guard: Any = contextlib.nullcontext()
        if args.listen:
            app = open_app(config, socket_path=None, listen=args.listen)
            start_app(app, None)
            pipeline = app.pipeline
            guard = app.ingest.lock
            print(f"serving {app.http.url if app.http else ''}", file=sys.stderr, flush=True)
        else:
            from gpufootprint.hub import FeatureHub

            pipeline = Pipeline(config.footprint, hub=FeatureHub(config.features, config.sampler))
        try:
            for name in args.files:
                result = replay_file(name, pipeline, speed=args.speed, guard=guard, stop=interrupt.stop,
                                     max_frame_bytes=config.daemon.max_frame_bytes,
                                     on_mark=app.oom.on_mark if app is not None else None)
                results.append(result)
                if interrupt.signal:
                    break
                if result.frames == 0 and not result.problems:
                    raise no_frames(name)
            if app is not None:
                app.ingest.tick()
                if args.linger > 0 and not interrupt.signal:
                    interrupt.stop.wait(args.linger)
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
                  "late_records": pipeline.late_records,
                  "complete": interrupt.signal is None, "interrupted": interrupt.signal}
        report.update(pipeline.hub.report())  # anomaly_windows, sampler_intervals: the sampler's view of the run
        write_json(args.report_json, report)
    if interrupt.signal is not None:
        where = f"; {args.report_json} covers those only (\"complete\": false)" if args.report_json else ""
        print(f"gpufootprint replay: interrupted by {interrupt.signal} after {records} records{where}",
              file=sys.stderr)
        return interrupt.exit_code
    mismatched = [m["label"] for m in marks if m.get("matches") is False]
    print(f"replayed {records} records ({formats}) in {elapsed:.3f} s; "
          f"{len(marks)} marks, {len(mismatched)} differ from the trace's expectation", file=sys.stderr)
    for problem in problems[:20]:
        print(f"gpufootprint replay: error: {problem}", file=sys.stderr)
    if len(problems) > 20:
        print(f"gpufootprint replay: ... and {len(problems) - 20} more problems", file=sys.stderr)
    return 1 if problems else 0


def cmd_convert(args: argparse.Namespace) -> int:
    from gpufootprint.wire.framing import PREAMBLE
    from gpufootprint.wire.jsonl import write_jsonl
    from gpufootprint.wire.sources import TraceFile

    out = Path(args.output)
    to_jsonl = ".jsonl" in out.suffixes
    if not Path(args.input).is_file():
        raise TraceError(f"{args.input}: no such file")
    check_output("-o", args.output, [args.input])
    trace = TraceFile(args.input)
    frames = 0

    def counted(it: Iterator[Frame]) -> Iterator[Frame]:
        nonlocal frames
        for frame in it:
            frames += 1
            yield frame

    # Written beside OUT and renamed at the end: damage (a cut .gz, a bad frame) raises inside the
    # block, so OUT is left as it was rather than holding a partial conversion that looks whole.
    with atomic_output("-o", args.output, "w" if to_jsonl else "wb") as fh:
        if to_jsonl:
            n = write_jsonl(counted(trace.frames()), fh)
            what = f"{n} lines"
        else:
            n = 0
            for chunk in trace.chunks():
                fh.write(chunk)
                n += len(chunk)
            frames = max(0, n - len(PREAMBLE))  # bytes past the preamble: frames, or the damage below
            what = f"{n} bytes"
        if trace.problems:
            more = f" (and {len(trace.problems) - 1} more problems)" if len(trace.problems) > 1 else ""
            raise TraceError(f"{trace.problems[0]}{more}; nothing written to {args.output}")
        if frames == 0:
            raise no_frames(args.input)
    print(f"wrote {out} ({what}, from {trace.format})", file=sys.stderr)
    return 0


def cmd_abtest(args: argparse.Namespace) -> int:
    from gpufootprint.abtest import load_policy, render_table, run_abtest

    config = config_from_args(args)
    setup(config, args.verbose)
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

