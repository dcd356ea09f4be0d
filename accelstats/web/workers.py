"""The HTTP server's worker threads, shared fairly between clients (:mod:`accelstats.web.server`).

Jobs wait per *key* (the client's address) and are taken round-robin across keys, at most
:data:`PER_CLIENT` running for one key, so a scrape from an address with nothing else waiting starts
as soon as a thread is free, after at most one job of each other waiting address: a flood from one
address, or a few, does not queue it. :class:`accelstats.web.auth.CheckGate` orders bcrypt checks the same way.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Generic, TypeVar

Job = TypeVar("Job")

# Jobs of one key running at once at most: a scraper and an operator's curl from one host; one process
# (the GIL): with 2 per address a flooding address leaves a scrape a third of the CPU, not a 65th.
PER_CLIENT = 2


class FairWorkers(Generic[Job]):
    """At most ``limit`` threads (started on demand, ended after ``idle_exit`` idle seconds) running
    ``run(job)``; jobs queued per key, taken round-robin across keys with at most ``per_key`` of one
    key running at once, except *shared* jobs (:meth:`submit`), which queue apart and have no cap.
    ``run`` returns the call that hands the job's result over; it is called after this thread counts
    itself free, so the client's next request finds a free thread.

    Thread-safe: :meth:`submit` is called from the event loop, the rest from the workers.
    """

    def __init__(self, limit: int, run: Callable[[Job], Callable[[], None] | None], *,
                 per_key: int = PER_CLIENT, idle_exit: float = 5.0, name: str = "accelstats-http-worker",
                 unshared: Callable[[Job], bool] | None = None) -> None:
        self.limit = limit
        self._unshared = unshared  # a shared job for which it is true when its turn comes goes to its key's cap
        self.per_key = per_key
        self.idle_exit = idle_exit
        self._name = name
        self._run = run
        self._cond = threading.Condition()
        self._queues: OrderedDict[str, deque[Job]] = OrderedDict()  # keys with waiting jobs, next turn first
        self._running: dict[str, int] = {}
        self._capped: dict[str, bool] = {}  # queue key -> whether per_key applies (kept while queued or running)
        self._idle = 0  # threads waiting for a job, or about to (see _worker)
        self._waiting = 0  # jobs queued
        self.threads = 0
        self._stopped = False

    @property
    def waiting(self) -> int:
        """Jobs queued, not yet started (for tests and benchmarks)."""
        with self._cond:
            return self._waiting

    def submit(self, key: str, job: Job, shared: bool = False) -> None:
        """Queue ``job`` for ``key``; start a thread when more jobs could start than threads are idle
        and fewer than ``limit`` threads exist. ``shared``: a job whose cost concurrent jobs share (a
        scrape of ``/metrics`` joins the collection and the encoded body in progress: 50 concurrent
        scrapers from one address shared 23 to a collection, two at a time shared none), queued apart
        from the key's other jobs, still in its turn, without the ``per_key`` cap."""
        with self._cond:
            if self._stopped:
                return
            if shared:
                key += "\0shared"
            self._capped[key] = not shared
            self._queues.setdefault(key, deque()).append(job)
            self._waiting += 1
            if self.threads < self.limit and self._startable_more_than(self._idle):
                self.threads += 1
                threading.Thread(target=self._worker, name=self._name, daemon=True).start()
            else:
                self._cond.notify()

    def stop(self) -> None:
        """Threads end after their current job; queued jobs are dropped."""
        with self._cond:
            self._stopped = True
            self._queues.clear()
            self._capped = {k: v for k, v in self._capped.items() if k in self._running}
            self._waiting = 0
            self._cond.notify_all()

    def _startable_more_than(self, count: int) -> bool:
        """Whether more than ``count`` queued jobs could start now (their key under its cap); stops
        counting there (caller holds the lock)."""
        startable = 0
        for key, queue in self._queues.items():
            room = self.per_key - self._running.get(key, 0) if self._capped[key] else len(queue)
            startable += min(len(queue), room)
            if startable > count:
                return True
        return False

    def _take(self) -> tuple[str, Job] | None:
        """The next job by the round-robin order (caller holds the lock), or None. A shared job found
        ``unshared`` first moves to the end of its key's capped queue (and stays there)."""
        while (moved := self._unshare()) is not None:  # each pass moves a job or ends the loop
            key, queue = moved
            own = key.removesuffix("\0shared")
            while queue and self._unshared is not None and self._unshared(queue[0]):
                self._queues.setdefault(own, deque()).append(queue.popleft())
            self._capped[own] = True
            if not queue:
                del self._queues[key]
                if key not in self._running:
                    del self._capped[key]
        for key, queue in self._queues.items():
            if not self._capped[key] or self._running.get(key, 0) < self.per_key:
                job = queue.popleft()
                self._waiting -= 1
                if queue:
                    self._queues.move_to_end(key)  # its next job waits for the other keys' turns
                else:
                    del self._queues[key]
                self._running[key] = self._running.get(key, 0) + 1
                return key, job
        return None

    def _unshare(self) -> tuple[str, deque[Job]] | None:
        """The first shared queue, in turn order, whose next job is ``unshared`` (caller holds the lock)."""
        if self._unshared is not None:
            for key, queue in self._queues.items():
                if not self._capped[key] and self._unshared(queue[0]):
                    return key, queue
        return None

    def _worker(self) -> None:
        announced = False  # counted idle since its last job, before its answer went out
        while True:
            with self._cond:
                if announced:
                    self._idle -= 1
                    announced = False
                end = time.monotonic() + self.idle_exit
                taken = None if self._stopped else self._take()
                while taken is None and not self._stopped:
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    self._idle += 1
                    self._cond.wait(left)
                    self._idle -= 1
                    taken = None if self._stopped else self._take()
                if taken is None:
                    self.threads -= 1
                    return
            key, job = taken
            try:
                deliver = self._run(job)
            finally:
                with self._cond:
                    left_running = self._running[key] - 1
                    if left_running:
                        self._running[key] = left_running
                    else:
                        del self._running[key]
                        if key not in self._queues:
                            del self._capped[key]
                    # Free before the answer goes out: the client's next request, which may come as soon
                    # as it has read the answer, must find this thread, not start another.
                    self._idle += 1
                    announced = True
                    if key in self._queues:  # a job of this key may have waited for its cap
                        self._cond.notify()
            if deliver is not None:
                deliver()
