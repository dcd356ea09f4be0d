"""The Prometheus sink: a ``prometheus_client`` custom collector over the manager.

``AccelstatsCollector.collect()`` asks the manager for a collection (shared with concurrent
scrapes) and renders it into metric families declared in :mod:`accelstats.catalog`; ``describe()``
yields the same families without samples, so registering never touches NVML (client_python's
custom-collector pattern; no global Gauges set from threads). The HTTP server that answers
``/metrics`` is :mod:`accelstats.httpserver`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest

from accelstats import catalog
from accelstats.catalog import Family
from accelstats.manager import AcceleratorManager, Collection

log = logging.getLogger(__name__)


def _family(spec: Family) -> GaugeMetricFamily | CounterMetricFamily:
    if spec.type == "counter":
        return CounterMetricFamily(spec.name, spec.help, labels=list(spec.labels), unit=spec.unit)
    return GaugeMetricFamily(spec.name, spec.help, labels=list(spec.labels), unit=spec.unit)


def render(collection: Collection) -> Iterator[Metric]:
    """The catalog's families for one collection, each filled by its row's reader
    (:data:`catalog.COLLECTED`); families with no sample this time are left out (``describe()``
    still declares them all)."""
    for spec in catalog.COLLECTED:
        assert spec.read is not None
        family = None
        for labels, value in spec.read(collection):
            if family is None:
                family = _family(spec)
            family.add_metric(labels, value)
        if family is not None:
            yield family


class AccelstatsCollector:
    """prometheus_client custom collector: one manager collection per scrape, rendered from the catalog."""

    def __init__(self, manager: AcceleratorManager) -> None:
        self.manager = manager

    def collect(self) -> Iterator[Metric]:
        """Yield every family for a fresh (or concurrently shared) collection."""
        yield from render(self.manager.collect())

    def describe(self) -> Iterator[Metric]:
        """Yield every family of the catalog without samples (no NVML call at registration)."""
        return describe_catalog()


def describe_catalog() -> Iterator[Metric]:
    """Every family of the catalog (:data:`catalog.ALL`), without samples: what a registry needs to
    find a family by name (``name[]`` filters) without collecting."""
    for spec in catalog.ALL:
        yield _family(spec)


def make_registry(manager: AcceleratorManager) -> CollectorRegistry:
    """A registry of our own (never the global REGISTRY) holding only :class:`AccelstatsCollector`."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(AccelstatsCollector(manager))
    return registry


def exposition(manager: AcceleratorManager) -> bytes:
    """One collection as Prometheus text exposition format 0.0.4 (what ``accelstats dump`` prints)."""
    return generate_latest(make_registry(manager))
