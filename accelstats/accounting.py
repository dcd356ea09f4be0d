"""GPU accounting per container: counters that integrate between scrapes (docs/accounting.md).

:class:`collectors.procsampler.ProcessSampler` reads every device once per ``accounting_interval``
and hands each round to :meth:`Ledger.add_rounds`, which integrates per (device, PID):

* SM-busy seconds: the seconds each NVML process-utilisation sample covers x its smUtil, every driver
  sample once (:func:`collectors.procsampler.busy_seconds`);
* memory byte-seconds: ``usedGpuMemory`` held from one read to the next (a value read at *t* counts
  until the next read);
* energy: each delta of the GPU's total energy counter, split over the PIDs on that GPU by their SM-busy
  seconds in the same window: a PID gets ``delta x its SM-seconds / max(window, sum of SM-seconds)``;
  the rest is *idle* energy of the GPU (time no process was SM-busy). When the GPU gives no per-process
  utilisation (MIG mode, NOT_SUPPORTED) the whole delta is *unattributed*.

Each collection calls :meth:`Ledger.settle` with the containers the attribution found: every PID's
growth since the last settlement goes to the container whose cgroup holds the PID's cgroup (looked up
once, when the PID is first listed, so a PID that exits between two scrapes still counts where it
ran); PIDs of host cgroups add their energy to the GPU's unattributed energy. Allocated seconds run
from the collection that first sees a devices-cgroup grant (back-dated to the oldest process of the
container, but not before accounting started) until the grant goes or the cgroup is removed (checked
every round); idle seconds are the allocated rounds in which none of the container's PIDs was
SM-busy. Scrapes only read: how often or how concurrently anyone scrapes changes nothing.

Series end as cAdvisor's do: a container's accounting series are published by the first collection
after it ended (its final totals), then no more. Counters restart at 0 when the exporter restarts.
Everything is in memory; the sampler's thread writes and collections read under one lock.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from accelstats.cgroups import is_host_cgroup
from accelstats.containers import ContainerStats
from accelstats.fsread import read_small
from accelstats.openfds import pids_in_cgroup, process_start_time
from collectors.procsampler import ProcessRound

log = logging.getLogger(__name__)

CgroupOf = Callable[[int], "str | None"]
"""PID -> its cgroup path as the kernel names it (``/proc/<pid>/cgroup``), None when unreadable."""
StartedAt = Callable[[str], "float | None"]
"""Container cgroup path -> monotonic seconds its oldest process started, None when unknown."""
Alive = Callable[[str], bool]
"""Container cgroup path -> whether the cgroup directory still exists."""


@dataclass
class _Pid:
    """One PID on one device: what it accumulated, and what was already handed to a container."""

    cgroup: str | None
    sm: float = 0.0  # SM-busy seconds
    memory: float = 0.0  # byte-seconds
    energy: float = 0.0  # joules
    settled: tuple[float, float, float] = (0.0, 0.0, 0.0)
    used_now: int | None = None  # usedGpuMemory of the last read, held until the next
    window_sm: float = 0.0  # SM-busy seconds in the GPU's current energy window
    listed: bool = True
    busy_rounds: dict[int, tuple[float, float]] = field(default_factory=dict)  # round -> (at, elapsed)


@dataclass
class _Device:
    """One device's energy window and totals that belong to no container."""

    energy_at: float | None = None  # monotonic time of the last energy reading
    energy_joules: float | None = None  # that reading
    window_unknown: bool = False  # a round in this window had no per-process utilisation
    idle_energy: float = 0.0
    unattributed_energy: float = 0.0
    split_energy: float = 0.0  # sum of every delta split so far (conservation checks)
    rounds: int = 0
    last_at: float | None = None
    has_sm: bool = False  # a round answered per-process utilisation


@dataclass
class Account:
    """One (container, device): the published counters (seconds, byte-seconds, joules).

    ``labels``: the container's identity labels (``id``, ``name``, ``image``, ``container``, ``pod``,
    ``namespace``) and ``uuid``, ``gpu`` (NVML index); ``intervals``: its allocations as monotonic
    ``(start, end)`` (end None: allocated now); ``ended``: the container is gone, and this is the
    collection that publishes its final totals; ``has_sm``: its device reports per-process
    utilisation, so idle seconds are known."""

    labels: tuple[str, ...]
    ident: tuple[str, ...] = ()  # the identity part of labels, as the attribution last gave it
    sm_seconds: float = 0.0
    memory_byte_seconds: float = 0.0
    energy_joules: float = 0.0
    busy_seconds: float = 0.0  # allocated time in rounds with SM activity
    intervals: list[tuple[float, float | None]] = field(default_factory=list)
    ended: bool = False
    has_sm: bool = False

    @property
    def allocated_now(self) -> bool:
        """True while an allocation is open."""
        return bool(self.intervals) and self.intervals[-1][1] is None

    def allocated(self, now: float) -> float:
        """Allocated seconds up to ``now`` (monotonic)."""
        return sum(max(0.0, (now if end is None else min(end, now)) - start) for start, end in self.intervals)

    def overlap(self, begin: float, end: float) -> float:
        """Seconds of ``(begin, end]`` that fall in an allocation."""
        return sum(max(0.0, min(end, e if e is not None else end) - max(begin, s)) for s, e in self.intervals)

    def close(self, at: float) -> None:
        """End the open allocation at ``at`` (nothing when none is open)."""
        if self.allocated_now:
            start = self.intervals[-1][0]
            self.intervals[-1] = (start, max(start, at))


class Published(NamedTuple):
    """One (container, device) as a collection publishes it (a copy: the sampler goes on meanwhile).
    ``allocated_seconds`` up to the view's ``as_of``; ``was_allocated``: a devices-cgroup grant was
    seen (else allocated and idle seconds are absent); ``has_sm``: the device reports per-process
    utilisation (else SM-seconds, energy and idle seconds are absent)."""

    labels: tuple[str, ...]
    sm_seconds: float
    memory_byte_seconds: float
    energy_joules: float
    allocated_seconds: float
    busy_seconds: float
    was_allocated: bool
    has_sm: bool
    ended: bool


@dataclass(frozen=True)
class AccountingView:
    """What one collection publishes: per (container, device) :class:`Published` and, per device
    UUID, ``(idle joules, unattributed joules)``; ``as_of``: monotonic time of the last round."""

    accounts: tuple[Published, ...] = ()
    devices: tuple[tuple[str, float, float], ...] = ()
    as_of: float = 0.0


class Ledger:
    """The accounting state of one exporter (module docstring). Thread-safe.

    ``cgroup_of``, ``started_at``, ``alive``: the host lookups (injectable: the manager passes ones that
    read ``/proc`` and the cgroup hierarchy); ``index_of``: device UUID -> NVML index label.
    """

    def __init__(self, cgroup_of: CgroupOf, started_at: StartedAt, alive: Alive) -> None:
        self.cgroup_of = cgroup_of
        self.started_at = started_at
        self.alive = alive
        self.started: float | None = None  # monotonic time of the first round
        self._lock = threading.Lock()
        self._pids: dict[str, dict[int, _Pid]] = {}  # device UUID -> PID -> its sums
        self._devices: dict[str, _Device] = {}
        self._accounts: dict[tuple[str, str], Account] = {}
        self._latest = 0.0

    # -- the sampler's side ------------------------------------------------------------------------
    def add_rounds(self, rounds: Sequence[ProcessRound]) -> None:
        """Integrate one sampler round (every device once); never raises for odd input."""
        with self._lock:
            for r in rounds:
                self._add(r)
                self._latest = max(self._latest, r.at)
            if rounds and self.started is None:
                self.started = min(r.at for r in rounds)
            for (cgroup, _), account in self._accounts.items():
                if account.allocated_now and not self.alive(cgroup):
                    account.close(self._latest)  # the container ended: its allocation ends with it

    def _add(self, r: ProcessRound) -> None:
        dev = self._devices.setdefault(r.uuid, _Device())
        dev.rounds += 1
        listed = dict(r.memory) if r.memory is not None else {}
        pids = self._pids.setdefault(r.uuid, {})
        for pid, entry in pids.items():
            if r.elapsed > 0 and entry.used_now is not None:
                entry.memory += entry.used_now * r.elapsed
            entry.listed = pid in listed
            entry.used_now = listed.get(pid)
        for pid, used in listed.items():
            if pid not in pids:
                pids[pid] = _Pid(cgroup=self.cgroup_of(pid), used_now=used)
        if r.sm is None:
            dev.window_unknown = dev.window_unknown or r.elapsed > 0
        else:
            dev.has_sm = True
            for pid, seconds in r.sm:
                found = pids.get(pid)
                if found is None:  # sampled, but not in the lists of this read (it just exited)
                    found = pids[pid] = _Pid(cgroup=self.cgroup_of(pid), listed=False)
                entry = found
                entry.sm += seconds
                entry.window_sm += seconds
                if seconds > 0:
                    entry.busy_rounds[dev.rounds] = (r.at, r.elapsed)
        if r.energy_joules is not None:
            self._split_energy(r.uuid, dev, r.at, r.energy_joules)
        dev.last_at = r.at

    def _split_energy(self, uuid: str, dev: _Device, at: float, joules: float) -> None:
        """Split the energy delta since the previous reading over the PIDs by SM-busy seconds."""
        previous, previous_at = dev.energy_joules, dev.energy_at
        dev.energy_joules, dev.energy_at = joules, at
        entries = list(self._pids.get(uuid, {}).values())
        if previous is None or previous_at is None or joules < previous:  # first reading, or the counter restarted
            for e in entries:
                e.window_sm = 0.0
            dev.window_unknown = False
            return
        delta, window = joules - previous, max(0.0, at - previous_at)
        dev.split_energy += delta
        if dev.window_unknown:
            dev.unattributed_energy += delta
        else:
            busy = sum(e.window_sm for e in entries)
            denominator = max(window, busy)
            given = 0.0
            if denominator > 0:
                for e in entries:
                    share = delta * e.window_sm / denominator
                    e.energy += share
                    given += share
            dev.idle_energy += delta - given
        for e in entries:
            e.window_sm = 0.0
        dev.window_unknown = False

    def split_energy(self, uuid: str) -> float:
        """Joules of every energy delta of device ``uuid`` split so far (containers' shares, idle and
        unattributed add up to it: the conservation the tests check)."""
        with self._lock:
            dev = self._devices.get(uuid)
            return dev.split_energy if dev is not None else 0.0

    # -- the collection's side ---------------------------------------------------------------------
    def settle(self, containers: Iterable[ContainerStats], labels: Callable[[ContainerStats], tuple[str, ...]],
               index_of: Callable[[str], str]) -> AccountingView:
        """Hand every PID's growth since the last settlement to its container, update allocations from
        this collection's ``containers`` (``labels``: their identity label values; ``index_of``: UUID
        -> ``gpu`` label), and return the view to publish. Accounts published as ended by the previous
        settlement are dropped first."""
        with self._lock:
            if self.started is None:
                return AccountingView()
            as_of = self._latest
            by_cgroup = {c.cgroup: c for c in containers}
            named: dict[str, tuple[str, ...]] = {}

            def once(container: ContainerStats) -> tuple[str, ...]:
                got = named.get(container.cgroup)
                if got is None:
                    got = named[container.cgroup] = labels(container)
                return got

            self._accounts = {k: a for k, a in self._accounts.items() if not a.ended}
            self._allocate(by_cgroup, once, index_of, as_of)
            live = self._settle_pids(by_cgroup, once, index_of)
            for (cgroup, _), account in self._accounts.items():
                account.ended = cgroup not in by_cgroup and cgroup not in live
                if account.ended:
                    account.close(as_of)
            return AccountingView(
                accounts=tuple(_frozen(a, as_of) for a in self._accounts.values()),
                devices=tuple((u, d.idle_energy, d.unattributed_energy) for u, d in sorted(self._devices.items())
                              if d.energy_joules is not None),  # GPUs whose energy counter answered
                as_of=as_of)

    def _account(self, cgroup: str, uuid: str, ident: tuple[str, ...] | None,
                 index_of: Callable[[str], str]) -> Account:
        """The account of (``cgroup``, ``uuid``), made on first use; ``ident``: the container's identity
        labels (None: a cgroup no collection found, labelled by its path alone)."""
        account = self._accounts.get((cgroup, uuid))
        if account is None:
            ident = ident or (cgroup, "", "", "", "", "")
            account = self._accounts[(cgroup, uuid)] = Account(labels=(*ident, uuid, index_of(uuid)), ident=ident)
        elif ident is not None and ident is not account.ident and ident != account.ident:
            account.ident = ident  # names may be read later than the cgroup
            account.labels = (*ident, uuid, index_of(uuid))
        if not account.has_sm:
            dev = self._devices.get(uuid)
            account.has_sm = dev is not None and dev.has_sm
        return account

    def _allocate(self, by_cgroup: dict[str, ContainerStats], labels: Callable[[ContainerStats], tuple[str, ...]],
                  index_of: Callable[[str], str], as_of: float) -> None:
        granted = {(c.cgroup, a.id) for c in by_cgroup.values() for a in c.accelerators
                   if a.attribution == "devices_cgroup"}
        for key, account in self._accounts.items():
            if key not in granted:
                account.close(as_of)  # the grant went (docker update) or the container ended
        for cgroup, uuid in sorted(granted):
            account = self._account(cgroup, uuid, labels(by_cgroup[cgroup]), index_of)
            if not account.allocated_now and not self._vanished(account, cgroup):
                assert self.started is not None
                began = self.started_at(cgroup) if not account.intervals else None
                # back-dated to the container's oldest process (a grant is set when the container is
                # created), never before accounting started, never after the latest round
                start = max(self.started, began if began is not None else as_of)
                account.intervals.append((min(start, as_of), None))
                del account.intervals[:-16]  # grants that come and go: the recent ones are enough

    def _vanished(self, account: Account, cgroup: str) -> bool:
        """True when an allocation was closed because the cgroup vanished: a collection that still lists
        the container (it raced the removal) does not open a new one."""
        return bool(account.intervals) and not self.alive(cgroup)

    def _settle_pids(self, by_cgroup: dict[str, ContainerStats],
                     labels: Callable[[ContainerStats], tuple[str, ...]], index_of: Callable[[str], str]) -> set[str]:
        """Move each PID's growth to its account; return the owners of PIDs still listed."""
        busy: dict[tuple[str, str], dict[int, tuple[float, float]]] = {}
        live: set[str] = set()
        for uuid, pids in self._pids.items():
            for pid, entry in list(pids.items()):
                owner = _container_of(entry.cgroup, by_cgroup)
                if owner is None and entry.cgroup is not None and not is_host_cgroup(entry.cgroup):
                    owner = entry.cgroup  # a container no collection saw (it ran between two scrapes)
                d_sm, d_mem, d_energy = (entry.sm - entry.settled[0], entry.memory - entry.settled[1],
                                         entry.energy - entry.settled[2])
                entry.settled = (entry.sm, entry.memory, entry.energy)
                if owner is None:
                    self._devices.setdefault(uuid, _Device()).unattributed_energy += d_energy
                else:
                    container = by_cgroup.get(owner)
                    account = self._account(owner, uuid, labels(container) if container is not None else None,
                                            index_of)
                    account.sm_seconds += d_sm
                    account.memory_byte_seconds += d_mem
                    account.energy_joules += d_energy
                    if entry.busy_rounds:
                        busy.setdefault((owner, uuid), {}).update(entry.busy_rounds)
                        entry.busy_rounds = {}
                    if entry.listed:
                        live.add(owner)
                if not entry.listed and entry.window_sm == 0.0:
                    del pids[pid]  # exited, and its last energy window is split: nothing more to come
        for owned, rounds in busy.items():
            account = self._accounts[owned]
            account.busy_seconds += sum(account.overlap(at - elapsed, at) for at, elapsed in rounds.values())
        return live


def _container_of(cgroup: str | None, by_cgroup: dict[str, ContainerStats]) -> str | None:
    """The container cgroup of ``by_cgroup`` that is ``cgroup`` or holds it, else None."""
    path = cgroup
    while path:
        if path in by_cgroup:
            return path
        if path + "/container" in by_cgroup:  # podman/crun: the payload's cgroup is the child
            return path + "/container"
        if path == "/":
            return None
        path = path.rsplit("/", 1)[0] or "/"
    return None


def _frozen(a: Account, as_of: float) -> Published:
    """What ``a`` publishes, allocated seconds up to ``as_of``."""
    allocated = a.allocated(as_of)
    return Published(a.labels, a.sm_seconds, a.memory_byte_seconds, a.energy_joules, allocated,
                     min(a.busy_seconds, allocated), bool(a.intervals), a.has_sm, a.ended)


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
