"""The kubelet's allocations as attribution evidence, and GPU use the kubelet did not allocate.

- :func:`add_allocations` (called by the attributor, which also keeps a container that holds no GPU
  otherwise when its names are in :func:`allocated_keys`): every container whose (namespace, pod,
  container) the runtime's state names (``ContainerMetadata``, from the CRI labels
  ``io.kubernetes.pod.namespace``/``.pod.name``/``.container.name``) gains each GPU or MIG instance the
  kubelet allocated to it that the attribution did not already find, with ``attribution="kubelet"``: on
  cgroup v2 without CAP_SYS_ADMIN (device programs unreadable) an idle allocated container has no
  process or open file on its GPU, and this is then the only evidence. A container the kubelet names
  that the attribution did not find (or did not name) keeps its allocation in
  ``accelstats_kubernetes_gpu_allocation`` only.
- :func:`unallocated`: the (container, device) pairs the attribution found by ``devices_cgroup``,
  ``process`` or ``open_fd`` that the kubelet allocated to no container of that name (to nobody, or to
  another pod): ``NVIDIA_VISIBLE_DEVICES=all``, privileged pods, a hostPath ``/dev``, or a container
  outside Kubernetes. A MIG instance allocated counts for its parent GPU too (an open ``/dev/nvidia<m>``
  names the parent). A container with a DRA claimed device that did not resolve to a device of this
  host (no CDI spec names it) is not judged: its claim may be the GPU it uses.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from accelstats.attribution.containers import AcceleratorStats, ContainerCollector, ContainerStats, HostView
from collectors.model import KubeletReading

KUBELET = "kubelet"
"""The ``attribution`` value of a device known only from the kubelet's allocation."""

Key = tuple[str, str, str]  # (namespace, pod, container)


def _allocated(reading: KubeletReading) -> dict[Key, set[str]]:
    """Per (namespace, pod, container): the UUIDs allocated, with MIG instances' parent GPUs."""
    out: dict[Key, set[str]] = {}
    for a in reading.allocations:
        if a.uuid:
            uuids = out.setdefault((a.namespace, a.pod, a.container), set())
            uuids.add(a.uuid)
            if a.parent_uuid:
                uuids.add(a.parent_uuid)
    return out


def _key(container: ContainerStats) -> Key | None:
    m = container.metadata
    return (m.namespace, m.pod, m.container) if m.namespace and m.pod and m.container else None


def allocated_keys(reading: KubeletReading | None) -> frozenset[Key]:
    """The (namespace, pod, container) of every container the kubelet allocated a GPU or MIG instance of
    this host to; empty without an answer from the kubelet."""
    if reading is None or not reading.up:
        return frozenset()
    return frozenset(key for key, uuids in _allocated(reading).items() if uuids)


def add_allocations(container: ContainerStats, reading: KubeletReading | None, view: HostView) -> None:
    """Add to ``container`` (one the attribution is building, not a cached one) each device of this host
    the kubelet allocated to its (namespace, pod, container) that it does not hold yet, with
    ``attribution="kubelet"`` and its own process share (module docstring). Nothing without an answer
    from the kubelet, or for a container the runtime's state does not name."""
    if reading is None or not reading.up:
        return
    key = _key(container)
    if key is None:
        return
    devices = {d.uuid: d for d in view.snapshot.devices}
    held = {a.id for a in container.accelerators}
    reader: ContainerCollector | None = None
    for a in reading.allocations:
        if (a.namespace, a.pod, a.container) == key and a.uuid in devices and a.uuid not in held:
            held.add(a.uuid)
            reader = reader or ContainerCollector(Path(container.cgroup), container.cgroup, view, devices_list=False)
            container.accelerators.append(reader.stats_for(devices[a.uuid], KUBELET))


def unallocated(containers: Sequence[ContainerStats],
                reading: KubeletReading | None) -> Iterator[tuple[ContainerStats, AcceleratorStats]]:
    """The (container, device) pairs found in use without the kubelet's allocation to that container
    (module docstring); nothing unless the kubelet answered in this collection."""
    if reading is None or not reading.up:
        return
    allocated = _allocated(reading)
    # a container with a DRA claim device CDI did not resolve may hold any GPU through it: not judged
    unknown = {(a.namespace, a.pod, a.container) for a in reading.allocations if a.claim and not a.uuid}
    for container in containers:
        key = _key(container)
        if key in unknown:
            continue
        mine = allocated.get(key, set()) if key else set()
        for a in container.accelerators:
            if a.attribution != KUBELET and a.id not in mine:
                yield container, a
