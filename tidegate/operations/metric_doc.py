"""One Prometheus metric family as the code registers it and as the docs list it.

Each module that exports metrics declares its families as ``MetricDoc`` constants and builds its
collectors from them (``gauge``, ``counter``, ``histogram``, ``family``), so the name, type,
labels and help a scrape shows are the ones the generated metrics reference prints: there is no
second list to keep in step. Counters are declared without ``_total``; Prometheus's text format
adds it (and ``_created``) to the samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

MetricKind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True, slots=True)
class MetricDoc:
    name: str  # the family's name: tidegate_..., without a counter's _total
    kind: MetricKind
    help: str  # Prometheus's HELP line, and the reference's description
    labels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name.startswith("tidegate_") or self.name.endswith("_total"):
            raise ValueError(f"metric {self.name!r}: tidegate_..., a counter without _total")
        if not self.help.strip():
            raise ValueError(f"metric {self.name!r} has no help text")

    @property
    def exposed_name(self) -> str:
        """The sample name a scrape shows: a counter's with ``_total``."""
        return self.name + "_total" if self.kind == "counter" else self.name

    def gauge(self, registry: CollectorRegistry) -> Gauge:
        self._expect("gauge")
        return Gauge(self.name, self.help, self.labels, registry=registry)

    def counter(self, registry: CollectorRegistry) -> Counter:
        self._expect("counter")
        return Counter(self.name, self.help, self.labels, registry=registry)

    def histogram(self, registry: CollectorRegistry, buckets: Sequence[float]) -> Histogram:
        self._expect("histogram")
        return Histogram(self.name, self.help, self.labels, buckets=tuple(buckets),
                         registry=registry)

    def family(self, value: float | None = None) -> GaugeMetricFamily | CounterMetricFamily:
        """A family for a custom collector: one unlabelled ``value``, or (with labels) empty,
        for ``add_metric``."""
        kind = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}.get(self.kind)
        if kind is None:
            raise TypeError(f"metric {self.name!r}: no plain family for a {self.kind}")
        if self.labels:
            return kind(self.name, self.help, labels=list(self.labels))
        return kind(self.name, self.help, value=value)

    def _expect(self, kind: MetricKind) -> None:
        if self.kind != kind:
            raise TypeError(f"metric {self.name!r} is a {self.kind}, not a {kind}")
