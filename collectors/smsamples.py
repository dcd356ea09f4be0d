"""SM-busy seconds and busy spans per process from ``nvmlDeviceGetProcessUtilization``, whatever
the accounting interval and whichever of the two answer shapes the driver gives.

NVML (API reference, ``nvmlDeviceGetProcessUtilization``): "one utilization sample structure is
returned per process running, that had some non-zero utilization during the last sample period",
with "the CPU timestamp at which the samples were recorded" (µs of the wall clock); "set
lastSeenTimeStamp to a timeStamp retrieved from a previous query to read utilization since the
previous query"; NOT_FOUND when no process was busy since then. Two shapes fit those words:

* **mean** (the documented one, and what public reports show: one sample per PID, each PID with its
  own timestamp lagging the read by up to seconds, NVIDIA/go-nvml#51): ``smUtil`` is the mean of
  the driver's samples of that PID since ``lastSeenTimeStamp``, idle ones included, and
  ``timeStamp`` its newest (busy) sample. The sample covers ``(lastSeenTimeStamp, timeStamp]``.
* **every**: every busy driver sample since ``lastSeenTimeStamp``, several per PID, each covering
  one driver sampling period (1/6 s to 1 s, nvidia-smi(1)) ending at its timestamp.

The rule (:class:`SmSamples`, stated with its error bounds in docs/accounting.md):

* the cursor sent as ``lastSeenTimeStamp`` is the newest timestamp answered so far; a NOT_FOUND
  answer leaves it (under the mean shape, the next mean then counts the idle samples in its
  window, so ``smUtil x (timeStamp - cursor)`` is the exact integral), but it is never more than
  :data:`CURSOR_WINDOW` seconds behind the read (the driver keeps a bounded sample buffer);
* mean shape: a PID's sample gives ``smUtil/100 x (timeStamp - cursor)`` SM-seconds; every shape:
  each sample gives ``smUtil/100 x`` its period (the time since the PID's previous sample, at most
  the driver period learnt as the smallest spacing of one PID's samples);
* the shape is learnt per device: an answer that lists a PID twice is the every shape; the first
  answer after a stretch the reads proved idle (a NOT_FOUND read at least
  :data:`DRIVER_PERIOD_MAX` after the cursor) is asked again from just before its sample: the
  every shape answers that same sample again, the mean shape a different mean (one call, once per
  device);
* busy spans (for idle seconds) are the covered periods; where a window may hold idle time before
  the process's work (after a proven idle stretch, or a PID not sampled in the previous answer),
  the busy part is placed at the window's end, as long as its SM-seconds take at full use.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

CURSOR_WINDOW = 2.0
"""Seconds (plus two read intervals) the cursor may lag the read. NVML's mean covers only the samples its
buffer still holds (seen: 4096 samples; the replay keeps 20 s), and its whole-percent rounding errs by up
to 0.5 % of the window, so a window spanning an idle stretch is kept short; two intervals more leave room
to see a stretch proven idle (:meth:`SmSamples.not_found`). Moving the cursor off the driver's sampling
grid costs at most one driver period x the next sample's (diluted) mean (docs/accounting.md)."""
DRIVER_PERIOD_MAX = 1.0
"""Longest driver sampling period (nvidia-smi(1): "between 1 second and 1/6 second")."""
DRIVER_PERIOD_DEFAULT = 1.0 / 6.0
"""Driver period assumed for the every shape until two samples of one PID show it."""
FUTURE_SLACK_US = 600_000_000
"""A sample stamped more than this (10 min) after the wall clock is left out: NVML's CPU timestamps
are the wall clock's µs on the drivers seen, and one absurd stamp must not stall every later read."""
VISIBILITY_MARGIN = 0.1
"""Seconds a driver sample may show up after its timestamp (not measured yet: docs/gpu-check.md)."""
PROBE_IDLE = 2 * DRIVER_PERIOD_MAX
"""Seconds of proven idleness (driver period unknown) before the first answer after it is asked again: the
window then holds at least one idle driver sample whatever the period (and a sample shown up to a period
late), so the mean shape's answer is diluted and cannot equal the last sample's."""
PROBE_MARGIN = 0.5
"""With the driver period known: seconds beyond one period of proven idleness before asking again (a
sample shown up to this late still leaves an idle sample in the window)."""
MIN_PERIOD_US = 10_000
"""Spacings below this (10 ms) are not a driver period (duplicates, clock jitter)."""


@dataclass
class SmReading:
    """One answer integrated: ``seconds`` SM-busy seconds per PID; ``spans`` per PID, wall-clock
    seconds ``(begin, end]`` with SM activity; ``future`` samples left out as stamped after the wall
    clock (:data:`FUTURE_SLACK_US`)."""

    seconds: dict[int, float] = field(default_factory=dict)
    spans: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    future: int = 0


Query = Callable[[int], "list[Any] | None"]
"""``nvmlDeviceGetProcessUtilization`` from a ``lastSeenTimeStamp`` (µs): the samples, [] for NOT_FOUND,
None when the call failed."""


class SmSamples:
    """What persists between reads of one GPU: the cursor, the last read that found nothing busy, the
    answer shape (None: not known yet, read as the mean shape) and the driver period once seen.

    Use: ``cursor = s.ask(now_us)``; call NVML with it; then :meth:`not_found` (NOT_FOUND),
    :meth:`answer` (samples) or nothing (the call failed: the cursor stays)."""

    def __init__(self) -> None:
        self.cursor_us = 0
        self.asked_us: int | None = None  # the previous read's wall clock (µs)
        self.idle_read_us: int | None = None  # the newest NOT_FOUND read after the cursor
        self.shape: str | None = None  # "mean" | "every"
        self.period_us: int | None = None  # the driver period as seen (:meth:`_learn_period`)
        self.period_hint_us: int | None = None  # the device's GPU-utilisation sample spacing (:meth:`hint_period`)
        self.spacings: deque[int] = deque(maxlen=64)  # recent spacings of one PID's samples (µs)
        self.last_us: dict[int, int] = {}  # PID -> its newest sample's timestamp (µs)
        self.sampled_before: set[int] = set()  # PIDs in the previous answer
        # PID -> (timestamp µs, window start µs, SM-seconds) of a window that may hold idle time before the
        # work: its busy span waits for the PID's next window, whose level says how long the work took
        self.pending: dict[int, tuple[int, int, float]] = {}

    def ask(self, now_us: int) -> int:
        """The ``lastSeenTimeStamp`` for a read at wall-clock ``now_us``: the cursor, moved up to
        :data:`CURSOR_WINDOW` plus two read intervals before the read when it lags more."""
        interval = max(0, now_us - self.asked_us) if self.asked_us is not None else 0
        self.asked_us = now_us
        self.cursor_us = max(self.cursor_us, now_us - int(CURSOR_WINDOW * 1e6) - 2 * min(interval, 60_000_000))
        return self.cursor_us

    def hint_period(self, stamps: Iterable[int]) -> None:
        """Take the median spacing of the device's own utilisation samples (``nvmlDeviceGetSamples``
        timestamps, µs) as the driver period until a process's samples show theirs."""
        ordered = sorted(int(t) for t in stamps)
        spacings = [b - a for a, b in itertools.pairwise(ordered)
                    if MIN_PERIOD_US <= b - a <= DRIVER_PERIOD_MAX * 1e6]
        if spacings:
            self.period_hint_us = int(statistics.median(spacings))

    def _known_period_us(self) -> int | None:
        return self.period_us if self.period_us is not None else self.period_hint_us

    def prime(self, now_us: int) -> None:
        """The device's first read answered NOT_FOUND at ``now_us``: accounting starts there (the driver
        may hold no samples before, e.g. right after it loaded)."""
        self.cursor_us, self.idle_read_us = now_us, None

    def not_found(self, now_us: int) -> SmReading:
        """NOT_FOUND at ``now_us``: no process was busy in ``(cursor, now_us]``. Once that proves an idle
        stretch, the spans still waiting for a level are placed at full use."""
        self.idle_read_us = now_us
        out = SmReading()
        if now_us - self.cursor_us >= self._idle_proof_us():
            for pid in list(self.pending):
                self._place(pid, 1.0, out)
        return out

    def restart(self) -> None:
        """Forget the cursor (the wall clock stepped back: NVML's timestamps restart below it)."""
        self.cursor_us, self.idle_read_us, self.asked_us = 0, None, None
        self.last_us.clear()
        self.sampled_before = set()
        self.pending.clear()  # their timestamps are of the clock before the step

    def answer(self, samples: Iterable[Any], now_us: int, *, prime: bool = False,
               query: Query | None = None) -> SmReading:
        """Integrate one answer (``.pid``, ``.timeStamp`` µs, ``.smUtil`` percent) read at wall-clock
        ``now_us`` with ``lastSeenTimeStamp`` = :attr:`cursor_us`. ``prime``: the device's first read,
        which only places the cursor. ``query``: asks NVML again (:data:`Query`), used once per device
        to learn the shape. smUtil above 100 (seen with zombie processes, nvtop #110) counts as 100;
        samples not newer than the cursor cover nothing."""
        out = SmReading()
        per_pid: dict[int, list[tuple[int, int]]] = {}
        for s in samples:
            ts = int(s.timeStamp)
            if ts > now_us + FUTURE_SLACK_US:
                out.future += 1
                continue
            if ts <= self.cursor_us:
                continue
            per_pid.setdefault(int(s.pid), []).append((ts, max(0, min(int(s.smUtil), 100))))
        if not per_pid:
            return out
        for stamped in per_pid.values():
            stamped.sort()
        self._learn_period(per_pid)
        cursor, idle_read = self.cursor_us, self.idle_read_us
        proven_idle = idle_read is not None and idle_read - cursor >= self._idle_proof_us()
        if self.shape is None and any(len(v) > 1 for v in per_pid.values()):
            self.shape = "every"
        if self.shape is None and idle_read is not None and proven_idle and not prime:
            # a mean since the cursor holds the idle samples before idle_read: it cannot stand for more busy
            # time than the rest of the window (plus the period the first busy sample covers)
            seen = (self._known_period_us() or DRIVER_PERIOD_MAX * 1e6) / 1e6
            room = (max(ts for v in per_pid.values() for ts, _ in v) - idle_read) / 1e6 + seen + VISIBILITY_MARGIN
            if any(v[-1][1] / 100.0 * (v[-1][0] - cursor) / 1e6 > 1.01 * room for v in per_pid.values()):
                self.shape = "every"
        known = self._known_period_us()
        probe_idle = known + PROBE_MARGIN * 1e6 if known is not None else PROBE_IDLE * 1e6
        if (self.shape is None and idle_read is not None and idle_read - cursor >= probe_idle
                and query is not None and not prime):
            self.shape = self._probe(per_pid, query)
        for pid in [p for p in self.pending if p not in per_pid]:  # its work ended within that window
            self._place(pid, 1.0, out)
        if not prime:
            for pid, stamped in per_pid.items():
                if self.shape == "every":
                    self._every(pid, stamped, out)
                else:
                    self._mean(pid, stamped[-1], proven_idle or pid not in self.sampled_before, out)
        for pid, stamped in per_pid.items():
            self.last_us[pid] = stamped[-1][0]
        self.cursor_us = max(self.cursor_us, *(v[-1][0] for v in per_pid.values()))
        self.idle_read_us = None
        self.sampled_before = set(per_pid)
        if len(self.last_us) > 4 * len(per_pid) + 64:  # PIDs long gone
            self.last_us = {p: t for p, t in self.last_us.items() if p in per_pid}
        return out

    def _learn_period(self, per_pid: dict[int, list[tuple[int, int]]]) -> None:
        """The driver period: the median of the recent spacings between two samples of one PID (in one
        answer, or its last one before and its first now) that lie within 1.5 x the smallest (later ones
        skip driver samples; the median, not the smallest, so that timestamp jitter does not bias it).
        Spacings above 1.5 x :data:`DRIVER_PERIOD_MAX` are read intervals or pauses, not periods."""
        for pid, stamped in per_pid.items():
            before = self.last_us.get(pid)
            stamps = ([before] if before is not None else []) + [ts for ts, _ in stamped]
            self.spacings.extend(b - a for a, b in itertools.pairwise(stamps)
                                 if MIN_PERIOD_US <= b - a <= 1.5 * DRIVER_PERIOD_MAX * 1e6)
        if self.spacings:
            least = min(self.spacings)
            self.period_us = int(statistics.median(d for d in self.spacings if d <= 1.5 * least))

    def _idle_proof_us(self) -> float:
        """µs after the cursor from which a NOT_FOUND read proves an idle stretch: 1.5 driver periods (the
        longest nvidia-smi(1) allows until one is seen) plus :data:`VISIBILITY_MARGIN`, so that a read
        between two samples of a busy process, or a sample shown late, is not taken for idleness."""
        period = self._known_period_us() or DRIVER_PERIOD_MAX * 1e6
        return 1.5 * period + VISIBILITY_MARGIN * 1e6

    def _probe(self, per_pid: dict[int, list[tuple[int, int]]], query: Query) -> str | None:
        """Ask again from just before one PID's sample: the every shape answers that sample again (same
        timestamp, same value); the mean shape a mean of the samples from there on, which differs from
        a mean diluted by the proven idle stretch. None when the second answer failed."""
        pid, (ts, util) = next(((p, v[-1]) for p, v in per_pid.items() if v[-1][1] > 0),
                               next((p, v[-1]) for p, v in per_pid.items()))
        again = query(ts - 1)
        if again is None:
            return None
        same = any(int(s.pid) == pid and int(s.timeStamp) == ts and max(0, min(int(s.smUtil), 100)) == util
                   for s in again)
        return "every" if same else "mean"

    def _mean(self, pid: int, sample: tuple[int, int], may_hold_idle: bool, out: SmReading) -> None:
        ts, util = sample
        window = (ts - self.cursor_us) / 1e6
        seconds = util / 100.0 * window
        out.seconds[pid] = out.seconds.get(pid, 0.0) + seconds
        if pid in self.pending:  # the level of this window says how long the waiting window's work took
            self._place(pid, util / 100.0 if not may_hold_idle else 1.0, out)
        if seconds <= 0:
            return
        if may_hold_idle:
            self.pending[pid] = (ts, self.cursor_us, seconds)
        else:
            out.spans.setdefault(pid, []).append((self.cursor_us / 1e6, ts / 1e6))

    def exited(self, listed: Iterable[int], out: SmReading) -> None:
        """Place, into ``out``, the waiting windows of PIDs no longer in the process lists (``listed``):
        their work ended there, at full use (no next window will tell its level)."""
        gone = set(self.pending) - set(listed)
        for pid in gone:
            self._place(pid, 1.0, out)

    def _place(self, pid: int, level: float, out: SmReading) -> None:
        """The waiting window of ``pid``: its SM-seconds at ``level`` (a fraction; the next window's, or 1
        when none tells), placed at the window's end."""
        ts, start, seconds = self.pending.pop(pid)
        busy = min((ts - start) / 1e6, seconds / level if level > 0 else seconds)
        out.spans.setdefault(pid, []).append((ts / 1e6 - busy, ts / 1e6))

    def _period(self) -> float:
        """The driver period in seconds: as seen, else the device's hint, else :data:`DRIVER_PERIOD_DEFAULT`."""
        known = self._known_period_us()
        return known / 1e6 if known is not None else DRIVER_PERIOD_DEFAULT

    def _every(self, pid: int, stamped: list[tuple[int, int]], out: SmReading) -> None:
        period = int(self._period() * 1e6)
        previous = self.last_us.get(pid)
        total = 0.0
        for ts, util in stamped:
            # the time since its previous sample when that was the driver's previous one (up to 1.5
            # periods: jitter), else one period (the first after a pause)
            covers = period if previous is None or ts - previous > 1.5 * period else ts - previous
            previous = ts
            if covers <= 0:
                continue
            total += util / 100.0 * covers / 1e6
            if util > 0:
                out.spans.setdefault(pid, []).append(((ts - covers) / 1e6, ts / 1e6))
        out.seconds[pid] = out.seconds.get(pid, 0.0) + total
