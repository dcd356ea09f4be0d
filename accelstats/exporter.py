"""The Prometheus sink: a ``prometheus_client`` custom collector over the manager.

``AccelstatsCollector.collect()`` asks the manager for a collection (shared with concurrent
scrapes) and renders it into metric families declared in :mod:`accelstats.catalog`; ``describe()``
yields the same families without samples, so registering never touches NVML (client_python's
custom-collector pattern; no global Gauges set from threads). The HTTP server that answers
``/metrics`` is :mod:`accelstats.httpserver`.
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest

from accelstats import __version__, catalog
from accelstats.catalog import Family
from accelstats.containers import ContainerStats
from accelstats.manager import AcceleratorManager, Collection

log = logging.getLogger(__name__)


def _family(spec: Family) -> GaugeMetricFamily | CounterMetricFamily:
    if spec.type == "counter":
        return CounterMetricFamily(spec.name, spec.help, labels=list(spec.labels))
    return GaugeMetricFamily(spec.name, spec.help, labels=list(spec.labels))


def _identity_labels(c: ContainerStats) -> list[str]:
    """cAdvisor's container labels: id (cgroup path), name, image, container, pod, namespace."""
    m = c.metadata
    return [_utf8(v) for v in (c.cgroup, m.name, m.image, m.container, m.pod, m.namespace)]


def _utf8(value: str) -> str:
    """A label value safe to encode: names read from the filesystem may carry undecodable bytes
    (``os.fsdecode`` surrogates), which would make the whole exposition fail. Each such byte becomes
    ``\\xNN`` (its hex value), so two names that differ only in undecodable bytes stay two series
    (a single replacement character for every byte made them one, and Prometheus dropped one)."""
    if value.isascii():
        return value
    try:
        raw = value.encode("utf-8", "surrogateescape")  # the bytes os.fsdecode could not decode
    except UnicodeEncodeError:  # another lone surrogate (not from a file name): its 3-byte form
        raw = value.encode("utf-8", "surrogatepass")
    return raw.decode("utf-8", "backslashreplace")


def render(collection: Collection) -> Iterator[Metric]:
    """The catalog's families for one collection; families with no sample this time are left out
    (``describe()`` still declares them all)."""
    snap = collection.snapshot
    fams = {f.name: _family(f) for f in catalog.ALL}

    def add(spec: Family, labels: Iterable[str], value: float) -> None:
        fams[spec.name].add_metric(list(labels), value)

    add(catalog.BUILD_INFO, [__version__, platform.python_version(), snap.nvml_version, snap.driver_version], 1)
    if snap.nvml_state:
        add(catalog.NVML_STATE, [snap.nvml_state, snap.nvml_status], 1)
    for r in snap.collector_results:
        add(catalog.COLLECTOR_SUCCESS, [r.name], 1.0 if r.success else 0.0)
        add(catalog.COLLECTOR_DURATION, [r.name], r.duration_seconds)
    for name, when in sorted(collection.collector_last_success.items()):
        add(catalog.COLLECTOR_LAST_SUCCESS, [name], when)
    add(catalog.SKIPPED_LINES, [], collection.devices_list_skipped_lines_total)
    for reason, count in sorted(collection.attribution_skipped.items()):
        add(catalog.ATTRIBUTION_SKIPPED, [reason], count)
    for (call, error), count in sorted(collection.nvml_errors.items()):
        add(catalog.NVML_ERRORS, [call, error], count)

    devices = {d.uuid: d for d in snap.devices}
    for d in snap.devices:
        base = [d.uuid, str(d.index), d.name]
        add(catalog.GPU_INFO, base + [
            "" if d.minor is None else str(d.minor), d.pci_bus_id, d.kind, d.parent_uuid, d.mig_profile,
            _opt(d.gpu_instance_id), _opt(d.compute_instance_id), snap.driver_version, snap.cuda_driver_version,
            d.vbios_version, d.mig_mode, d.compute_mode, d.persistence_mode, d.compute_capability,
            d.architecture, snap.source], 1)
        sample = snap.samples.get(d.uuid)
        add(catalog.GPU_UP, base, 1.0 if sample is not None and sample.up else 0.0)
        if d.uuid in snap.last_success:
            add(catalog.GPU_LAST_SUCCESS, base, snap.last_success[d.uuid])
        if sample is None or not sample.up:
            continue
        for spec in catalog.GPU_SAMPLED:
            assert spec.read is not None
            for extra, value in spec.read(sample):
                add(spec, base + list(extra), value)

    for c in collection.containers:
        if not c.accelerators:
            continue
        ident = _identity_labels(c)
        i = c.identity
        info = [i.runtime, i.id, i.pod_uid, i.alloc_id, i.task] if i is not None else ["unknown", "", "", "", ""]
        add(catalog.CONTAINER_INFO, ident + [_utf8(v) for v in info], 1)
        for a in c.accelerators:
            cad = ident + [a.make, a.model, a.id]
            if a.memory_total_bytes is not None:
                add(catalog.CADVISOR_MEMORY_TOTAL, cad, a.memory_total_bytes)
            if a.memory_used_bytes is not None:
                add(catalog.CADVISOR_MEMORY_USED, cad, a.memory_used_bytes)
            if a.duty_cycle is not None:
                add(catalog.CADVISOR_DUTY_CYCLE, cad, a.duty_cycle)
            dev = devices.get(a.id)
            labels = ident + [a.id, str(dev.index if dev else a.index), a.attribution]
            if a.container_memory_used_bytes is not None:
                add(catalog.CONTAINER_MEMORY, labels, a.container_memory_used_bytes)
            if a.container_sm_utilization_ratio is not None:
                add(catalog.CONTAINER_SM, labels, a.container_sm_utilization_ratio)
            if a.container_processes is not None:
                add(catalog.CONTAINER_PROCESSES, labels, a.container_processes)
            if a.device_open is not None:
                add(catalog.CONTAINER_DEVICE_OPEN, labels, 1 if a.device_open else 0)

    for m in snap.mps:
        add(catalog.MPS_UP, [m.resource], 1.0 if m.up else 0.0)
        if not m.up:
            continue
        add(catalog.MPS_SERVERS, [m.resource], m.servers)
        add(catalog.MPS_CLIENTS, [m.resource], m.clients)
        if m.active_thread_ratio is not None:
            add(catalog.MPS_THREADS, [m.resource], m.active_thread_ratio)
        for uuid, limit in m.pinned_memory_limit_bytes:
            if limit is not None:
                add(catalog.MPS_PINNED, [m.resource, uuid], limit)
    if any(r.name == "files" for r in snap.collector_results):
        add(catalog.FILES_SKIPPED, [], snap.file_devices_skipped_total)
    for f in snap.file_devices:
        labels = [f.id, f.vendor, f.type, f.name, _utf8(f.path)]
        add(catalog.FILE_INFO, labels, 1)
        add(catalog.FILE_HEALTHY, labels, 1.0 if f.healthy else 0.0)
        add(catalog.FILE_SIZE, labels, f.size_bytes)
        add(catalog.FILE_MTIME, labels, f.modified_timestamp_seconds)
        add(catalog.FILE_MODE, labels, f.mode)
    yield from (f for f in fams.values() if f.samples)


def _opt(value: int | None) -> str:
    return "" if value is None else str(value)


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
