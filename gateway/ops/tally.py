"""Counters and histograms kept as plain numbers per label tuple, turned into Prometheus families
only when /metrics is scraped.

prometheus_client's own metric objects take a lock and make four calls per increment (a dozen per
request here: a measurable share of the request path); the gateway counts on one event-loop thread,
so a dict update is all a count needs. What a scrape returns is the same exposition: the same
names, help, label names, `le` buckets, `_sum` and `_count`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class Tally:
    """A counter family: a sum per label tuple."""

    __slots__ = ("help", "labels", "name", "values")

    def __init__(self, name: str, help: str, labels: Sequence[str]) -> None:
        self.name, self.help, self.labels = name, help, list(labels)
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        values = self.values
        values[labels] = values.get(labels, 0.0) + amount

    def family(self) -> Metric:
        family = CounterMetricFamily(self.name, self.help, labels=self.labels)
        for labels, value in self.values.items():
            family.add_metric(labels, value)
        return family


class Spread:
    """A histogram family: per label tuple, a count per bucket (the last for +Inf) and the sum."""

    __slots__ = ("bounds", "help", "labels", "les", "name", "series")

    def __init__(self, name: str, help: str, labels: Sequence[str], buckets: Sequence[float]) -> None:
        self.name, self.help, self.labels = name, help, list(labels)
        self.bounds = tuple(float(b) for b in buckets)
        self.les = [*(floatToGoString(b) for b in self.bounds), "+Inf"]  # type: ignore[no-untyped-call]
        self.series: dict[tuple[str, ...], list[float]] = {}

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        counts = self.series.get(labels)
        if counts is None:
            counts = self.series[labels] = [0.0] * (len(self.bounds) + 2)
        # A bucket counts the values at or below its bound: the first bound not below the value.
        counts[bisect_left(self.bounds, value)] += 1
        counts[-1] += value

    def family(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.help, labels=self.labels)
        for labels, counts in self.series.items():
            cumulative, buckets = 0.0, []
            for le, count in zip(self.les, counts, strict=False):
                cumulative += count
                buckets.append((le, cumulative))
            family.add_metric(list(labels), buckets, counts[-1])
        return family


class Tallies(Collector):
    """The families, in the order they were made, as one collector of a registry."""

    def __init__(self) -> None:
        self._all: list[Tally | Spread] = []

    def counter(self, name: str, help: str, labels: Sequence[str]) -> Tally:
        tally = Tally(name, help, labels)
        self._all.append(tally)
        return tally

    def histogram(self, name: str, help: str, labels: Sequence[str], buckets: Sequence[float]) -> Spread:
        spread = Spread(name, help, labels, buckets)
        self._all.append(spread)
        return spread

    def collect(self) -> Iterator[Metric]:
        for metric in self._all:
            yield metric.family()

    def describe(self) -> Iterator[Metric]:
        """The families without samples: the registry reserves their names at registration."""
        for metric in self._all:
            yield (CounterMetricFamily if isinstance(metric, Tally) else HistogramMetricFamily)(
                metric.name, metric.help, labels=metric.labels
            )
