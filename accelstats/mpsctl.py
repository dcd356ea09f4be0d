"""MPS for this host: the configured resources resolved against the GPUs NVML sees, and who the
clients are.

``accelstats mps start|stop|status`` and the ``mps`` collector use this: :func:`resolve` turns the
``[mps]`` settings into :class:`collectors.mps.MpsResource` objects (``devices = "all"`` or UUIDs and
NVML indices → UUIDs), :func:`gpus_of` reads what MPS needs to know of each GPU from one collection,
and :func:`client_containers` names the container of each MPS client PID (``/proc/<pid>/cgroup``).
"""

from __future__ import annotations

from pathlib import Path

from accelstats.cgroups import identify_with_root, parse_proc_cgroup
from accelstats.config import MpsResourceSettings, MpsSettings
from accelstats.fsread import read_small
from collectors.model import DeviceSnapshot
from collectors.mps import Manager, MpsError, MpsGpu, MpsResource, Root


def gpus_of(snapshot: DeviceSnapshot) -> list[MpsGpu]:
    """The physical GPUs of one collection as MPS sees them (UUID, NVML index, memory, compute
    capability, MIG mode); MIG instances are not MPS devices."""
    out = []
    for d in snapshot.devices:
        if d.kind != "gpu":
            continue
        sample = snapshot.samples.get(d.uuid)
        total = sample.memory_total_bytes if sample is not None and sample.memory_total_bytes else 0
        out.append(MpsGpu(uuid=d.uuid, index=d.index, memory_total_bytes=total,
                          compute_capability=d.compute_capability, mig_enabled=d.mig_mode == "enabled"))
    return out


def resolve_one(resource: MpsResourceSettings, gpus: list[MpsGpu]) -> MpsResource:
    """One ``[mps]`` resource with its devices as UUIDs (``"all"``: every GPU, in NVML order). Raises
    MpsError naming the resource when a device (UUID or index) is not a GPU of this host."""
    if resource.devices == "all":
        return MpsResource(name=resource.name, replicas=resource.replicas, devices=tuple(g.uuid for g in gpus))
    by_uuid = {g.uuid: g for g in gpus}
    by_index = {g.index: g for g in gpus}
    found = []
    for d in resource.devices:
        gpu = by_index.get(d) if isinstance(d, int) else by_uuid.get(d)
        if gpu is None:
            raise MpsError(f"MPS resource {resource.name!r}: device {d!r} is not a GPU of this host")
        found.append(gpu.uuid)
    return MpsResource(name=resource.name, replicas=resource.replicas, devices=tuple(found))


def resolve(settings: MpsSettings, gpus: list[MpsGpu]) -> list[MpsResource]:
    """``[mps]`` resources with their devices as UUIDs (:func:`resolve_one` each). Raises MpsError."""
    return [resolve_one(r, gpus) for r in settings.resources]


def manager(settings: MpsSettings, gpus: list[MpsGpu], binary: str = "nvidia-cuda-mps-control") -> Manager:
    """The MPS Manager for ``settings`` on these GPUs (validation happens at start)."""
    return Manager(resolve(settings, gpus), gpus, Root(settings.root), binary=binary, timeout=settings.timeout,
                   exclusive_process=settings.exclusive_process)


def client_containers(pids: list[int], proc_root: Path) -> dict[int, str]:
    """``{client pid: container cgroup path}`` for MPS client PIDs that belong to a container
    (host processes and vanished PIDs are left out)."""
    out = {}
    for pid in pids:
        data = read_small(proc_root / str(pid) / "cgroup")
        if data is None:
            continue
        parsed = parse_proc_cgroup(data.decode("utf-8", errors="surrogateescape"))
        path = parsed.get("devices") or parsed.get("")
        rooted = identify_with_root(path) if path else None
        if rooted is not None:
            out[pid] = rooted[0]
    return out


class MpsCollector:
    """The ``mps`` collector: watches the configured control daemons (started by ``accelstats mps
    start``, the Nomad plugin, or anyone else using the same root) on every collection.

    Runs after the ``nvidia`` collector of the same collection and uses its GPUs; a resource whose
    devices are not GPUs of this host is reported down with the reason. Each status costs a few
    short control commands (each with the configured timeout).
    """

    name = "mps"

    def __init__(self, settings: MpsSettings, binary: str = "nvidia-cuda-mps-control") -> None:
        self.settings = settings
        self.binary = binary

    def update(self, snapshot: DeviceSnapshot) -> None:
        """Add one :class:`collectors.model.MpsDaemonReading` per configured resource to ``snapshot.mps``."""
        from collectors.model import MpsDaemonReading, NoDataError

        gpus = gpus_of(snapshot)
        if not gpus:
            raise NoDataError("no GPUs to run MPS on in this collection")
        try:
            mgr = manager(self.settings, gpus, self.binary)
        except MpsError as exc:
            snapshot.mps.extend(MpsDaemonReading(resource=r.name, up=False, reason=str(exc))
                                for r in self.settings.resources)
            return
        for daemon, status in zip(mgr.daemons(), mgr.status_all().values(), strict=True):
            snapshot.mps.append(MpsDaemonReading(
                resource=daemon.resource.name, up=status.healthy, reason=status.reason,
                servers=len(status.servers), clients=sum(len(c) for c in status.clients.values()),
                active_thread_ratio=(status.active_thread_percentage / 100.0
                                     if status.active_thread_percentage is not None else None),
                pinned_memory_limit_bytes=tuple(sorted(status.pinned_limits_bytes.items()))))
