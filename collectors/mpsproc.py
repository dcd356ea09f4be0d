"""Process and file helpers of the MPS daemon manager: is a PID alive, reap it, read its command
line, kill a command's process group, remove what a daemon left."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import IO

log = logging.getLogger("collectors.mps")

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
