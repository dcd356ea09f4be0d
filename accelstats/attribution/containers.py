"""Per-container accelerator stats: cAdvisor's ``AcceleratorCollector`` and what it fills.

A :class:`ContainerCollector` is bound to one container cgroup and one collection's :class:`HostView`:
the attributor makes one per container on every collection, and
:meth:`accelstats.manager.AcceleratorManager.get_collector` one for a cgroup asked about.
``update_stats(stats)`` appends one :class:`AcceleratorStats` per device the container is attributed,
saying how (``attribution``):

* ``devices_cgroup`` — the devices cgroup grants the GPU: on v1 ``devices.list`` holds
  ``c 195:<minor> r|w`` (docs/containers.md), on v2 the ``BPF_CGROUP_DEVICE`` programs in effect
  allow reading or writing ``c 195:<minor>`` (§5); re-read on every collection so ``docker update``
  is seen;
* ``process`` — an unrestricted devices cgroup (``a *:* rwm``, no device program), or v2 device
  programs that could not be read: the devices NVML lists a process of this container on (compute,
  graphics and MPS processes; ``/proc/<pid>/cgroup``);
* ``open_fd`` — a process of the container holds ``/dev/nvidia<minor>`` open (``/proc/<pid>/fd``),
  for devices not attributed otherwise.

Device-wide numbers (memory total/used, duty cycle) stay device-wide, as cAdvisor's were; the
container's own numbers come from NVML's per-process data summed over the processes whose
``/proc/<pid>/cgroup`` names this container's cgroup.
"""

from __future__ import annotations

import functools
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from accelstats.attribution.cgroupns import CgroupNamespace
from accelstats.cgroups import (
    ContainerIdentity,
    GpuGrant,
    MigCap,
    MigInstance,
    gpu_grant,
    mig_instances,
    parse_devices_list,
    parse_proc_cgroup,
    read_devices_list_text,
)
from collectors.fsread import MISSING, SMALL, read_regular
from collectors.model import Device, DeviceSnapshot, ProcessUsage

log = logging.getLogger(__name__)

NVIDIA_MAJOR = 195


@dataclass(frozen=True)
class AcceleratorStats:
    """One device as seen from one container (cAdvisor's ``AcceleratorStats`` plus attribution).

    ``memory_*`` are device-wide bytes, ``duty_cycle`` device-wide percent 0-100 (cAdvisor
    compatibility); ``container_memory_used_bytes`` / ``container_sm_utilization_ratio`` /
    ``container_processes`` are the container's own share, ``None`` when NVML's process list is
    not readable; ``device_open`` whether one of its processes holds the device node open.
    """

    make: str
    model: str
    id: str
    minor: int | None
    index: int
    attribution: str
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    duty_cycle: float | None
    container_memory_used_bytes: int | None
    container_sm_utilization_ratio: float | None
    container_processes: int | None
    device_open: bool | None = None
    """A process of the container holds the device's node (``/dev/nvidia<minor>``; a MIG instance's
    parent GPU's) open, from the open-fd scan; ``None`` when the scan is off."""


@dataclass(frozen=True)
class ContainerMetadata:
    """What people call the container: cAdvisor's ``name``, ``image``, ``container``, ``pod``,
    ``namespace`` labels ("" when unknown), from the runtime's state files
    (:mod:`accelstats.attribution.metadata`) or the cgroup path (LXC, systemd-nspawn, Nomad).  ``reason`` says
    why a field that should be there is not (no state file, a root that does not exist, an image
    name only containerd's database holds); it is not part of equality."""

    name: str = ""
    image: str = ""
    container: str = ""
    pod: str = ""
    namespace: str = ""
    reason: str = field(default="", compare=False)


@dataclass
class ContainerStats:
    """One container: its cgroup path, identity, metadata, and the accelerators attributed to it."""

    cgroup: str
    identity: ContainerIdentity | None
    metadata: ContainerMetadata = field(default_factory=ContainerMetadata)
    accelerators: list[AcceleratorStats] = field(default_factory=list)
    reason: str = ""  # what could not be read or attributed (unreadable devices.list, unrestricted rules, …)
    devices_cgroup: str = ""
    """What the devices cgroup says: ``"restricted"`` (rules read; GPUs granted by name, maybe
    none), ``"unrestricted"`` (every char device allowed: proves nothing), ``"unreadable"`` (the rules
    exist but could not be read), ``""`` (not read: v2 device programs without the capability)."""

    lost_gpu_access: bool = False
    """Its ``devices.list`` names the GPUs but grants no read or write (``c 195:* m``: what a
    ``systemctl daemon-reload`` leaves with the systemd cgroup driver, docs/containers.md): listed
    with zero GPUs and the reason, because its processes will fail NVML."""

    def add_reason(self, reason: str) -> None:
        """Append ``reason`` to :attr:`reason` (``"; "``-separated, each once)."""
        if reason and reason not in self.reason.split("; "):
            self.reason = f"{self.reason}; {reason}" if self.reason else reason


class AcceleratorCollector(Protocol):
    """cAdvisor's collector interface: fill one container's accelerator stats."""

    def update_stats(self, stats: ContainerStats) -> None:
        """Append this container's :class:`AcceleratorStats` to ``stats.accelerators``; never raises."""


class NoopCollector:
    """A collector that reports nothing and says why (unknown or unreadable cgroup, NVML absent)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def update_stats(self, stats: ContainerStats) -> None:
        """Leave ``stats.accelerators`` alone; record :attr:`reason` on ``stats``."""
        stats.reason = stats.reason or self.reason


def cgroup_of_pids(pids: Iterable[int], proc_root: Path, controller: str,
                   namespace: CgroupNamespace | None = None) -> tuple[dict[int, str], Counter[str]]:
    """``({pid: cgroup path}, skipped)`` from ``<proc_root>/<pid>/cgroup``: the ``controller`` line
    (``"devices"`` on v1, falling back to the v2 ``0::`` line; ``""`` for v2).

    ``skipped`` counts PIDs left out, by reason: ``pid_vanished`` (exited between NVML's answer and
    this read: normal, docs/containers.md), ``pid_unreadable`` (no permission: the exporter lacks
    the host PID namespace or privileges; also a file without a usable line), ``bad_cgroup_path``
    (``..``, NUL, absurd depth: see :func:`usable_cgroup_path`), ``foreign_cgroupns`` (the path
    starts with ``/..``: this process runs in a cgroup namespace of its own, and ``namespace``
    (:class:`accelstats.attribution.cgroupns.CgroupNamespace`) could not place it in the host's hierarchy).
    With ``namespace`` given, paths relative to a private cgroup namespace are resolved to host paths.
    """
    found = {}
    skipped: Counter[str] = Counter()
    for pid in pids:
        got = read_regular(proc_root / str(pid) / "cgroup", SMALL, past_limit="truncate")
        data = got.data
        if data is None:
            skipped["pid_vanished" if got.reason == MISSING else "pid_unreadable"] += 1
            continue
        # surrogateescape, as os.scandir names the walked directories: the same bytes, the same str
        parsed = parse_proc_cgroup(data.decode("utf-8", errors="surrogateescape"))
        path = parsed.get(controller) or parsed.get("")
        if path is None:
            skipped["pid_unreadable"] += 1
            continue
        if path.startswith("/..") or (namespace is not None and namespace.private):
            resolved = namespace.resolve(path) if namespace is not None else None
            if resolved is None:
                skipped["foreign_cgroupns"] += 1
                continue
            path = resolved
        if not usable_cgroup_path(path):
            skipped["bad_cgroup_path"] += 1
            continue
        found[pid] = path
    return found, skipped


@dataclass(frozen=True)
class MigMap:
    """How v1 ``devices.list`` rules name MIG instances: the ``nvidia-caps`` major (``/proc/devices``)
    and ``/proc/driver/nvidia-caps/mig-minors`` parsed (docs/containers.md, "Device numbers")."""

    caps_major: int
    caps: Mapping[int, MigCap]


@dataclass(frozen=True)
class DeviceIndex:
    """A snapshot's devices by what a container's rules name them: ``gpus_by_minor`` (whole GPUs by
    NVIDIA minor number), ``minors`` (its keys), ``by_uuid`` (every device, MIG instances included),
    ``caps_minors`` (the MIG capability minors of ``/proc/driver/nvidia-caps/mig-minors``)."""

    gpus_by_minor: Mapping[int, Device]
    minors: frozenset[int]
    by_uuid: Mapping[str, Device]
    caps_minors: frozenset[int]
    mig_of: Mapping[str, tuple[Device, ...]]
    """The MIG instances of each GPU, by the GPU's UUID (GPUs without one are left out)."""


@dataclass
class HostView:
    """What one collection knows beyond the devices, shared by every container's collector.

    ``pid_cgroups``: cgroup path of each GPU process NVML listed; ``mig``: the MIG capability map
    (None without MIG); ``open_minors(directory)``: NVIDIA minors held open by the processes of a
    cgroup directory (None: open-fd evidence off).
    """

    snapshot: DeviceSnapshot
    pid_cgroups: Mapping[int, str] = field(default_factory=dict)
    mig: MigMap | None = None
    open_minors: Callable[[Path], frozenset[int]] | None = None
    device_programs: Callable[[Path], tuple[GpuGrant | None, str]] | None = None
    """cgroup v2: ``(grant, reason)`` of the device programs in effect for a cgroup directory
    (:class:`accelstats.cgroups.devices_bpf.DeviceProgramCache`); grant None when they could not be
    read or evaluated, with the reason.  None: not asked (v1, or attribution by evidence only)."""
    by_container: dict[str, dict[str, list[ProcessUsage]]] | None = None
    mps_clients: Mapping[str, list[ProcessUsage]] = field(default_factory=dict)  # not in NVML's lists
    plain_reads: bool = False
    """The hierarchy is cgroupfs alone (:class:`accelstats.cgroups.plainreads.PlainReads`): its control
    files are read with one plain ``open``."""
    _index: DeviceIndex | None = field(default=None, repr=False, compare=False)

    @property
    def index(self) -> DeviceIndex:
        """The snapshot's devices indexed once for every container of the collection
        (:class:`DeviceIndex`: by minor number, by UUID, MIG instances by parent UUID, and the MIG
        capability minors of :attr:`mig`); made on first use, so :attr:`mig` must be set before."""
        if self._index is None:
            gpus = {d.minor: d for d in self.snapshot.devices if d.kind == "gpu" and d.minor is not None}
            mig: dict[str, list[Device]] = {}
            for d in self.snapshot.devices:
                if d.kind == "mig":
                    mig.setdefault(d.parent_uuid or "", []).append(d)
            self._index = DeviceIndex(gpus, frozenset(gpus), {d.uuid: d for d in self.snapshot.devices},
                                      frozenset(self.mig.caps) if self.mig is not None else frozenset(),
                                      {parent: tuple(ds) for parent, ds in mig.items()})
        return self._index

    def index_processes(self, containers: Iterable[str]) -> None:
        """Group every NVML process (and every MPS client NVML did not list, :attr:`mps_clients`) by
        (container cgroup, device UUID) once, so each container's collector looks its processes up
        instead of scanning every device's list: a process belongs to the container whose cgroup is
        the longest prefix of its own (sub-cgroups included)."""
        known = set(containers)
        index: dict[str, dict[str, list[ProcessUsage]]] = {}
        for uuid, sample in self.snapshot.samples.items():
            for p in [*(sample.processes or ()), *self.mps_clients.get(uuid, ())]:
                owner = container_of(self.pid_cgroups.get(p.pid), known)
                if owner is not None:
                    index.setdefault(owner, {}).setdefault(uuid, []).append(p)
        self.by_container = index


MAX_CGROUP_DEPTH = 64


def usable_cgroup_path(path: str) -> bool:
    """A cgroup path attribution may follow: absolute, at most 64 components deep, no ``.``/``..``
    components or NUL (it must never lead outside the cgroup root). Real paths are far shallower."""
    if not path.startswith("/") or "\0" in path:
        return False
    comps = path.split("/")
    return len(comps) <= MAX_CGROUP_DEPTH + 1 and ".." not in comps and "." not in comps


def container_of(path: str | None, containers: set[str]) -> str | None:
    """The member of ``containers`` that is ``path`` or its nearest ancestor cgroup, or None."""
    while path:
        if path in containers:
            return path
        if path == "/":
            return None
        path = path.rsplit("/", 1)[0] or "/"
    return None


class ContainerCollector:
    """The collector of one container cgroup (cAdvisor's ``AcceleratorCollector``).

    ``directory``: the container's cgroup directory (v1: in the devices hierarchy, holding
    ``devices.list``; v2: in the unified hierarchy); ``cgroup``: its path as ``/proc/<pid>/cgroup``
    names it; ``devices_list``: whether to attribute by ``devices.list`` (v1) or only by evidence
    (v2). A process counts for the container when its cgroup is the container's or below it.
    ``on_skipped(cgroup, lines)`` is told the malformed ``devices.list`` lines; ``on_unreadable()``
    that ``devices.list`` could not be read while the cgroup exists (permissions, a FIFO planted in a
    mounted tree); :meth:`read_into` answers False when it could not because the cgroup was removed
    meanwhile (the container stopped during the collection: normal, not a fault of the host).

    Attribution, in order (each device once, first reason wins):

    1. restricted rules: on v1 the GPUs ``c 195:<minor> r|w`` grants, on v2 the GPUs the device
       programs in effect let it read or write (:attr:`HostView.device_programs`): ``devices_cgroup``;
       a MIG instance instead of its parent when the rules also grant its capability minors;
    2. v2 without readable device programs, or unrestricted rules (``a *:* rwm``, no device program:
       they prove nothing): the devices NVML lists one of the container's processes on (``process``);
    3. both: GPUs whose ``/dev/nvidia<minor>`` a process of the container holds open (``open_fd``).
    """

    def __init__(self, directory: Path, cgroup: str, view: HostView, *, devices_list: bool,
                 on_skipped: Callable[[str, tuple[str, ...]], None] | None = None,
                 on_unreadable: Callable[[], None] | None = None) -> None:
        self.directory = directory
        self.on_unreadable = on_unreadable
        self.cgroup = cgroup
        self.view = view
        self.devices_list = devices_list
        self.on_skipped = on_skipped

    def update_stats(self, stats: ContainerStats) -> None:
        """Append one AcceleratorStats per device attributed (see the class docstring); never raises."""
        self.read_into(stats)

    def read_into(self, stats: ContainerStats) -> bool:
        """:meth:`update_stats`, answering False when the cgroup was removed before its ``devices.list``
        was read (``stats.reason`` says so), else True; never raises."""
        snapshot = self.view.snapshot
        index = self.view.index
        gpus_by_minor = index.gpus_by_minor
        chosen: dict[str, tuple[Device, str]] = {}
        evidence_needed = True
        grant: GpuGrant | None = None
        if self.devices_list:
            text = read_devices_list_text(self.directory, plain=self.view.plain_reads)
            if text is None:
                if not os.path.isdir(self.directory):
                    stats.reason = f"{self.directory} does not exist (removed during the collection?)"
                    return False
                stats.devices_cgroup = "unreadable"
                stats.add_reason(f"devices.list not readable in {self.directory}")
                if self.on_unreadable is not None:
                    self.on_unreadable()
                return True
            mig = self.view.mig
            grant, skipped, names_gpus = _grant(text, index.minors, mig.caps_major if mig else None,
                                                index.caps_minors)
            if skipped and self.on_skipped is not None:
                self.on_skipped(self.cgroup, skipped)
            if names_gpus and not grant.minors and not grant.unrestricted:
                stats.lost_gpu_access = True
                stats.add_reason("its devices.list names the NVIDIA GPUs but grants neither read nor write (e.g. "
                                 "c 195:* m): it lost GPU access, as systemctl daemon-reload does to containers of "
                                 "the systemd cgroup driver; its processes will fail to use a GPU")
        elif self.view.device_programs is not None:
            grant, why = self.view.device_programs(self.directory)
            stats.add_reason(why)
        if grant is not None:
            stats.devices_cgroup = "unrestricted" if grant.unrestricted else "restricted"
            if not grant.unrestricted:
                evidence_needed = False
                for device in self._granted(grant, gpus_by_minor):
                    chosen.setdefault(device.uuid, (device, "devices_cgroup"))
        if evidence_needed:
            for device in snapshot.devices:
                if self._own_processes(device):
                    chosen.setdefault(device.uuid, (device, "process"))
            # NVML lists a MIG instance's processes on the parent GPU too: the instance is the answer.
            for parent in {d.parent_uuid for d, _ in chosen.values() if d.kind == "mig"}:
                if parent in chosen and chosen[parent][1] == "process":
                    del chosen[parent]
        open_minors: frozenset[int] | None = None
        if self.view.open_minors is not None:
            open_minors = self.view.open_minors(self.directory)
            held = {d.uuid for d, _ in chosen.values()} | {d.parent_uuid for d, _ in chosen.values()}
            for minor in sorted(open_minors):
                gpu = gpus_by_minor.get(minor)
                if gpu is not None and gpu.uuid not in held:
                    chosen[gpu.uuid] = (gpu, "open_fd")
        parents = index.by_uuid
        for device, attribution in chosen.values():
            node = parents.get(device.parent_uuid or "", device) if device.kind == "mig" else device
            opened = None if open_minors is None else node.minor in open_minors
            stats.accelerators.append(self.stats_for(device, attribution, opened))
        if not chosen and stats.devices_cgroup == "unrestricted":
            rules = "a *:* rwm" if self.devices_list else "its device programs allow every device, or none is attached"
            stats.add_reason(f"unrestricted devices cgroup ({rules}) and none of its processes is on a GPU")
        return True

    def _granted(self, grant: GpuGrant, gpus_by_minor: Mapping[int, Device]) -> list[Device]:
        """Granted GPUs, each replaced by the MIG instances the grant's capability minors name."""
        mig_of = self.view.index.mig_of
        if not mig_of:
            return [gpus_by_minor[minor] for minor in sorted(grant.minors)]
        instances = mig_instances(grant, self.view.mig.caps) if self.view.mig is not None else frozenset()
        out: list[Device] = []
        for minor in sorted(grant.minors):
            parent = gpus_by_minor[minor]
            mine = [d for d in mig_of.get(parent.uuid, ())
                    if MigInstance(minor, d.gpu_instance_id if d.gpu_instance_id is not None else -1,
                                   d.compute_instance_id if d.compute_instance_id is not None else 0) in instances]
            out.extend(mine or [parent])
        return out

    def _own_processes(self, device: Device) -> list[ProcessUsage] | None:
        """This container's processes on ``device`` (None when NVML's process list is not readable)."""
        sample = self.view.snapshot.samples.get(device.uuid)
        if sample is None or sample.processes is None:
            return None
        if self.view.by_container is not None:
            return self.view.by_container.get(self.cgroup, {}).get(device.uuid, [])
        prefix = self.cgroup.rstrip("/") + "/"
        own = []
        for p in sample.processes:
            path = self.view.pid_cgroups.get(p.pid)
            if path is not None and (path == self.cgroup or path.startswith(prefix)):
                own.append(p)
        return own

    def stats_for(self, device: Device, attribution: str, device_open: bool | None = None) -> AcceleratorStats:
        """The AcceleratorStats of ``device`` for this container, with its own process share;
        ``device_open``: whether one of its processes holds the device node open (None: not scanned)."""
        sample = self.view.snapshot.samples.get(device.uuid)
        mine = self._own_processes(device)
        util = sample.utilization_ratio if sample is not None else None
        memory: int | None
        sm: float | None
        processes: int | None
        if mine:
            memory, sm, processes = _sum_memory(mine), _sum_sm(mine), len(mine)
        else:  # not readable (None), or none of its processes on the device: what the sums give, at once
            memory, sm, processes = (None, None, None) if mine is None else (0, 0.0, 0)
        return AcceleratorStats(
            make="nvidia", model=device.name, id=device.uuid, minor=device.minor, index=device.index,
            attribution=attribution,
            memory_total_bytes=sample.memory_total_bytes if sample is not None else None,
            memory_used_bytes=sample.memory_used_bytes if sample is not None else None,
            duty_cycle=util * 100.0 if util is not None else None,
            container_memory_used_bytes=memory,
            container_sm_utilization_ratio=sm,
            container_processes=processes,
            device_open=device_open,
        )


_MAX_CACHED_TEXT = 4096  # bytes: a real devices.list is a few hundred; longer texts are not kept


def _grant(devices_list_text: str, minors: frozenset[int], caps_major: int | None,
           caps_minors: frozenset[int]) -> tuple[GpuGrant, tuple[str, ...], bool]:
    """(grant, skipped lines, whether a char rule names the NVIDIA major with ``*`` or a GPU's minor,
    whatever its access) of a ``devices.list`` text. Parsing and granting are pure and a host's
    containers share a handful of rule sets, so this is cached by text (strings cache their hash;
    the parsed rules do not) — for texts up to 4 KiB, so that the cache is bounded in bytes too."""
    if len(devices_list_text) > _MAX_CACHED_TEXT:
        return _grant_of(devices_list_text, minors, caps_major, caps_minors)
    return _grant_cached(devices_list_text, minors, caps_major, caps_minors)


def _grant_of(devices_list_text: str, minors: frozenset[int], caps_major: int | None,
              caps_minors: frozenset[int]) -> tuple[GpuGrant, tuple[str, ...], bool]:
    """:func:`_grant`, computed."""
    parsed = parse_devices_list(devices_list_text)
    grant = gpu_grant(parsed, minors, nvidia_major=NVIDIA_MAJOR, caps_major=caps_major,
                      known_caps_minors=caps_minors)
    names_gpus = any(r.type == "c" and r.major == NVIDIA_MAJOR and (r.minor is None or r.minor in minors)
                     for r in parsed.rules)
    return grant, parsed.skipped_lines, names_gpus


_grant_cached = functools.lru_cache(maxsize=4096)(_grant_of)


def _sum_memory(procs: list[ProcessUsage] | None) -> int | None:
    if procs is None or any(p.used_memory_bytes is None for p in procs):
        return None
    return sum(p.used_memory_bytes or 0 for p in procs)


def _sum_sm(procs: list[ProcessUsage] | None) -> float | None:
    if procs is None or any(p.sm_utilization_ratio is None for p in procs):
        return None
    return sum(p.sm_utilization_ratio or 0.0 for p in procs)
