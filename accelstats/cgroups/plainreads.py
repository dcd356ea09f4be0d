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
import re
import select
import weakref
from pathlib import Path

log = logging.getLogger(__name__)

MOUNTINFO = "/proc/self/mountinfo"
_CGROUPFS = frozenset({"cgroup", "cgroup2"})
_MAX_BYTES = 16 << 20  # a host with 10 000 mounts writes ~1.5 MB
_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    r"""A mountinfo field with the kernel's ``\NNN`` octal escapes decoded (space, tab, newline, ``\``)."""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field) if "\\" in field else field


def mounts_of(text: str) -> list[tuple[str, str, str]]:
    """``(device, mount point, filesystem type)`` of each line of ``/proc/<pid>/mountinfo`` text, in file
    order (proc(5): field 3 is the filesystem's ``major:minor``, as ``stat`` gives ``st_dev``, field 5
    the mount point, the field after the ``-`` separator the type). Lines of another shape are left out."""
    out: list[tuple[str, str, str]] = []
    for line in text.splitlines():
        head, sep, tail = line.partition(" - ")
        fields = head.split(" ", 5)
        if not sep or len(fields) < 5 or not tail:
            continue
        out.append((fields[2], _unescape(fields[4]), tail.split(" ", 1)[0]))
    return out


def all_cgroupfs(mounts: list[tuple[str, str, str]], directory: str, device: str) -> bool:
    """Whether every file under the absolute, symlink-free ``directory``, whose ``stat`` gives the
    filesystem ``device`` (``major:minor``), is on cgroupfs by ``mounts`` (:func:`mounts_of`): that
    filesystem is a ``cgroup`` or ``cgroup2`` one, and no mount of another type has its mount point
    below ``directory`` (visible or hidden: either answers False)."""
    directory = directory.rstrip("/") or "/"
    below = "/" if directory == "/" else directory + "/"
    found = False
    for dev, point, fstype in mounts:
        if dev == device:
            if fstype not in _CGROUPFS:
                return False
            found = True
        elif point.startswith(below) and fstype not in _CGROUPFS:
            return False
    return found


class PlainReads:
    """Whether ``hierarchy`` (a cgroup hierarchy's directory) may be read with plain opens
    (module docstring), checked by :meth:`check` at each collection and kept while the mount table
    is unchanged. ``mountinfo``: the mount table to read (tests name another file; a regular file
    never signals a change, so it is read at each check). Not thread-safe: one attributor's."""

    def __init__(self, hierarchy: Path, mountinfo: str = MOUNTINFO) -> None:
        self.hierarchy = hierarchy
        self.mountinfo = mountinfo
        self._fd: int | None = None
        self._poll: select.poll | None = None
        self._mounts: list[tuple[str, str, str]] | None = None
        self._closer: weakref.finalize[[int], PlainReads] | None = None  # closes the kept descriptor with this object
        self._answer: tuple[tuple[int, int, str], bool] | None = None  # ((st_dev, st_ino, path), answer)
        self.rereads = 0
        """How many times the mount table was read (the first read included)."""

    def check(self) -> bool:
        """True when every file under the hierarchy is on cgroupfs now, as far as the mount table and a
        ``stat`` of the hierarchy directory say. Never raises ``OSError``: what cannot be read answers
        False (and is tried again at the next check)."""
        try:
            directory = os.path.realpath(self.hierarchy)
            st = os.stat(directory)
        except (OSError, ValueError):
            return False
        if self._mounts is None or self._changed():
            self._mounts = self._read()
            self._answer = None
            if self._mounts is None:
                return False
        key = (st.st_dev, st.st_ino, directory)
        if self._answer is None or self._answer[0] != key:
            device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
            self._answer = (key, all_cgroupfs(self._mounts, directory, device))
        return self._answer[1]

    def _changed(self) -> bool:
        """Whether the mount table may have changed since it was read: the kernel's ``POLLPRI`` on
        ``/proc/self/mountinfo``; another file (tests) is read again at every check."""
        if self._poll is None or self.mountinfo != MOUNTINFO:
            return True
        try:
            events = self._poll.poll(0)
        except OSError:
            return True
        return any(ev & (select.POLLPRI | select.POLLERR) for _, ev in events)

    def _read(self) -> list[tuple[str, str, str]] | None:
        self.rereads += 1
        try:
            if self._fd is None:
                self._fd = os.open(self.mountinfo, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
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
                      self.mountinfo, exc)
            return None
        if size > _MAX_BYTES:
            return None
        return mounts_of(b"".join(chunks).decode("utf-8", errors="surrogateescape"))

    def close(self) -> None:
        """Close the mount table's descriptor (the next :meth:`check` opens it again)."""
        if self._closer is not None:
            self._closer()
        self._fd, self._poll, self._closer, self._mounts = None, None, None, None
