"""Rootless containers: named from their owner's own runtime state, labelled with their owner.

A rootless podman or docker container's cgroup is in its owner's delegated subtree,
``/user.slice/user-<uid>.slice/user@<uid>.service/…`` (docs/containers.md, path table), where the owner
may name a cgroup anything: the path alone is never believed (:mod:`accelstats.cgroups.trust`).  Its
name is in the owner's own runtime state, under their home and runtime directory (read under
``rootfs``; the home from ``/etc/passwd``):

=================  ==========================================================  =========================
runtime            state root (the runtimes' rootless defaults)                what is read there
=================  ==========================================================  =========================
podman             ``~/.local/share/containers/storage`` (graphroot,           ``<driver>-containers/``
                   ``$XDG_DATA_HOME/containers/storage``), ``/run/user/<uid>/   ``containers.json``,
                   containers`` (runroot, ``$XDG_RUNTIME_DIR/containers``)     ``volatile-containers.json``
docker             ``~/.local/share/docker`` (data-root,                       ``containers/<id>/``,
                   ``$XDG_DATA_HOME/docker``)                                  ``config.v2.json``
=================  ==========================================================  =========================

The same files, in the same format, as the system runtimes' (:mod:`accelstats.attribution.runtimes`,
:mod:`accelstats.attribution.metadata`).  A container is named when one of its cgroup path's components
below ``user@<uid>.service`` is an ID that state knows; it gets :attr:`ContainerIdentity.owner` = the
uid, so it never equals a system container.  It stays ``runtime="unknown"`` when:

* the path is not ``/user.slice/user-<uid>.slice/user@<uid>.service/…`` with one uid throughout, or the
  ``user@<uid>.service`` cgroup sits in a parent a user may write to (then anyone could have made it);
* the owner's state does not know any of its components (a path rule alone is not enough);
* a system runtime knows that ID too (the owner writes their own state: it may claim any ID);
* a state root is not a directory owned by the uid inside the owner's home (or ``/run/user/<uid>``)
  once symbolic links are resolved: such a root is not read (a link to someone else's state).

Cost: nothing unless a GPU process runs in a ``user@<uid>.service`` subtree; then, per collection and
owner, what :class:`~accelstats.attribution.runtimes.RuntimeState` costs for three roots.  At most
:data:`MAX_OWNERS` owners are kept (the least recently seen is dropped).
"""

from __future__ import annotations

import os
import re
import stat
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path

from accelstats.attribution.containers import ContainerMetadata
from accelstats.attribution.metadata import MetadataReader
from accelstats.attribution.runtimes import RuntimeState
from accelstats.cgroups.identity import ContainerIdentity, KnownLookup, identify_with_root
from accelstats.cgroups.trust import parent_untrusted_because
from accelstats.settings import RuntimeRoots
from collectors.fsread import read_regular

MAX_OWNERS = 64
"""Owners whose state is kept between collections at most."""

MAX_PASSWD_BYTES = 4 * 1024 * 1024
"""The first 4 MiB of ``/etc/passwd`` are looked at for an owner's home."""

_USER_SLICE_RE = re.compile(r"user-([0-9]+)\.slice")
_READ = frozenset({"docker_data_root", "storage_graphroot", "storage_runroot"})


def owner_of(path: str) -> int | None:
    """The uid of ``path`` when it is in a user's delegated subtree as systemd makes it,
    ``/user.slice/user-<uid>.slice/user@<uid>.service/<more>`` (one uid in both places), else None."""
    comps = [c for c in path.split("/") if c]
    if len(comps) < 4 or comps[0] != "user.slice":
        return None
    match = _USER_SLICE_RE.fullmatch(comps[1])
    if match is None or comps[2] != f"user@{match.group(1)}.service":
        return None
    return int(match.group(1))


def home_of(rootfs: Path, uid: int) -> Path | None:
    """The home directory ``/etc/passwd`` (under ``rootfs``) gives ``uid`` (the first line for it),
    an absolute host path; None when there is none.  Never raises."""
    data = read_regular(rootfs / "etc" / "passwd", MAX_PASSWD_BYTES, past_limit="truncate").data
    for line in (data or b"").decode("utf-8", "surrogateescape").splitlines():
        fields = line.split(":")
        if len(fields) >= 7 and fields[2] == str(uid) and fields[5].startswith("/"):
            return Path(fields[5])
    return None


@dataclass
class _Owner:
    uid: int
    state: RuntimeState
    metadata: MetadataReader
    bases: dict[str, Path]  # setting -> the directory (under rootfs) its root must stay inside
    refreshed: int = -1


@dataclass(frozen=True)
class Rootless:
    """A rootless container named: its identity (``owner`` set) and metadata from the owner's state."""

    identity: ContainerIdentity
    metadata: ContainerMetadata


class RootlessOwners:
    """The rootless owners' runtime state on one host (module docstring).

    ``rootfs``: the host's ``/`` as this process sees it; ``hierarchy``: the cgroup hierarchy the
    paths are in; ``system_known``: the system runtimes' :class:`~accelstats.cgroups.identity.KnownLookup`
    (an ID it knows is never a rootless container's).  Call :meth:`begin_collection` once per
    collection, then :meth:`name` per cgroup.  Not thread-safe: the attributor's one worker uses it.
    """

    def __init__(self, rootfs: Path, hierarchy: Path, system_known: KnownLookup) -> None:
        self.rootfs = Path(rootfs)
        self.hierarchy = hierarchy
        self.system_known = system_known
        self._owners: OrderedDict[int, _Owner] = OrderedDict()
        self._collection = 0

    def begin_collection(self) -> None:
        """A new collection: each owner's state is looked at again when first asked about."""
        self._collection += 1

    def name(self, path: str, root_fd: int | None = None) -> Rootless | str | None:
        """The rootless container the cgroup ``path`` is, from its owner's state; else why not (one
        phrase for REASON); None when ``path`` is not in a ``user@<uid>.service`` subtree.  Never
        raises ``OSError``."""
        uid = owner_of(path)
        if uid is None:
            return None
        manager = f"/user.slice/user-{uid}.slice/user@{uid}.service"
        why = parent_untrusted_because(self.hierarchy, manager, root_fd)
        if why is None or why:
            return f"user@{uid}.service itself is not where systemd makes it ({why or 'gone'})"
        owner = self._owner(uid)
        found = identify_with_root(path, owner.state.known)
        if found is None or not found[1].how.startswith("runtime state") or owner_of(found[0]) != uid:
            roots = ", ".join(str(getattr(owner.state.roots, s)) for s in sorted(owner.state.read)) or "none usable"
            return f"the runtime state of its owner uid {uid} ({roots}) does not know it"
        identity = found[1]
        if self.system_known(identity.id, "") is not None:
            return (f"its owner uid {uid}'s state claims {identity.runtime} ID {identity.id[:12]}, which a system "
                    "runtime knows: not trusted")
        identity = replace(identity, owner=str(uid), how=f"{identity.how} (rootless, owner uid {uid})")
        metadata = owner.metadata.lookup_pod(identity, owner.metadata.lookup(identity))
        return Rootless(identity, metadata)

    def _owner(self, uid: int) -> _Owner:
        """``uid``'s state, refreshed once per collection (its roots checked first)."""
        owner = self._owners.get(uid)
        if owner is None or (owner.refreshed != self._collection and "storage_graphroot" not in owner.bases):
            # new, or /etc/passwd had no home for it: looked up (again) once per collection
            owner = self._owners[uid] = self._new_owner(uid)
            while len(self._owners) > MAX_OWNERS:
                self._owners.popitem(last=False)
        self._owners.move_to_end(uid)
        if owner.refreshed != self._collection:
            owner.refreshed = self._collection
            owner.state.read = frozenset(s for s, base in owner.bases.items()
                                         if _owned_inside(owner.state.root_here(s), base, uid))
            owner.state.refresh()
        return owner

    def _new_owner(self, uid: int) -> _Owner:
        home = home_of(self.rootfs, uid)
        run = Path(f"/run/user/{uid}")
        share = (home or Path("/nonexistent")) / ".local" / "share"
        roots = RuntimeRoots(docker_data_root=share / "docker", storage_graphroot=share / "containers" / "storage",
                             storage_runroot=run / "containers")
        state = RuntimeState(self.rootfs, roots)
        state.read = frozenset()
        bases = {"storage_runroot": state.host_path(run)}
        if home is not None:
            bases |= {"docker_data_root": state.host_path(home), "storage_graphroot": state.host_path(home)}
        assert set(bases) <= _READ
        return _Owner(uid, state, MetadataReader(self.rootfs, runtimes=state), bases)


def _owned_inside(root: Path, base: Path, uid: int) -> bool:
    """``root`` is a directory owned by ``uid`` that, symbolic links resolved, is inside ``base``."""
    try:
        st = os.stat(root)
        inside = os.path.realpath(root).startswith(os.path.realpath(base) + os.sep)
    except (OSError, ValueError):
        return False
    return inside and st.st_uid == uid and stat.S_ISDIR(st.st_mode)
