"""The accounting ledger: integrates the sampler's rounds per (device, PID), hands them to containers
at each collection (the package docstring and docs/accounting.md say what and why)."""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence

from accelstats.accounting.host import HostLookup
from accelstats.accounting.records import (
    BUSY_SPANS_KEPT,
    Account,
    AccountingView,
    DeviceSums,
    PidSums,
    Spans,
    container_of,
    merge_spans,
    published,
    unseen_container,
)
from accelstats.attribution.containers import ContainerStats
from accelstats.attribution.labels import identity_labels
from collectors.procsampler import ENERGY_EVERY, ProcessRound
from collectors.smsamples import DRIVER_PERIOD_MAX

log = logging.getLogger(__name__)

_Labels = Callable[[ContainerStats], tuple[str, ...]]  # a container's identity label values, once per settlement


MAX_WATTS = 10_000.0
"""An energy-counter delta faster than this per GPU is a glitch, not a GPU (an H200 is capped at 700 W):
left out and counted (``energy_jump``)."""
CGROUP_LOOKUPS = 3
"""Times in all a PID's ``/proc/<pid>/cgroup`` is read while it cannot be (no host PID namespace, the
process gone, a replayed PID); then its energy share goes unattributed, its SM and memory to no container
(``cgroup_unknown``)."""
EXITED_KEPT = 10_000
"""Cgroups whose exited PIDs' sums wait for a collection; beyond (no scrape while more than this many
short-lived containers came and went) they go to one bucket per device (``ledger_full``)."""
IDLE_KEPT_S = 600.0
"""Seconds an account keeps its series while idle and empty: its cgroup still exists (nothing removes a
user's empty job cgroups) but the attribution no longer lists it, no PID of it is held and no
allocation is open. Then its series end as a removed container's do (published once more, then gone);
a later job there starts new ones from 0."""
ACCOUNTS_KEPT = 4096
"""(container, device) accounts kept. A new one beyond it ends the longest-idle account first (its series
end early: ``accounts_full``); with none idle, the new one's readings are not attributed (``accounts_full``)."""
DISCARD_REASONS = ("energy_jump", "sample_from_future", "clock_stepped_back", "cgroup_unknown", "ledger_full",
                   "accounts_full")


class Ledger:
    """The accounting state of one exporter. Thread-safe: the sampler's thread calls
    :meth:`add_rounds`, collections call :meth:`settle`, under one lock.

    ``host``: what the ledger asks of the host (the manager passes a
    :class:`~accelstats.accounting.host.CgroupLookup`, which reads ``/proc`` and the cgroup
    hierarchy). ``discarded`` counts readings left out, by reason
    (:data:`DISCARD_REASONS`). ``idle_kept``: seconds (of the sampler's clock) an idle and empty
    account keeps its series (:data:`IDLE_KEPT_S`); ``max_accounts``: accounts kept
    (:data:`ACCOUNTS_KEPT`); ``lag``: seconds idle seconds trail the latest round (None: :meth:`span_lag`,
    from the rounds' spacing; tests that hand in exact spans give 0). Raises ValueError for ``idle_kept`` or
    ``lag`` < 0 or ``max_accounts`` < 1.
    """

    def __init__(self, host: HostLookup, *, idle_kept: float = IDLE_KEPT_S, max_accounts: int = ACCOUNTS_KEPT,
                 lag: float | None = None) -> None:
        if not idle_kept >= 0 or max_accounts < 1 or (lag is not None and not lag >= 0):
            raise ValueError(f"idle_kept and lag must be >= 0 s and max_accounts >= 1, got {idle_kept!r}, "
                             f"{lag!r}, {max_accounts!r}")
        self.host = host
        self.lag = lag
        self.idle_kept = idle_kept
        self.max_accounts = max_accounts
        self._kept = 0  # accounts not ended
        self._evictable: list[tuple[str, str]] | None = None  # idle accounts, longest-idle last (one settlement)
        self._owners: set[str] = set()  # cgroups with a PID or exited sums held (one settlement): never evicted
        self.started: float | None = None  # monotonic time of the first round
        self.discarded: Counter[str] = Counter({r: 0 for r in DISCARD_REASONS})
        self._lock = threading.Lock()
        self._pids: dict[str, dict[int, PidSums]] = {}  # device UUID -> PID -> its sums
        self._exited: dict[tuple[str, str | None], PidSums] = {}  # (UUID, cgroup) -> exited PIDs' sums
        self._devices: dict[str, DeviceSums] = {}
        self._accounts: dict[tuple[str, str], Account] = {}
        self._containers: dict[str, ContainerStats] = {}  # the last attribution's, by cgroup path
        self._latest = 0.0
        self._elapsed: deque[float] = deque(maxlen=64)  # the longest elapsed between two reads, per round
        self._logged: set[str] = set()

    # -- the sampler's side ------------------------------------------------------------------------
    def add_rounds(self, rounds: Sequence[ProcessRound]) -> None:
        """Integrate one sampler round (each device read once). A device the round did not read has
        its PIDs marked gone; PIDs gone are folded into their cgroup's exited sums (so the PID table
        holds the running ones, whatever the churn), which wait for their last energy share unless the
        energy counter stopped answering."""
        with self._lock:
            seen = set()
            for r in rounds:
                self._add(r)
                seen.add(r.uuid)
                self._latest = max(self._latest, r.at)
                for reason, n in r.discarded:
                    self._discard(reason, n)
            if rounds:
                self._elapsed.append(max(r.elapsed for r in rounds))
            if rounds and self.started is None:
                self.started = min(r.at for r in rounds)
            for uuid, pids in self._pids.items():
                dev = self._devices[uuid]
                no_split = uuid not in seen or dev.energy_joules is None or \
                    dev.rounds - dev.energy_round > 2 * ENERGY_EVERY  # no energy share will come
                for pid, entry in list(pids.items()):
                    if uuid not in seen:
                        entry.listed = False
                    if not entry.listed:
                        self._retire(uuid, entry)
                        del pids[pid]
                if no_split:
                    for (u, _), exited in self._exited.items():
                        if u == uuid:
                            exited.window_sm = 0.0
            alive: dict[str, bool] = {}  # one look per container, however many GPUs it holds
            for (cgroup, _), account in self._accounts.items():
                if account.allocated_now:
                    if cgroup not in alive:
                        alive[cgroup] = self.host.alive(cgroup)
                    if not alive[cgroup]:
                        account.close(self._latest)  # the container ended: its allocation ends with it

    def _discard(self, reason: str, n: int = 1) -> None:
        self.discarded[reason] += n
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("GPU accounting: readings left out or not attributed (%s); counted in "
                        "accelstats_accounting_discarded_total", reason)

    def _retire(self, uuid: str, entry: PidSums) -> None:
        """Fold an exited PID into its cgroup's exited sums (past :data:`EXITED_KEPT` cgroups without a
        collection, into one bucket of the device whose sums go unattributed, counted)."""
        key = (uuid, entry.cgroup)
        if key not in self._exited and len(self._exited) >= EXITED_KEPT:
            self._discard("ledger_full")
            key = (uuid, None)
        self._exited.setdefault(key, PidSums(cgroup=key[1], listed=False)).fold(entry)

    def _lookup(self, pid: int, entry: PidSums | None = None) -> str | None:
        cgroup = self.host.cgroup_of(pid)
        if cgroup is None and entry is not None and entry.lookups >= CGROUP_LOOKUPS:
            self._discard("cgroup_unknown")
        return cgroup

    def _add(self, r: ProcessRound) -> None:
        dev = self._devices.setdefault(r.uuid, DeviceSums())
        dev.rounds += 1
        pids = self._pids.setdefault(r.uuid, {})
        # no list answered (r.memory None): what runs is unknown, the last reading holds
        listed = dict(r.memory) if r.memory is not None else {p: e.used_now for p, e in pids.items() if e.listed}
        # every entry here was listed by the previous round (add_rounds retires the others, so a PID
        # the kernel reuses after an exit starts a new entry, with its own cgroup)
        for pid, entry in pids.items():
            if r.elapsed > 0 and entry.used_now is not None:
                entry.memory += entry.used_now * r.elapsed
            now_listed = pid in listed
            entry.listed, entry.used_now = now_listed, listed.get(pid)
            if now_listed and entry.cgroup is None and entry.lookups < CGROUP_LOOKUPS:
                entry.lookups += 1
                entry.cgroup = self._lookup(pid, entry)
        for pid, used in listed.items():
            if pid not in pids:
                pids[pid] = PidSums(cgroup=self._lookup(pid), used_now=used)
        if r.sm is None:
            dev.window_unknown = dev.window_unknown or r.elapsed > 0
        else:
            dev.has_sm = True
            for pid, seconds in r.sm:
                sampled = pids.get(pid)
                if sampled is None:  # sampled, but not in this read's lists (it just exited)
                    sampled = pids[pid] = PidSums(cgroup=self._lookup(pid), listed=False)
                entry = sampled
                entry.sm += seconds
                entry.window_sm += seconds
            for pid, begin, end in r.busy:
                if pid in pids:
                    pids[pid].mark_busy(begin, end)
        if r.energy_joules is not None:
            self._split_energy(r.uuid, dev, r.at, r.energy_joules)

    def _split_energy(self, uuid: str, dev: DeviceSums, at: float, joules: float) -> None:
        """Split the energy delta since the previous reading over the PIDs by SM-busy seconds."""
        previous, previous_at = dev.energy_joules, dev.energy_at
        dev.energy_joules, dev.energy_at, dev.energy_round = joules, at, dev.rounds
        entries = [*self._pids.get(uuid, {}).values(), *(e for (u, _), e in self._exited.items() if u == uuid)]
        window = max(0.0, at - previous_at) if previous_at is not None else 0.0
        usable = previous is not None and joules >= previous  # else the first reading, or the counter restarted
        if usable and previous is not None and joules - previous > MAX_WATTS * window + 1.0:
            self._discard("energy_jump")
            usable = False
        if usable and previous is not None:
            delta = joules - previous
            dev.split_energy += delta
            if dev.window_unknown:
                dev.unattributed_energy += delta
            else:
                denominator = max(window, sum(e.window_sm for e in entries))
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

    @property
    def pids_held(self) -> int:
        """PID entries and exited-cgroup sums held (tests and benchmarks: bounded by running PIDs)."""
        with self._lock:
            return sum(len(p) for p in self._pids.values()) + len(self._exited)

    # -- the collection's side ---------------------------------------------------------------------
    def settle(self, containers: Iterable[ContainerStats] | None, index_of: Callable[[str], str]) -> AccountingView:
        """Hand every PID's growth since the last settlement to its container, update allocations from
        this collection's ``containers`` (None: the attribution failed; the last one's containers are
        used and no allocation changes), and return the view to publish, its accounts labelled with
        :func:`~accelstats.attribution.labels.identity_labels` (``index_of``: UUID -> ``gpu`` label).
        Accounts published as ended by the previous settlement are dropped first."""
        with self._lock:
            if self.started is None:
                return AccountingView()
            as_of = self._latest
            if containers is not None:
                self._containers = {c.cgroup: c for c in containers}
            by_cgroup = self._containers
            named: dict[str, tuple[str, ...]] = {}

            def once(container: ContainerStats) -> tuple[str, ...]:
                got = named.get(container.cgroup)
                if got is None:
                    got = named[container.cgroup] = identity_labels(container)
                return got

            self._accounts = {k: a for k, a in self._accounts.items() if not a.ended}
            self._kept, self._evictable = len(self._accounts), None
            # known before any account is made, so that none whose cgroup runs a job again this round ends
            self._owners = {o for _, entry, _ in self._held() if (o := self._owner(entry, by_cgroup)) is not None}
            if containers is not None:
                self._allocate(by_cgroup, once, index_of, as_of)
            live = self._settle_pids(by_cgroup, once, index_of)
            for (cgroup, uuid), account in self._accounts.items():
                if not account.has_sm:
                    dev = self._devices.get(uuid)
                    account.has_sm = dev is not None and dev.has_sm
                if account.ended:
                    continue  # evicted by this settlement: its final totals are published now
                # gone from the attribution, no PID of it held, its allocation closed: idle and empty
                if cgroup in by_cgroup or cgroup in live or account.allocated_now:
                    account.idle_since = None
                elif not self.host.alive(cgroup):
                    account.ended = True  # its cgroup removed: the container ended
                else:
                    if account.idle_since is None:
                        account.idle_since = as_of
                    account.ended = as_of - account.idle_since >= self.idle_kept
            for account in self._accounts.values():
                if account.ended and account.was_allocated:
                    account.count_busy([], as_of)  # its final totals: every span counted
            return AccountingView(
                accounts=tuple(published(a, as_of) for a in self._accounts.values()),
                devices=tuple((u, d.idle_energy, d.unattributed_energy) for u, d in sorted(self._devices.items())
                              if d.energy_joules is not None),  # GPUs whose energy counter answered
                energy_read=tuple((u, d.energy_joules) for u, d in sorted(self._devices.items())
                                  if d.energy_joules is not None),
                discarded=tuple(sorted(self.discarded.items())), as_of=as_of)

    def _account(self, cgroup: str, uuid: str, ident: tuple[str, ...] | None,
                 index_of: Callable[[str], str]) -> Account | None:
        """The account of (``cgroup``, ``uuid``), made on first use; ``ident``: the container's identity
        labels (None: a cgroup no collection found, labelled by its path alone). A new one past
        :attr:`max_accounts` ends the longest-idle account first (:meth:`_evict`); None when none is
        idle (the caller leaves the readings unattributed). Both counted as ``accounts_full``."""
        account = self._accounts.get((cgroup, uuid))
        if account is None:
            if self._kept >= self.max_accounts:
                self._discard("accounts_full")
                if not self._evict():
                    return None
            self._kept += 1
            ident = ident or (cgroup, "", "", "", "", "")
            account = self._accounts[(cgroup, uuid)] = Account(labels=(*ident, uuid, index_of(uuid)), ident=ident)
        elif ident is not None and ident is not account.ident and ident != account.ident:
            account.ident = ident  # names may be read later than the cgroup
            account.labels = (*ident, uuid, index_of(uuid))
        if not account.has_sm:
            dev = self._devices.get(uuid)
            account.has_sm = dev is not None and dev.has_sm
        return account

    def _evict(self) -> bool:
        """End the account idle and empty the longest (by ``idle_since``, as of the last settlement, not
        listed by this one's attribution and with no PID or exited sums held this round: a job run again
        in its cgroup keeps it); its final totals are published by this settlement. False when none is idle."""
        if self._evictable is None:
            idle = [(a.idle_since, key) for key, a in self._accounts.items() if a.idle_since is not None
                    and not a.ended and key[0] not in self._containers and key[0] not in self._owners]
            self._evictable = [key for _, key in sorted(idle, reverse=True)]
        while self._evictable:
            account = self._accounts.get(self._evictable.pop())
            if account is not None and not account.ended and account.idle_since is not None:
                account.ended = True
                self._kept -= 1
                return True
        return False

    def _allocate(self, by_cgroup: dict[str, ContainerStats], labels: _Labels, index_of: Callable[[str], str],
                  as_of: float) -> None:
        granted = {(c.cgroup, a.id) for c in by_cgroup.values() for a in c.accelerators
                   if a.attribution == "devices_cgroup"}
        for key, account in self._accounts.items():
            if key in granted or not account.allocated_now:
                continue
            if key[0] not in by_cgroup and not self.host.alive(key[0]):
                continue  # the container ended: the sampler's next round closes it when it sees the cgroup gone
            account.close(as_of)  # the grant went (docker update), seen by this collection
        for cgroup, uuid in sorted(granted):
            known = self._accounts.get((cgroup, uuid))
            if known is not None and known.allocated_now:
                continue
            if not self.host.alive(cgroup):
                continue  # its cgroup is gone already: this attribution raced the container's end
            made = self._account(cgroup, uuid, labels(by_cgroup[cgroup]), index_of)
            if made is None:
                continue  # no room (counted): this grant is not accounted
            assert self.started is not None
            began = self.host.started_at(cgroup) if not made.was_allocated else None
            # back-dated to the container's oldest process (a grant is set when the container is
            # created), never before accounting started; without a start time, from the latest round
            made.open(max(self.started, began if began is not None else as_of))

    def _held(self) -> list[tuple[str, PidSums, bool]]:
        """(device UUID, sums, still held) of each running PID and each exited cgroup's sums; still held:
        running, or waiting for its last energy share."""
        held = [(uuid, entry, True) for uuid, pids in self._pids.items() for entry in pids.values()]
        return held + [(uuid, entry, entry.window_sm > 0) for (uuid, _), entry in self._exited.items()]

    @staticmethod
    def _owner(entry: PidSums, by_cgroup: dict[str, ContainerStats]) -> str | None:
        """The container cgroup ``entry``'s readings go to; None: no container's (unattributed)."""
        owner = container_of(entry.cgroup, by_cgroup)
        if owner is None and entry.cgroup is not None and unseen_container(entry.cgroup):
            owner = entry.cgroup  # a container no collection saw (it ran between two scrapes)
        return owner

    def _settle_pids(self, by_cgroup: dict[str, ContainerStats], labels: _Labels,
                     index_of: Callable[[str], str]) -> set[str]:
        """Move each PID's (and each exited cgroup's) growth to its account; return the owners of PIDs
        still held (running, or waiting for their last energy share)."""
        busy: dict[tuple[str, str], Spans] = {}
        live: set[str] = set()
        for uuid, entry, still_held in self._held():
            owner = self._owner(entry, by_cgroup)
            sm, memory, energy, spans = entry.take()
            if owner is None:
                self._devices.setdefault(uuid, DeviceSums()).unattributed_energy += energy
                continue
            if still_held:
                live.add(owner)
            if (owner, uuid) not in self._accounts and not (sm or memory or energy or spans):
                continue  # nothing to say: no series for it (yet)
            container = by_cgroup.get(owner)
            account = self._account(owner, uuid, labels(container) if container is not None else None, index_of)
            if account is None:  # no room (counted): as a PID no container holds
                self._devices.setdefault(uuid, DeviceSums()).unattributed_energy += energy
                continue
            account.sm_seconds += sm
            account.memory_byte_seconds += memory
            account.energy_joules += energy
            if spans:
                busy.setdefault((owner, uuid), []).extend(spans)
        self._exited = {k: e for k, e in self._exited.items() if e.window_sm > 0}  # the rest is handed over
        horizon = self._latest - self.span_lag()
        for owned, account in self._accounts.items():  # the union of its PIDs' spans, within its allocations
            spans = busy.get(owned, [])
            if account.was_allocated:
                account.count_busy(spans, self._latest if account.ended else horizon)
            elif spans:  # kept for an allocation back-dated over them (bounded)
                account.busy_before = merge_spans(account.busy_before + spans)[-BUSY_SPANS_KEPT:]
        return live

    def span_lag(self) -> float:
        """Seconds busy spans may reach the ledger after the time they cover: a sample's period ends up to
        a driver period before the read that answers it, and a window that may hold idle time waits for
        the PID's next one (at most two rounds). Idle seconds are published up to this long ago."""
        if self.lag is not None:
            return self.lag
        return DRIVER_PERIOD_MAX + 2.0 * max(self._elapsed, default=0.0) + 0.5
