"""Host cgroup paths for an exporter that runs in a cgroup namespace of its own.

``/proc/<pid>/cgroup`` shows paths relative to the *reader's* cgroup namespace root
(cgroup_namespaces(7)): a process outside that root reads as ``/../../kubepods.slice/…``. On cgroup
v2, containerd, Docker and podman give containers a private cgroup namespace by default, and
Kubernetes has no field for the host's, so a DaemonSet's exporter sees every other container that way.

The host's cgroup tree is still whole under the mounted hierarchy (a bind mount of the host's
``/sys/fs/cgroup`` keeps its root; a cgroup namespace changes only what ``/proc/<pid>/cgroup``
prints). So the namespace root's host path is found once: the directory of the hierarchy whose
``cgroup.procs`` lists this process, minus the path this process reads for itself. Every path is
then that root joined with the relative path.
"""

from __future__ import annotations

import logging
import os
import posixpath
from pathlib import Path

from accelstats.cgroups import parse_proc_cgroup
from collectors.fsread import read_small

log = logging.getLogger(__name__)

MAX_DIRS = 100_000  # a walk that finds no cgroup of ours gives up after this many directories


class CgroupNamespace:
    """Resolves namespace-relative cgroup paths to host paths for one hierarchy.

    ``hierarchy``: the mounted cgroup hierarchy (v1 ``devices`` or v2 unified) as the walk reads it;
    ``proc_root``: the host's ``/proc`` as this process sees it (``self`` must be this process, i.e.
    the host PID namespace, which NVML's PIDs need anyway); ``controller``: ``"devices"`` on v1,
    ``""`` on v2. :meth:`root` is found lazily, once; never raises.
    """

    def __init__(self, hierarchy: Path, proc_root: Path, controller: str) -> None:
        self.hierarchy = hierarchy
        self.proc_root = proc_root
        self.controller = controller
        self._root: str | None = None
        self._searched = False
        self.reason = ""  # why the root is unknown, once searched

    def _own_path(self) -> tuple[int, str] | None:
        """(this process's PID in ``proc_root``, its cgroup path as it reads it), or None."""
        try:
            pid = int(os.readlink(self.proc_root / "self"))
        except (OSError, ValueError):
            self.reason = f"cannot read {self.proc_root}/self"
            return None
        data = read_small(self.proc_root / str(pid) / "cgroup")
        path = parse_proc_cgroup(data.decode("utf-8", "surrogateescape")).get(self.controller) if data else None
        if path is None:
            path = parse_proc_cgroup(data.decode("utf-8", "surrogateescape")).get("") if data else None
        if path is None:
            self.reason = f"cannot read {self.proc_root}/{pid}/cgroup"
            return None
        return pid, path

    def _find_dir_of(self, pid: int) -> str | None:
        """The hierarchy path (``/a/b``) whose ``cgroup.procs`` lists ``pid``; a bounded walk."""
        needle = str(pid).encode()
        stack = [self.hierarchy]
        seen = 0
        while stack and seen < MAX_DIRS:
            directory = stack.pop()
            seen += 1
            data = read_small(directory / "cgroup.procs", limit=4 << 20)
            if data is not None and needle in data.split():
                rel = directory.relative_to(self.hierarchy).as_posix()
                return "/" if rel == "." else "/" + rel
            try:
                with os.scandir(directory) as entries:
                    stack.extend(Path(e.path) for e in entries if e.is_dir(follow_symlinks=False))
            except OSError:
                continue
        return None

    def root(self) -> str | None:
        """Host path of this process's cgroup namespace root (``/`` in the host's namespace), or None."""
        if self._searched:
            return self._root
        self._searched = True
        own = self._own_path()
        if own is None:
            return None
        pid, relative = own
        if relative.startswith("/.."):
            self.reason = "this process's own cgroup is outside its cgroup namespace"
            return None
        host = self._find_dir_of(pid)
        if host is None:
            self.reason = f"no cgroup.procs under {self.hierarchy} lists this process (pid {pid})"
            return None
        if relative == "/":
            root = host
        elif host.endswith(relative) and (host[: -len(relative)] or "/").startswith("/"):
            root = host[: -len(relative)] or "/"
        else:
            self.reason = f"this process reads its cgroup as {relative}, but it is at {host}"
            return None
        self._root = root
        log.info("cgroup namespace root of this process is %s in the host's hierarchy: namespace-relative "
                 "paths are resolved against it", root)
        return root

    @property
    def private(self) -> bool:
        """True once the root is known and is not the host's root: every path then needs resolving."""
        return self._root not in (None, "/")

    def resolve(self, path: str) -> str | None:
        """The host path of ``path`` as read from ``/proc/<pid>/cgroup``; None when the root is unknown
        or the path climbs above the host's root."""
        root = self.root()
        if root is None:
            return None
        joined = posixpath.join(root, path.lstrip("/"))
        depth = 0
        for part in joined.split("/"):
            if part == "..":
                depth -= 1
                if depth < 0:
                    return None
            elif part not in ("", "."):
                depth += 1
        return posixpath.normpath(joined)
