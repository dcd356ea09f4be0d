"""Run blocking work (NVML calls) on one dedicated thread, and never wait for it past a deadline.

An NVML call can hang when a GPU falls off the bus (docs/design.md, "NVML runs on its own thread, under a deadline").
:class:`DeadlineWorker` keeps such a hang away from the scrape: the caller waits at most
``deadline`` seconds; a job still running then is left to finish on its own, and while it runs no
other job is started, so a hung call costs one thread, however many scrapes come meanwhile (no
thread leak). The caller renders what it has: the job's partial results and the last complete ones.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class DeadlineWorker:
    """One daemon thread (started lazily, named ``name``) running one job at a time.

    ``run(job, deadline)`` answers True when the job finished within ``deadline`` seconds, False
    when it did not (it keeps running) or when an earlier job is still running (then the new job is
    not started at all). A job's exceptions are logged and swallowed: jobs report through their
    own state.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], threading.Event] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._running: threading.Event | None = None  # the current job's "done" event
        self._lock = threading.Lock()

    @property
    def thread(self) -> threading.Thread | None:
        """The worker thread (None before the first job)."""
        return self._thread

    @property
    def busy(self) -> bool:
        """True while a job (possibly one that missed its deadline) is still running."""
        running = self._running
        return running is not None and not running.is_set()

    def start(self, job: Callable[[], None]) -> threading.Event | None:
        """Start ``job`` on the worker thread without waiting; returns the event set when it ends, or
        None when an earlier job is still running (``job`` is then not started)."""
        with self._lock:
            if self.busy:
                return None
            done = threading.Event()
            self._running = done
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            self._queue.put((job, done))
        return done

    def run(self, job: Callable[[], None], deadline: float) -> bool:
        """Run ``job`` on the worker thread; wait at most ``deadline`` seconds (see class docstring)."""
        done = self.start(job)
        return done is not None and done.wait(deadline)

    def wait_idle(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the running job (if any) to end; True when none runs."""
        running = self._running
        return running is None or running.wait(timeout)

    def stop(self) -> None:
        """Ask the thread to exit after the current job (it is a daemon: a hung one never blocks exit).
        The worker is not used after this."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                self._queue.put(None)

    def join(self, timeout: float) -> bool:
        """After :meth:`stop`: wait at most ``timeout`` seconds for the thread to end; True when it
        has (or never started), False when a job is still stuck in a call."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, done = item
            try:
                job()
            except Exception:
                log.exception("%s: job failed", self.name)
            finally:
                done.set()
