"""The one safe way to read a small file named by a path that someone else may control.

The exporter runs as root and reads files in trees that containers, runtimes and operators write:
``/proc/<pid>/cgroup``, ``cgroup.procs``, ``devices.list``, ``mountinfo``, sysfs's PCI ``vendor``
files, the runtimes' state files and indexes, the web configuration and its TLS files, often through
a mounted root (``--proc-root``, ``--cgroup-root``, ``--rootfs``, ``sysfs_root``) where anything can
stand in their place: a FIFO (an ``open`` or a ``read`` that never returns), a device (``/dev/urandom``:
a read that never ends; a watchdog or a tape: an ``open`` that *does* something), a huge file, a
symbolic link to any of them. A reader of such a file calls :func:`read_regular` and does not open
the file itself: the rules below live here once.

How :func:`read_regular` reads ``path``:

1. ``open(path, O_PATH | O_CLOEXEC | O_NOFOLLOW)``: an ``O_PATH`` descriptor names the inode without
   opening the file (no driver's ``open`` runs, a FIFO does not wait for a writer, nothing is
   reported to inotify as an open). With ``O_NOFOLLOW`` a symbolic link as the last component is
   that link itself (refused below); ``follow_symlinks=True`` (only for files an operator names, such
   as ``web.yml`` and TLS files, which Kubernetes and certbot mount as links) resolves it, and the
   check below applies to what it points at. Directories earlier in the path are followed as usual
   (``/proc/self``, sysfs's ``devices/<address>`` links).
2. ``fstat`` of that descriptor: anything but a regular file (FIFO, socket, character or block
   device, directory, symbolic link) is refused *without having been opened*.
3. The same inode is opened for reading through ``/proc/self/fd/<n>`` (``O_RDONLY | O_NONBLOCK |
   O_CLOEXEC``; ``O_NONBLOCK`` also keeps an ``open`` from waiting on a lease), so a file swapped in
   between steps 1 and 3 is never the one opened. Where ``/proc`` is not mounted it opens ``path``
   again with ``O_NOFOLLOW`` and refuses the result unless it is the inode of step 2 (a device
   swapped in at that moment would then have been opened, and is still never read).
4. At most ``limit`` bytes are read (``limit + 1`` with ``past_limit="refuse"``, to know there is
   more). Past the limit the file is either cut (``"truncate"``: the first ``limit`` bytes) or
   refused (``"refuse"``). Each caller says which: a truncated procfs list is still the useful part
   of a list, a truncated JSON document or certificate is not.

It never raises :class:`OSError` and never logs: what happened is in the :class:`FileRead` it
returns, whose ``detail`` says why in words fit for an error message (the OS's reason, "not a regular
file", "larger than N bytes") and never holds any of the file's content. A caller that must raise
calls :meth:`FileRead.data_or_raise`.
"""

from __future__ import annotations

import errno as errnos
import os
import stat
from dataclasses import dataclass
from typing import Literal

SMALL = 64 * 1024
"""The limit of :func:`read_small` unless given: procfs and cgroupfs files of a few lines."""

MISSING = "missing"
"""Nothing at the path (``ENOENT``), or the process it belonged to exited (``ESRCH``)."""
UNREADABLE = "unreadable"
"""The OS refused (``EACCES``, ``EIO``, ``ENOTDIR``, …), or the name holds a NUL character."""
NOT_REGULAR = "not_regular"
"""A FIFO, socket, device, directory, or (not followed) a symbolic link: refused unopened."""
TOO_LARGE = "too_large"
"""More than ``limit`` bytes, with ``past_limit="refuse"``."""

_VANISHED_ERRNOS = frozenset({errnos.ENOENT, errnos.ESRCH})
_CHUNK = 64 * 1024  # procfs, sysfs and cgroupfs answer a page or so per read: no limit-sized buffer


@dataclass(frozen=True, slots=True)
class FileRead:
    """What :func:`read_regular` got from one file.

    ``data``: the bytes read, or None when nothing was read. Then ``reason`` is one of
    :data:`MISSING`, :data:`UNREADABLE`, :data:`NOT_REGULAR`, :data:`TOO_LARGE` (``""`` when
    ``data`` is there), ``detail`` says why for a message ("No such file or directory", "not a
    regular file", "larger than 65536 bytes"; never the file's content) and ``errno`` is the OS's
    error number (0 when the refusal is ours).
    """

    data: bytes | None
    reason: str = ""
    detail: str = ""
    errno: int = 0

    def data_or_raise(self) -> bytes:
        """``data``; else raises :class:`OSError` (the subclass its ``errno`` maps to:
        :class:`FileNotFoundError`, :class:`PermissionError`, …) with ``detail`` as ``strerror`` for
        what the OS refused, or :class:`ValueError` with ``detail`` for what :func:`read_regular`
        refused itself (not a regular file, too large, a NUL in the name)."""
        if self.data is not None:
            return self.data
        if self.errno:
            raise OSError(self.errno, self.detail)
        raise ValueError(self.detail)


def read_regular(path: str | os.PathLike[str], limit: int, *, past_limit: Literal["truncate", "refuse"],
                 follow_symlinks: bool = False) -> FileRead:
    """Read the regular file ``path``: at most ``limit`` bytes (> 0), only if it is a regular file,
    never opening anything else (module docstring: how).

    ``past_limit``: ``"truncate"`` gives the first ``limit`` bytes of a longer file, ``"refuse"``
    gives nothing (:data:`TOO_LARGE`) for one of more than ``limit`` bytes. ``follow_symlinks``:
    whether a symbolic link as the last component is resolved (False: it is refused as
    :data:`NOT_REGULAR`, whatever it points at). Never raises :class:`OSError`; raises ValueError
    only for a ``limit`` below 1 or an unknown ``past_limit`` (a caller's mistake)."""
    if limit < 1 or past_limit not in ("truncate", "refuse"):
        raise ValueError(f"read_regular: limit {limit!r} and past_limit {past_limit!r}")
    flags = os.O_PATH | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        handle = os.open(path, flags)
    except OSError as exc:
        return _failed(exc)
    except ValueError:  # a NUL character in the name
        return FileRead(None, UNREADABLE, "the name holds a NUL character")
    try:
        try:
            st = os.fstat(handle)
        except OSError as exc:
            return _failed(exc)
        if not stat.S_ISREG(st.st_mode):
            return FileRead(None, NOT_REGULAR, "not a regular file")
        fd = _reopen(handle, path, st, follow_symlinks)
        if isinstance(fd, FileRead):
            return fd
    finally:
        os.close(handle)
    try:
        want = limit + 1 if past_limit == "refuse" else limit
        chunks: list[bytes] = []
        size = 0
        while size < want:
            chunk = os.read(fd, min(_CHUNK, want - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        return _failed(exc)
    finally:
        os.close(fd)
    if size > limit:
        return FileRead(None, TOO_LARGE, f"larger than {limit} bytes")
    return FileRead(b"".join(chunks))


def _reopen(handle: int, path: str | os.PathLike[str], st: os.stat_result, follow_symlinks: bool) -> int | FileRead:
    """A readable descriptor of the inode ``handle`` (an ``O_PATH`` descriptor whose ``fstat`` is
    ``st``) names, or the :class:`FileRead` saying why not."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        return os.open(f"/proc/self/fd/{handle}", flags)
    except FileNotFoundError as exc:
        if os.path.isdir("/proc/self/fd"):
            return _failed(exc)  # /proc is there: the inode is gone (a procfs file whose process exited)
    except OSError as exc:
        return _failed(exc)
    # No /proc: open the path again, and keep it only if it is still the inode that was checked.
    try:
        fd = os.open(path, flags | (0 if follow_symlinks else os.O_NOFOLLOW))
    except OSError as exc:
        return _failed(exc)
    try:
        again = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        return _failed(exc)
    if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(again.st_mode):
        os.close(fd)
        return FileRead(None, NOT_REGULAR, "not a regular file")
    return fd


def _failed(exc: OSError) -> FileRead:
    code = exc.errno or 0
    return FileRead(None, MISSING if code in _VANISHED_ERRNOS else UNREADABLE, exc.strerror or str(exc), code)


def read_plain(path: str, limit: int, *, one_record: bool = False) -> bytes | None:
    """The first ``limit`` bytes of ``path`` (> 0), or None when it cannot be opened or read: one ``open``
    (``O_NONBLOCK``, ``O_NOFOLLOW``), reads until end of file or ``limit``, ``close``. Only for a file
    the caller knows to be on a filesystem of directories and regular files alone (cgroupfs:
    :class:`accelstats.cgroups.plainreads.PlainReads`); elsewhere :func:`read_regular`, which never
    opens a FIFO or a device. Never raises :class:`OSError`.

    ``one_record``: the file is a kernfs file written by one ``seq_show`` call and no ``seq_start``
    (``devices.list``: ``devcgroup_seq_show`` in security/device_cgroup.c), which kernfs serves as
    ``single_open`` does (fs/kernfs/file.c ``kernfs_seq_start``): seq_file grows its buffer until the
    whole record fits, so a read shorter than asked for is the whole file and no second read is made
    to see the end (cgroup.procs is many records, a page or so per read: read on)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (OSError, ValueError):
        return None
    try:
        data = os.read(fd, limit)
        if data and len(data) < limit and not one_record:  # a page or so per read: read on to the end
            chunks, size = [data], len(data)
            while size < limit:
                more = os.read(fd, limit - size)
                if not more:
                    break
                chunks.append(more)
                size += len(more)
            data = b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data


def read_small(path: str | os.PathLike[str], limit: int = SMALL) -> bytes | None:
    """``read_regular(path, limit, past_limit="truncate").data``: the first ``limit`` bytes of the
    regular file ``path``, or None (missing, unreadable, not a regular file, a symbolic link). For the
    procfs, sysfs and cgroupfs files read on every collection, where a caller only needs the bytes."""
    return read_regular(path, limit, past_limit="truncate").data


def ascii_int(token: bytes | str, max_digits: int = 19) -> int | None:
    """``int(token)`` for a plain ASCII decimal of at most ``max_digits`` digits, else None (no
    superscript digits, no 5 000-digit numbers that Python refuses to convert)."""
    if isinstance(token, str):
        if not (token.isascii() and token.isdigit()):
            return None
    elif not token.isdigit():
        return None
    return int(token) if 0 < len(token) <= max_digits else None
