"""Post-processing of metric families at scrape time: pod labels, then a series cap.

Runs over whatever families the collector built (the foundation's and any added
later), so every per-process series (any sample with a ``pid`` label) gets the
same treatment without each family knowing about it.

The cap: at most ``max_series`` series per metric. Series keep their slot while
they exist (a process does not flicker in and out of view as values change);
a new series finds a slot only while there is room. Past the cap, the rest are
folded into one series ``pid="__overflow__"`` (other labels empty) carrying
their sum, and ``gpufootprint_series_dropped_total{metric}`` grows by the number
of series folded at each rendering of the body. Memory is bounded too: at most
``max_series`` remembered keys per metric.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.samples import Sample

from gpufootprint.k8s.attribution import Attributor, unresolved

OVERFLOW_PID = "__overflow__"
DROPPED_METRIC = "gpufootprint_series_dropped"

_SeriesKey = tuple[tuple[str, str], ...]


def _key(labels: dict[str, str]) -> _SeriesKey:
    return tuple(sorted(labels.items()))


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def safe_label_value(value: str, max_len: int) -> str:
    """Control characters become '?'; a value over ``max_len`` is cut and ends in '~' and 8 hex
    digits of its hash, so two long values that share a prefix stay two series."""
    if _CONTROL.search(value):
        value = _CONTROL.sub("?", value)
    if len(value) > max_len:
        digest = hashlib.sha256(value.encode("utf-8", "replace")).hexdigest()[:8]
        value = value[: max_len - 9] + "~" + digest
    return value


def sanitize_label_values(families: Iterable[Metric], max_len: int) -> list[Metric]:
    """Whatever a probe managed to put into a label value (a HELLO field, a counter name) comes out
    bounded in length and without control characters."""
    out = []
    for fam in families:
        samples = fam.samples
        for i, s in enumerate(samples):
            values = s.labels.values()
            joined = "".join(values)
            if len(joined) <= max_len and joined.isprintable():
                continue  # every value short and clean, found with two C calls: the common case
            for v in values:
                # str.isprintable is one C loop: the common clean value costs next to nothing
                if len(v) > max_len or not v.isprintable():
                    samples[i] = s._replace(labels={k: safe_label_value(v, max_len) for k, v in s.labels.items()})
                    break
        out.append(fam)
    return out


def attach_pod_labels(families: Iterable[Metric], labels_for: Callable[[str], dict[str, str]]) -> list[Metric]:
    """Add pod labels to every sample that has a ``pid`` label; one lookup per pid per scrape."""
    cache: dict[str, dict[str, str]] = {}
    out = []
    for fam in families:
        new = []
        for s in fam.samples:
            pid = s.labels.get("pid")
            if pid is None or pid == OVERFLOW_PID:
                new.append(s)
                continue
            extra = cache.get(pid)
            if extra is None:
                extra = cache[pid] = labels_for(pid)
            new.append(s._replace(labels={**s.labels, **extra}))
        fam.samples = new
        out.append(fam)
    return out


class SeriesCap:
    """``preferred``: the pids (as label values) of processes with a live probe now. Past the cap
    their series take slots first, before those of exited or replayed processes: a burst of
    short-lived processes cannot fold the processes still running into the overflow series."""

    def __init__(self, max_series: int, preferred: Callable[[], set[str]] | None = None) -> None:
        if max_series < 2:
            raise ValueError("series cap must be at least 2 (one kept series and the overflow)")
        self.max_series = max_series
        self.preferred = preferred
        self._admitted: dict[str, dict[_SeriesKey, None]] = {}  # metric -> keys holding a slot, oldest first
        self.dropped: dict[str, int] = {}
        self._lock = threading.Lock()  # scrapes may run on several HTTP threads at once

    def apply(self, families: Iterable[Metric]) -> list[Metric]:
        live = self.preferred() if self.preferred is not None else set()
        with self._lock:
            out = [self._cap(fam, live) for fam in families]
        dropped = CounterMetricFamily(DROPPED_METRIC, "Series folded into the pid=\"__overflow__\" series of a "
                                      "metric because it had reached exporter.series_cap, counted at every "
                                      "exposition.", labels=["metric"])
        for name, n in sorted(self.dropped.items()):
            dropped.add_metric([name], n)
        out.append(dropped)
        return out

    def _cap(self, fam: Metric, live: set[str]) -> Metric:
        per_process = [s for s in fam.samples if "pid" in s.labels]
        if not per_process:
            return fam
        exposed = fam.name + "_total" if fam.type == "counter" else fam.name  # the name a query uses
        self.dropped.setdefault(exposed, 0)
        # A series is its label set; a counter's _total and _created samples are one series.
        present: dict[_SeriesKey, None] = {}
        for s in per_process:
            present.setdefault(_key(s.labels), None)
        old = self._admitted.get(fam.name, {})
        kept: dict[_SeriesKey, None]
        if len(present) <= self.max_series:
            kept = present
        else:
            room = self.max_series - 1  # one slot is the overflow series
            # Slots go, in order: live processes already shown, new live ones, others already
            # shown, new others. Within each, the order of arrival (a series keeps its slot).
            pid = {key: dict(key).get("pid", "") for key in present}
            kept = {}
            for want_live in (True, False):
                for k in [k for k in old if k in present] + list(present):
                    if len(kept) >= room:
                        break
                    if (pid[k] in live) is want_live:
                        kept.setdefault(k, None)
        # Forget series that are gone, so their slots free up for newcomers.
        self._admitted[fam.name] = {k: None for k in old if k in kept} | {k: None for k in kept if k not in old}
        if len(kept) == len(present):
            return fam
        folded: dict[str, float] = {}
        names: set[str] = set()
        folded_keys: set[_SeriesKey] = set()
        new: list[Sample] = []
        for s in fam.samples:
            if "pid" not in s.labels:
                new.append(s)
                continue
            k = _key(s.labels)
            if k in kept:
                new.append(s)
            else:
                folded_keys.add(k)
                names.update(s.labels)
                folded[s.name] = folded.get(s.name, 0.0) + s.value
        labels = {n: "" for n in sorted(names)}
        labels["pid"] = OVERFLOW_PID
        for sample_name, total in folded.items():
            new.append(Sample(sample_name, dict(labels), total))
        self.dropped[exposed] += len(folded_keys)
        fam.samples = new
        return fam


def build_postprocess(attributor: Attributor | None, max_series: int,
                      max_label_len: int | None = None,
                      preferred: Callable[[], set[str]] | None = None) -> Callable[[list[Metric]], list[Metric]]:
    """The collector's hook: pod labels (when Kubernetes attribution is on), label values cut to
    ``max_label_len`` and cleaned of control characters (a probe chooses some of them), then the cap."""
    cap = SeriesCap(max_series, preferred)

    def labels_for(pid: str) -> dict[str, str]:
        assert attributor is not None
        try:
            return attributor.identify(int(pid)).labels()
        except ValueError:  # not a number: nothing to look up
            return unresolved(()).labels()

    def postprocess(families: list[Metric]) -> list[Metric]:
        if attributor is not None:
            families = attach_pod_labels(families, labels_for)
        if max_label_len is not None:
            families = sanitize_label_values(families, max_label_len)
        return cap.apply(families)

    postprocess.cap = cap  # type: ignore[attr-defined]  # for tests and self-metrics
    return postprocess
