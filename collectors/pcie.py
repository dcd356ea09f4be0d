"""PCIe throughput, read by a background sampler: ``nvmlDeviceGetPcieThroughput`` never runs on a scrape.

NVML measures PCIe throughput by counting bytes over a 20 ms window inside the call (NVML API
reference, ``nvmlDeviceGetPcieThroughput``), so each call blocks: 20.9 ms median on the H200
(measured on an H200), 42 ms per GPU for both directions, 0.34 s for eight GPUs. That is too slow for the
scrape path (blocking calls stay off the scrape path; the metrics contract: "background
sampler only"), so :class:`PcieSampler` reads every GPU once per ``interval`` seconds and keeps the
last reading per GPU UUID; the backend's scrape pass only copies it into the sample.

Units: NVML answers KB/s with "1KB granularity" (nvml.h, ``nvmlPcieUtilCounter_t``); KB is taken as
1024 bytes, as nvtop reads the same call (KiB/s), and exported in bytes per second. Directions are
the GPU's: ``tx`` = NVML_PCIE_UTIL_TX_BYTES, bytes the GPU sent (GPU to host, e.g. device-to-host
copies); ``rx`` = NVML_PCIE_UTIL_RX_BYTES, bytes the GPU received (host to GPU).

Threads, and why not the scrape's NVML worker: the scrape pass runs on the backend's
:class:`~collectors.deadline.DeadlineWorker`, which starts no job while one runs. A round of PCIe
reads on that worker would keep every scrape that arrives meanwhile from starting its pass (0.34 s
per round on eight GPUs, forever if the call hangs), so the sampler has a worker of its own, and
NVML allows that: "NVML is thread-safe so it is safe to make simultaneous NVML calls from multiple
threads" (NVML API reference). Every call still goes through the backend's one wrapper
(:class:`~collectors.nvml_call.NvmlCaller`: same error classes, same error counters). A timer
thread starts one round per interval on the sampler's worker and never waits for it; a round still
running when the next is due (a hung call: a GPU fell off the bus) is not doubled, so a hang costs
one thread for as long as it lasts, and its GPU's reading ages out: a reading older than
:data:`STALE_INTERVALS` intervals is absent, never repeated forever. The first round (at
:meth:`PcieSampler.start`, on NVML setup) is waited for at most ``first_wait`` seconds, so the first
scrape has values without a hang there costing the scrape more than that.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from collectors.deadline import DeadlineWorker
from collectors.nvml_call import DeviceLostError, NvmlCaller, NvmlUnavailableError

log = logging.getLogger(__name__)

KB = 1024  # bytes per NVML "KB" (nvml.h: "1KB granularity"; nvtop reads it as KiB/s)
# (direction label, nvmlPcieUtilCounter_t constant): NVML counts from the GPU's side.
DIRECTIONS = (("rx", "NVML_PCIE_UTIL_RX_BYTES"), ("tx", "NVML_PCIE_UTIL_TX_BYTES"))
STALE_INTERVALS = 3  # a reading older than this many intervals is absent

Reading = tuple[tuple[str, float], ...]  # ((direction, bytes per second), ...)


class PcieSampler:
    """Reads PCIe throughput of every GPU every ``interval`` seconds in the background.

    ``call``: the backend's NVML wrapper; ``nvml``: pynvml or the replay (for the counter
    constants); ``interval``: seconds between rounds (> 0); ``first_wait``: seconds :meth:`start`
    waits for the first round; ``clock``: monotonic seconds (injectable for tests).

    Lifecycle: :meth:`start` (NVML set up: GPUs to read) → :meth:`set_handles` (re-enumeration) →
    :meth:`stop` (NVML about to shut down; :meth:`start` may follow) → :meth:`close` (backend
    closed). Thread-safe reader: :meth:`reading`.
    """

    def __init__(self, call: NvmlCaller, nvml: Any, interval: float, *, first_wait: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not interval > 0:
            raise ValueError(f"PCIe sampling interval must be > 0 seconds, got {interval!r}")
        self.call = call
        self.nvml = nvml
        self.interval = interval
        self.first_wait = first_wait
        self.clock = clock
        self.rounds = 0  # rounds completed (tests and logs)
        self._worker = DeadlineWorker("accelstats-pcie-nvml")
        self._timer: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._handles: dict[str, Any] = {}
        self._readings: dict[str, tuple[float, Reading]] = {}
        self._stuck_logged = False

    @property
    def busy(self) -> bool:
        """True while a round (possibly stuck in a call) is running on the sampler's worker."""
        return self._worker.busy

    @property
    def threads(self) -> tuple[threading.Thread, ...]:
        """The sampler's threads that are alive: the timer and the NVML worker (for tests and logs)."""
        return tuple(t for t in (self._timer, self._worker.thread) if t is not None and t.is_alive())

    def start(self, handles: Mapping[str, Any]) -> None:
        """Read ``handles`` (``{GPU UUID: NVML handle}``; no MIG handles: NVML measures the physical
        link) from now on: run a first round, waiting at most ``first_wait`` seconds for it, then
        start the timer thread if it is not running."""
        self.set_handles(handles)
        self._stop.clear()
        done = self._worker.start(self._round)
        if done is None:
            log.warning("PCIe throughput: a round started before has not returned (an NVML call hangs)")
        elif not done.wait(self.first_wait):
            log.info("PCIe throughput: the first round did not end within %gs; values follow when it does",
                     self.first_wait)
        self.resume()

    def resume(self) -> None:
        """Start the timer thread again after :meth:`stop` (no first round; the GPUs are kept)."""
        with self._lock:
            self._stop.clear()
            if self._timer is None or not self._timer.is_alive():
                self._timer = threading.Thread(target=self._loop, name="accelstats-pcie", daemon=True)
                self._timer.start()

    def set_handles(self, handles: Mapping[str, Any]) -> None:
        """Replace the GPUs read; readings of GPUs no longer listed are dropped."""
        with self._lock:
            self._handles = dict(handles)
            self._readings = {u: r for u, r in self._readings.items() if u in self._handles}

    def reading(self, uuid: str) -> Reading:
        """``(("rx", bytes/s), ("tx", bytes/s))`` of the GPU's last round (the directions NVML
        answered), or ``()`` when there is none or it is older than :data:`STALE_INTERVALS` intervals."""
        with self._lock:
            got = self._readings.get(uuid)
        if got is None or self.clock() - got[0] > STALE_INTERVALS * self.interval:
            return ()
        return got[1]

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the timer (joined: it never waits on NVML) and drop every reading; a running round
        ends after its current call (see :meth:`wait_idle`)."""
        self._stop.set()
        with self._lock:
            timer, self._timer = self._timer, None
            self._readings = {}
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
            done = self._worker.start(self._round)
            if done is None:
                if not self._stuck_logged:
                    log.warning("PCIe throughput: the previous round has not returned (an NVML call hangs); "
                                "its GPUs' values go absent after %gs", STALE_INTERVALS * self.interval)
                    self._stuck_logged = True
            else:
                self._stuck_logged = False

    def _round(self) -> None:
        """Read both directions of every GPU (on the sampler's worker); ends early when stopped."""
        with self._lock:
            handles = list(self._handles.items())
        for uuid, handle in handles:
            if self._stop.is_set():
                return
            try:
                values = self._read(handle)
            except DeviceLostError:
                values = ()  # counted by the wrapper; the backend's own pass marks the GPU down
            except NvmlUnavailableError:
                with self._lock:
                    self._readings = {}
                return  # the backend's pass finds it too and re-initialises NVML
            with self._lock:
                if uuid not in self._handles or self._stop.is_set():
                    continue
                if values:
                    self._readings[uuid] = (self.clock(), values)
                else:
                    self._readings.pop(uuid, None)
        self.rounds += 1

    def _read(self, handle: Any) -> Reading:
        out = []
        for direction, const in DIRECTIONS:
            kb = self.call("nvmlDeviceGetPcieThroughput", handle, getattr(self.nvml, const))
            if kb is not None:
                out.append((direction, float(kb) * KB))
        return tuple(out)
