"""What the accounting ledger asks of the host, and the lookup that answers it from files (I/O at
the edge)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from accelstats.attribution.containers import cgroup_of_pids
from accelstats.attribution.openfds import pids_in_cgroup, process_start_time
from collectors.fsread import read_small

if TYPE_CHECKING:
    from accelstats.attribution.cgroupns import CgroupNamespace


class HostLookup(Protocol):
    """The ledger's questions about the host (tests answer them from tables)."""

    def cgroup_of(self, pid: int) -> str | None:
        """``pid``'s cgroup path as the kernel names it (``/proc/<pid>/cgroup``), None when unreadable."""

    def started_at(self, cgroup: str) -> float | None:
        """Monotonic seconds at which the oldest process of the container ``cgroup`` started, None when
        unknown."""

    def alive(self, cgroup: str) -> bool:
        """Whether the container's cgroup directory still exists."""


class CgroupLookup:
    """:class:`HostLookup` from ``/proc`` (``proc_root``) and the cgroup ``hierarchy`` the attribution
    walks (None: no hierarchy found; no container is then alive or started). ``controller`` and
    ``namespace`` are the attribution's: which line of ``/proc/<pid>/cgroup`` to read (``devices`` on
    v1, the unified one on v2) and how to place paths of a private cgroup namespace."""

    def __init__(self, hierarchy: Path | None, proc_root: Path, controller: str,
                 namespace: CgroupNamespace | None) -> None:
        self.hierarchy = hierarchy
        self.proc_root = proc_root
        self.controller = controller
        self.namespace = namespace

    def cgroup_of(self, pid: int) -> str | None:
        """See :meth:`HostLookup.cgroup_of`."""
        found, _ = cgroup_of_pids((pid,), self.proc_root, self.controller, self.namespace)
        return found.get(pid)

    def started_at(self, cgroup: str) -> float | None:
        """See :meth:`HostLookup.started_at`."""
        if self.hierarchy is None:
            return None
        return oldest_process_start(self.hierarchy / cgroup.lstrip("/"), self.proc_root)

    def alive(self, cgroup: str) -> bool:
        """See :meth:`HostLookup.alive` (once per round per allocated container: plain strings)."""
        return self.hierarchy is not None and os.path.isdir(os.path.join(self.hierarchy, cgroup.lstrip("/")))


def oldest_process_start(directory: Path, proc_root: Path, clock: Callable[[], float] = time.monotonic) -> float | None:
    """Monotonic seconds at which the oldest process of the cgroup ``directory`` (and below) started,
    from ``cgroup.procs`` and field 22 of ``<proc_root>/<pid>/stat`` (clock ticks since boot, proc(5))
    against ``<proc_root>/uptime``; None when no process or time can be read. A host that was
    suspended skews it by the time asleep (CLOCK_MONOTONIC stops, boot time does not)."""
    pids, _ = pids_in_cgroup(directory)
    ticks = [t for t in (process_start_time(proc_root, pid) for pid in pids) if t is not None]
    uptime = read_small(proc_root / "uptime")
    if not ticks or uptime is None:
        return None
    try:
        since_boot = float(uptime.split()[0])
    except (ValueError, IndexError):
        return None
    return clock() - max(0.0, since_boot - min(ticks) / os.sysconf("SC_CLK_TCK"))
