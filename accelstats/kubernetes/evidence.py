"""The kubelet's allocations as attribution evidence, and GPU use the kubelet did not allocate.

- :func:`with_allocations`: every container whose (namespace, pod, container) the runtime's state names
  (``ContainerMetadata``, from the CRI labels ``io.kubernetes.pod.namespace``/``.pod.name``/
  ``.container.name``) gains each GPU or MIG instance the kubelet allocated to it that the attribution did
  not already find, with ``attribution="kubelet"``: on cgroup v2 without CAP_SYS_ADMIN (device programs
  unreadable) an idle allocated container has no process or open file on its GPU, and this is then the
  only evidence. A container the kubelet names that the attribution did not find (or did not name) keeps
  its allocation in ``accelstats_kubernetes_gpu_allocation`` only.
- :func:`unallocated`: the (container, device) pairs the attribution found by ``devices_cgroup``,
  ``process`` or ``open_fd`` that the kubelet allocated to no container of that name (to nobody, or to
  another pod): ``NVIDIA_VISIBLE_DEVICES=all``, privileged pods, a hostPath ``/dev``, or a container
  outside Kubernetes. A MIG instance allocated counts for its parent GPU too (an open ``/dev/nvidia<m>``
  names the parent).
"""

from __future__ import annotations

import dataclasses
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


def with_allocations(containers: Sequence[ContainerStats], reading: KubeletReading | None,
                     view: HostView | None) -> list[ContainerStats]:
    """``containers`` with the kubelet's allocations added as evidence (module docstring). The containers
    given are not changed (they may be a cached attribution): a container that gains a device is a copy.
    Nothing changes without an answer from the kubelet (``reading`` None or not up) or a ``view``."""
    if reading is None or not reading.up or view is None:
        return list(containers)
    devices = {d.uuid: d for d in view.snapshot.devices}
    wanted: dict[Key, list[str]] = {}
    for a in reading.allocations:
        if a.uuid in devices:
            uuids = wanted.setdefault((a.namespace, a.pod, a.container), [])
            if a.uuid not in uuids:
                uuids.append(a.uuid)
    out: list[ContainerStats] = []
    for container in containers:
        key = _key(container)
        missing = [u for u in wanted.get(key, ()) if all(s.id != u for s in container.accelerators)] if key else []
        if not missing:
            out.append(container)
            continue
        reader = ContainerCollector(Path(container.cgroup), container.cgroup, view, devices_list=False)
        added = [reader.stats_for(devices[u], KUBELET) for u in missing]
        out.append(dataclasses.replace(container, accelerators=[*container.accelerators, *added]))
    return out


def unallocated(containers: Sequence[ContainerStats],
                reading: KubeletReading | None) -> Iterator[tuple[ContainerStats, AcceleratorStats]]:
    """The (container, device) pairs found in use without the kubelet's allocation to that container
    (module docstring); nothing unless the kubelet answered in this collection."""
    if reading is None or not reading.up:
        return
    allocated = _allocated(reading)
    for container in containers:
        key = _key(container)
        mine = allocated.get(key, set()) if key else set()
        for a in container.accelerators:
            if a.attribution != KUBELET and a.id not in mine:
                yield container, a
