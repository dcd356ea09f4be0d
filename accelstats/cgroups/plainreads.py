"""Whether the files of a cgroup hierarchy may be read with a plain ``open``.

:func:`collectors.fsread.read_regular` opens a path with ``O_PATH`` first and reads it only once
``fstat`` says it is a regular file, so that a FIFO or a device node planted where a control file
should be is never opened (docs/security.md). On cgroupfs that cannot happen: kernfs makes only
directories and regular files (cgroup v1 and v2 control files; no ``mknod``, ``mkfifo`` or
``symlink`` there, kernel ``Documentation/admin-guide/cgroup-v2.rst``, ``fs/kernfs``), so the
check only costs two syscalls and a ``/proc/self/fd`` lookup per file, per container, per scrape.

:class:`PlainReads` says, once per collection, whether everything under a hierarchy directory is on
cgroupfs: the mount that holds the directory is a ``cgroup`` or ``cgroup2`` mount and no mount of
another type lies below it. It reads the mount table of the exporter's own mount namespace
(``/proc/self/mountinfo``, the paths it opens) again only when the kernel says it changed (``poll``
on the open file gives ``POLLPRI``: proc(5), "/proc/pid/mounts ... this file is pollable";
``fs/proc_namespace.c mounts_poll``). Anything it cannot tell (no such file, an unreadable one, a
hierarchy that is not a directory) answers False: the checked reads are kept.
"""

from __future__ import annotations

import logging
import os
import select
import weakref
from collections.abc import Sequence
from pathlib import Path

from accelstats.cgroups.mode import Mount, parse_mountinfo

log = logging.getLogger(__name__)

MOUNTINFO = "/proc/self/mountinfo"
_CGROUPFS = frozenset({"cgroup", "cgroup2"})
_MAX_BYTES = 16 << 20  # a host with 10 000 mounts writes ~1.5 MB


def all_cgroupfs(mounts: Sequence[Mount], directory: str, mount_id: int) -> bool:
    """Whether every file under ``directory`` (absolute, symlink-free, in this mount namespace), which is on
    the mount ``mount_id``, is on cgroupfs by ``mounts`` (this namespace's table,
    :func:`accelstats.cgroups.mode.parse_mountinfo`): that mount is in the table and is a ``cgroup`` or
    ``cgroup2`` one, and no mount of another type has its mount point below ``directory`` (visible or
    hidden: either answers False)."""
    directory = directory.rstrip("/") or "/"
    below = "/" if directory == "/" else directory + "/"
    found = False
    for m in mounts:
        if m.mount_id == mount_id:
            if m.fstype not in _CGROUPFS:
                return False
            found = True
        elif m.mount_point.startswith(below) and m.fstype not in _CGROUPFS:
            return False
    return found


def _where(hierarchy: Path) -> tuple[str, int] | None:
    """``(path, mount ID)`` of the directory ``hierarchy`` names, from a descriptor of it: the path as the
    kernel resolves it in this namespace (``readlink /proc/self/fd/<fd>``) and the mount it is on
    (``mnt_id`` of ``/proc/self/fdinfo/<fd>``, proc(5)), so that a name through another process's root
    (``/proc/<pid>/root/…``: another mount namespace, whose mounts this table does not list) is on a
    mount this table does not hold. None when it cannot be told."""
    try:
        fd = os.open(hierarchy, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except (OSError, ValueError):
        return None
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
        info = os.open(f"/proc/self/fdinfo/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            text = os.read(info, 4096).decode("ascii", errors="replace")
        finally:
            os.close(info)
    except OSError:
        return None
    finally:
        os.close(fd)
    mount_id = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("mnt_id:")), "")
    if not (mount_id.isascii() and mount_id.isdigit()) or not path.startswith("/") or path.endswith(" (deleted)"):
        return None
    return path, int(mount_id)


class PlainReads:
    """Whether ``hierarchy`` (a cgroup hierarchy's directory) may be read with plain opens
    (module docstring), checked by :meth:`check` at each collection and kept while the mount table
    (``/proc/self/mountinfo``) is unchanged. Not thread-safe: one attributor's."""

    def __init__(self, hierarchy: Path) -> None:
        self.hierarchy = hierarchy
        self._fd: int | None = None
        self._poll: select.poll | None = None
        self._mounts: list[Mount] | None = None
        self._closer: weakref.finalize[[int], PlainReads] | None = None  # closes the kept descriptor with this object
        self._answer: tuple[tuple[str, int], bool] | None = None  # ((path, mount ID), answer)
        self.rereads = 0
        """How many times the mount table was read (the first read included)."""

    def check(self) -> bool:
        """True when every file under the hierarchy is on cgroupfs now, as far as the mount table and a
        descriptor of the hierarchy directory say (:func:`_where`). Never raises ``OSError``: what cannot
        be read answers False (and is tried again at the next check)."""
        where = _where(self.hierarchy)
        if where is None:
            return False
        if self._mounts is None or self._changed():
            self._mounts = self._read()
            self._answer = None
            if self._mounts is None:
                return False
        if self._answer is None or self._answer[0] != where:
            self._answer = (where, all_cgroupfs(self._mounts, *where))
        return self._answer[1]

    def _changed(self) -> bool:
        """Whether the mount table may have changed since it was read: the kernel's ``POLLPRI`` on
        ``/proc/self/mountinfo``. A descriptor
        closed behind this object's back (``POLLNVAL``) is given up, not closed again (its number may
        be someone else's now), and the table opened and read afresh."""
        if self._poll is None:
            return True
        try:
            events = self._poll.poll(0)
        except OSError:
            return True
        if any(ev & select.POLLNVAL for _, ev in events):
            if self._closer is not None:
                self._closer.detach()
            self._fd, self._poll, self._closer, self._mounts = None, None, None, None
            return True
        return any(ev & (select.POLLPRI | select.POLLERR) for _, ev in events)

    def _read(self) -> list[Mount] | None:
        self.rereads += 1
        try:
            if self._fd is None:
                self._fd = os.open(MOUNTINFO, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                self._closer = weakref.finalize(self, os.close, self._fd)
                self._poll = select.poll()
                self._poll.register(self._fd, select.POLLPRI | select.POLLERR)
            os.lseek(self._fd, 0, os.SEEK_SET)
            chunks: list[bytes] = []
            size = 0
            while size <= _MAX_BYTES:
                chunk = os.read(self._fd, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        except OSError as exc:
            self.close()
            log.debug("mount table %s not readable (%s): cgroup files are read with the checked reads",
                      MOUNTINFO, exc)
            return None
        if size > _MAX_BYTES:
            return None
        return parse_mountinfo(b"".join(chunks).decode("utf-8", errors="surrogateescape"))

    def close(self) -> None:
        """Close the mount table's descriptor (the next :meth:`check` opens it again)."""
        if self._closer is not None:
            self._closer()
        self._fd, self._poll, self._closer, self._mounts = None, None, None, None
