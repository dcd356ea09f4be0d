"""Which container uses which device: one pass over the host's cgroups per collection.

:class:`Attributor` turns a device snapshot into :class:`~accelstats.attribution.containers.ContainerStats`:

1. find the container cgroups (v1: the ``devices`` hierarchy; v2: the unified one), recognised by
   the runtimes' own state (:mod:`accelstats.attribution.runtimes`: a container ID docker, containerd,
   podman/CRI-O or Nomad knows, on any path) or by the path rules of docs/containers.md;
2. read ``/proc/<pid>/cgroup`` of every process NVML listed (host PIDs) — process evidence;
3. on hosts with MIG, read the ``nvidia-caps`` major and ``mig-minors`` (v1 rules name instances);
4. list each container's PIDs (``cgroup.procs``) and the NVIDIA device nodes they hold open
   (cached by PID and start time, so a scrape with no new process scans no fd directory);
5. run each container's :class:`~accelstats.attribution.containers.ContainerCollector` (on v2 with the device
   programs in effect for its cgroup, :mod:`accelstats.cgroups.devices_bpf`);
6. a GPU process whose cgroup is no container found by the walk still gets a row: its container
   when a rule recognises the path, else ``runtime="unknown"`` (host processes are left out);
7. a container in a delegated subtree (under ``user@<uid>.service``, or whose cgroup is not owned by
   root) keeps ``runtime="unknown"``: any user can name a cgroup after someone else's container;
   except a rootless container its owner's own runtime state names (:mod:`accelstats.attribution.rootless`),
   which gets that name and its owner;
8. name each container from its runtime's state files when readable (:mod:`accelstats.attribution.metadata`).

Only containers that matter are returned: those with a device attributed, an unrestricted devices
cgroup (it may open any GPU), a ``devices.list`` that could not be read, or one that names the GPUs
but grants no access (lost GPU access); a container whose rules grant no GPU and that holds none is
left out, and so, on cgroup v2 without ``CAP_SYS_ADMIN`` (the device programs cannot be read), is a
container that holds no GPU by process or open node: :attr:`Attributor.notes` says so once.

Everything that vanishes or cannot be read mid-way (a PID that exited, a cgroup removed during the
walk, an fd directory of another user) is skipped and counted in :attr:`Attributor.skipped`
(``accelstats_attribution_skipped_total{reason}``), never raised.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from accelstats.attribution.cgroupns import CgroupNamespace
from accelstats.attribution.containers import (
    ContainerCollector,
    ContainerMetadata,
    ContainerStats,
    HostView,
    MigMap,
    cgroup_of_pids,
    container_of,
)
from accelstats.attribution.kubelet_evidence import add_allocations, allocated_keys
from accelstats.attribution.metadata import MetadataReader
from accelstats.attribution.openfds import OpenFdScanner, char_major, pids_in_cgroup
from accelstats.attribution.rootless import Rootless, RootlessOwners
from accelstats.attribution.runtimes import RuntimeState
from accelstats.cgroups import (
    CgroupLayout,
    ContainerIdentity,
    GpuGrant,
    discover_v1_containers,
    discover_v2_containers,
    identify_with_root,
    is_host_cgroup,
    parse_mig_minors,
)
from accelstats.cgroups.discovery import WalkMemo
from accelstats.cgroups.plainreads import PlainReads
from accelstats.cgroups.trust import untrusted_because
from accelstats.settings import RuntimeRoots
from collectors.fsread import read_small
from collectors.model import DeviceSnapshot, ProcessUsage

if TYPE_CHECKING:
    from accelstats.cgroups.devices_bpf import DeviceProgramCache

log = logging.getLogger(__name__)
_NO_METADATA = ContainerMetadata()  # frozen: shared by the containers whose identity gives no name

SKIP_REASONS = ("cgroup_vanished", "cgroup_unreadable", "cgroup_too_deep", "devices_list_unreadable",
                "pid_vanished", "pid_unreadable", "bad_cgroup_path", "foreign_cgroupns", "fd_unreadable",
                "mig_minors_line", "device_programs_denied", "device_programs_unreadable",
                "device_program_undecidable", "cgroup_unrecognised_too_many", "runtime_index_refused")
_MAX_LOGGED = 10_000


def mps_clients_not_listed(snapshot: DeviceSnapshot) -> dict[str, list[ProcessUsage]]:
    """MPS clients the control daemons name per device (``get_device_client_list``, the ``mps``
    collector) that NVML's process lists of that device lack: ``{GPU UUID: [ProcessUsage(type "mps",
    memory unknown)]}``. NVML lists MPS clients on the H200 (docs/mps.md), so this is usually empty;
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
    """Attribution state of one host: the runtimes' state, the fd-scan cache, the metadata cache, the
    device-program cache (v2), skip counters.

    ``layout``: where the cgroup hierarchies are; ``proc_root``/``rootfs``: the host's ``/proc``
    and ``/`` as this process sees them; ``runtimes``: where the runtimes keep their state (host
    paths, read under ``rootfs``); ``open_fds``: scan ``/proc/<pid>/fd`` (off: no ``open_fd``
    attribution and no per-container PID listing); ``device_programs``: on v2, read the device
    programs (bpf(2)); injectable for tests, None makes the real one.
    """

    def __init__(self, layout: CgroupLayout, proc_root: Path, rootfs: Path = Path("/"), *,
                 open_fds: bool = True, runtimes: RuntimeRoots | None = None,
                 device_programs: DeviceProgramCache | None = None) -> None:
        self.layout = layout
        self.proc_root = proc_root
        self.devices_list = layout.devices_root is not None
        self.hierarchy = layout.devices_root if layout.devices_root is not None else layout.unified_root
        self.controller = "devices" if self.devices_list else ""
        self.scanner = OpenFdScanner(proc_root) if open_fds else None
        self.runtimes = RuntimeState(rootfs, runtimes or RuntimeRoots())
        self.metadata = MetadataReader(rootfs, runtimes=self.runtimes)
        self.programs: DeviceProgramCache | None = None
        if not self.devices_list:  # v2 alone: the BPF decoder is imported only there (start-up on v1)
            from accelstats.cgroups.devices_bpf import DeviceProgramCache
            self.programs = device_programs or DeviceProgramCache()
        self.rootless = RootlessOwners(rootfs, self.hierarchy, self.runtimes.known) if self.hierarchy else None
        self.skipped: Counter[str] = Counter({r: 0 for r in SKIP_REASONS})
        self._cgroupns_logged = False
        self.namespace = CgroupNamespace(self.hierarchy, proc_root, self.controller) if self.hierarchy else None
        self._mig_lines_seen: set[str] = set()
        self._programs_logged: set[str] = set()
        self._identities_logged: set[tuple[str, str]] = set()
        self._walk_memo = WalkMemo()  # identify() answers and Paths, kept while the runtimes' state holds
        self._parents: dict[str, str | None] = {}  # trust answers by parent cgroup, for one collection
        # whether the hierarchy is cgroupfs alone, so that its files are read with plain opens
        self._plain = PlainReads(self.hierarchy) if self.hierarchy is not None else None
        self.notes: dict[str, str] = {}
        """Host-wide conditions of the last attribution worth one line to a user (``accelstats
        containers`` prints them): key -> text."""
        self._roots_warned: set[str] = set()
        for setting, path in self.runtimes.missing_roots():
            if setting in self.runtimes.roots.explicit:
                self._warn_root(setting, path)

    def _warn_root(self, setting: str, path: Path) -> None:
        if setting not in self._roots_warned:
            self._roots_warned.add(setting)
            log.warning("runtime state root %s (setting runtimes.%s) does not exist under %s: containers of that "
                        "runtime are recognised by their cgroup paths only, without names or images",
                        path, setting, self.runtimes.rootfs)

    def attribute(self, snapshot: DeviceSnapshot,
                  on_skipped: Callable[[str, tuple[str, ...]], None] | None = None
                  ) -> tuple[list[ContainerStats], HostView]:
        """The containers that hold a device or may open any (see the module docstring), and the
        view they were built from."""
        view = HostView(snapshot=snapshot)
        self.notes = {}
        if self.hierarchy is None:
            return [], view
        self.runtimes.refresh()
        self.skipped["runtime_index_refused"] = self.runtimes.errors  # each refused version once
        if self.rootless is not None:
            self.rootless.begin_collection()
        known = self.runtimes.known
        self._walk_memo.begin(self.runtimes.generation)
        found = (discover_v1_containers(self.hierarchy, known=known, memo=self._walk_memo) if self.devices_list
                 else discover_v2_containers(self.hierarchy, known=known, memo=self._walk_memo))
        self.skipped["cgroup_vanished"] += found.stats.skipped_vanished
        self.skipped["cgroup_unreadable"] += found.stats.skipped_unreadable
        self.skipped["cgroup_too_deep"] += found.stats.skipped_too_deep
        self.skipped["cgroup_unrecognised_too_many"] += found.stats.skipped_unrecognised
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
        view.plain_reads = self._plain.check() if self._plain is not None else False
        if self.programs is not None:
            view.device_programs = self._device_programs(snapshot, view.mig)

        targets: list[tuple[str, Path, ContainerIdentity | None]] = [
            (c.path, c.directory, c.identity) for c in found.containers]
        # leaf cgroups nothing recognised: listed (as unknown) only if they hold a GPU, below
        targets += [(c.path, c.directory, None) for c in found.unrecognised]
        # podman/crun keep the payload in a "container" child: the walk reports the child; a process
        # whose cgroup is the parent belongs to it too.
        aliases = {c.path.rsplit("/", 1)[0]: c.path for c in found.containers if c.path.endswith("/container")}
        view.pid_cgroups = {pid: aliases.get(path, path) for pid, path in view.pid_cgroups.items()}
        targets += self._unlisted(view.pid_cgroups.values(), {p for p, _, _ in targets})
        view.index_processes(path for path, _, _ in targets)
        # Containers the walk listed and whose cgroup is removed before they are read stopped during
        # the collection: counted once as cgroup_vanished and not listed. ``gone``: those the PID
        # listing found removed (counted there).
        walked = {c.directory for c in (*found.containers, *found.unrecognised)}
        gone: set[Path] = set()
        if self.scanner is not None:
            leaves = {c.directory for c in (*found.containers, *found.unrecognised) if c.leaf}
            view.open_minors = self._open_minors([d for _, d, _ in targets], walked, gone, view.plain_reads,
                                                 leaves)

        out: list[ContainerStats] = []
        self.metadata.fit(len(targets))
        self._parents = {}  # this collection's parent-cgroup answers (trust.untrusted_because)
        try:
            root_fd: int | None = os.open(self.hierarchy, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            root_fd = None  # _delegated opens it itself, and says what fails
        try:
            self._build(targets, view, walked, gone, on_skipped, root_fd, out)
        finally:
            if root_fd is not None:
                os.close(root_fd)
        return out, view

    def _build(self, targets: list[tuple[str, Path, ContainerIdentity | None]], view: HostView, walked: set[Path],
               gone: set[Path], on_skipped: Callable[[str, tuple[str, ...]], None] | None, root_fd: int | None,
               out: list[ContainerStats]) -> None:
        """Each target's stats, its identity checked, appended to ``out`` when it is a GPU container."""
        roots_checked: set[str] = set()
        debug = log.isEnabledFor(logging.DEBUG)
        for path, directory, identity in targets:
            if directory in gone:
                continue  # the container stopped during the collection: it is not listed
            name = identity.name if identity else ""
            stats = ContainerStats(cgroup=path, identity=identity,
                                   metadata=ContainerMetadata(name=name) if name else _NO_METADATA)
            vanished = not ContainerCollector(directory, path, view, devices_list=self.devices_list,
                                              on_skipped=on_skipped,
                                              on_unreadable=self._devices_list_unreadable).read_into(stats)
            if vanished and directory in walked:
                self.skipped["cgroup_vanished"] += 1
                continue
            if vanished:  # a GPU process's cgroup the walk never saw: listed, its devices.list unread
                self._devices_list_unreadable()
            if not stats.accelerators and (identity is None or (
                    stats.devices_cgroup not in ("unrestricted", "unreadable") and not stats.lost_gpu_access
                    and not vanished)) and not self._kubelet_allocated(identity, view):
                continue  # its rules grant no GPU and it holds none (nor did the kubelet allocate it one)
            why = self._delegated(path, root_fd)
            if why is None and directory in walked:  # removed meanwhile: a container that stopped, or a
                self.skipped["cgroup_vanished"] += 1  # look-alike pulled away
                continue
            if why is None:  # a GPU process's cgroup that is not in the hierarchy read here
                why = "its cgroup is not in the hierarchy accelstats reads, so who made it cannot be checked"
            rootless = self.rootless.name(path, root_fd) if why and self.rootless is not None else None
            if isinstance(rootless, Rootless):  # named by its owner's own state, labelled with its owner
                identity = stats.identity = rootless.identity
                stats.metadata = rootless.metadata
                stats.add_reason(rootless.metadata.reason)
            elif why:
                # its id is its whole cgroup path: never equal to the container ID it may imitate; and
                # no name, not even the one its path spells (lxc.payload.<name>)
                looks = f"a {identity.runtime} container" if identity is not None else "a container"
                why = f"{why} and {rootless}" if rootless else why
                stats.identity = identity = ContainerIdentity(
                    runtime="unknown", id=path, how=f"delegated cgroup, identity not trusted: {why}")
                stats.metadata = ContainerMetadata()
                stats.add_reason(f"looks like {looks} but {why}: identity not trusted (a rootless container is "
                                 "named only from its owner's runtime state)")
            elif identity is None:
                stats.identity = identity = _unknown(path, "no runtime state and no path rule recognises it")
                stats.add_reason("no runtime's state knows it and no path rule recognises it (is the runtime's "
                                 "state root, [runtimes] in the config, right?)")
            if identity.runtime != "unknown" and not identity.owner:  # state files only for the containers listed
                stats.metadata = self.metadata.lookup_pod(identity, self.metadata.lookup(identity))
                if stats.metadata.reason:
                    stats.add_reason(stats.metadata.reason)
                    if identity.runtime not in roots_checked:  # once a runtime a collection
                        roots_checked.add(identity.runtime)
                        self._metadata_root_missing(identity.runtime)
            add_allocations(stats, view.snapshot.kubelet, view)  # the kubelet's allocations as evidence
            if debug:
                self._log_identity(path, stats)
            out.append(stats)

    def _kubelet_allocated(self, identity: ContainerIdentity | None, view: HostView) -> bool:
        """Whether the kubelet allocated a GPU to this container, by the names its runtime's state gives
        (read only when the kubelet allocated some GPU: an idle allocated container on cgroup v2 without
        CAP_SYS_ADMIN has no other evidence, accelstats/attribution/kubelet_evidence.py)."""
        wanted = allocated_keys(view.snapshot.kubelet)
        if not wanted or identity is None or identity.runtime == "unknown" or identity.owner:
            return False
        m = self.metadata.lookup(identity)
        return (m.namespace, m.pod, m.container) in wanted

    def _delegated(self, path: str, root_fd: int | None = None) -> str | None:
        """:func:`accelstats.cgroups.trust.untrusted_because` for ``path`` in this hierarchy."""
        assert self.hierarchy is not None
        return untrusted_because(self.hierarchy, path, root_fd, self._parents)

    def _metadata_root_missing(self, runtime: str) -> None:
        """Warn once per setting when a container of ``runtime`` is attributed but that runtime's
        state root does not exist (its names and images stay empty)."""
        settings = {"docker": ("docker_data_root",), "containerd": ("containerd_state",),
                    "podman": ("storage_graphroot", "storage_runroot"),
                    "cri-o": ("storage_graphroot", "storage_runroot")}.get(runtime, ())
        if all(s in self._roots_warned for s in settings):
            return
        missing = dict(self.runtimes.missing_roots())
        if settings and all(s in missing for s in settings):
            for setting in settings:
                self._warn_root(setting, missing[setting])

    def _log_identity(self, path: str, stats: ContainerStats) -> None:
        """``--log-level debug``: which rule or runtime state identified each container, once (called
        only when debug logging is on)."""
        identity = stats.identity
        key = (path, identity.runtime if identity else "")
        if key in self._identities_logged:
            return
        if len(self._identities_logged) >= _MAX_LOGGED:
            self._identities_logged.clear()
        self._identities_logged.add(key)
        if identity is None:
            log.debug("container %s: no identity", path)
        else:
            log.debug("container %s: %s %s, identified by %s", path, identity.runtime, identity.id,
                      identity.how or "the path (no rule)")

    def _device_programs(self, snapshot: DeviceSnapshot,
                         mig: MigMap | None) -> Callable[[Path], tuple[GpuGrant | None, str]]:
        """v2: ``(grant, reason)`` per cgroup directory from the device programs in effect (one
        collection: the cache's instruction budget for new programs starts again)."""
        from accelstats.cgroups.bpf_program import UndecidableError
        from accelstats.cgroups.devices_bpf import DeviceProgramsError

        assert self.programs is not None
        programs = self.programs
        programs.begin_collection()
        minors = frozenset(d.minor for d in snapshot.devices if d.kind == "gpu" and d.minor is not None)
        caps_major = mig.caps_major if mig is not None else None
        caps = frozenset(mig.caps) if mig is not None else frozenset()

        def grant(directory: Path) -> tuple[GpuGrant | None, str]:
            try:
                found = programs.grant(str(directory), minors, caps_major=caps_major, known_caps_minors=caps)
            except DeviceProgramsError as exc:
                if exc.kind == "vanished":
                    self.skipped["cgroup_vanished"] += 1
                    return None, f"{directory} vanished while its device programs were read"
                reason = "device_programs_denied" if exc.kind == "denied" else "device_programs_unreadable"
                self.skipped[reason] += 1
                why = (f"the cgroup v2 device programs could not be read ({exc}); attributed by processes and "
                       "open device nodes only, so a GPU granted but unused is not seen")
                self._log_programs(exc.kind, why)
                if exc.kind == "denied":
                    self.notes["device_programs"] = (f"cgroup v2 device programs not readable ({exc}): containers "
                                                     "granted a GPU that run nothing on it are not listed")
                return None, why
            except UndecidableError as exc:
                self.skipped["device_program_undecidable"] += 1
                why = f"{exc}: no decision, attributed by processes and open device nodes only"
                self._log_programs(str(exc), why)
                return None, why
            except Exception as exc:  # a bug here must cost one container its grant, never the scrape
                self.skipped["device_program_undecidable"] += 1
                if type(exc).__name__ not in self._programs_logged:
                    self._programs_logged.add(type(exc).__name__)
                    log.exception("devices cgroup (v2): evaluating the device programs of %s failed", directory)
                return None, f"evaluating its device programs failed ({type(exc).__name__}: {exc})"
            return found.grant, ""

        return grant

    def _log_programs(self, key: str, why: str) -> None:
        if key not in self._programs_logged and len(self._programs_logged) < 100:
            self._programs_logged.add(key)
            log.warning("devices cgroup (v2): %s", why)

    def _devices_list_unreadable(self) -> None:
        self.skipped["devices_list_unreadable"] += 1

    def _unlisted(self, paths: Iterable[str], known: set[str]) -> list[tuple[str, Path, ContainerIdentity | None]]:
        """Containers of GPU processes that the walk did not list (not recognised by the runtimes'
        state or any rule, or beyond its depth): the recognised container's own cgroup, else the
        process's cgroup as ``runtime="unknown"``; host processes (services, sessions, ``/``) are not
        containers."""
        assert self.hierarchy is not None
        extra: dict[str, ContainerIdentity] = {}
        for path in sorted(set(paths)):
            if container_of(path, known) is not None:
                continue
            rooted = identify_with_root(path, self.runtimes.known)
            if rooted is not None:
                extra.setdefault(rooted[0], rooted[1])
            elif not is_host_cgroup(path):
                extra.setdefault(path, _unknown(path, "no runtime state and no path rule recognises it"))
        return [(p, self.hierarchy / p.lstrip("/"), ident) for p, ident in extra.items()]

    def _mig_map(self, snapshot: DeviceSnapshot) -> MigMap | None:
        """The nvidia-caps major and mig-minors, when the snapshot has MIG instances and the files
        are readable (v1 rules and v2 device programs name MIG instances by these minors)."""
        if not any(d.kind == "mig" for d in snapshot.devices):
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
                log.warning("mig-minors: skipped a line of %d characters that is not a capability and minor",
                            len(line))  # its text is never logged: under --proc-root the file may be anyone's
        return MigMap(caps_major=major, caps=caps)

    def _open_minors(self, directories: list[Path], walked: set[Path], gone: set[Path], plain: bool = False,
                     leaves: frozenset[Path] | set[Path] = frozenset()) -> Callable[[Path], frozenset[int]]:
        """One fd scan for the PIDs of every container (cached by PID + start time), then a lookup.
        Directories of ``walked`` removed since the walk are added to ``gone`` (counted here)."""
        assert self.scanner is not None
        pids_of: dict[Path, list[int]] = {}
        for directory in directories:
            pids, vanished = pids_in_cgroup(directory, plain=plain, leaf=directory in leaves)
            self.skipped["cgroup_vanished"] += vanished
            if vanished and directory in walked and not os.path.isdir(directory):
                gone.add(directory)
            pids_of[directory] = pids
        before = self.scanner.unreadable
        held = self.scanner.scan(pid for pids in pids_of.values() for pid in pids)
        self.skipped["fd_unreadable"] += self.scanner.unreadable - before
        table = {d: frozenset(m for pid in pids for m in held.get(pid, ()) if m < 254)
                 for d, pids in pids_of.items() if pids}  # an empty cgroup holds nothing: the default
        return lambda directory: table.get(directory, frozenset())


def _unknown(path: str, how: str) -> ContainerIdentity:
    """``runtime="unknown"`` for ``path``: its id is the last component (a trailing ``container``
    payload child, podman's, skipped)."""
    comps = [c for c in path.split("/") if c]
    if len(comps) > 1 and comps[-1] == "container":
        comps = comps[:-1]
    return ContainerIdentity(runtime="unknown", id=comps[-1] if comps else path, how=how)
