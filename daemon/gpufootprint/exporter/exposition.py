"""/metrics bodies rendered ahead of the scrape, so a scrape costs almost nothing.

Building and formatting the exposition costs tens of milliseconds of CPU for a busy node
(1,500 series: 35 ms on the bench machine), and on the request thread it also waits for the GIL
behind the ingest thread: /metrics p99 was 150-235 ms under bench/load.py. The snapshot behind
the body changes only every ``daemon.tick_ms`` and Prometheus scrapes every 15-60 s, so here a
background thread renders the body every ``exporter.render_interval_ms`` (1 s by default): it
collects the registry's families once and writes each format clients have asked for in the last
ten minutes (the text format, OpenMetrics), plain and gzipped. A scrape writes those bytes out.

* The first scrape of a format, or any scrape while the cache is older than five intervals (a
  render thread that has died or hung), renders on the request thread: a body is never empty and
  never frozen.
* Each body carries ``gpufootprint_exporter_body_timestamp_seconds`` (when its families were
  collected: its age at a scrape is ``time() - ...``) and
  ``gpufootprint_exporter_render_duration_seconds`` (how long the previous rendering took).
* At most ``MAX_FORMATS`` formats are kept (a client's Accept header can name any version);
  past that a request is rendered for itself and not cached.
"""

from __future__ import annotations

import gzip
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.registry import Collector

from gpufootprint.exporter.text import render_text

log = logging.getLogger(__name__)

Encoder = Callable[[Collector], bytes]

#: A format nobody asked for in this long is no longer rendered.
FORGET_S = 600.0
#: Formats (content types) kept at most.
MAX_FORMATS = 4
#: A cache older than this many intervals is not served; the scrape renders instead.
STALE_INTERVALS = 5
#: gzip level of cached bodies: 6 is zlib's default, most of level 9's gain for a third of the time.
GZIP_LEVEL = 6


class _Families(Collector):
    """One rendering's families, handed to prometheus_client's encoders as a registry."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


@dataclass
class _Wanted:
    """A format clients ask for: rendered while asked for within ``FORGET_S``."""

    encoder: Encoder
    last: float  # clock() of the last request
    last_gzip: float | None = None  # ... of the last request that accepted gzip


def _encode(encoder: Encoder, families: list[Metric]) -> bytes:
    if encoder is generate_latest:  # the text format 0.0.4, the default: the lean writer
        return render_text(families)
    return encoder(_Families(families))


class ExpositionCache:
    def __init__(self, registry: Collector, interval_s: float, *,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.registry = registry
        self.interval_s = interval_s  # exporter.render_interval_ms; a SIGHUP may change it
        self._clock = clock
        self._wall = wall
        self._render_lock = threading.Lock()  # one rendering at a time
        self._lock = threading.Lock()  # guards the fields below (held for dictionary updates only)
        # content type -> its encoder and when it was last asked for; the text format from the start
        self._wanted: dict[str, _Wanted] = {CONTENT_TYPE_PLAIN_0_0_4: _Wanted(generate_latest, clock())}
        self._families: list[Metric] | None = None  # the current rendering's families
        self._bodies: dict[tuple[str, bool], bytes] = {}  # (content type, gzipped) -> body
        self._rendered_at: float | None = None  # clock() when the current families were collected
        self.last_render_seconds: float | None = None
        self.renders = 0
        self.render_errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the scrape -----------------------------------------------------------------

    def cached(self, encoder: Encoder, content_type: str, gzipped: bool) -> bytes | None:
        """The fresh cached body, or None when answering needs rendering (which may take a while)."""
        now = self._clock()
        with self._lock:
            wanted = self._wanted.get(content_type)
            if wanted is None or not self._fresh(now):
                return None
            body = self._bodies.get((content_type, gzipped))
            if body is not None:
                wanted.last = now
                if gzipped:
                    wanted.last_gzip = now
            return body

    def body(self, encoder: Encoder, content_type: str, gzipped: bool) -> bytes:
        """The body for one scrape: cached bytes when there are fresh ones (gzipped if asked)."""
        now = self._clock()
        with self._lock:
            self._forget(now)
            wanted = self._wanted.get(content_type)
            if wanted is None and len(self._wanted) < MAX_FORMATS:
                wanted = self._wanted[content_type] = _Wanted(encoder, now)
            if wanted is not None:
                wanted.last = now
                if gzipped:
                    wanted.last_gzip = now
            body = self._bodies.get((content_type, gzipped)) if self._fresh(now) else None
            families = self._families if self._fresh(now) else None
        if body is not None:
            return body
        if families is None:  # no rendering yet, or the render thread is far behind: render now
            self.render(unless_fresh=True)
            with self._lock:
                body = self._bodies.get((content_type, gzipped))
                families = self._families
            if body is not None:
                return body
        assert families is not None
        # A format first asked for now (or one past MAX_FORMATS): write it from the current families.
        body = _encode(encoder, families)
        if gzipped:
            body = gzip.compress(body, GZIP_LEVEL)
        with self._lock:
            if wanted is not None and self._families is families:
                self._bodies[(content_type, gzipped)] = body
        return body

    def _forget(self, now: float) -> None:
        for ctype in [c for c, w in self._wanted.items() if now - w.last > FORGET_S]:
            del self._wanted[ctype]

    def _fresh(self, now: float) -> bool:
        return self._rendered_at is not None and now - self._rendered_at <= STALE_INTERVALS * self.interval_s

    # --- rendering ------------------------------------------------------------------

    def render(self, unless_fresh: bool = False) -> None:
        """Collect the families once and write every wanted format, plain and (if asked) gzipped.
        ``unless_fresh``: not if another thread rendered while this one waited for the lock."""
        with self._render_lock:
            t0 = self._clock()
            if unless_fresh and self._fresh(t0):
                return
            wall = self._wall()
            with self._lock:
                self._forget(t0)
                wanted = [(c, w.encoder, w.last_gzip is not None and t0 - w.last_gzip <= FORGET_S)
                          for c, w in self._wanted.items()]
            families = list(self.registry.collect())
            families.extend(self._self_families(wall))
            bodies: dict[tuple[str, bool], bytes] = {}
            for ctype, encoder, gz in wanted:
                raw = _encode(encoder, families)
                bodies[(ctype, False)] = raw
                if gz:
                    bodies[(ctype, True)] = gzip.compress(raw, GZIP_LEVEL)
            with self._lock:
                self._families, self._bodies, self._rendered_at = families, bodies, t0
            self.last_render_seconds = self._clock() - t0
            self.renders += 1

    def _self_families(self, wall: float) -> Iterator[Metric]:
        stamp = GaugeMetricFamily("gpufootprint_exporter_body_timestamp_seconds",
                                  "When the families of this /metrics body were collected (Unix seconds); the "
                                  "body is rendered every exporter.render_interval_ms.")
        stamp.add_metric([], wall)
        yield stamp
        if self.last_render_seconds is not None:
            took = GaugeMetricFamily("gpufootprint_exporter_render_duration_seconds",
                                     "Seconds the previous rendering of the /metrics body took (collecting the "
                                     "families, formatting, gzip).")
            took.add_metric([], self.last_render_seconds)
            yield took

    # --- the background thread ------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpufootprint-render", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            t0 = self._clock()
            try:
                self.render()
            except Exception:  # the thread must outlive any one bug; scrapes render then
                self.render_errors += 1
                if self.render_errors == 1 or self.render_errors % 100 == 0:
                    log.exception("rendering /metrics failed (%d times so far)", self.render_errors)
            took = self._clock() - t0
            # At most a fifth of the time rendering (its thread holds the GIL the ingest loop needs: 24,000
            # series of a full node took 0.3 s to render on a small machine), and never so seldom that a
            # scrape finds the body stale and renders it itself.
            pause = max(self.interval_s - took, self.interval_s / 2,
                        min(4 * took, (STALE_INTERVALS - 1) * self.interval_s))
            if self._stop.wait(pause):
                return
