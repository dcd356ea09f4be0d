"""MPS for this host: the configured resources resolved against the GPUs NVML sees, and who the
clients are.

``accelstats mps start|stop|status`` and the ``mps`` collector use this: :func:`resolve` turns the
``[mps]`` settings into :class:`accelstats.mps.daemon.MpsResource` objects (``devices = "all"`` or UUIDs and
NVML indices → UUIDs), :func:`gpus_of` reads what MPS needs to know of each GPU from one collection,
and :func:`client_containers` names the container of each MPS client PID (``/proc/<pid>/cgroup``).
"""

from __future__ import annotations

import threading
import time
from functools import partial
from pathlib import Path

from accelstats.cgroups import identify_with_root, parse_proc_cgroup
from accelstats.cgroups.identity import KnownLookup
from accelstats.mps.daemon import Daemon, DaemonStatus, Manager, MpsError, MpsGpu, MpsResource, Root
from accelstats.settings import MpsResourceSettings, MpsSettings
from collectors.deadline import DeadlineWorker
from collectors.fsread import read_small
from collectors.model import DeviceSnapshot


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


def lenient_manager(settings: MpsSettings, gpus: list[MpsGpu],
                    binary: str = "nvidia-cuda-mps-control") -> tuple[Manager, dict[str, str]]:
    """A Manager for *watching and stopping*: every resource, its devices resolved where they can be.

    A resource whose devices cannot be resolved (NVML not answering: ``gpus`` empty; a listed GPU
    gone) gets no devices, so its daemon can still be asked and stopped (neither needs them; only the
    pinned-limit queries do); ``{resource name: why}`` says which. Raises MpsError only for names
    that clash (:class:`accelstats.mps.daemon.Manager`).
    """
    resources, problems = [], {}
    for r in settings.resources:
        try:
            resources.append(resolve_one(r, gpus))
        except MpsError as exc:
            problems[r.name] = str(exc)
            resources.append(MpsResource(name=r.name, replicas=r.replicas, devices=()))
    return Manager(resources, gpus, Root(settings.root), binary=binary, timeout=settings.timeout,
                   exclusive_process=settings.exclusive_process), problems


def client_containers(pids: list[int], proc_root: Path, known: KnownLookup | None = None) -> dict[int, str]:
    """``{client pid: container cgroup path}`` for MPS client PIDs that belong to a container
    (host processes and vanished PIDs are left out); ``known``: the runtimes' state
    (:meth:`accelstats.attribution.runtimes.RuntimeState.known`), so that containers on any path are found."""
    out = {}
    for pid in pids:
        data = read_small(proc_root / str(pid) / "cgroup")
        if data is None:
            continue
        parsed = parse_proc_cgroup(data.decode("utf-8", errors="surrogateescape"))
        path = parsed.get("devices") or parsed.get("")
        rooted = identify_with_root(path, known) if path else None
        if rooted is not None:
            out[pid] = rooted[0]
    return out


STATUS_DEADLINE = 1.0  # seconds a collection waits for the daemons' answers (each resource asked in parallel)


class MpsCollector:
    """The ``mps`` collector: watches the configured control daemons (started by ``accelstats mps
    start``, the Nomad plugin, or anyone else using the same root) on every collection.

    Each resource is asked on a worker thread of its own (:class:`collectors.deadline.DeadlineWorker`),
    all in parallel, and a collection waits for them at most ``deadline`` seconds: a daemon that
    accepts and never answers costs the scrape that long, not its control timeout per command, and
    it never holds up the other resources. A resource whose status is still pending is reported down
    with that reason (its worker finishes on its own; no second query starts meanwhile). Daemons are
    watched even when NVML is not answering (their devices then are not resolved: no pinned limits).
    """

    name = "mps"
    bounds_own_calls = True  # each daemon is asked under its own timeout: the manager does not wrap it

    def __init__(self, settings: MpsSettings, binary: str = "nvidia-cuda-mps-control",
                 deadline: float = STATUS_DEADLINE) -> None:
        self.settings = settings
        self.binary = binary
        self.deadline = deadline
        self._workers: dict[str, DeadlineWorker] = {}
        self._results: dict[str, tuple[object, DaemonStatus]] = {}

    def _ask(self, daemon: Daemon, token: object) -> None:
        self._results[daemon.name] = (token, daemon.status())

    def update(self, snapshot: DeviceSnapshot) -> None:
        """Add one :class:`collectors.model.MpsDaemonReading` per configured resource to ``snapshot.mps``."""
        from collectors.model import MpsDaemonReading

        gpus = gpus_of(snapshot)
        try:
            mgr, problems = lenient_manager(self.settings, gpus, self.binary)
        except MpsError as exc:
            snapshot.mps.extend(MpsDaemonReading(resource=r.name, up=False, reason=str(exc))
                                for r in self.settings.resources)
            return
        started: dict[str, tuple[object, threading.Event | None]] = {}
        for daemon in mgr.daemons():
            worker = self._workers.get(daemon.name)
            if worker is None:
                worker = self._workers[daemon.name] = DeadlineWorker(f"accelstats-mps-{len(self._workers)}")
            token = object()
            started[daemon.name] = (token, worker.start(partial(self._ask, daemon, token)))
        end = time.monotonic() + self.deadline
        for _, done in started.values():
            if done is not None:
                done.wait(max(0.0, end - time.monotonic()))
        for daemon in mgr.daemons():
            token, done = started[daemon.name]
            result = self._results.get(daemon.name)
            if done is None or not done.is_set() or result is None or result[0] is not token:
                snapshot.mps.append(MpsDaemonReading(
                    resource=daemon.name, up=False,
                    reason=f"no answer within {self.deadline:g} s (the control daemon may be wedged)"))
                continue
            status = result[1]
            reason = "; ".join(r for r in (status.reason, problems.get(daemon.name, "")) if r)
            snapshot.mps.append(MpsDaemonReading(
                resource=daemon.name, up=status.healthy, reason=reason,
                servers=len(status.servers), clients=sum(len(c) for c in status.clients.values()),
                active_thread_ratio=(status.active_thread_percentage / 100.0
                                     if status.active_thread_percentage is not None else None),
                pinned_memory_limit_bytes=tuple(sorted(status.pinned_limits_bytes.items())),
                device_clients=tuple((uuid, pid) for uuid, pids in sorted(status.device_clients.items())
                                     for pid in pids)))

    def close(self) -> None:
        """End the worker threads (a query stuck past its timeout ends with its own child process)."""
        for worker in self._workers.values():
            worker.stop()
