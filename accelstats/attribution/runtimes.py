"""Which container IDs the container runtimes on this host know, from their own state directories.

A cgroup path alone cannot say whether ``/gpujobs/<64 hex>`` is a docker container, and a user with
a delegated cgroup can name a directory ``docker-<someone else's id>.scope``.  The runtimes' own
state can: :class:`RuntimeState` lists it (read-only, under ``rootfs``) and answers "does runtime R
know container ID X", which :func:`accelstats.cgroups.identify` uses to recognise a container on
any cgroup path (docs/containers.md has the table of paths and state files).

==============  ===================================================================  ==================
runtime         known IDs                                                            setting (default)
==============  ===================================================================  ==================
docker          ``<data-root>/containers/<id>/``                                     ``docker_data_root``
                                                                                     (``/var/lib/docker``)
containerd      ``<state>/io.containerd.runtime.v2.task/<namespace>/<id>/`` (and     ``containerd_state``
                ``…runtime.v1.linux…``), every namespace: the running tasks          (``/run/containerd``)
podman, CRI-O   ``<graphroot>/<driver>-containers/containers.json`` and              ``storage_graphroot``
                ``volatile-containers.json``, ``<runroot>/<driver>-containers/``      (``/var/lib/containers/storage``),
                ``volatile-containers.json``, every storage driver (overlay, vfs,      ``storage_runroot``
                btrfs, zfs, …); CRI-O's entries carry ``pod-name``/``pod-id``          (``/run/containers/storage``)
Nomad           ``<data_dir>/alloc/<allocation id>/``                                ``nomad_data_dir``
                                                                                     (``/opt/nomad/data``)
==============  ===================================================================  ==================

``containerd_root`` (``/var/lib/containerd``) is where containerd keeps its metadata database;
nothing is read from it (it is a bbolt file, see :mod:`accelstats.attribution.metadata`), but it is checked for
existence like the others.

Cost: each collection ``stat``s the directories and files above; a directory is listed again, or a
file parsed again, only when its signature (inode, modification time, link count or size) changed,
or while its modification time is within :data:`RACY_SECONDS` of now (a change in the same clock
tick would not move it; once read after that window it is trusted until it changes).  An index
whose parse took ``t`` (at least :data:`BACKOFF_MIN_SECONDS`) is not parsed again for
:data:`BACKOFF_FACTOR` ``* t``: one rewritten at every collection costs at most about 5 % of a core,
and a new container in it is seen that much later.  An index of at most :data:`MAX_INDEX_BYTES` and
:data:`MIN_BYTES_PER_VALUE` costs at most 16 times its size to parse (docs/security.md).  Nothing
here raises on what it reads; a root that does not exist is reported by
:meth:`RuntimeState.missing_roots` (the caller warns once).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelstats.settings import RuntimeRoots
from collectors.fsread import NOT_REGULAR, TOO_LARGE, read_regular

log = logging.getLogger(__name__)

RACY_SECONDS = 2.0
"""A directory or file changed less than this long ago is read again at the next collection."""

MAX_NAMESPACES = 1024
"""containerd namespaces listed at most (in name order); beyond it one warning names the cap."""

MAX_INDEX_BYTES = 4 * 1024 * 1024
"""A containers/storage index larger than this (4 MiB) is not parsed (counted as an error, warned
once): podman 4.3 writes about 510 bytes per container (``podman create --name c1``, measured), so
this holds about 8 000 containers."""

MIN_BYTES_PER_VALUE = 10
"""An index holding more than one JSON value per this many bytes is not parsed (counted, warned
once). A parsed value costs 50 to 70 bytes of Python objects (``[]``, ``{}``: 24 times their size);
containers/storage writes one value per 16.5 bytes (podman 4.3, measured). The values are
bounded from above by counting ``[``, ``{``, ``,`` and ``:`` bytes, before any parse; only in an
index over 64 KiB (a smaller one costs at most 1.6 MiB whatever it holds)."""

MAX_METADATA_CHARS = 64 * 1024
"""An entry's ``metadata`` string (JSON in a string: about 200 characters) longer than this is not
parsed: the entry keeps its name and gets no image."""

MAX_STORAGE_DRIVERS = 8
"""``<driver>-containers`` directories read per storage root at most, in name order: containers/storage
has six drivers (overlay, vfs, btrfs, zfs, aufs, devicemapper); a rootless owner's graphroot is theirs
to fill with more."""

BACKOFF_FACTOR = 20.0
"""An index whose last parse took ``t`` seconds is not parsed again for ``BACKOFF_FACTOR * t``."""

BACKOFF_MIN_SECONDS = 0.01
"""Parses shorter than this (an index of a few hundred containers) are not backed off."""

_INDEX_KEYS = frozenset({"id", "names", "metadata"})

_HEX64_RE = re.compile(r"[0-9a-f]{64}")
_UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
TASK_DIRS = ("io.containerd.runtime.v2.task", "io.containerd.runtime.v1.linux")


@dataclass(frozen=True, slots=True)
class StorageEntry:
    """One container of a containers/storage index (podman, CRI-O): its first name, its image's name
    (from the entry's ``metadata`` JSON string, ``image-name``), whether CRI-O made it (``pod-name``
    or ``pod-id`` in that metadata), and the index file it is in."""

    name: str
    image: str
    crio: bool
    index: Path


@dataclass(frozen=True)
class _Listing:
    signature: tuple[int, int, int, int]
    names: frozenset[str]
    racy: bool


@dataclass(frozen=True)
class _Parsed:
    signature: tuple[int, int, int, int]
    entries: Mapping[str, StorageEntry]
    racy: bool
    not_before: float  # timer(): no new parse before then (BACKOFF_FACTOR)


def _signature(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_ino, st.st_mtime_ns, st.st_nlink, st.st_size)


def _racy(st: os.stat_result, now: float) -> bool:
    """Changed so recently (within :data:`RACY_SECONDS` of ``now``, either way) that another change
    in the same clock tick would not move the modification time: read again next time. A time far
    in the future (a clock stepped back) is not racy: it would be re-read forever."""
    return abs(now - st.st_mtime) < RACY_SECONDS


class RuntimeState:
    """The container IDs known to docker, containerd, podman/CRI-O and Nomad on this host.

    ``rootfs``: the host's ``/`` as this process sees it; ``roots``: where each runtime keeps its
    state (host paths, resolved under ``rootfs``).  Call :meth:`refresh` once per collection, then
    :meth:`known` for each cgroup name.  Thread-safe (one lock around refresh and reads).
    ``clock``: wall-clock seconds, compared with modification times; ``timer``: monotonic seconds, for
    the parse back-off (both injectable for tests).  :attr:`read` names the settings whose roots are
    read (all by default; a rootless owner's state, :mod:`accelstats.attribution.rootless`, reads
    fewer): a root left out is neither looked at nor reported missing, and knows no container.

    :attr:`errors` counts state files that exist but cannot be used (not JSON, too large, too many
    values for their size: see :data:`MIN_BYTES_PER_VALUE`), each version once; the attributor
    exports it as ``accelstats_attribution_skipped_total{reason="runtime_index_refused"}``.
    """

    def __init__(self, rootfs: Path, roots: RuntimeRoots, *, clock: Callable[[], float] = time.time,
                 timer: Callable[[], float] = time.monotonic) -> None:
        self.rootfs = Path(rootfs)
        self.roots = roots
        self.errors = 0
        self.generation = 0
        """Changes whenever :meth:`known` may answer differently (a refresh that found other state)."""
        self.read: frozenset[str] = frozenset(RuntimeRoots.SETTINGS)
        self._clock = clock
        self._timer = timer
        self._lock = threading.Lock()
        self._listings: dict[Path, _Listing] = {}
        self._indexes: dict[Path, _Parsed] = {}
        self._docker: frozenset[str] = frozenset()
        self._containerd: dict[str, frozenset[str]] = {}
        self._containerd_hex: dict[str, str] = {}
        self._storage: dict[str, StorageEntry] = {}
        self._nomad: frozenset[str] = frozenset()
        self._warned: set[Path] = set()
        self._bad_versions: dict[Path, tuple[int, int, int, int]] = {}
        self._roots_here = {s: self.host_path(getattr(roots, s)) for s in RuntimeRoots.SETTINGS}
        self._missing: list[tuple[str, Path]] | None = None
        self._docker_containers = self._roots_here["docker_data_root"] / "containers"
        self._containerd_tasks = [self._roots_here["containerd_state"] / d for d in TASK_DIRS]

    # -- where things are ----------------------------------------------------------------------------
    def host_path(self, path: Path) -> Path:
        """``path`` (a host path) as this process sees it: under ``rootfs``."""
        return self.rootfs / Path(path).relative_to("/") if Path(path).is_absolute() else self.rootfs / path

    def root_here(self, setting: str) -> Path:
        """The state root of ``setting`` (a key of :class:`accelstats.settings.RuntimeRoots`) under ``rootfs``."""
        return self._roots_here[setting]

    def docker_containers(self) -> Path:
        """``<data-root>/containers`` under ``rootfs``."""
        return self._docker_containers

    def containerd_tasks(self) -> list[Path]:
        """The task state directories (v2 and v1 runtimes) under ``rootfs``."""
        return list(self._containerd_tasks)

    def storage_roots(self) -> list[Path]:
        """``graphroot`` and ``runroot`` under ``rootfs``."""
        return [self._roots_here["storage_graphroot"], self._roots_here["storage_runroot"]]

    def missing_roots(self) -> list[tuple[str, Path]]:
        """``[(setting, host path)]`` of the state roots that do not exist (or are not directories), as
        of the last :meth:`refresh` (checked now when there was none)."""
        missing = self._missing
        if missing is None:
            missing = self._missing = self._check_roots()
        return list(missing)

    def _check_roots(self) -> list[tuple[str, Path]]:
        return [(setting, getattr(self.roots, setting)) for setting in RuntimeRoots.SETTINGS
                if setting in self.read and not os.path.isdir(self._roots_here[setting])]

    # -- the per-collection refresh ----------------------------------------------------------------
    def refresh(self) -> None:
        """Re-read whatever changed since the last call (see the module docstring).  Never raises."""
        with self._lock:
            before = self._answers()
            now = self._clock()
            self._missing = self._check_roots()
            docker = self._list(self.docker_containers(), now) if "docker_data_root" in self.read else frozenset()
            self._docker = frozenset(n for n in docker if _HEX64_RE.fullmatch(n))
            containerd: dict[str, set[str]] = {}
            for tasks in self.containerd_tasks() if "containerd_state" in self.read else ():
                names = sorted(self._list(tasks, now))
                if len(names) > MAX_NAMESPACES and tasks not in self._warned:
                    self._warned.add(tasks)
                    log.warning("runtime state: %s holds %d containerd namespaces; only the first %d (in name order) "
                                "are read, containers of the others are recognised by their cgroup paths only",
                                tasks, len(names), MAX_NAMESPACES)
                for ns in names[:MAX_NAMESPACES]:
                    if _NAME_RE.fullmatch(ns):
                        ids = {n for n in self._list(tasks / ns, now) if _NAME_RE.fullmatch(n)}
                        containerd.setdefault(ns, set()).update(ids)
            self._containerd = {ns: frozenset(ids) for ns, ids in containerd.items()}
            self._containerd_hex = {cid: ns for ns, ids in containerd.items() for cid in ids
                                    if _HEX64_RE.fullmatch(cid)}
            self._refresh_storage(now)
            allocs = self.host_path(self.roots.nomad_data_dir) / "alloc"
            nomad = self._list(allocs, now) if "nomad_data_dir" in self.read else frozenset()
            self._nomad = frozenset(n for n in nomad if _UUID_RE.fullmatch(n))
            self._bump(before)

    def _answers(self) -> tuple[object, ...]:
        return self._docker, self._containerd, self._containerd_hex, self._storage, self._nomad

    def _bump(self, before: tuple[object, ...]) -> None:
        """A new :attr:`generation` when :meth:`known` may answer differently than it did at ``before``
        (frozensets and dicts compare in C; the storage entries are the parsed index's own objects)."""
        if self._answers() != before:
            self.generation += 1

    def _refresh_storage(self, now: float) -> None:
        storage: dict[str, StorageEntry] = {}
        for setting in ("storage_graphroot", "storage_runroot"):
            if setting not in self.read:
                continue
            root = self._roots_here[setting]
            drivers = sorted(n for n in self._list(root, now) if n.endswith("-containers"))
            for driver_dir in drivers[:MAX_STORAGE_DRIVERS]:
                for name in ("containers.json", "volatile-containers.json"):
                    for cid, entry in self._index(root / driver_dir / name, now).items():
                        storage.setdefault(cid, entry)
        self._storage = storage

    def _list(self, directory: Path, now: float) -> frozenset[str]:
        """Names of the subdirectories of ``directory`` (cached by signature); empty when absent."""
        try:
            st = os.stat(directory)
        except OSError:
            self._listings.pop(directory, None)
            return frozenset()
        signature = _signature(st)
        cached = self._listings.get(directory)
        if cached is not None and cached.signature == signature and not cached.racy:
            return cached.names
        names: set[str] = set()
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    try:
                        if entry.is_dir():
                            names.add(entry.name)
                    except OSError:
                        continue
        except OSError as exc:
            log.debug("runtime state: cannot list %s: %s", directory, exc)
        listing = _Listing(signature, frozenset(names), _racy(st, now))
        self._listings[directory] = listing
        return listing.names

    def _index(self, path: Path, now: float) -> Mapping[str, StorageEntry]:
        """``{id: StorageEntry}`` of one containers/storage index, re-parsed when it changes."""
        try:
            st = os.stat(path)
        except OSError:
            self._indexes.pop(path, None)
            return {}
        signature = _signature(st)
        cached = self._indexes.get(path)
        if cached is not None and ((cached.signature == signature and not cached.racy)
                                   or self._timer() < cached.not_before):
            return cached.entries
        started = self._timer()
        entries = dict(self._parse_index(path, signature))
        took = self._timer() - started
        not_before = started + BACKOFF_FACTOR * took if took >= BACKOFF_MIN_SECONDS else float("-inf")
        self._indexes[path] = _Parsed(signature, entries, _racy(st, now), not_before)
        return entries

    def _parse_index(self, path: Path, signature: tuple[int, int, int, int]) -> Iterator[tuple[str, StorageEntry]]:
        got = read_regular(path, MAX_INDEX_BYTES, past_limit="refuse")
        if got.reason in (NOT_REGULAR, TOO_LARGE):
            self._bad(path, signature, f"not a regular file of at most {MAX_INDEX_BYTES} bytes")
            return
        if got.data is None:
            log.debug("runtime state: cannot read %s: %s", path, got.detail)
            return
        if len(got.data) > 64 * 1024 and MIN_BYTES_PER_VALUE * sum(
                got.data.count(c) for c in (b"[", b"{", b",", b":")) > len(got.data):
            self._bad(path, signature, f"more than one JSON value per {MIN_BYTES_PER_VALUE} bytes, "
                                       "not an index containers/storage writes")
            return
        try:
            doc = json.loads(got.data, object_pairs_hook=_index_keys)
        except (ValueError, RecursionError) as exc:
            self._bad(path, signature, f"not valid JSON: {type(exc).__name__}")
            return
        if not isinstance(doc, list):
            self._bad(path, signature, "not a JSON list")
            return
        for item in doc:
            if not isinstance(item, dict):
                continue
            cid = item.get("id")
            if not isinstance(cid, str) or not _HEX64_RE.fullmatch(cid):
                continue  # containers/storage makes 64-hex IDs (stringid.GenerateRandomID)
            names = item.get("names")
            name = names[0] if isinstance(names, list) and names and isinstance(names[0], str) else ""
            meta = _json_object(item.get("metadata"))
            image = meta.get("image-name")
            crio = "pod-name" in meta or "pod-id" in meta
            yield cid, StorageEntry(name, image if isinstance(image, str) else "", crio, path)

    def _bad(self, path: Path, signature: tuple[int, int, int, int], why: str) -> None:
        """Count a bad file once per version (signature), warn once per path."""
        if self._bad_versions.get(path) == signature:
            return
        if len(self._bad_versions) >= 1000:
            self._bad_versions.clear()
        self._bad_versions[path] = signature
        self.errors += 1
        if path not in self._warned and len(self._warned) < 1000:
            self._warned.add(path)
            log.warning("runtime state: %s: %s; its containers are recognised by their cgroup paths only", path, why)

    # -- questions ----------------------------------------------------------------------------------
    def known(self, candidate: str, parent: str) -> tuple[str, str, str, str] | None:
        """``(runtime, id, where, containerd namespace or "")`` when a runtime knows the container
        ``candidate`` (a cgroup name with
        its runtime prefix removed, see :func:`accelstats.cgroups.identity.id_candidates`), else None.

        docker and containers/storage IDs (64 hex) match on any path; a containerd ID matches when
        its namespace is the parent cgroup's name (``ctr -n <namespace>`` puts containers at
        ``/<namespace>/<id>``) or it is 64 hex (Kubernetes, nerdctl); a Nomad allocation ID matches
        ``<alloc id>.<task>``.  A task in containerd's ``moby`` or ``plugins.moby`` namespace is a
        docker container (dockerd runs its containers there), so it is docker's even when docker's
        own data-root is not where ``[runtimes]`` says.  The
        :class:`accelstats.cgroups.identity.KnownLookup` of this host.
        """
        if candidate in self._docker:
            return "docker", candidate, str(self.roots.docker_data_root / "containers"), ""
        entry = self._storage.get(candidate)
        if entry is not None:
            return ("cri-o" if entry.crio else "podman"), candidate, str(entry.index.relative_to(self.rootfs)), ""
        ids = self._containerd.get(parent)
        if ids is not None and candidate in ids:
            return (_containerd_runtime(parent), candidate, f"{self.roots.containerd_state} namespace {parent}",
                    parent)
        ns = self._containerd_hex.get(candidate)
        if ns is not None:
            return _containerd_runtime(ns), candidate, f"{self.roots.containerd_state} namespace {ns}", ns
        if candidate in self._nomad:
            return "nomad", candidate, str(self.roots.nomad_data_dir / "alloc"), ""
        return None

    def storage_entry(self, cid: str) -> StorageEntry | None:
        """The containers/storage entry of ``cid`` (podman, CRI-O); the indexes are checked for
        changes (one ``stat`` each) when the last refresh did not have it."""
        entry = self._storage.get(cid)
        if entry is None:
            with self._lock:
                before = self._answers()
                self._refresh_storage(self._clock())
                self._bump(before)
            entry = self._storage.get(cid)
        return entry

    def containerd_namespace(self, cid: str) -> str | None:
        """The containerd namespace whose tasks hold ``cid`` (the first in name order), or None."""
        ns = self._containerd_hex.get(cid)
        if ns is not None:
            return ns
        for name in sorted(self._containerd):
            if cid in self._containerd[name]:
                return name
        return None

    def known_ids(self) -> dict[str, int]:
        """How many IDs each runtime's state holds now (for the debug log and tests)."""
        return {"docker": len(self._docker), "containerd": sum(len(v) for v in self._containerd.values()),
                "storage": len(self._storage), "nomad": len(self._nomad)}


def _index_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook`` for an index: each object keeps only the keys an entry
    is read for (``id``, ``names``, ``metadata``), so the rest is freed while the index is parsed."""
    return {key: value for key, value in pairs if key in _INDEX_KEYS}


def _json_object(value: object) -> dict[str, Any]:
    """The object a JSON-in-a-string field holds (the storage index's ``metadata``), at most
    :data:`MAX_METADATA_CHARS` characters; ``{}`` else."""
    if not isinstance(value, str) or len(value) > MAX_METADATA_CHARS:
        return {}
    try:
        found = json.loads(value)
    except (ValueError, RecursionError):
        return {}
    return found if isinstance(found, dict) else {}


DOCKER_NAMESPACES = frozenset({"moby", "plugins.moby"})
"""The containerd namespaces dockerd keeps its containers and plugins in."""


def _containerd_runtime(namespace: str) -> str:
    """``docker`` for dockerd's containerd namespaces, else ``containerd``."""
    return "docker" if namespace in DOCKER_NAMESPACES else "containerd"
