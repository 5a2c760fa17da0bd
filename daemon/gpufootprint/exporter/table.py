"""Metric families as rows of a table: name, help, type, labels, and a getter.

A table is read against a list of sources (a process's device, a process, a GPU, the snapshot),
each with the label values it stands for; a row's getter says which samples one source adds
(the label values after the source's own, and the value). Every family of a table is walked in
one pass over the sources, and a new metric is one new row, its name and help beside the code
that reads its value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

S = TypeVar("S")
K = TypeVar("K")
LabelValues = tuple[str, ...]
Samples = Iterable[tuple[LabelValues, float]]
Getter = Callable[[S], Samples]


@dataclass(frozen=True)
class Row(Generic[S]):
    name: str  # without _total: prometheus_client adds it to counters
    help: str
    labels: tuple[str, ...]  # all of them: the source's first, then the getter's
    get: Callable[[S], Samples]
    type: Literal["gauge", "counter"] = "gauge"

    def family(self) -> GaugeMetricFamily | CounterMetricFamily:
        if self.type == "counter":
            return CounterMetricFamily(self.name, self.help, labels=list(self.labels))
        return GaugeMetricFamily(self.name, self.help, labels=list(self.labels))


def gauge(name: str, help: str, labels: Sequence[str], get: Callable[[S], Samples]) -> Row[S]:
    return Row(name, help, tuple(labels), get, "gauge")


def counter(name: str, help: str, labels: Sequence[str], get: Callable[[S], Samples]) -> Row[S]:
    return Row(name, help, tuple(labels), get, "counter")


def build(table: Sequence[Row[S]], sources: Iterable[tuple[LabelValues, S]]) -> list[Metric]:
    """The table's families, in its order, with every source's samples in the sources' order."""
    fams = [row.family() for row in table]
    for base, source in sources:
        for row, fam in zip(table, fams):
            for values, value in row.get(source):
                fam.add_metric([*base, *values], value)
    return list(fams)


def one(get: Callable[[S], float | None]) -> Callable[[S], Samples]:
    """A getter for one sample per source, none where the value is None."""

    def samples(source: S) -> Samples:
        value = get(source)
        return () if value is None else (((), value),)

    return samples


def each(get: Callable[[S], Mapping[K, float]], *, sort: bool = False,
         name: Callable[[K], str] = str) -> Callable[[S], Samples]:
    """A getter for one sample per key of a mapping (the key, named, is the last label)."""

    def samples(source: S) -> Samples:
        items = get(source).items()
        return [((name(k),), v) for k, v in (sorted(items) if sort else items)]

    return samples


def states(get: Callable[[S], str], names: Sequence[str]) -> Callable[[S], Samples]:
    """1 for the source's current state, 0 for each other one (the state is the last label)."""

    def samples(source: S) -> Samples:
        now = get(source)
        return [((n,), 1.0 if now == n else 0.0) for n in names]

    return samples
