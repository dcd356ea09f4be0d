"""Background rounds of NVML calls, off the scrape path: the timer and worker both samplers share.

:class:`BackgroundRounds` runs :meth:`BackgroundRounds._round` once per ``interval`` seconds on a
:class:`~collectors.deadline.DeadlineWorker` of its own (NVML is thread-safe: "it is safe to make
simultaneous NVML calls from multiple threads", NVML API reference), never on the backend's scrape
worker, so a round cannot delay a scrape's pass. A timer thread starts one round per interval and
never waits for it; a round still running when the next is due is not doubled, so a hang (a GPU fell
off the bus) costs one thread for as long as it lasts. A round still running is only said to be
late (how long it has run: a loaded CPU does that too), at info, once per episode and at most once
per :data:`LATE_LOG_EVERY_S` (the next line says how many episodes were left out); it is called a
hang, at warning, once per episode, only after it has run ``hang_after`` seconds (:data:`HANG_AFTER_S`).
Skipped rounds are counted in :attr:`BackgroundRounds.skipped` (no metric family exports sampler
health yet).

Subclasses: :class:`collectors.pcie.PcieSampler` (PCIe throughput, ~21 ms per call) and
:class:`collectors.procsampler.ProcessSampler` (per-process accounting reads).
"""

from __future__ import annotations

import logging
import threading
import time

from collectors.deadline import DeadlineWorker

log = logging.getLogger(__name__)

#: Seconds a round may run before it is said to hang. A round is a few NVML calls per GPU (PCIe:
#: ~21 ms a call; accounting: ~3 ms a call, collectors/procsampler.py); ten seconds is far past any
#: round measured, loaded CPU or not, and far short of a GPU that fell off the bus.
HANG_AFTER_S = 10.0

#: Seconds between two "still running" info lines at least: sustained load can make every few rounds
#: a new episode; one line a minute says it, with the count of the episodes left out since the last.
LATE_LOG_EVERY_S = 60.0


class BackgroundRounds:
    """A timer thread that starts :meth:`_round` every ``interval`` seconds (> 0) on its own worker.

    ``what`` names the rounds in thread names and log lines; ``first_wait``: seconds :meth:`start`
    waits for the first round; ``hang_after``: seconds a round runs before the log calls it a hang
    (before that it is "still running after N s"); ``late_log_every``: seconds between two "still
    running" lines at least. :attr:`skipped` counts the rounds that were due while the previous one
    still ran (not started). Lifecycle: :meth:`start` → :meth:`stop` (:meth:`resume` may follow)
    → :meth:`close`. Raises ValueError for an interval that is not > 0.
    """

    def __init__(self, what: str, interval: float, *, first_wait: float = 0.5,
                 hang_after: float = HANG_AFTER_S, late_log_every: float = LATE_LOG_EVERY_S) -> None:
        if not interval > 0:
            raise ValueError(f"{what} interval must be > 0 seconds, got {interval!r}")
        self.what = what
        self.interval = interval
        self.first_wait = first_wait
        self.hang_after = hang_after
        self.late_log_every = late_log_every
        self.rounds = 0  # rounds completed (tests and logs)
        self.skipped = 0  # rounds not started: the previous one still ran
        self._worker = DeadlineWorker(f"accelstats-{what}-nvml")
        self._timer: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._late_logged = False  # "still running" said in this episode
        self._hang_logged = False  # "hangs" said in this episode
        self._round_started = 0.0  # time.monotonic() when the running (or last) round was started
        self._late_said_at: float | None = None  # time.monotonic() of the last "still running" line
        self._late_left_out = 0  # late episodes not logged since that line (rate limit)

    @property
    def busy(self) -> bool:
        """True while a round (possibly stuck in a call) is running on the worker."""
        return self._worker.busy

    @property
    def threads(self) -> tuple[threading.Thread, ...]:
        """The threads that are alive: the timer and the NVML worker (for tests and logs)."""
        return tuple(t for t in (self._timer, self._worker.thread) if t is not None and t.is_alive())

    def _start_rounds(self) -> None:
        """Run a first round now, waiting at most ``first_wait`` seconds for it, then :meth:`resume`."""
        self._stop.clear()
        done = self._start_round()
        if done is None:
            self._skipped()
        elif not done.wait(self.first_wait):
            log.info("%s: the first round did not end within %gs; values follow when it does", self.what,
                     self.first_wait)
        self.resume()

    def resume(self) -> None:
        """Start the timer thread again after :meth:`stop` (no first round)."""
        with self._lock:
            self._stop.clear()
            if self._timer is None or not self._timer.is_alive():
                self._timer = threading.Thread(target=self._loop, name=f"accelstats-{self.what}", daemon=True)
                self._timer.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the timer (joined: it never waits on NVML) and call :meth:`_stopped`; a running round
        ends after its current call (see :meth:`wait_idle`)."""
        self._stop.set()
        with self._lock:
            timer, self._timer = self._timer, None
            self._stopped()
        if timer is not None and timer is not threading.current_thread():
            timer.join(timeout)

    def wait_idle(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for a running round; True when no NVML call is running."""
        return self._worker.wait_idle(timeout)

    def close(self, timeout: float = 2.0) -> bool:
        """:meth:`stop`, then end the worker thread; True when both threads have ended within
        ``timeout`` seconds, False when a call is still stuck (its daemon thread ends when it returns)."""
        self.stop(timeout)
        self._worker.stop()
        return self._worker.join(timeout)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            if self._start_round() is None:
                self._skipped()

    def _start_round(self) -> threading.Event | None:
        """Start a round on the worker; None (nothing started) while the previous one still runs."""
        started = time.monotonic()
        done = self._worker.start(self._round)
        if done is not None:
            self._round_started = started
            self._late_logged = self._hang_logged = False
        return done

    def _skipped(self) -> None:
        """A round was due while the previous one still runs: count it in :attr:`skipped`, say how long
        the previous one has run (info, once per episode, at most once per :attr:`late_log_every`),
        and that an NVML call hangs only once it has run :attr:`hang_after` seconds (warning, once per
        episode)."""
        self.skipped += 1
        now = time.monotonic()
        running = now - self._round_started
        if running >= self.hang_after:
            if not self._hang_logged:
                log.warning("%s: the previous round is still running after %.1f s, past %g s: an NVML call "
                            "hangs; %s", self.what, running, self.hang_after, self._stuck_consequence())
                self._hang_logged = self._late_logged = True
        elif not self._late_logged:
            self._late_logged = True
            if self._late_said_at is not None and now - self._late_said_at < self.late_log_every:
                self._late_left_out += 1
                return
            left_out = (f"; {self._late_left_out} more such episodes since the last line were not logged"
                        if self._late_left_out else "")
            log.info("%s: the previous round is still running after %.1f s (interval %g s); this round is "
                     "skipped%s", self.what, running, self.interval, left_out)
            self._late_said_at, self._late_left_out = now, 0

    # -- what a subclass provides ----------------------------------------------------------------
    def _round(self) -> None:
        """One round of reads (on the worker thread)."""
        raise NotImplementedError

    def _stopped(self) -> None:
        """Called by :meth:`stop` under the lock: drop what must not outlive the NVML session."""

    def _stuck_consequence(self) -> str:
        """What a hung round means for the values (completes the log line)."""
        return "values wait until it does"
