"""The identity labels of a container's series: cAdvisor's container labels, made safe to encode.

The catalog (every container family) and the accounting ledger (its accounts) both label a container
with :func:`identity_labels`, so that its series join on the same values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from accelstats.attribution.containers import ContainerStats


def utf8(value: str) -> str:
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


def utf8_all(values: tuple[str, ...]) -> tuple[str, ...]:
    """:func:`utf8` of each of ``values``, same length and order; ``values`` itself when all are ASCII
    (the usual case, checked once for the lot instead of once a value)."""
    if "".join(values).isascii():
        return values
    return tuple(utf8(v) for v in values)


def identity_labels(c: ContainerStats) -> tuple[str, ...]:
    """cAdvisor's container labels: id (cgroup path), name, image, container, pod, namespace."""
    m = c.metadata
    return utf8_all((c.cgroup, m.name, m.image, m.container, m.pod, m.namespace))
