"""The Prometheus exposition of a collection: prometheus_client families and the fast encoder.

**Families** (:func:`render`, :class:`AccelstatsCollector`): the catalog's rows of one collection as
``prometheus_client`` metric families; ``describe()`` yields them without samples, so registering never
touches NVML. ``accelstats dump`` prints :func:`exposition`.

**The fast encoder** (:class:`FastEncoder`) writes the bytes prometheus_client's encoders write for
those families (text 0.0.4 and 1.0.0, OpenMetrics 1.0.0, escapings that leave names unchanged:
:func:`supported`) from the catalog's readers directly: header lines rendered once per format, a
sample's label string once per family and label values and kept for the next scrapes (one dict per
family; what went unused is dropped once it is a third of the dict), only values formatted per scrape.
``tests/web/test_exposition.py`` checks the bytes against the reference on every fixture, an 8-GPU
1000-container host and edge cases.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from math import copysign
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client import utils as _client_utils
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest

from accelstats import catalog, dcgm
from accelstats.catalog import Family

if TYPE_CHECKING:
    from accelstats.manager import AcceleratorManager, Collection


RENDERED: tuple[Family, ...] = catalog.COLLECTED + dcgm.FAMILIES
"""What a collection renders: the catalog's families, then dcgm-exporter's names (empty unless the
``dcgm_names`` setting is on: :mod:`accelstats.dcgm`)."""


def _family(spec: Family) -> GaugeMetricFamily | CounterMetricFamily:
    if spec.type == "counter":
        return CounterMetricFamily(spec.name, spec.help, labels=list(spec.labels), unit=spec.unit)
    return GaugeMetricFamily(spec.name, spec.help, labels=list(spec.labels), unit=spec.unit)


def render(collection: Collection) -> Iterator[Metric]:
    """The catalog's families for one collection, each filled by its row's reader
    (:data:`catalog.COLLECTED`); families with no sample this time are left out (``describe()``
    still declares them all)."""
    for spec in RENDERED:
        assert spec.read is not None
        family = None
        for labels, value in spec.read(collection):
            if family is None:
                family = _family(spec)
            family.add_metric(labels, value)
        if family is not None:
            yield family


class AccelstatsCollector:
    """prometheus_client custom collector of the catalog's families: ``collect`` gives the collection to
    render (a manager's, fresh or shared, per scrape; or one finished collection, never collected again)."""

    def __init__(self, collect: Callable[[], Collection]) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Metric]:
        """Yield every family of the collection :attr:`collect` gives."""
        yield from render(self._collect())

    def describe(self) -> Iterator[Metric]:
        """Yield every family of the catalog without samples (no NVML call at registration)."""
        return describe_catalog()


def describe_catalog() -> Iterator[Metric]:
    """Every family of the catalog (:data:`catalog.ALL`), without samples: what a registry needs to
    find a family by name (``name[]`` filters) without collecting."""
    for spec in (*catalog.ALL, *dcgm.FAMILIES):
        yield _family(spec)


def make_registry(manager: AcceleratorManager) -> CollectorRegistry:
    """A registry of our own (never the global REGISTRY) holding only :class:`AccelstatsCollector`."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(AccelstatsCollector(manager.collect))
    return registry


def exposition(manager: AcceleratorManager) -> bytes:
    """One collection as Prometheus text exposition format 0.0.4 (what ``accelstats dump`` prints)."""
    return generate_latest(make_registry(manager))


TEXT = "text"
OPENMETRICS = "openmetrics"
_FAST_ESCAPINGS = ("", "underscores", "allow-utf-8")
_go_float: Callable[[float], str] = _client_utils.floatToGoString  # the reference's value format


def supported(content_type: str) -> str | None:
    """The format (:data:`TEXT` or :data:`OPENMETRICS`) the fast encoder writes for a negotiated
    ``content_type`` (:func:`accelstats.web.app.negotiate`), or None when only prometheus_client's
    encoder writes it (an escaping that rewrites names)."""
    params = dict(p.strip().partition("=")[::2] for p in content_type.split(";")[1:])
    if params.get("escaping", "") not in _FAST_ESCAPINGS:
        return None
    return OPENMETRICS if content_type.startswith("application/openmetrics-text") else TEXT


def _escape_value(value: str) -> str:
    """A label value as both reference encoders escape it: backslash, newline, double quote."""
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


class _Layout:
    """What is fixed for one family in one format: its header lines, sample name and label order."""

    __slots__ = ("header", "names", "order", "sample_name")

    def __init__(self, spec: Family, fmt: str) -> None:
        base = spec.name.removesuffix("_total") if spec.type == "counter" else spec.name
        if fmt == TEXT:  # exposition.generate_latest: counters keep _total in HELP/TYPE; \ and newline escaped
            shown = base + "_total" if spec.type == "counter" else base
            doc = spec.help.replace("\\", r"\\").replace("\n", r"\n")
            self.header = f"# HELP {shown} {doc}\n# TYPE {shown} {spec.type}\n"
        else:  # openmetrics.generate_latest: the family name without _total, HELP escaped like a value
            self.header = f"# HELP {base} {_escape_value(spec.help)}\n# TYPE {base} {spec.type}\n"
            if spec.unit:
                self.header += f"# UNIT {base} {spec.unit}\n"
        self.sample_name = base + "_total" if spec.type == "counter" else base
        self.order = sorted(range(len(spec.labels)), key=lambda i: spec.labels[i])
        self.names = spec.labels


class FastEncoder:
    """Encodes collections of one host, keeping rendered label strings between scrapes (one dict
    lookup per sample; the strings of series gone are dropped at the family's next encoding once they
    are a third of those held). Thread-safe for concurrent :meth:`encode` calls (each dict operation is
    atomic; a string is the same whoever renders it, and a racing call at worst renders one again)."""

    def __init__(self) -> None:
        self._layouts: dict[tuple[str, str], _Layout] = {}
        # rendered "name{labels} " by family, then by label values. One dict per family, looked up once
        # per sample; a family whose dict holds over 1.5 times the samples it last wrote (series gone) is
        # compacted at its next encoding: a fresh dict, filled from the old one with what is used.
        self._labels: dict[str, dict[tuple[str, ...], str]] = {}
        self._compact: set[str] = set()

    def _layout(self, spec: Family, fmt: str) -> _Layout:
        key = (spec.name, fmt)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = _Layout(spec, fmt)
        return layout

    @property
    def cached(self) -> int:
        """Label strings held."""
        return sum(map(len, list(self._labels.values())))

    def encode(self, collection: Collection, fmt: str, families: Iterable[Family] = RENDERED) -> str:
        """The exposition text of ``collection``'s families (without OpenMetrics' ``# EOF``: the
        caller appends the server's families and ends the body). Families without a sample are left
        out, as :func:`accelstats.web.exposition.render` leaves them out."""
        cache, compact = self._labels, self._compact
        out: list[str] = []
        append = out.append
        floats: dict[float, str] = {}  # values repeat (a GPU's figures in each of its containers' series)
        no_previous: dict[tuple[str, ...], str] = {}
        for spec in families:
            assert spec.read is not None
            layout: _Layout | None = None
            labels: dict[tuple[str, ...], str] = {}
            previous = no_previous
            count = 0
            for values, value in spec.read(collection):
                if layout is None:
                    layout = self._layout(spec, fmt)
                    append(layout.header)
                    found_labels = cache.get(spec.name)
                    if found_labels is None or spec.name in compact:
                        previous = found_labels or no_previous
                        cache[spec.name] = labels
                    else:
                        labels = found_labels
                prefix = labels.get(values)
                if prefix is None:
                    prefix = previous.get(values)
                    if prefix is None:
                        names = layout.names
                        prefix = layout.sample_name + (
                            "{" + ",".join(f'{names[i]}="{_escape_value(values[i])}"' for i in layout.order) + "} "
                            if values else " ")
                    labels[values] = prefix
                count += 1
                if value == 0:  # 0.0 and -0.0 are one key of a dict but two texts
                    text = "0.0" if copysign(1.0, value) > 0 else "-0.0"
                else:
                    found = floats.get(value)
                    if found is None:
                        found = floats[value] = _go_float(value)
                    text = found
                append(f"{prefix}{text}\n")
            if layout is None:
                cache.pop(spec.name, None)  # no series left: nothing to keep
                compact.discard(spec.name)
            elif len(labels) > count + count // 2:  # more than a third of them gone
                compact.add(spec.name)
            else:
                compact.discard(spec.name)
        return "".join(out)
