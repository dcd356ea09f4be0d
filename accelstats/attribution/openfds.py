"""Open-device-node evidence: which processes of a container hold NVIDIA device nodes open.

docs/containers.md ("How a container is found": open device nodes): for the PIDs of a container's cgroup, the char
devices of major 195 that a process holds open prove that the container uses those GPUs.  This
module provides the three pieces, all reading a configurable ``proc_root`` (the exporter often runs
in a container with the host's ``/proc`` mounted at e.g. ``/host/proc``) and never raising
:class:`OSError` on the races that are normal on a live host (processes exit, cgroups are removed):

* :func:`pids_in_cgroup`: the PIDs of a cgroup directory and of all its sub-cgroups (v1 or v2).
* :func:`process_start_time`: ``starttime`` from ``/proc/<pid>/stat``, which tells a reused PID
  from the process that held it before.
* :class:`OpenFdScanner`: the minors of major-195 char devices each PID holds open, cached by
  (pid, start time) so that a scrape in which no process started scans no fd directory.
* :func:`char_major`, :func:`nvidia_caps_major`, :func:`nvidia_uvm_major`: the dynamic char majors
  from ``/proc/devices`` (docs/containers.md, "Device numbers": ``nvidia-uvm`` and ``nvidia-caps`` are not fixed).

Device facts (docs/containers.md, "Device numbers"): ``/dev/nvidia<N>`` is char ``195:N`` with N the NVML minor
number; ``195:255`` is ``nvidiactl`` and ``195:254`` ``nvidia-modeset`` (not GPUs: the scanner
returns every minor of the major and leaves that decision to the caller).
"""

from __future__ import annotations

import ctypes
import os
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collectors.fsread import ascii_int, read_plain, read_small

__all__ = [
    "DEFAULT_NVIDIA_MAJOR",
    "OpenFdScanner",
    "char_major",
    "nvidia_caps_major",
    "nvidia_uvm_major",
    "pids_in_cgroup",
    "process_start_time",
]

DEFAULT_NVIDIA_MAJOR = 195
"""Char major of ``/dev/nvidia<N>``, ``/dev/nvidiactl`` and ``/dev/nvidia-modeset`` (spec §2)."""

# proc(5): after the ')' closing field 2 (comm) come field 3 (state) ... field 22 (starttime).
_FIRST_FIELD_AFTER_COMM = 3
_STARTTIME_FIELD = 22
_STARTTIME_INDEX = _STARTTIME_FIELD - _FIRST_FIELD_AFTER_COMM


def pids_in_cgroup(directory: Path, *, max_depth: int = 8, plain: bool = False,
                   leaf: bool = False) -> tuple[list[int], int]:
    """Return the PIDs of a cgroup and of every cgroup below it, and how many directories failed.

    Reads ``<directory>/cgroup.procs`` and the ``cgroup.procs`` of each sub-directory, walking
    with :func:`os.scandir` without following symlinks, down to ``max_depth`` levels below
    ``directory`` (``0``: the directory alone; deeper directories are not visited and not counted).
    ``cgroup.procs`` holds one thread-group ID (a "PID" as ``ps`` shows it) per line in both cgroup
    v1 and v2 (kernel ``Documentation/admin-guide/cgroup-v2.rst``, ``cgroup-v1/cgroups.rst``); in
    the PID namespace of the reader, so a monitor in a container needs the host's PID namespace.

    Returns ``(pids, failed)``: ``pids`` sorted ascending without duplicates (v1 does not promise
    either, and a process moving during the walk can be listed twice); ``failed`` the number of
    directories (``directory`` itself included) whose ``cgroup.procs`` or listing could not be read
    because they vanished mid-walk (a container stopped: normal) or were unreadable
    (``PermissionError``, ``EOPNOTSUPP`` on a v2 threaded cgroup, ...).  Each directory counts at
    most once.  Lines of ``cgroup.procs`` that are not decimal integers are ignored.

    ``plain``: the hierarchy is cgroupfs alone (:class:`accelstats.cgroups.plainreads.PlainReads`), so
    each ``cgroup.procs`` is read with one plain ``open`` rather than the checked read. ``leaf``: the
    caller has just seen that ``directory`` has no subdirectory (:attr:`accelstats.cgroups.discovery.
    ContainerCgroup.leaf`): it is not looked at again.

    Never raises :class:`OSError`; raises :class:`ValueError` when ``max_depth`` is negative.
    """
    if max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    pids: set[int] = set()
    failed = 0
    stack: list[tuple[str, int]] = [(os.fspath(directory), 0)]
    while stack:
        path, depth = stack.pop()
        ok = _read_cgroup_procs(f"{path}/cgroup.procs", pids, plain)
        if depth < max_depth and not (leaf and depth == 0) and not _is_leaf(path):
            try:
                with os.scandir(path) as it:
                    for entry in it:
                        try:
                            is_dir = entry.is_dir(follow_symlinks=False)
                        except OSError:
                            is_dir = False
                        if is_dir:
                            stack.append((entry.path, depth + 1))
            except OSError:
                ok = False
        if not ok:
            failed += 1
    return sorted(pids), failed


def _is_leaf(path: str) -> bool:
    """True when the directory has no subdirectories, known from its link count alone: cgroupfs and
    kernfs (like most filesystems) count each subdirectory's ``..`` link, so 2 means none. Any
    other count (more, or 1 where a filesystem does not count) falls back to listing it."""
    try:
        return os.stat(path).st_nlink == 2
    except OSError:
        return False


def _read_cgroup_procs(path: str, into: set[int], plain: bool = False) -> bool:
    """Add the integers of one ``cgroup.procs`` file to ``into``; False when it could not be read.
    ``plain``: on cgroupfs alone, read with one plain ``open`` (:func:`collectors.fsread.read_plain`)."""
    data = read_plain(path, 4 << 20) if plain else read_small(path, 4 << 20)
    if data is None:
        return False
    for line in data.split():
        pid = ascii_int(line, 10)
        if pid is not None:
            into.add(pid)
    return True


def process_start_time(proc_root: Path, pid: int) -> int | None:
    """Return the start time of process ``pid``: field 22 (``starttime``) of ``<proc_root>/<pid>/stat``.

    The unit is clock ticks since boot (``sysconf(_SC_CLK_TCK)``, usually 100 Hz; proc(5)).  The
    value only serves to tell processes apart: a PID reused by a new process has a different start
    time.  Field 2 (``comm``) is in parentheses and may itself contain spaces and ``)``, so the line
    is split after its **last** ``)``; the fields after it are 3 (``state``) onwards.

    Returns ``None`` when the process is gone (``ENOENT``/``ESRCH``), on any other
    :class:`OSError`, and when the file is not a ``stat`` line with at least 22 fields.  Never
    raises :class:`OSError`.
    """
    data = read_small(os.path.join(os.fspath(proc_root), str(pid), "stat"), 4096)
    if data is None:
        return None
    close = data.rfind(b")")
    if close < 0:
        return None
    fields = data[close + 1 :].split()
    if len(fields) <= _STARTTIME_INDEX:
        return None
    return ascii_int(fields[_STARTTIME_INDEX], 20)


@dataclass(frozen=True)
class _CacheEntry:
    start_time: int
    minors: frozenset[int]
    scanned_at: float


class OpenFdScanner:
    """Find the minors of char devices of one major that processes hold open, with a cache.

    ``proc_root`` is the procfs to read (``/proc``, or the host's mounted elsewhere);
    ``nvidia_major`` the char major to look for (195 for ``/dev/nvidia*``; pass the value of
    :func:`nvidia_caps_major` or :func:`nvidia_uvm_major` to scan for those nodes instead); ``ttl``
    the age in seconds (of ``clock``) after which a cached result is rescanned even though the
    process is the same (it may have opened or closed nodes since); ``clock`` a monotonic clock in
    seconds (injectable for tests).  Raises :class:`ValueError` when ``ttl`` is negative or NaN.

    Sources: ``<proc_root>/<pid>/stat`` field 22 for the cache key (:func:`process_start_time`);
    ``<proc_root>/<pid>/fd/`` (proc(5)), whose entries are magic links to the open files.  Each is
    first read with ``readlink``, which the kernel answers from the dentry without asking the file's
    filesystem (``d_path``): only an entry naming a path in a ``dev`` directory (``/dev/nvidia0``;
    a tree mounted elsewhere shows ``/host/dev/...``) is looked at further, so a
    file held open on a network or FUSE filesystem whose server stopped answering is never touched
    (a ``stat`` of it would wait for that server for ever).  A ``/dev/`` entry is then looked at with
    :func:`char_device` (``statx`` with ``AT_STATX_DONT_SYNC``): it counts when it is a char device
    whose major is ``nvidia_major``.  Listing another user's fd directory needs ptrace read access
    (root, or ``CAP_SYS_PTRACE``).

    Counters (cumulative ``int`` attributes, for the exporter's self-metrics):

    * ``scans``: fd directories actually opened and listed.
    * ``cache_hits``: PIDs answered from the cache without listing their fd directory.
    * ``vanished``: PIDs gone between the cgroup listing and the read (no ``stat``, no ``fd``
      directory, or a different start time after the scan): normal, not an error.
    * ``unreadable``: PIDs whose fd directory exists but could not be listed (``PermissionError``,
      ``NotADirectoryError``, other :class:`OSError`): skipped.

    Concurrency: :meth:`scan` holds an internal lock, so concurrent calls are safe but run one at a
    time.  The cache keeps only the PIDs of the latest scan, so the scanner is meant for one
    collection loop that passes all PIDs of interest in one call; two loops sharing a scanner with
    different PID sets would evict each other's entries (correct, but uncached).
    """

    def __init__(
        self,
        proc_root: Path = Path("/proc"),
        *,
        nvidia_major: int = DEFAULT_NVIDIA_MAJOR,
        ttl: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not ttl >= 0:  # also rejects NaN
            raise ValueError(f"ttl must be >= 0 seconds, got {ttl}")
        self.proc_root = proc_root
        self.nvidia_major = nvidia_major
        self.ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: dict[int, _CacheEntry] = {}
        self._unreadable_now: set[int] = set()
        self.scans = 0
        self.cache_hits = 0
        self.vanished = 0
        self.unreadable = 0

    @property
    def cache_size(self) -> int:
        """Number of PIDs currently cached (at most the number of PIDs of the latest scan)."""
        return len(self._cache)

    def scan(self, pids: Iterable[int]) -> dict[int, frozenset[int]]:
        """Return, for each live PID of ``pids``, the minors of ``nvidia_major`` nodes it holds open.

        The result maps PID to a frozenset of minors (all minors of the major, 254/255 included;
        empty when the process holds none).  PIDs that vanished or whose fd directory could not be
        read are absent from the result (and counted in ``vanished``/``unreadable``).  Duplicate
        PIDs are scanned once.

        A PID that was in the previous call and whose entry is younger than its lifetime (``ttl``
        spread over [ttl/2, ttl) by PID) is answered from the cache without reading anything;
        otherwise its start time is read and its fd directory listed. An fd directory that cannot
        be read is cached as "holds nothing", so it is counted once per lifetime, not every scrape.  Cache entries of
        PIDs not in ``pids`` are dropped, so memory is bounded by the latest call.  Individual fd
        entries that disappear or cannot be stat'ed during the listing (closed meanwhile, dangling)
        are skipped.  Never raises :class:`OSError`.
        """
        with self._lock:
            now = self._clock()
            old_cache = self._cache
            new_cache: dict[int, _CacheEntry] = {}
            result: dict[int, frozenset[int]] = {}
            asked = dict.fromkeys(pids)
            for pid in asked:
                entry = old_cache.get(pid)
                if entry is not None and now - entry.scanned_at < self._lifetime(pid):
                    # Listed in the previous scan and still listed now: the same process (a PID
                    # reused between two scrapes *and* placed in a container's cgroup again is
                    # caught when the entry expires). No /proc read at all on a hit.
                    self.cache_hits += 1
                    new_cache[pid] = entry
                    result[pid] = entry.minors
                    continue
                start = process_start_time(self.proc_root, pid)
                if start is None:
                    self.vanished += 1
                    continue
                minors = self._scan_fds(pid)
                if minors is None:
                    if pid in self._unreadable_now:  # cached as empty: counted once per lifetime
                        new_cache[pid] = _CacheEntry(start, frozenset(), now)
                    continue
                # The PID may have been reused while its fd directory was listed: only a start
                # time unchanged across the listing proves the minors belong to one process.
                if process_start_time(self.proc_root, pid) != start:
                    self.vanished += 1
                    continue
                new_cache[pid] = _CacheEntry(start, minors, now)
                result[pid] = minors
            self._cache = new_cache
            # forget the unreadable PIDs that are no longer asked about (exited, or left the containers)
            self._unreadable_now.intersection_update(asked)
            return result

    def _lifetime(self, pid: int) -> float:
        """``ttl`` spread over [ttl/2, ttl) by PID, so entries made in one scrape do not all expire
        (and get rescanned) in the same later one."""
        return self.ttl * (0.5 + (pid * 2654435761 % 1000) / 2000)  # Knuth's multiplicative hash

    def _scan_fds(self, pid: int) -> frozenset[int] | None:
        """List ``<proc_root>/<pid>/fd``; None (counted) when it vanished or is unreadable."""
        fd_dir = os.path.join(os.fspath(self.proc_root), str(pid), "fd")
        minors: set[int] = set()
        try:
            with os.scandir(fd_dir) as it:
                self.scans += 1
                for entry in it:
                    try:
                        if not _device_path(os.readlink(entry.path)):
                            continue  # sockets, pipes, regular files: never touched (see the class docstring)
                        found = char_device(entry.path)
                    except OSError:
                        continue
                    if found is not None and found[0] == self.nvidia_major:
                        minors.add(found[1])
        except (FileNotFoundError, ProcessLookupError):
            self.vanished += 1
            return None
        except OSError:
            self.unreadable += 1
            self._unreadable_now.add(pid)
            return None
        self._unreadable_now.discard(pid)
        return frozenset(minors)


def _device_path(target: str) -> bool:
    """Whether an fd's link target names a file in a ``dev`` directory (where device nodes live), as
    opposed to ``socket:[…]``, ``pipe:[…]``, ``anon_inode:…`` or a file on some other filesystem."""
    return target.startswith("/") and (target.startswith("/dev/") or "/dev/" in target)


_AT_FDCWD = -100
_AT_STATX_DONT_SYNC = 0x4000  # include/uapi/linux/fcntl.h
_STATX_TYPE = 0x1
_STATX_SIZE = 256  # struct statx, include/uapi/linux/stat.h (stx_mode at 28, stx_rdev_major/minor at 128/132)
_statx: Any = None


def _libc_statx() -> Any:
    """glibc's ``statx`` (2.28+), or False where there is none (or on a big-endian host, where the
    struct is read differently)."""
    global _statx
    if _statx is None:
        try:
            if sys.byteorder != "little":
                raise AttributeError("big-endian")
            fn = ctypes.CDLL(None, use_errno=True).statx
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            _statx = fn
        except (AttributeError, OSError):
            _statx = False
    return _statx


def char_device(path: str) -> tuple[int, int] | None:
    """``(major, minor)`` when ``path`` (followed, e.g. a ``/proc/<pid>/fd/N`` magic link) is a char
    device, else None.  Asks with ``statx(AT_FDCWD, path, AT_STATX_DONT_SYNC, STATX_TYPE)`` so that a
    network or FUSE filesystem answers from its cache and never waits for its server (statx(2),
    "AT_STATX_DONT_SYNC"); :func:`os.stat` where there is no ``statx``.  Raises :class:`OSError` as
    ``stat`` does."""
    fn = _libc_statx()
    if not fn:
        st = os.stat(path)
        return (os.major(st.st_rdev), os.minor(st.st_rdev)) if stat.S_ISCHR(st.st_mode) else None
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if fn(_AT_FDCWD, os.fsencode(path), _AT_STATX_DONT_SYNC, _STATX_TYPE, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    if not stat.S_ISCHR(int.from_bytes(buf.raw[28:30], "little")):
        return None
    return int.from_bytes(buf.raw[128:132], "little"), int.from_bytes(buf.raw[132:136], "little")


def char_major(proc_root: Path, name: str) -> int | None:
    """Return the char major registered under ``name`` in ``<proc_root>/devices``, or None.

    ``/proc/devices`` (proc(5), ``fs/proc/devices.c``) lists ``Character devices:`` then, after a
    blank line, ``Block devices:``; each entry is ``<major> <name>`` with the major right-aligned
    to three columns (``195 nvidia``, ``241 nvidia-caps``, ``508 nvidia-uvm``).  Only the
    character section is searched; the name must match exactly; the first match wins.

    Returns None when the file is unreadable (any :class:`OSError`), has no character section, or
    has no such name.  Never raises :class:`OSError`.
    """
    data = read_small(os.path.join(os.fspath(proc_root), "devices"))
    if data is None:
        return None
    text = data.decode("utf-8", errors="replace")
    in_char = False
    for raw in text.splitlines():
        line = raw.strip()
        if line.endswith(":") and not line[:1].isdigit():
            in_char = line == "Character devices:"
            continue
        if not in_char:
            continue
        parts = line.split(None, 1)
        if len(parts) == 2 and parts[1].strip() == name and ascii_int(parts[0], 7) is not None:
            return ascii_int(parts[0], 7)
    return None


def nvidia_caps_major(proc_root: Path) -> int | None:
    """Return the dynamic char major of ``/dev/nvidia-caps/nvidia-cap<M>`` (MIG capabilities).

    Source: the ``nvidia-caps`` entry of ``<proc_root>/devices`` (docs/containers.md, "Device numbers"); None when
    the driver is not loaded or the file is unreadable.  Never raises :class:`OSError`.
    """
    return char_major(proc_root, "nvidia-caps")


def nvidia_uvm_major(proc_root: Path) -> int | None:
    """Return the dynamic char major of ``/dev/nvidia-uvm`` and ``/dev/nvidia-uvm-tools``.

    Source: the ``nvidia-uvm`` entry of ``<proc_root>/devices`` ("Device numbers" in docs/containers.md: 238 on the H200
    host of this project, 508 or 511 elsewhere); None when the module is not loaded or the file is
    unreadable.  Never raises :class:`OSError`.
    """
    return char_major(proc_root, "nvidia-uvm")
