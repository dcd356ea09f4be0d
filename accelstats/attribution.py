"""Which container uses which device: one pass over the host's cgroups per collection.

:class:`Attributor` turns a device snapshot into :class:`~accelstats.containers.ContainerStats`:

1. find the container cgroups (v1: the ``devices`` hierarchy; v2: the unified one);
2. read ``/proc/<pid>/cgroup`` of every process NVML listed (host PIDs) — process evidence;
3. on hosts with MIG, read the ``nvidia-caps`` major and ``mig-minors`` (v1 rules name instances);
4. list each container's PIDs (``cgroup.procs``) and the NVIDIA device nodes they hold open
   (cached by PID and start time, so a scrape with no new process scans no fd directory);
5. run each container's :class:`~accelstats.containers.ContainerCollector`;
6. a GPU process whose cgroup is no container found by the walk still gets a row: its container
   when a rule recognises the path, else ``runtime="unknown"`` (host processes are left out);
7. name each container from its runtime's state files when readable (:mod:`accelstats.metadata`).

Everything that vanishes or cannot be read mid-way (a PID that exited, a cgroup removed during the
walk, an fd directory of another user) is skipped and counted in :attr:`Attributor.skipped`
(``accelstats_attribution_skipped_total{reason}``), never raised.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

from accelstats.cgroupns import CgroupNamespace
from accelstats.cgroups import (
    CgroupLayout,
    ContainerIdentity,
    discover_v1_containers,
    discover_v2_containers,
    identify_with_root,
    is_host_cgroup,
    parse_mig_minors,
)
from accelstats.containers import (
    ContainerCollector,
    ContainerMetadata,
    ContainerStats,
    HostView,
    MigMap,
    cgroup_of_pids,
    container_of,
)
from accelstats.fsread import read_small
from accelstats.metadata import MetadataReader
from accelstats.openfds import OpenFdScanner, char_major, pids_in_cgroup
from collectors.model import DeviceSnapshot, ProcessUsage

log = logging.getLogger(__name__)

SKIP_REASONS = ("cgroup_vanished", "cgroup_unreadable", "cgroup_too_deep", "devices_list_unreadable",
                "pid_vanished", "pid_unreadable", "bad_cgroup_path", "foreign_cgroupns", "fd_unreadable",
                "mig_minors_line")


def mps_clients_not_listed(snapshot: DeviceSnapshot) -> dict[str, list[ProcessUsage]]:
    """MPS clients the control daemons name per device (``get_device_client_list``, the ``mps``
    collector) that NVML's process lists of that device lack: ``{GPU UUID: [ProcessUsage(type "mps",
    memory unknown)]}``. NVML lists MPS clients on the H200 (spec/mps.md), so this is usually empty;
    where it does not, the daemon's word still puts each client in its container."""
    out: dict[str, list[ProcessUsage]] = {}
    for reading in snapshot.mps:
        for uuid, pid in reading.device_clients:
            sample = snapshot.samples.get(uuid)
            if sample is None or any(p.pid == pid for p in sample.processes or ()):
                continue  # not a device of this collection, or NVML lists it already
            if all(p.pid != pid for p in out.get(uuid, ())):
                out.setdefault(uuid, []).append(ProcessUsage(pid=pid, type="mps"))
    return out


class Attributor:
    """Attribution state of one host: the fd-scan cache, the metadata cache, skip counters.

    ``layout``: where the cgroup hierarchies are; ``proc_root``/``rootfs``: the host's ``/proc``
    and ``/`` as this process sees them; ``open_fds``: scan ``/proc/<pid>/fd`` (off: no ``open_fd``
    attribution and no per-container PID listing).
    """

    def __init__(self, layout: CgroupLayout, proc_root: Path, rootfs: Path = Path("/"), *,
                 open_fds: bool = True) -> None:
        self.layout = layout
        self.proc_root = proc_root
        self.devices_list = layout.devices_root is not None
        self.hierarchy = layout.devices_root if layout.devices_root is not None else layout.unified_root
        self.controller = "devices" if self.devices_list else ""
        self.scanner = OpenFdScanner(proc_root) if open_fds else None
        self.metadata = MetadataReader(rootfs)
        self.skipped: Counter[str] = Counter({r: 0 for r in SKIP_REASONS})
        self._cgroupns_logged = False
        self.namespace = CgroupNamespace(self.hierarchy, proc_root, self.controller) if self.hierarchy else None
        self._mig_lines_seen: set[str] = set()

    def attribute(self, snapshot: DeviceSnapshot,
                  on_skipped: Callable[[str, tuple[str, ...]], None] | None = None
                  ) -> tuple[list[ContainerStats], HostView]:
        """Every container cgroup with the devices attributed to it, and the view they were built from."""
        view = HostView(snapshot=snapshot)
        if self.hierarchy is None:
            return [], view
        found = (discover_v1_containers(self.hierarchy) if self.devices_list
                 else discover_v2_containers(self.hierarchy))
        self.skipped["cgroup_vanished"] += found.stats.skipped_vanished
        self.skipped["cgroup_unreadable"] += found.stats.skipped_unreadable
        self.skipped["cgroup_too_deep"] += found.stats.skipped_too_deep
        gpu_pids = {p.pid for s in snapshot.samples.values() for p in s.processes or ()}
        view.mps_clients = mps_clients_not_listed(snapshot)
        gpu_pids |= {p.pid for ps in view.mps_clients.values() for p in ps}
        view.pid_cgroups, skipped = cgroup_of_pids(gpu_pids, self.proc_root, self.controller, self.namespace)
        self.skipped.update(skipped)
        if skipped["foreign_cgroupns"] and not self._cgroupns_logged:
            self._cgroupns_logged = True
            log.warning("process cgroup paths start with /..: accelstats runs in a cgroup namespace of its own "
                        "and could not place it in the host's hierarchy (%s); mount the host's cgroup tree "
                        "(--cgroup-root) or run in the host's cgroup namespace (docker --cgroupns=host)",
                        self.namespace.reason if self.namespace else "no hierarchy")
        view.mig = self._mig_map(snapshot)

        targets: list[tuple[str, Path, ContainerIdentity | None]] = [
            (c.path, c.directory, c.identity) for c in found.containers]
        # podman/crun keep the payload in a "container" child: the walk reports the child; a process
        # whose cgroup is the parent belongs to it too.
        aliases = {c.path.rsplit("/", 1)[0]: c.path for c in found.containers if c.path.endswith("/container")}
        view.pid_cgroups = {pid: aliases.get(path, path) for pid, path in view.pid_cgroups.items()}
        targets += self._unlisted(view.pid_cgroups.values(), {c.path for c in found.containers})
        view.index_processes(path for path, _, _ in targets)
        # Containers the walk listed and whose cgroup is removed before they are read stopped during
        # the collection: counted once as cgroup_vanished and not listed. ``gone``: those the PID
        # listing found removed (counted there).
        walked = {c.directory for c in found.containers}
        gone: set[Path] = set()
        if self.scanner is not None:
            view.open_minors = self._open_minors([d for _, d, _ in targets], walked, gone)

        out = []
        for path, directory, identity in targets:
            if directory in gone:
                continue  # the container stopped during the collection: it is not listed
            stats = ContainerStats(cgroup=path, identity=identity,
                                   metadata=ContainerMetadata(name=identity.name if identity else ""))
            vanished: list[bool] = []
            ContainerCollector(directory, path, view, devices_list=self.devices_list, on_skipped=on_skipped,
                               on_unreadable=self._devices_list_unreadable,
                               on_vanished=partial(vanished.append, True)).update_stats(stats)
            if vanished and directory in walked:
                self.skipped["cgroup_vanished"] += 1
                continue
            if vanished:  # a GPU process's cgroup the walk never saw: listed, its devices.list unread
                self._devices_list_unreadable()
            if stats.accelerators and identity is not None:  # state files only for containers that matter
                stats.metadata = self.metadata.lookup(identity)
            out.append(stats)
        return out, view

    def _devices_list_unreadable(self) -> None:
        self.skipped["devices_list_unreadable"] += 1

    def _unlisted(self, paths: Iterable[str], known: set[str]) -> list[tuple[str, Path, ContainerIdentity | None]]:
        """Containers of GPU processes that the walk did not list (not recognised by any rule, or
        beyond its depth): the recognised container's own cgroup, else the process's cgroup as
        ``runtime="unknown"``; host processes (services, sessions, ``/``) are not containers."""
        assert self.hierarchy is not None
        extra: dict[str, ContainerIdentity] = {}
        for path in sorted(set(paths)):
            if container_of(path, known) is not None:
                continue
            rooted = identify_with_root(path)
            if rooted is not None:
                extra.setdefault(rooted[0], rooted[1])
            elif not is_host_cgroup(path):
                extra.setdefault(path, ContainerIdentity(runtime="unknown", id=path.rstrip("/").rsplit("/", 1)[-1]))
        return [(p, self.hierarchy / p.lstrip("/"), ident) for p, ident in extra.items()]

    def _mig_map(self, snapshot: DeviceSnapshot) -> MigMap | None:
        """The nvidia-caps major and mig-minors, when the snapshot has MIG instances and the files
        are readable (v1 rules name MIG instances by these minors)."""
        if not self.devices_list or not any(d.kind == "mig" for d in snapshot.devices):
            return None
        major = char_major(self.proc_root, "nvidia-caps")
        data = read_small(self.proc_root / "driver" / "nvidia-caps" / "mig-minors")
        if data is None or major is None:
            return None
        text = data.decode("utf-8", errors="replace")
        caps, skipped = parse_mig_minors(text)
        for line in skipped:
            if line not in self._mig_lines_seen and len(self._mig_lines_seen) < 1000:
                self._mig_lines_seen.add(line)
                self.skipped["mig_minors_line"] += 1
                log.warning("mig-minors: skipped unknown line %r", line[:200])
        return MigMap(caps_major=major, caps=caps)

    def _open_minors(self, directories: list[Path], walked: set[Path],
                     gone: set[Path]) -> Callable[[Path], frozenset[int]]:
        """One fd scan for the PIDs of every container (cached by PID + start time), then a lookup.
        Directories of ``walked`` removed since the walk are added to ``gone`` (counted here)."""
        assert self.scanner is not None
        pids_of: dict[Path, list[int]] = {}
        for directory in directories:
            pids, vanished = pids_in_cgroup(directory)
            self.skipped["cgroup_vanished"] += vanished
            if vanished and directory in walked and not os.path.isdir(directory):
                gone.add(directory)
            pids_of[directory] = pids
        before = self.scanner.unreadable
        held = self.scanner.scan(pid for pids in pids_of.values() for pid in pids)
        self.skipped["fd_unreadable"] += self.scanner.unreadable - before
        table = {d: frozenset(m for pid in pids for m in held.get(pid, ()) if m < 254) for d, pids in pids_of.items()}
        return lambda directory: table.get(directory, frozenset())
