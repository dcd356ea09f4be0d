"""Reading the small kernel files attribution depends on, safely.

``/proc/<pid>/cgroup``, ``/proc/<pid>/stat``, ``cgroup.procs``, ``/proc/devices`` and
``mig-minors`` are small virtual files, but the exporter may read a tree mounted from elsewhere
(``--proc-root``, ``--cgroup-root``) where anything can stand in their place. :func:`read_small`
never blocks on a FIFO (``O_NONBLOCK``; only regular files are read — procfs and cgroupfs files are
regular), never reads more than ``limit`` bytes, and never raises ``OSError``.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

SMALL = 64 * 1024


def read_small(path: str | Path, limit: int = SMALL) -> bytes | None:
    """The first ``limit`` bytes of the regular file ``path``, or None when it is missing,
    unreadable or not a regular file (a FIFO, a device, a directory). See :func:`read_error` for why."""
    data, _ = read_small_why(path, limit)
    return data


def read_small_why(path: str | Path, limit: int = SMALL) -> tuple[bytes | None, str]:
    """Like :func:`read_small`, also saying why nothing was read: ``""`` (read), ``"vanished"``
    (ENOENT, ESRCH), ``"unreadable"`` (any other error, or not a regular file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except (FileNotFoundError, ProcessLookupError):
        return None, "vanished"
    except (OSError, ValueError):  # ValueError: a NUL in the path
        return None, "unreadable"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, "unreadable"
        chunks: list[bytes] = []
        size = 0
        while size < limit:
            chunk = os.read(fd, min(65536, limit - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks), ""
    except OSError as exc:
        return None, "vanished" if exc.errno in (errno.ENOENT, errno.ESRCH) else "unreadable"
    finally:
        os.close(fd)


def ascii_int(token: bytes | str, max_digits: int = 19) -> int | None:
    """``int(token)`` for a plain ASCII decimal of at most ``max_digits`` digits, else None (no
    superscript digits, no 5 000-digit numbers that Python refuses to convert)."""
    if isinstance(token, str):
        if not (token.isascii() and token.isdigit()):
            return None
    elif not token.isdigit():
        return None
    return int(token) if 0 < len(token) <= max_digits else None
