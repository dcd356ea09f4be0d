"""MPS for this host: the configured resources resolved against the GPUs NVML sees, their daemons,
and who the clients are.

``accelstats mps start|stop|status`` and the ``mps`` collector use this: :func:`resolve` turns the
``[mps]`` settings into :class:`accelstats.mps.rules.MpsResource` objects (``devices = "all"`` or UUIDs and
NVML indices → UUIDs), :func:`gpus_of` reads what MPS needs to know of each GPU from one collection,
:class:`MpsDaemons` holds the daemons of a configuration (:func:`daemons_to_start`,
:func:`daemons_to_watch`), and :func:`client_containers` names the container of each MPS client PID
(``/proc/<pid>/cgroup``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from accelstats.cgroups import identify_with_root, parse_proc_cgroup
from accelstats.cgroups.identity import KnownLookup
from accelstats.mps.control import DEFAULT_BINARY, DaemonStatus
from accelstats.mps.daemon import Daemon
from accelstats.mps.rules import MpsError, MpsGpu, MpsResource, Root, check_names, validate_resources
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


class MpsDaemons:
    """The MPS control daemons a configuration asks for (docs/mps.md, "Interface"): one
    :class:`accelstats.mps.daemon.Daemon` per resource, none when MPS is not configured; started all
    or nothing, stopped and asked together.

    ``daemon_kwargs`` go to every Daemon (``binary``, ``timeout``, ``exclusive_process``, ``nvidia_smi``).
    Raises MpsError when two resources share a name or one's directories would nest in another's
    (:func:`accelstats.mps.rules.check_names`).
    """

    def __init__(self, resources: Sequence[MpsResource], gpus: Sequence[MpsGpu], root: Root,
                 **daemon_kwargs: Any) -> None:
        check_names([resource.name for resource in resources])
        self.root = root
        self._gpus = tuple(gpus)
        self._daemons = [Daemon(resource, gpus, root, **daemon_kwargs) for resource in resources]

    def daemons(self) -> list[Daemon]:
        """The daemons, in configuration order (empty when no resource is configured)."""
        return list(self._daemons)

    def validate_all(self) -> None:
        """Check every resource against the GPUs (:func:`accelstats.mps.rules.validate_resources`: the
        rules, and no GPU in two resources); raise the first resource's MpsError."""
        errors = validate_resources([daemon.resource for daemon in self._daemons], self._gpus)
        for daemon in self._daemons:
            if daemon.name in errors:
                raise errors[daemon.name]

    def start_all(self) -> None:
        """Start every daemon, all or nothing.

        Everything is validated first; when a start fails, the daemons already started are stopped
        (in reverse order) and MpsError names the resource that failed.
        """
        self.validate_all()
        started: list[Daemon] = []
        for daemon in self._daemons:
            try:
                daemon.start()
            except MpsError as exc:
                for done in reversed(started):
                    done.stop()
                raise MpsError(f"MPS: starting resource {daemon.name!r} failed, "
                               f"{len(started)} started daemon(s) stopped again: {exc}") from exc
            started.append(daemon)

    def stop_all(self) -> dict[str, list[str]]:
        """Stop every daemon (reverse order); never raises. Resource name → problems met ([] when clean)."""
        return {name: problems for name, (_, problems) in self.stop_all_found().items()}

    def stop_all_found(self) -> dict[str, tuple[bool, list[str]]]:
        """Stop every daemon (reverse order); never raises. Resource name → ``(found, problems)`` of
        :meth:`accelstats.mps.daemon.Daemon.stop_found` (``found``: it ran, or left a pipe dir, when its
        stop held the lock)."""
        return {daemon.name: daemon.stop_found() for daemon in reversed(self._daemons)}

    def status_all(self) -> dict[str, DaemonStatus]:
        """Resource name → :meth:`accelstats.mps.control.DaemonChannel.status`, in configuration order
        (as :meth:`daemons`); never raises."""
        return {daemon.name: daemon.status() for daemon in self._daemons}


def daemons_to_start(settings: MpsSettings, gpus: list[MpsGpu], binary: str = DEFAULT_BINARY) -> MpsDaemons:
    """The daemons of ``settings`` on these GPUs, for starting: every device must resolve (MpsError
    naming the resource otherwise); the rules are checked at start (:meth:`MpsDaemons.start_all`)."""
    return MpsDaemons(resolve(settings, gpus), gpus, Root(settings.root), binary=binary, timeout=settings.timeout,
                      exclusive_process=settings.exclusive_process)


def daemons_to_watch(settings: MpsSettings, gpus: list[MpsGpu],
                     binary: str = DEFAULT_BINARY) -> tuple[MpsDaemons, dict[str, str]]:
    """The daemons of ``settings``, for watching and stopping: every resource, its devices resolved
    where they can be.

    A resource whose devices cannot be resolved (NVML not answering: ``gpus`` empty; a listed GPU
    gone) gets no devices, so its daemon can still be asked and stopped (neither needs them; only the
    pinned-limit queries do); ``{resource name: why}`` says which. Raises MpsError only for names
    that clash (:class:`MpsDaemons`).
    """
    resources, problems = [], {}
    for r in settings.resources:
        try:
            resources.append(resolve_one(r, gpus))
        except MpsError as exc:
            problems[r.name] = str(exc)
            resources.append(MpsResource(name=r.name, replicas=r.replicas, devices=()))
    return MpsDaemons(resources, gpus, Root(settings.root), binary=binary, timeout=settings.timeout,
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

    def __init__(self, settings: MpsSettings, binary: str = DEFAULT_BINARY,
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
            daemons, problems = daemons_to_watch(self.settings, gpus, self.binary)
        except MpsError as exc:
            snapshot.mps.extend(MpsDaemonReading(resource=r.name, up=False, reason=str(exc))
                                for r in self.settings.resources)
            return
        started: dict[str, tuple[object, threading.Event | None]] = {}
        for daemon in daemons.daemons():
            worker = self._workers.get(daemon.name)
            if worker is None:
                worker = self._workers[daemon.name] = DeadlineWorker(f"accelstats-mps-{len(self._workers)}")
            token = object()
            started[daemon.name] = (token, worker.start(partial(self._ask, daemon, token)))
        end = time.monotonic() + self.deadline
        for _, done in started.values():
            if done is not None:
                done.wait(max(0.0, end - time.monotonic()))
        for daemon in daemons.daemons():
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
