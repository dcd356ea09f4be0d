"""The records of the accounting ledger: per-PID sums, per-device energy state, per-(container,
device) accounts, and what a collection publishes. Plain data and pure helpers; the ledger
(:mod:`accelstats.accounting.ledger`) owns and locks them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from accelstats.cgroups import identify, is_host_cgroup

BUSY_SPANS_KEPT = 4096
"""Spans of SM activity one PID (or one cgroup's exited PIDs) keeps until a collection counts them
(contiguous busy rounds make one span). Beyond that, without a collection, the oldest are dropped
(their time then counts as idle)."""
INTERVALS_KEPT = 16
"""Allocations an account keeps as intervals (grants that come and go); older ones are summed."""

Spans = list[tuple[float, float]]
"""Monotonic ``(begin, end)`` spans with SM activity, in time order (contiguous rounds merged)."""


@dataclass
class PidSums:
    """One PID on one device (or, in the ledger's exited table, every exited PID of one cgroup): what it
    accumulated since the last collection (SM-busy seconds, byte-seconds, joules), and what the sampler
    needs between rounds. ``cgroup``: from ``/proc/<pid>/cgroup`` when first listed (None: unreadable,
    ``lookups`` times tried)."""

    cgroup: str | None
    sm: float = 0.0
    memory: float = 0.0
    energy: float = 0.0
    used_now: int | None = None  # usedGpuMemory of the last read, held until the next
    window_sm: float = 0.0  # SM-busy seconds in the GPU's current energy window
    listed: bool = True
    lookups: int = 1
    busy: Spans = field(default_factory=list)

    def mark_busy(self, begin: float, end: float) -> None:
        """Remember ``(begin, end]`` with SM activity: it extends the last span when it starts where
        that one ends (a PID busy round after round keeps one span); bounded by :data:`BUSY_SPANS_KEPT`."""
        if self.busy and begin <= self.busy[-1][1] + 1e-9 and end >= self.busy[-1][0]:
            first, last = self.busy[-1]
            self.busy[-1] = (min(first, begin), max(last, end))
            return
        self.busy.append((begin, end))
        if len(self.busy) > BUSY_SPANS_KEPT:
            del self.busy[0]

    def fold(self, other: PidSums) -> None:
        """Add ``other``'s unsettled sums, busy spans and SM-seconds of the open energy window to these
        (an exited PID into its cgroup's: the window's energy is still split to it)."""
        self.sm += other.sm
        self.memory += other.memory
        self.energy += other.energy
        self.window_sm += other.window_sm
        self.busy = merge_spans(self.busy + other.busy)[-BUSY_SPANS_KEPT:]

    def take(self) -> tuple[float, float, float, Spans]:
        """The unsettled sums and busy spans, zeroed here."""
        out = (self.sm, self.memory, self.energy, self.busy)
        self.sm = self.memory = self.energy = 0.0
        self.busy = []
        return out


def merge_spans(spans: Spans) -> Spans:
    """``spans`` sorted and merged where they overlap or touch: their union."""
    out: Spans = []
    for begin, end in sorted(spans):
        if out and begin <= out[-1][1] + 1e-9:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((begin, end))
    return out


@dataclass
class DeviceSums:
    """One device: its energy window and the energy that belongs to no container."""

    energy_at: float | None = None  # monotonic time of the last energy reading
    energy_joules: float | None = None  # that reading
    window_unknown: bool = False  # a round in this window had no per-process utilisation
    idle_energy: float = 0.0
    unattributed_energy: float = 0.0
    split_energy: float = 0.0  # every delta split so far (conservation checks)
    rounds: int = 0
    energy_round: int = 0  # the round of the last energy reading
    has_sm: bool = False  # a round answered per-process utilisation


@dataclass
class Account:
    """One (container, device): the published counters (seconds, byte-seconds, joules).

    ``labels``: the container's identity labels (``id``, ``name``, ``image``, ``container``, ``pod``,
    ``namespace``) and ``uuid``, ``gpu`` (NVML index); ``intervals``: its recent allocations as monotonic
    ``(start, end)`` (end None: allocated now), older ones summed in ``closed_seconds``; ``ended``: the
    container is gone (or idle and empty past the ledger's retention, or evicted past its cap), and
    this collection publishes its final totals; ``idle_since``: when a settlement first found it idle
    and empty (see :class:`accelstats.accounting.ledger.Ledger`); ``has_sm``: its device reports
    per-process utilisation, so SM-seconds, energy and idle seconds are known."""

    labels: tuple[str, ...]
    ident: tuple[str, ...] = ()  # the identity part of labels, as the attribution last gave it
    sm_seconds: float = 0.0
    memory_byte_seconds: float = 0.0
    energy_joules: float = 0.0
    busy_seconds: float = 0.0  # allocated time in rounds with SM activity
    intervals: list[tuple[float, float | None]] = field(default_factory=list)
    closed_seconds: float = 0.0
    ended: bool = False
    has_sm: bool = False
    busy_before: Spans = field(default_factory=list)  # busy before any allocation: counted by the first
    recent: Spans = field(default_factory=list)  # busy after ``counted_to``: counted once the horizon passes them
    counted_to: float | None = None  # the horizon busy time is counted up to (see :meth:`count_busy`)
    idle_since: float | None = None  # as_of of the first settlement that found it idle and empty, until not

    @property
    def allocated_now(self) -> bool:
        """True while an allocation is open."""
        return bool(self.intervals) and self.intervals[-1][1] is None

    @property
    def was_allocated(self) -> bool:
        """True once a devices-cgroup grant was seen."""
        return bool(self.intervals) or self.closed_seconds > 0

    def allocated(self, now: float) -> float:
        """Allocated seconds up to ``now`` (monotonic)."""
        intervals = self.intervals
        if len(intervals) == 1:  # the usual case (one allocation, still open), without a generator
            start, end = intervals[0]
            return self.closed_seconds + max(0.0, (now if end is None else min(end, now)) - start)
        return self.closed_seconds + sum(max(0.0, (now if end is None else min(end, now)) - start)
                                         for start, end in intervals)

    def overlap(self, begin: float, end: float) -> float:
        """Seconds of ``(begin, end]`` in a kept allocation interval."""
        return sum(max(0.0, min(end, e if e is not None else end) - max(begin, s)) for s, e in self.intervals)

    def open(self, start: float) -> None:
        """Start an allocation at ``start`` (busy spans seen before the first one count in it, so a
        back-dated allocation is busy where its processes were); intervals beyond
        :data:`INTERVALS_KEPT` are summed."""
        self.intervals.append((start, None))
        if self.busy_before:
            self.busy_seconds += sum(self.overlap(b, e) for b, e in merge_spans(self.busy_before))
            self.busy_before = []
        while len(self.intervals) > INTERVALS_KEPT:
            s, e = self.intervals.pop(0)
            self.closed_seconds += max(0.0, (e if e is not None else s) - s)

    def count_busy(self, spans: Spans, horizon: float) -> None:
        """Count ``spans`` (with those kept from earlier collections, as one union) as busy up to
        ``horizon``, within the allocations; keep what lies beyond. Busy spans come from driver samples
        that reach the exporter up to a few seconds after the time they cover, so idle seconds are
        published up to a horizon that late spans no longer reach (they only grow: a counter); a span
        that arrives for time before the horizon already counted is clipped to it."""
        before = self.counted_to
        horizon = horizon if before is None else max(before, horizon)
        kept: Spans = []
        for begin, end in merge_spans(self.recent + spans):
            if before is not None:
                begin = max(begin, before)
            if begin < horizon:
                self.busy_seconds += self.overlap(begin, min(end, horizon))
            if end > horizon:
                kept.append((max(begin, horizon), end))
        self.recent = kept[-BUSY_SPANS_KEPT:]
        self.counted_to = horizon

    def close(self, at: float) -> None:
        """End the open allocation at ``at`` (nothing when none is open)."""
        if self.allocated_now:
            start = self.intervals[-1][0]
            self.intervals[-1] = (start, max(start, at))


class Published(NamedTuple):
    """One (container, device) as a collection publishes it (a copy: the sampler goes on meanwhile).
    ``allocated_seconds`` up to the view's ``as_of``; ``was_allocated``: a devices-cgroup grant was
    seen (else allocated and idle seconds are absent); ``has_sm``: the device reports per-process
    utilisation (else SM-seconds, energy and idle seconds are absent); ``busy_seconds`` and
    ``idle_seconds``: allocated time with and without SM activity up to the account's busy horizon
    (:meth:`Account.count_busy`), which trails ``as_of`` by a few seconds."""

    labels: tuple[str, ...]
    sm_seconds: float
    memory_byte_seconds: float
    energy_joules: float
    allocated_seconds: float
    busy_seconds: float
    idle_seconds: float
    was_allocated: bool
    has_sm: bool
    ended: bool


@dataclass(frozen=True)
class AccountingView:
    """What one collection publishes: per (container, device) :class:`Published`; per device UUID
    ``(idle joules, unattributed joules)``; ``energy_read``: per device UUID the energy counter reading
    (joules) the split last used, published as the GPU's energy counter so that both add up on every
    scrape; ``discarded``: (reason, count) of readings left out;
    ``as_of``: monotonic time of the last round."""

    accounts: tuple[Published, ...] = ()
    devices: tuple[tuple[str, float, float], ...] = ()
    energy_read: tuple[tuple[str, float], ...] = ()
    discarded: tuple[tuple[str, int], ...] = ()
    as_of: float = 0.0


def published(a: Account, as_of: float) -> Published:
    """What ``a`` publishes, allocated seconds up to ``as_of``, idle seconds up to its busy horizon."""
    allocated = a.allocated(as_of)
    horizon = min(as_of, a.counted_to) if a.counted_to is not None else as_of
    until_horizon = allocated if horizon >= as_of else a.allocated(horizon)
    return Published(a.labels, a.sm_seconds, a.memory_byte_seconds, a.energy_joules, allocated,
                     min(a.busy_seconds, until_horizon), max(0.0, until_horizon - a.busy_seconds), a.was_allocated,
                     a.has_sm, a.ended)


def container_of(cgroup: str | None, containers: Mapping[str, object]) -> str | None:
    """The cgroup of ``containers`` (keyed by cgroup path) that is ``cgroup`` or holds it, else None;
    podman/crun keep the payload in a ``container`` child, which counts for its parent too."""
    path = cgroup
    while path:
        if path in containers:
            return path
        if path + "/container" in containers:
            return path + "/container"
        if path == "/":
            return None
        path = path.rsplit("/", 1)[0] or "/"
    return None


def unseen_container(cgroup: str) -> bool:
    """True when ``cgroup`` is a container's (a path rule or the runtime's naming recognises it, or it
    is no host cgroup): a PID there whose container no collection found still counts as a container's
    (one that ran between two scrapes). ``identify`` first: a docker or CRI-O scope under
    ``system.slice`` is a container, whatever ``is_host_cgroup`` says of transient scopes."""
    return identify(cgroup) is not None or not is_host_cgroup(cgroup)
