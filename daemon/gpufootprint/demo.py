"""``gpufootprint demo``: real H200 traces looped into the daemon, with a live screen.

Each bundled trace plays one process. At every loop the process "restarts" (a new
HELLO with a new start time), so its footprint starts from nothing, exactly as a
workload restarted under the daemon would. The training trace is the exception: a
training job runs for hours, so it plays once and then repeats its recorded steady
steps (their kernels, copies and memsets, no allocation) with their timestamps moved
on, as one process that never restarts. Its CUDA Graph advice then holds for the
whole demo instead of going each time the trace loops.

What the bundled traces show, so that every panel of the shipped dashboard has
data within a minute:

* h200_caching, h200_expandable: the footprint by kind, copies, memsets, churn;
* h200_kernels_train: KERNEL records of a training step (CUDA Graph advice);
* h200_probe_pinned_managed: a probe recording with its counters (probe overhead
  and drops) and unified memory (page migrations and faults);
* synth_leak (its leaking process only): steady growth, so budgets predict an
  exhaustion time and, after a few minutes, the leak engine suspects it. It is 20 minutes
  long and played by two processes, the second starting ten minutes after the first, so that
  after each loop one of them still has its trend.

Beside them a simulated H200 (``nvml.simulated``) plays NVML's part: device
memory, utilisation, power, and the model that prices the GPU. Without budget
rules of its own the demo sets two (a process budget and 90% of each GPU).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from gpufootprint.app import App
from gpufootprint.config import Config
from gpufootprint.ingest.session import Session
from gpufootprint.nvml.simulated import SimulatedNvml
from gpufootprint.records import COPY_KIND_NAMES, RecordKind
from gpufootprint.replay import Pacer, frame_time_ns, load_frames, paced, shift_frame
from gpufootprint.signals import on_signal
from gpufootprint.snapshot import PipelineSnapshot
from gpufootprint.wire.framing import HEADER_SIZE, Frame, FrameType, encode_batch, encode_json

log = logging.getLogger(__name__)

BUNDLED = ("h200_caching.jsonl.gz", "h200_expandable.jsonl.gz", "h200_kernels_train.gfp.gz",
           "h200_probe_pinned_managed.gfp.gz", "synth_leak.gfp.gz")
DEMO_PIDS = (855, 856)
#: Traces that play once and then repeat the frames between two of their marks (steady
#: steps, recorded after warm-up) for as long as the demo runs.
STEADY_STEPS = {"h200_kernels_train.gfp.gz": ("step_1", "step_4")}
#: What a repeated step may carry: records that leave the footprint as it is.
STEADY_KINDS = (RecordKind.KERNEL, RecordKind.MEMCPY, RecordKind.MEMSET)
#: Traces played by two processes, the second starting when the first is half-way through: a slow
#: leak restarts at each loop and its trend (hence the budgets' time to exhaustion) needs minutes
#: of growth again, so one copy is always mature while the other starts over.
STAGGERED = ("synth_leak.gfp.gz",)
#: Traces of several processes play one of them (the demo gives each trace one pid).
ONLY_PID = {"synth_leak.gfp.gz": 5151}
#: Budgets the demo sets when the configuration has none: both panels then have data.
DEMO_BUDGETS: list[dict[str, object]] = [{"scope": "process", "name": "*", "bytes": 4 << 30},
                                         {"scope": "gpu", "name": "*", "fraction": 0.9}]


def bundled_traces() -> list[Path]:
    base = resources.files("gpufootprint") / "data"
    return [Path(str(base / name)) for name in BUNDLED]


def _own_process(frames: list[Frame], only: int | None) -> list[Frame]:
    """The frames of one process of a multi-process trace (``only``), every frame otherwise."""
    if only is None:
        return frames
    out = []
    for f in frames:
        if f.type is FrameType.BATCH:
            recs = f.records()
            mine = recs[recs["pid"] == only]
            if len(mine) == 0:
                continue
            raw = encode_batch(RecordKind(f.tag), mine)
            f = Frame(f.type, f.tag, raw[HEADER_SIZE:], f.offset)
        out.append(f)
    return out


def steady_block(frames: list[Frame], first: str, last: str) -> tuple[list[Frame], int, int]:
    """The batches of ``STEADY_KINDS`` between the marks labelled ``first`` and ``last``, the trace
    time from one mark to the other (what one repetition of the block advances), and the index of
    the ``last`` mark: the recording plays up to it, and the repetitions follow on from there
    (what the recording holds after it, a final mark, would put them behind time)."""
    marks = {f.json().get("label"): (i, f.json().get("ts")) for i, f in enumerate(frames) if f.type is FrameType.MARK}
    (lo, t_lo), (hi, t_hi) = marks[first], marks[last]
    if not isinstance(t_lo, int) or not isinstance(t_hi, int) or t_hi <= t_lo:
        raise ValueError(f"steady steps {first}..{last}: marks without increasing timestamps")
    block = [f for f in frames[lo + 1:hi] if f.type is FrameType.BATCH and RecordKind(f.tag) in STEADY_KINDS]
    if not block:
        raise ValueError(f"steady steps {first}..{last}: no kernel, copy or memset between the marks")
    return block, t_hi - t_lo, hi


def _last_time_ns(frame: Frame) -> int | None:
    recs = frame.records()
    return int(recs["end"].max()) if len(recs) and "end" in (recs.dtype.names or ()) else frame_time_ns(frame)


def play_order(frames: list[Frame], steady: tuple[list[Frame], int, int] | None) -> Iterator[tuple[Frame, int]]:
    """What one run of a trace's process sends, in order: (frame, how much later in trace time than
    recorded). The recording once (its HELLO left out: the demo writes its own); a trace with
    ``steady`` steps (``steady_block``) then plays up to their last mark and repeats them forever,
    each repetition one ``period`` later."""
    if steady is None:
        yield from ((f, 0) for f in frames if f.type is not FrameType.HELLO)
        return
    block, period, last = steady
    yield from ((f, 0) for f in frames[:last + 1] if f.type is not FrameType.HELLO)
    for rounds in itertools.count(1):
        yield from ((f, rounds * period) for f in block)


def trace_seconds(path: Path) -> float:
    """Trace time from a trace's first timestamp to its last."""
    frames, _ = load_frames(path)
    times = [t for t in map(frame_time_ns, _own_process(frames, ONLY_PID.get(path.name))) if t is not None]
    return (max(times) - min(times)) / 1e9 if times else 0.0


def feeders(traces: list[Path], speed: float) -> list[tuple[Path, int, float]]:
    """(trace, pid, seconds before it starts) of every demo process: one per trace, and a second for
    each trace in ``STAGGERED``, starting half its length later."""
    plan = [(path, 0.0) for path in traces]
    plan += [(path, trace_seconds(path) / 2 / speed) for path in traces if path.name in STAGGERED]
    return [(path, DEMO_PIDS[i % 2] + 2 * (i // 2), after) for i, (path, after) in enumerate(plan)]


def _feeder(app: App, path: Path, pid: int, speed: float, stop: threading.Event, start_after: float = 0.0) -> None:
    if stop.wait(start_after):
        return
    frames, problems = load_frames(path)
    for problem in problems:
        log.error("%s", problem)
    frames = _own_process(frames, ONLY_PID.get(path.name))
    own_hello = next((f.json() for f in frames if f.type is FrameType.HELLO), None)
    steady = steady_block(frames, *STEADY_STEPS[path.name]) if path.name in STEADY_STEPS else None
    loop = 0
    while not stop.is_set():
        loop += 1
        session = Session(app.pipeline, source="trace", name=f"demo {path.name}")
        # A probe recording's own HELLO (its devices, versions) is kept; the pid and start time are the demo's.
        hello_body = {**(own_hello or {}), "pid": pid, "start_time": loop, "trace": path.name,
                      "host": os.uname().nodename}
        hello = encode_json(FrameType.HELLO, hello_body)
        app.ingest.inject(session, Frame(FrameType.HELLO, 0, hello[HEADER_SIZE:], 0))
        first = next((t for t in map(frame_time_ns, frames) if t is not None), 0)
        delta = time.time_ns() - first
        pacer = Pacer(speed, stop)
        repeats: Pacer | None = None
        for whole, later in play_order(frames, steady):
            moved = shift_frame(whole, delta + later, pid=pid)
            if later == 0:
                for frame in paced(moved, pacer):
                    if stop.is_set():
                        break
                    app.ingest.inject(session, frame)
            else:
                # Repeated steps play at real time whatever ``speed`` (faster would only cost more),
                # on from the recording's last mark, which is due now; a batch is handed on whole
                # once its last record is due, as a probe forwards a completed buffer: a few frames a
                # step, not one per millisecond of records.
                if repeats is None:
                    assert steady is not None
                    last_mark = frames[steady[2]].json()["ts"]
                    repeats = Pacer(1.0, stop, origin=(time.monotonic(), delta + last_mark))
                repeats.wait_for(_last_time_ns(moved))
                if not stop.is_set():
                    app.ingest.inject(session, moved)
            if stop.is_set():
                break
        app.ingest.inject(session, None)
        stop.wait(1.0 / speed)


def demo_config(config: Config) -> Config:
    """The demo's configuration: budgets when the user set none."""
    if config.budgets.rules:
        return config
    return dataclasses.replace(config, budgets=dataclasses.replace(config.budgets, rules=list(DEMO_BUDGETS)))


def demo_gpu() -> tuple[SimulatedNvml, Callable[[App], None]]:
    """The simulated H200, and how to hand it the app whose snapshot says what each process holds."""
    holder: list[App] = []

    def held() -> dict[int, int]:
        if not holder:
            return {}
        snap = holder[0].ingest.snapshot
        return {p.pid: sum(d.device_bytes for d in p.devices if d.dev == 0) for p in snap.processes if not p.exited}

    return SimulatedNvml(held), holder.append


def render(snap: PipelineSnapshot, url: str, started: float, doc: dict[str, Any] | None = None) -> str:
    """The demo's screen. ``doc``: the daemon's ``/api/processes`` document, whose rows the table
    shows, so the demo lists exactly the (process, GPU) rows `gpufootprint top` lists (built
    from the snapshot alone when None)."""
    from gpufootprint.engines.runner import EMPTY_OUTPUTS
    from gpufootprint.exporter.processes import processes_document

    mib = 1024 * 1024
    doc = doc if doc is not None else processes_document(snap, EMPTY_OUTPUTS)
    lines = [f"gpufootprint demo: real H200 traces replayed in a loop    metrics: {url}",
             (f"uptime {time.monotonic() - started:5.0f} s    records ingested "
              f"{sum(snap.records_ingested.values()):,}    ingest errors {sum(snap.ingest_errors.values())}"),
             "",
             (f"{'pid':>6} {'gpu':>3} {'device MiB':>11} {'static MiB':>10} {'pinned MiB':>10} "
              f"{'peak MiB':>9} {'pool MiB':>8} {'HtoD MiB':>9} {'DtoH MiB':>9}  source")]
    htod = next(k for k, v in COPY_KIND_NAMES.items() if v == "htod")
    dtoh = next(k for k, v in COPY_KIND_NAMES.items() if v == "dtoh")
    devs = {(p.pid, d.dev): (p, d) for p in snap.processes for d in p.devices}
    rows = sorted((r for r in doc.get("processes", []) if isinstance(r, dict)), key=lambda r: (r["pid"], r["gpu"]))
    for r in rows:
        lb = r.get("live_bytes") or {}
        proc, dev = devs.get((r["pid"], r["gpu"]), (None, None))
        copies = dev.memcpy_bytes if dev is not None else {}
        source = proc.info.get("trace", proc.source) if proc is not None else r.get("source")
        lines.append(
            f"{r['pid']:>6} {r['gpu']:>3} {lb.get('device', 0) / mib:>11.2f} {lb.get('device_static', 0) / mib:>10.2f} "
            f"{lb.get('pinned', 0) / mib:>10.2f} {(r.get('window_peak_bytes') or 0) / mib:>9.2f} "
            f"{(r.get('pool_reserved_bytes') or 0) / mib:>8.2f} {copies.get(htod, 0) / mib:>9.1f} "
            f"{copies.get(dtoh, 0) / mib:>9.1f}  {source}")
    if not rows:
        lines.append("  (waiting for the first records)")
    lines.append("")
    lines.append(f"peak = highest GPU-resident bytes over the last {snap.window_peak_seconds:g} s, "
                 "from exact event times. Ctrl-C to stop.")
    return "\n".join(lines)


def run_demo(app: App, *, speed: float, duration: float | None, traces: list[Path],
             notice: str | None = None) -> int:
    """``notice``: a line kept at the top of every repaint (the screen is cleared each time)."""
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        # As PID 1 in a container, SIGTERM has no default action: without a handler `docker stop`
        # and compose wait out their grace period and then kill.
        # Set by the signals thread, not in the handler: this thread waits on ``stop`` (gpufootprint/signals.py).
        on_signal(signal.SIGTERM, lambda _signum: stop.set())
    app.start()
    url = app.http.url if app.http else "(no --listen)"
    print(f"gpufootprint demo serving {url}", flush=True)
    threads = [threading.Thread(target=_feeder, args=(app, path, pid, speed, stop, after),
                                name=f"demo-feeder-{i}", daemon=True)
               for i, (path, pid, after) in enumerate(feeders(traces, speed))]
    for t in threads:
        t.start()
    started = time.monotonic()
    tty = sys.stdout.isatty()
    try:
        while not stop.is_set():
            if duration is not None and time.monotonic() - started >= duration:
                break
            screen = render(app.ingest.snapshot, url, started, app.routes["/api/processes"]())
            if notice and tty:
                screen = notice + "\n\n" + screen
            if tty:
                sys.stdout.write("\x1b[H\x1b[2J" + screen + "\n")
                sys.stdout.flush()
                stop.wait(1.0)
            else:
                print(screen + "\n", flush=True)
                stop.wait(5.0 if duration is None or duration > 10 else 2.0)
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=5)
        app.stop()
    return 0
