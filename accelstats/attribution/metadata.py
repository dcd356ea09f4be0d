"""Container metadata from the runtimes' own state files (docs/containers.md, "Paths and state files").

:class:`MetadataReader` turns a :class:`~accelstats.cgroups.identity.ContainerIdentity` (what the
cgroup path says) into a :class:`~accelstats.attribution.containers.ContainerMetadata`: cAdvisor's ``name``,
``image``, ``container``, ``pod`` and ``namespace`` labels.  Every file is optional: a file that is
absent, unreadable, not a regular file, larger than :data:`MAX_FILE_BYTES` or not valid JSON gives
what the identity already says (``name`` for LXC/systemd-nspawn, the task for Nomad, else ``""``).
Nothing here raises on what it reads.

Sources, every path resolved under ``rootfs`` (the host's ``/``; ``/host`` when the exporter runs in a
container with the host root mounted there, like node_exporter's ``--path.rootfs``); each runtime's
state root is a setting of ``[runtimes]`` (:class:`accelstats.settings.RuntimeRoots`; the paths below
are the defaults: ``var/lib/docker`` is ``<docker_data_root>``, ``run/containerd`` is
``<containerd_state>``, ``var/lib/containers/storage`` and ``run/containers/storage`` are
``<storage_graphroot>`` and ``<storage_runroot>``, and ``overlay`` stands for any storage driver):

=================  ===============================================================================
runtime            files, keys -> labels
=================  ===============================================================================
``docker``         ``var/lib/docker/containers/<id>/config.v2.json``: ``Name`` without its leading
                   ``/`` -> name; ``Config.Image`` -> image; ``Config.Labels``
                   ``io.kubernetes.pod.name`` / ``io.kubernetes.pod.namespace`` /
                   ``io.kubernetes.container.name`` (dockershim, cri-dockerd) -> pod / namespace /
                   container.
``containerd``     the task bundle ``run/containerd/io.containerd.runtime.v2.task/<ns>/<id>/config.json``
                   (OCI runtime spec), ``<ns>`` tried in the order ``k8s.io``, ``moby``, ``default``,
                   then up to :data:`MAX_OTHER_NAMESPACES` other directories in name order.
                   ``annotations``: ``io.kubernetes.cri.sandbox-name`` (else
                   ``io.kubernetes.pod.name``) -> pod; ``io.kubernetes.cri.sandbox-namespace`` (else
                   ``io.kubernetes.pod.namespace``) -> namespace; ``io.kubernetes.cri.container-name``
                   (else ``io.kubernetes.container.name``) -> container;
                   ``io.kubernetes.cri.image-name`` -> image; name = the container id.  The
                   namespace whose tasks hold the id (:class:`accelstats.attribution.runtimes.RuntimeState`)
                   is tried first.  A container made without CRI (``ctr run``, nerdctl) has no image
                   annotation: containerd keeps its image name only in its metadata database
                   (``<containerd_root>/io.containerd.metadata.v1.bolt/meta.db``, a bbolt file,
                   for which there is no well-kept Python reader), so its image stays ``""`` and
                   the reason says so.  When no
                   bundle is found, docker's ``config.v2.json`` is tried: Kubernetes with
                   cri-dockerd and the cgroupfs driver names a container by its bare id, which
                   :func:`~accelstats.cgroups.identify` reports as ``containerd``.
``cri-o``          ``var/lib/containers/storage/overlay-containers/<id>/userdata/config.json``, then
                   the same under ``run/containers/storage``.  ``annotations``:
                   ``io.kubernetes.cri-o.Name`` -> name; ``io.kubernetes.cri-o.ImageName`` (else
                   ``io.kubernetes.cri-o.Image``) -> image; ``io.kubernetes.pod.name`` /
                   ``io.kubernetes.pod.namespace`` / ``io.kubernetes.container.name`` (else the same
                   keys inside the JSON string ``io.kubernetes.cri-o.Labels``) -> pod / namespace /
                   container.  Neither file: the storage index (below).
``podman``         the containers/storage index of every storage driver (``overlay``, ``vfs``, …):
                   ``var/lib/containers/storage/<driver>-containers/containers.json`` and
                   ``volatile-containers.json`` (``podman run --rm``), and
                   ``run/containers/storage/<driver>-containers/volatile-containers.json``
                   (``transient_store``); each a JSON list of ``{"id", "names": [...], "image": <image
                   id>, "metadata": <JSON string>}``, read by :class:`accelstats.attribution.runtimes.RuntimeState`.
                   ``names[0]`` -> name; ``metadata``'s ``image-name`` -> image.  Podman's OCI
                   ``config.json`` is not read: its annotations (``io.container.manager=libpod``,
                   ``io.podman.annotations.*`` flags, the image's ``org.opencontainers.image.*``)
                   name neither the container nor the image.  Rootless podman keeps all of this under the user's home
                   (``~/.local/share/containers``): a reader bound to that owner's state reads it
                   (:mod:`accelstats.attribution.rootless`).  Podman pods' names live only in libpod's database
                   (``libpod/bolt_state.db``, bbolt) and are not read; the pod's id is in the cgroup
                   path and becomes ``pod_uid``.
``nomad``          no files: name = the task (the allocation id stays in the identity).
``lxc``,           no files: name = the name in the cgroup path.
``systemd-nspawn``
=================  ===============================================================================

What cAdvisor's ``name`` label holds, and so what ``name`` holds here: the first alias of the
container, which cAdvisor's handlers set to docker's and podman's container name (``Name`` without
``/``; ``k8s_<container>_<pod>_<namespace>_<pod uid>_<attempt>`` under dockershim), CRI-O's
``ContainerInfo.Name`` (the ``io.kubernetes.cri-o.Name`` annotation, the same ``k8s_…`` form) and,
for containerd, **the container id**: cAdvisor's containerd handler sets ``Aliases: [id, name]``, so
kubelet's ``/metrics/cadvisor`` shows the 64-hex id as ``name`` on containerd nodes.  This module
follows cAdvisor there, so series join with kubelet's; the Kubernetes container name is the
``container`` label.  ``image`` is what cAdvisor shows too: docker's ``Config.Image`` (as the user
wrote it), containerd's image name, CRI-O's image name, podman's image name.

Caching: results are kept per ``(runtime, id)`` for the reader's lifetime, at most ``max_entries``
(the least recently used is dropped first).  A lookup that found no readable file is a miss and is
tried again at most every :data:`REFRESH_SECONDS` (a container created a moment ago may not have its
files yet); a found file is not read again (what it holds does not change while the container lives;
a ``docker rename`` is not seen, as in cAdvisor).  The storage index is re-parsed only when its size,
mtime or inode changes.  Symlinks are followed as given (``/var/lib/docker`` is often a link to
another disk); no path is checked against ``rootfs`` beyond refusing ids that are not plain names.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from accelstats.attribution.containers import ContainerMetadata
from accelstats.attribution.runtimes import RuntimeState
from accelstats.cgroups.identity import ContainerIdentity
from accelstats.settings import RuntimeRoots
from collectors.fsread import NOT_REGULAR, TOO_LARGE, read_regular

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 4 * 1024 * 1024
"""A state file larger than this (4 MiB) is not read (counted in :attr:`MetadataReader.errors`)."""

REFRESH_SECONDS = 60.0
"""How long a miss (no readable file) is served from the cache before the files are tried again."""

CONTAINERD_NAMESPACES = ("k8s.io", "moby", "default")
"""containerd namespaces tried first, in this order (Kubernetes CRI, docker's, ``ctr``'s)."""

MAX_OTHER_NAMESPACES = 16
"""How many other containerd namespace directories are tried (in name order) after those."""

CONTAINERD_IMAGE_REASON = ("containerd keeps the image of a container made without CRI (ctr, nerdctl) only in its "
                           "metadata database ({root}/io.containerd.metadata.v1.bolt/meta.db, a bbolt file that no "
                           "well-kept Python library reads)")

# A runtime id is a plain name (64 hex for docker/CRI-O/podman, containerd's identifier rules for
# containerd): no "/", never "." or "..".  Anything else is not looked up.
_SAFE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")

_K8S_POD = "io.kubernetes.pod.name"
_K8S_NAMESPACE = "io.kubernetes.pod.namespace"
_K8S_CONTAINER = "io.kubernetes.container.name"
_CRI_POD = "io.kubernetes.cri.sandbox-name"
_CRI_NAMESPACE = "io.kubernetes.cri.sandbox-namespace"
_CRI_CONTAINER = "io.kubernetes.cri.container-name"
_CRI_IMAGE = "io.kubernetes.cri.image-name"
_CRIO_NAME = "io.kubernetes.cri-o.Name"
_CRIO_IMAGE_NAME = "io.kubernetes.cri-o.ImageName"
_CRIO_IMAGE = "io.kubernetes.cri-o.Image"
_CRIO_LABELS = "io.kubernetes.cri-o.Labels"

_ABSENT_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR})


@dataclass
class _Entry:
    metadata: ContainerMetadata
    found: bool
    checked_at: float


class MetadataReader:
    """Reads container metadata from the runtimes' state files under ``rootfs``; see the module docstring.

    ``rootfs``: the host's root directory as this process sees it (``/``, or ``/host`` in a
    container).  ``runtimes``: the runtimes' state (:class:`accelstats.attribution.runtimes.RuntimeState`, which
    knows the ``[runtimes]`` roots; made from ``rootfs`` and the default roots when None).
    ``max_entries``: how many ``(runtime, id)`` results are cached (>= 1, else ``ValueError``).
    ``clock``: seconds from a monotonic source, for the miss refresh interval
    (injectable for tests).  Thread-safe: one lock around the cache and the reads.

    :attr:`errors` counts state files that were there but could not be used: not valid JSON (bad
    syntax, not UTF-8, nested too deep), not a JSON object (or list, for the storage index), or
    larger than :data:`MAX_FILE_BYTES`.  Each such file is logged at warning the first time and at
    debug after that.  Absent or unreadable files are normal and not counted.
    """

    def __init__(self, rootfs: Path = Path("/"), *, runtimes: RuntimeState | None = None, max_entries: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, not {max_entries}")
        self.rootfs = Path(rootfs)
        self.runtimes = runtimes if runtimes is not None else RuntimeState(self.rootfs, RuntimeRoots())
        self.max_entries = self._least = max_entries
        self._errors = 0
        self._clock = clock
        self._cache: OrderedDict[tuple[str, str, str], _Entry] = OrderedDict()
        self._warned: OrderedDict[Path, None] = OrderedDict()
        self._lock = threading.Lock()

    def fit(self, containers: int) -> None:
        """Hold at least the results of ``containers`` containers (the most a collection looks up) and a
        quarter more for those that come and go, never fewer than the ``max_entries`` it was made with:
        a cache smaller than the host's containers is emptied in turn by each collection, every lookup
        a miss that reads state files again (issue 29: 8 x 5000 read each ``config.v2.json`` each scrape).
        Only containers whose cgroup root alone could make are looked up (accelstats/cgroups/trust.py), so
        the size follows what the host's runtimes made."""
        self.max_entries = max(self._least, containers + containers // 4)

    def lookup(self, identity: ContainerIdentity) -> ContainerMetadata:
        """The metadata of ``identity``'s container; never raises.

        Each field is what the runtime's state file says (module docstring: which file, which
        key) or, when the file does not say, what the identity says (``name``: the LXC/nspawn name,
        the Nomad task), else ``""``.  Served from the cache by ``(identity.runtime, identity.id)``;
        a miss is re-read at most every :data:`REFRESH_SECONDS`.
        """
        if identity.runtime not in _SOURCES or not _SAFE_ID_RE.fullmatch(identity.id):
            return _from_identity(identity)
        key = (identity.runtime, identity.id, identity.state_namespace)
        with self._lock:
            now = self._clock()
            entry = self._cache.get(key)
            if entry is not None and (entry.found or now - entry.checked_at < REFRESH_SECONDS):
                self._cache.move_to_end(key)
                return entry.metadata
            base = _from_identity(identity)
            found = None
            for source in _SOURCES[identity.runtime]:
                found = source(self, identity)
                if found is not None:
                    break
            metadata = _merge(base, found) if found is not None else replace(base, reason=self._why_not(identity))
            self._cache[key] = _Entry(metadata, found is not None, now)
            self._cache.move_to_end(key)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
            return metadata

    def _why_not(self, identity: ContainerIdentity) -> str:
        """Why no state file of ``identity``'s runtime was found: the root that does not exist (and
        its setting), or where the files were looked for."""
        roots = self.runtimes.roots
        settings = {"docker": ("docker_data_root",), "containerd": ("containerd_state",),
                    "cri-o": ("storage_graphroot", "storage_runroot"),
                    "podman": ("storage_graphroot", "storage_runroot")}[identity.runtime]
        absent = {s for s, _ in self.runtimes.missing_roots()}
        missing = [s for s in settings if s in absent]
        if len(missing) == len(settings):
            where = ", ".join(f"{getattr(roots, s)} (setting runtimes.{s})" for s in missing)
            return f"no name or image: {identity.runtime} state not found: {where} does not exist"
        where = ", ".join(f"{getattr(roots, s)} (runtimes.{s})" for s in settings)
        return f"no name or image: {identity.runtime} state under {where} has no file for this container"

    # -- sources: each gives the metadata its file holds, or None when it has no usable file --------

    def _docker(self, identity: ContainerIdentity) -> ContainerMetadata | None:
        cid = identity.id
        doc = self._read_object(self.runtimes.docker_containers() / cid / "config.v2.json")
        if doc is None:
            return None
        config = _mapping(doc.get("Config"))
        labels = _mapping(config.get("Labels"))
        return ContainerMetadata(
            name=_text(doc, "Name").removeprefix("/"),
            image=_text(config, "Image"),
            container=_text(labels, _K8S_CONTAINER),
            pod=_text(labels, _K8S_POD),
            namespace=_text(labels, _K8S_NAMESPACE),
        )

    def _containerd(self, identity: ContainerIdentity) -> ContainerMetadata | None:
        cid = identity.id
        for namespace_dir in self._containerd_namespaces(cid, identity.state_namespace):
            spec = self._read_object(namespace_dir / cid / "config.json")
            if spec is None:
                continue
            ann = _mapping(spec.get("annotations"))
            image = _text(ann, _CRI_IMAGE)
            return ContainerMetadata(
                name=cid,
                image=image,
                container=_text(ann, _CRI_CONTAINER) or _text(ann, _K8S_CONTAINER),
                pod=_text(ann, _CRI_POD) or _text(ann, _K8S_POD),
                namespace=_text(ann, _CRI_NAMESPACE) or _text(ann, _K8S_NAMESPACE),
                reason="" if image else CONTAINERD_IMAGE_REASON.format(root=self.runtimes.roots.containerd_root),
            )
        return None

    def _containerd_namespaces(self, cid: str, namespace: str = "") -> Iterator[Path]:
        """Where a task's bundle may be: the namespace its cgroup path names first (``ctr -n <ns>``),
        then the one whose tasks hold the ID, then the usual ones and a few others, in each task
        directory (v2 and v1 runtimes)."""
        known = namespace or self.runtimes.containerd_namespace(cid)
        for tasks in self.runtimes.containerd_tasks():
            seen: set[str] = set()
            for name in (*((known,) if known else ()), *CONTAINERD_NAMESPACES):
                if name not in seen:
                    seen.add(name)
                    yield tasks / name
            try:
                with os.scandir(tasks) as entries:
                    others = sorted(e.name for e in entries if e.name not in seen and _is_dir(e))
            except OSError:
                continue
            for name in others[:MAX_OTHER_NAMESPACES]:
                seen.add(name)
                yield tasks / name

    def _crio(self, identity: ContainerIdentity) -> ContainerMetadata | None:
        cid = identity.id
        entry = self.runtimes.storage_entry(cid)
        folders = [entry.index.parent] if entry is not None else []
        folders += [root / "overlay-containers" for root in self.runtimes.storage_roots()]
        for folder in folders:
            spec = self._read_object(folder / cid / "userdata" / "config.json")
            if spec is None:
                continue
            ann = _mapping(spec.get("annotations"))
            labels = _json_string_object(ann.get(_CRIO_LABELS))
            return ContainerMetadata(
                name=_text(ann, _CRIO_NAME),
                image=_text(ann, _CRIO_IMAGE_NAME) or _text(ann, _CRIO_IMAGE),
                container=_text(ann, _K8S_CONTAINER) or _text(labels, _K8S_CONTAINER),
                pod=_text(ann, _K8S_POD) or _text(labels, _K8S_POD),
                namespace=_text(ann, _K8S_NAMESPACE) or _text(labels, _K8S_NAMESPACE),
            )
        return None

    def _storage(self, identity: ContainerIdentity) -> ContainerMetadata | None:
        cid = identity.id
        entry = self.runtimes.storage_entry(cid)
        if entry is None:
            return None
        return ContainerMetadata(name=entry.name, image=entry.image)

    def lookup_pod(self, identity: ContainerIdentity, metadata: ContainerMetadata) -> ContainerMetadata:
        """``metadata`` with the reason a podman pod's name is missing, when ``identity`` is in one."""
        if identity.runtime == "podman" and identity.pod_uid and not metadata.pod:
            why = ("pod name not read: podman keeps it only in libpod's database (libpod/bolt_state.db), "
                   "pod_uid holds the pod ID")
            return replace(metadata, reason=f"{metadata.reason}; {why}" if metadata.reason else why)
        return metadata

    # -- file reading --------------------------------------------------------------------------------

    def _read_object(self, path: Path) -> Mapping[str, Any] | None:
        """The JSON object in ``path``; None when it is absent, unreadable or malformed."""
        doc = self._read_json(path)
        if doc is None:
            return None
        if not isinstance(doc, dict):
            self._malformed(path, "not a JSON object")
            return None
        return doc

    def _read_json(self, path: Path) -> Any:
        """The JSON value in ``path``, or None (absent, unreadable, not a regular file, too large,
        malformed; the last two counted in :attr:`errors`)."""
        data = self._read_bytes(path)
        if data is None:
            return None
        try:
            return json.loads(data)
        except json.JSONDecodeError as exc:  # its message says where, never what
            self._malformed(path, f"not valid JSON: {exc}")
            return None
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError's message quotes a byte: not logged
            self._malformed(path, f"not valid JSON: {type(exc).__name__}")
            return None

    def _read_bytes(self, path: Path) -> bytes | None:
        """The bytes of the state file ``path`` (:func:`collectors.fsread.read_regular`: a regular file,
        not a symbolic link, of at most :data:`MAX_FILE_BYTES`; a larger one is refused, counted and
        warned about); None when it is absent, unreadable or not a regular file (logged at debug)."""
        got = read_regular(path, MAX_FILE_BYTES, past_limit="refuse")
        if got.reason == TOO_LARGE:
            self._malformed(path, f"larger than {MAX_FILE_BYTES} bytes, not read")
        elif got.reason == NOT_REGULAR:
            log.debug("metadata: %s is not a regular file", path)
        elif got.data is None and got.errno not in _ABSENT_ERRNOS:
            log.debug("metadata: cannot read %s: %s", path, got.detail)
        return got.data

    @property
    def errors(self) -> int:
        """State files that were there but could not be used (see the class docstring), the
        containers/storage indexes included."""
        return self._errors + self.runtimes.errors

    def _malformed(self, path: Path, why: str) -> None:
        self._errors += 1
        if path in self._warned:
            log.debug("metadata: %s: %s", path, why)
            return
        log.warning("metadata: %s: %s; its container keeps the labels its cgroup path gives", path, why)
        self._warned[path] = None
        while len(self._warned) > self.max_entries:
            self._warned.popitem(last=False)


_SOURCES: dict[str, tuple[Callable[[MetadataReader, ContainerIdentity], ContainerMetadata | None], ...]] = {
    "docker": (MetadataReader._docker,),
    "containerd": (MetadataReader._containerd, MetadataReader._docker),
    "cri-o": (MetadataReader._crio, MetadataReader._storage),
    "podman": (MetadataReader._storage,),
}


def _from_identity(identity: ContainerIdentity) -> ContainerMetadata:
    """What the cgroup path alone says: the LXC/nspawn name, or the Nomad task as the name."""
    if identity.runtime == "nomad":
        return ContainerMetadata(name=identity.name or identity.task)
    return ContainerMetadata(name=identity.name)


def _merge(base: ContainerMetadata, found: ContainerMetadata) -> ContainerMetadata:
    """``found``'s fields where they are non-empty, else ``base``'s (the reason is ``found``'s)."""
    values = {f.name: getattr(found, f.name) or getattr(base, f.name) for f in fields(ContainerMetadata)}
    values["reason"] = found.reason
    return ContainerMetadata(**values)


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def _text(mapping: Mapping[str, Any], key: str) -> str:
    value = mapping.get(key)
    return value if isinstance(value, str) else ""


def _json_string_object(value: object) -> Mapping[str, Any]:
    """The object a JSON-in-a-string field holds (CRI-O's ``io.kubernetes.cri-o.Labels``, the storage
    index's ``metadata``); ``{}`` when it is not a string holding a JSON object."""
    if not isinstance(value, str) or len(value) > MAX_FILE_BYTES:
        return {}
    try:
        return _mapping(json.loads(value))
    except (ValueError, RecursionError):
        return {}


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False
