"""Process and file helpers of the MPS daemon manager: is a PID alive, reap it, read its command
line, kill a command's process group, remove what a daemon left, the per-resource lock that serialises
starts and stops across processes (:func:`acquire_lock`, :func:`release_lock`), and the SELinux label
of the pipe dir (:func:`label_for_containers`)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

log = logging.getLogger("accelstats.mps.daemon")

KILL_WAIT_S = 1.0  # after SIGKILL, how long to wait for a process to be gone

# --------------------------------------------------------------------------------------------
# processes


def proc_state(pid: int) -> str | None:
    """The process state letter from ``/proc/<pid>/stat`` (``Z`` for a zombie); None when gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            stat = handle.read()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return "?"
        return "?"
    fields = stat[stat.rfind(")") + 2:].split()
    return fields[0] if fields else "?"


def reap(pid: int) -> bool:
    """Reap ``pid`` if it is our exited child; True when it was reaped now or is not our child."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    except OSError:
        return True
    return done == pid


def alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie is reaped when it is our child and counts as gone either way."""
    state = proc_state(pid)
    if state is None:
        return False
    if state == "Z":
        reap(pid)
        return False
    return True


def wait_gone(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` s for ``pid`` to exit (reaping it if it is our child); True when gone."""
    deadline = time.monotonic() + timeout
    while True:
        if not alive(pid):
            reap(pid)
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def cmdline(pid: int) -> list[str]:
    """The arguments of ``pid`` from ``/proc/<pid>/cmdline`` (NUL-separated); [] when it is gone or
    unreadable. Never raises."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            raw = handle.read()
    except OSError:
        return []
    return [os.fsdecode(arg) for arg in raw.split(b"\0") if arg]


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks after boot (``/proc/<pid>/stat`` field 22, proc(5)); None when
    it is gone or unreadable. Two processes that share a PID one after the other differ here."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            stat = handle.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # fields[0] is field 3 (the state)
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


def environ(pid: int) -> dict[bytes, bytes] | None:
    """The initial environment of ``pid`` (``/proc/<pid>/environ``, NUL-separated ``NAME=value``); None
    when it is gone or unreadable. Never raises."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            raw = handle.read()
    except OSError:
        return None
    return dict(var.split(b"=", 1) for var in raw.split(b"\0") if b"=" in var)


def signal_process(pid: int, ticks: int, sig: int) -> bool:
    """Send ``sig`` to ``pid`` only while it is the process that started at ``ticks`` (:func:`start_ticks`).

    A pidfd (``pidfd_open(2)``) is opened first and the start time checked after: a pidfd names one
    process, so a PID freed and reused between the check and the signal is never signalled. Returns
    False when the process is gone or is another one now; OSError for any other failure (EPERM)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        if start_ticks(pid) != ticks:
            return False
        try:
            signal.pidfd_send_signal(fd, sig)
        except ProcessLookupError:
            return False
        return True
    finally:
        os.close(fd)


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's process group (it was started in a session of its own) and reap the child.

    The reaping waits at most :data:`KILL_WAIT_S`: a child stuck in the kernel (a wedged driver)
    cannot die yet, and is left for ``subprocess`` to reap later rather than block the caller.
    """
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        proc.kill()
    try:
        proc.wait(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        log.warning("pid %d (%s) did not die within %g s of SIGKILL", proc.pid, proc.args, KILL_WAIT_S)


def read_text(handle: IO[bytes]) -> str:
    """The whole of a temporary output file, from its start, decoded as UTF-8 (bad bytes replaced)."""
    handle.seek(0)
    return handle.read().decode("utf-8", errors="replace")


def remove_path(path: Path) -> None:
    """Remove a file, link or directory tree; raise OSError when it stays."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def remove_empty_parents(path: Path, stop: Path) -> None:
    """Remove ``path`` and its parents while they are empty directories strictly below ``stop``."""
    current = path
    while current != stop and stop in current.parents:
        try:
            current.rmdir()
        except OSError:
            return
        current = current.parent


# --------------------------------------------------------------------------------------------
# the per-resource start/stop lock

LOCK_POLL_S = 0.01  # how often a waiting process tries the lock again


class LockBusyError(Exception):
    """The lock stayed held by another process for the whole wait."""


def acquire_lock(path: Path, wait: float, create: bool) -> int | None:
    """Take an exclusive ``flock(2)`` on the file ``path``; the open descriptor that holds it.

    ``create``: make the file and its missing parent directories (a start); otherwise (a stop) the
    lock is taken only where its directory exists, and None is returned when it does not (nothing
    to stop there, and nothing is created). The descriptor is close-on-exec, so neither the daemon
    nor any command run while the lock is held inherits it, and the kernel releases the lock when
    this process dies, however it dies: a crashed start never blocks the next one.

    The file may be removed by the holder (:func:`release_lock` with ``remove``); a waiter that then
    gets the lock on the removed file notices (its descriptor is not the file at ``path`` any more:
    device and inode differ, or the path is gone) and tries again on the file at ``path``, so two
    processes never both hold "the" lock. Polls every :data:`LOCK_POLL_S` s for at most ``wait``
    seconds. Raises LockBusyError past the wait, OSError when the directory or file cannot be
    made or opened (e.g. ENOTDIR, EROFS, EACCES).
    """
    deadline = time.monotonic() + wait
    while True:
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
        elif not path.parent.is_dir():
            return None
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise LockBusyError(f"{path} kept disappearing for {wait:g} s") from None
            continue  # the directory went away with its last holder (release_lock): make it again, or stop
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise LockBusyError(f"{path} held by another process for more than {wait:g} s") from None
                    time.sleep(LOCK_POLL_S)
            held = os.fstat(fd)
            try:
                now = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                now = None
        except BaseException:
            os.close(fd)
            raise
        if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            return fd
        os.close(fd)  # we locked a file its holder removed: try the one at path now


def release_lock(fd: int, path: Path, remove: bool, stop: Path) -> None:
    """Release the lock :func:`acquire_lock` returned. ``remove``: first, while still holding it,
    remove the lock file and its parent directories left empty strictly below ``stop`` (the MPS
    root), so a stopped resource leaves nothing behind. Never raises."""
    try:
        if remove:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cannot remove lock file %s: %s", path, exc)
            remove_empty_parents(path.parent, stop)
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


# --------------------------------------------------------------------------------------------
# SELinux

#: The label k8s-device-plugin gives the MPS pipe dir where SELinux is enabled
#: (``internal/mps/daemon.go:104-106, 147-158``): container processes may use files of this type.
CONTAINER_FILE_LABEL = b"system_u:object_r:container_file_t:s0"
SELINUXFS = Path("/sys/fs/selinux")


def selinux_enabled(selinuxfs: Path = SELINUXFS) -> bool:
    """True when SELinux is enabled: selinuxfs is mounted (its ``enforce`` file exists), whether
    enforcing or permissive, as go-selinux's ``GetEnabled`` decides."""
    return (selinuxfs / "enforce").exists()


def label_for_containers(path: Path, selinuxfs: Path = SELINUXFS,
                         setxattr: Callable[[str, str, bytes], None] | None = None) -> bool:
    """Label ``path`` and everything in it ``container_file_t`` (the ``security.selinux`` extended
    attribute) when SELinux is enabled, so containerised MPS clients may use the pipe dir; a no-op
    otherwise. Returns whether it labelled. Raises OSError when labelling fails."""
    if not selinux_enabled(selinuxfs):
        return False
    set_label = setxattr or (lambda p, name, value: os.setxattr(p, name, value, follow_symlinks=False))
    set_label(str(path), "security.selinux", CONTAINER_FILE_LABEL)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            set_label(os.path.join(dirpath, name), "security.selinux", CONTAINER_FILE_LABEL)
    return True
