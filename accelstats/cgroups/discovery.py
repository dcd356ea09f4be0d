"""Find container cgroups in a cgroup hierarchy, and read their ``devices.list``.

Walks with :func:`os.scandir` rather than cgroupspy.  cgroupspy's ``Tree`` builds a node for every
cgroup of every controller up front, hides per-directory errors, and with ``sub_groups=…`` creates
missing groups, which a read-only monitor must never do (docs/containers.md).  ``os.scandir`` gives
the entry type from ``getdents`` without a ``stat`` per entry, lets us refuse symlinks, bound the
depth, stop at a recognised container, and count each directory that vanished (a container
exiting mid-walk is normal) or could not be read, separately.
"""

from __future__ import annotations

import functools
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from accelstats.cgroups.devices_list import DevicesList, parse_devices_list
from accelstats.cgroups.identity import ContainerIdentity, KnownLookup, identify, is_host_cgroup
from collectors.fsread import read_plain, read_regular

DEFAULT_MAX_DEPTH = 16
"""Directories deeper than this below the hierarchy root are not entered (counted instead)."""
MAX_UNRECOGNISED = 4096
"""Unrecognised leaf cgroups kept per walk at most (the rest are counted, not kept): anyone with a
delegated cgroup can make thousands, and each kept one costs reads at every collection."""
_USER_MANAGER = re.compile(r"user@[0-9]+\.service")
_PAYLOAD_CHILD = "container"
_MAX_DEVICES_LIST_BYTES = 64 << 10  # a real one is a few hundred bytes; the kernel prints at most one rule a line
_MAX_CACHED_TEXT = 4096  # longer texts are parsed every time rather than kept (the caches are bounded in bytes)


@dataclass(frozen=True)
class ContainerCgroup:
    """A container's cgroup in one hierarchy.

    ``path`` is the cgroup path as the kernel names it (starts with ``/``, relative to the
    hierarchy root, e.g. ``/docker/<id>``); ``directory`` is the absolute directory holding its
    control files; ``identity`` is :func:`identify` of ``path``.
    """

    path: str
    directory: Path
    identity: ContainerIdentity | None
    leaf: bool = field(default=False, compare=False)
    """True when the walk saw that ``directory`` had no subdirectory (its link count: 2 on cgroupfs),
    so that a PID listing need not look for sub-cgroups; False when it has some or was not looked at."""


@dataclass(frozen=True)
class WalkStats:
    """What a walk could not look at: directories that vanished (``FileNotFoundError``/
    ``NotADirectoryError``, e.g. a container that exited), directories that could not be read
    (permission or other ``OSError``), directories not entered because of the depth bound, and
    unrecognised leaves beyond :data:`MAX_UNRECOGNISED`."""

    skipped_vanished: int = 0
    skipped_unreadable: int = 0
    skipped_too_deep: int = 0
    skipped_unrecognised: int = 0


@dataclass(frozen=True)
class Discovery:
    """Result of a walk: the container cgroups found (in path order), the walk's counters, and the
    ``unrecognised`` leaf cgroups (no subdirectory, no identity, not a host cgroup such as a
    ``.service`` or a session: :func:`~accelstats.cgroups.identity.is_host_cgroup`), in path order:
    a container whose runtime's state is not readable may be one of them."""

    containers: tuple[ContainerCgroup, ...]
    stats: WalkStats
    unrecognised: tuple[ContainerCgroup, ...] = ()


class WalkMemo:
    """What a walk may keep for the next one: :func:`identify` of each cgroup path and the ``Path`` of
    each directory, valid while the runtimes' state answers the same (``generation``: the
    :attr:`accelstats.attribution.runtimes.RuntimeState.generation` they were made with; a walk with
    another one starts empty). ``identify`` is a pure function of the path and that state, so a kept
    answer is the answer. At most :data:`MAX_MEMO` paths: past that it starts again (a host whose
    cgroup names never repeat gains nothing and keeps nothing)."""

    MAX_MEMO = 65536

    def __init__(self) -> None:
        self.generation: int | None = None
        self.identities: dict[str, ContainerIdentity | None] = {}
        self.directories: dict[str, Path] = {}

    def begin(self, generation: int | None) -> None:
        """Start a walk with the runtimes' state of ``generation``."""
        if generation != self.generation or len(self.identities) > self.MAX_MEMO \
                or len(self.directories) > self.MAX_MEMO:
            self.identities.clear()
            self.directories.clear()
            self.generation = generation

    def identify(self, path: str, known: KnownLookup | None) -> ContainerIdentity | None:
        """:func:`identify` of ``path``, kept."""
        try:
            return self.identities[path]
        except KeyError:
            found = self.identities[path] = identify(path, known)
            return found

    def directory(self, directory: str) -> Path:
        """``Path(directory)``, kept."""
        found = self.directories.get(directory)
        if found is None:
            found = self.directories[directory] = Path(directory)
        return found


def _cgroup_path(parts: tuple[str, ...]) -> str:
    return "/" + "/".join(parts)


def _subdirectories(directory: str) -> list[str]:
    """Names of the real (non-symlink) subdirectories, sorted; ``OSError`` propagates."""
    names: list[str] = []
    with os.scandir(directory) as entries:
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    names.append(entry.name)
            except OSError:
                continue
    names.sort()
    return names


def _children(directory: str) -> tuple[bool, bool]:
    """``(payload, leaf)``: whether the container keeps its processes in a ``container`` child
    (podman/crun), and whether ``directory`` has no subdirectory at all — known from its link count
    alone (cgroupfs, like most filesystems, counts each subdirectory's ``..``: 2 means none), so a
    container without children costs one ``lstat``."""
    try:
        if os.lstat(directory).st_nlink == 2:
            return False, True
        return stat.S_ISDIR(os.lstat(f"{directory}/{_PAYLOAD_CHILD}").st_mode), False
    except OSError:
        return False, False


def _walk(root: Path, max_depth: int, known: KnownLookup | None = None, memo: WalkMemo | None = None) -> Discovery:
    # Plain strings rather than pathlib in the loop: a scrape walks every cgroup directory.
    memo = memo or WalkMemo()
    found: list[ContainerCgroup] = []
    leaves: list[ContainerCgroup] = []
    vanished = unreadable = too_deep = too_many = 0
    base = str(root)
    prefix = base if base.endswith("/") else base + "/"
    stack: list[tuple[str, ...]] = [()]
    while stack:
        parts = stack.pop()
        directory = prefix + "/".join(parts) if parts else base
        if parts:
            identity = memo.identify(_cgroup_path(parts), known)
            if identity is not None:
                payload, leaf = _children(directory)
                if payload:
                    parts = (*parts, _PAYLOAD_CHILD)
                    directory = f"{directory}/{_PAYLOAD_CHILD}"
                found.append(ContainerCgroup(_cgroup_path(parts), memo.directory(directory), identity, leaf))
                continue
        if len(parts) >= max_depth:
            too_deep += 1
            continue
        try:
            children = _subdirectories(directory)
        except (FileNotFoundError, NotADirectoryError):
            vanished += 1
            continue
        except OSError:
            unreadable += 1
            continue
        if not children and parts and not is_host_cgroup(_cgroup_path(parts)):
            if len(leaves) < MAX_UNRECOGNISED:
                leaves.append(ContainerCgroup(_cgroup_path(parts), memo.directory(directory), None, True))
            else:
                too_many += 1
        # A user's delegated subtree (systemd's user@<uid>.service) is not walked: nothing in it may be
        # given a runtime's identity, its device rules are its parent's, and its owner could fill it
        # with cgroups to slow every scrape. GPU processes in it are still found (NVML's lists).
        stack.extend((*parts, name) for name in reversed(children) if not _USER_MANAGER.fullmatch(name))
    found.sort(key=lambda c: c.path)
    leaves.sort(key=lambda c: c.path)
    return Discovery(tuple(found), WalkStats(vanished, unreadable, too_deep, too_many), tuple(leaves))


def discover_v1_containers(devices_root: Path, *, max_depth: int = DEFAULT_MAX_DEPTH,
                           known: KnownLookup | None = None, memo: WalkMemo | None = None) -> Discovery:
    """Find container cgroups in the v1 ``devices`` hierarchy rooted at ``devices_root``.

    Every directory whose cgroup path :func:`identify` recognises is one container; its subtree is
    not walked (its children belong to it), except that a ``container`` child (podman/crun keep the
    payload there, spec §3) is reported instead of its parent, since the runtime applies the device
    rules there.  Symlinks are not followed; directories deeper than ``max_depth`` are not entered.
    A directory that vanishes or cannot be read mid-walk is skipped and counted in
    :class:`WalkStats` (a missing ``devices_root`` counts as one vanished directory).  Never raises
    ``OSError``; never creates anything.  ``known``: the runtimes' state
    (:class:`accelstats.attribution.runtimes.RuntimeState.known`), so that a container a runtime knows is found
    on any path (:func:`~accelstats.cgroups.identity.identify`). ``memo``: the previous walks'
    answers (:class:`WalkMemo`, begun by the caller with the runtimes' state generation).
    """
    return _walk(devices_root, max_depth, known, memo)


def discover_v2_containers(unified_root: Path, *, max_depth: int = DEFAULT_MAX_DEPTH,
                           known: KnownLookup | None = None, memo: WalkMemo | None = None) -> Discovery:
    """Find container cgroups in the cgroup2 hierarchy rooted at ``unified_root``.

    Same walk and guarantees as :func:`discover_v1_containers`; on v2 there is no ``devices.list``:
    device access is decided by BPF programs (:mod:`accelstats.cgroups.devices_bpf`).
    """
    return _walk(unified_root, max_depth, known, memo)


def read_devices_list(directory: Path) -> DevicesList | None:
    """Read and parse ``<directory>/devices.list`` (a regular file, at most 64 KiB; invalid UTF-8
    replaced).

    Returns ``None`` when the file vanished or cannot be read (the caller counts it); malformed
    lines are in the result's ``skipped_lines``.  Re-read on every collection: cAdvisor read it once
    and missed ``docker update`` and ``daemon-reload`` changes (spec §2).  Never raises ``OSError``.
    """
    text = read_devices_list_text(directory)
    if text is None:
        return None
    return _parse_cached(text) if len(text) <= _MAX_CACHED_TEXT else parse_devices_list(text)


def read_devices_list_text(directory: Path | str, *, plain: bool = False) -> str | None:
    """The text of ``<directory>/devices.list`` (its first 64 KiB: a longer one is cut there, invalid
    UTF-8 replaced), or ``None`` when it vanished, cannot be read, or is not a regular file (cgroupfs's
    is; a FIFO, a device such as ``/dev/urandom``, a symbolic link or a directory planted in a mounted
    tree is refused unopened: :func:`collectors.fsread.read_regular`). ``plain``: the hierarchy is known to
    be cgroupfs alone (:class:`accelstats.cgroups.plainreads.PlainReads`), where neither can be: one plain
    ``open`` (:func:`collectors.fsread.read_plain`). Never raises ``OSError``."""
    path = f"{os.fspath(directory)}/devices.list"
    data = (read_plain(path, _MAX_DEVICES_LIST_BYTES, one_record=True) if plain
            else read_regular(path, _MAX_DEVICES_LIST_BYTES, past_limit="truncate").data)
    return None if data is None else data.decode("utf-8", errors="replace")


# Containers' devices.list texts repeat (most containers of a host share a handful of rule sets), and
# the parse is pure: cache it by text so re-reading every collection costs a read, not a parse.
_parse_cached = functools.lru_cache(maxsize=4096)(parse_devices_list)
