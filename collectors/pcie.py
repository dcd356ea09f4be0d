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
per round on eight GPUs, forever if the call hangs), so the sampler has a worker and timer of its
own (:class:`collectors.rounds.BackgroundRounds`). Every call still goes through the backend's one
wrapper (:class:`~collectors.nvml_call.NvmlCaller`: same error classes, same error counters). A
round that hangs is not doubled, and its GPU's reading ages out: a reading older than
:data:`STALE_INTERVALS` intervals is absent, never repeated forever. The first round (at
:meth:`PcieSampler.start`, on NVML setup) is waited for at most ``first_wait`` seconds, so the first
scrape has values without a hang there costing the scrape more than that.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from collectors.nvml_call import DeviceLostError, NvmlCaller, NvmlUnavailableError
from collectors.rounds import BackgroundRounds

log = logging.getLogger(__name__)

KB = 1024  # bytes per NVML "KB" (nvml.h: "1KB granularity"; nvtop reads it as KiB/s)
# (direction label, nvmlPcieUtilCounter_t constant): NVML counts from the GPU's side.
DIRECTIONS = (("rx", "NVML_PCIE_UTIL_RX_BYTES"), ("tx", "NVML_PCIE_UTIL_TX_BYTES"))
STALE_INTERVALS = 3  # a reading older than this many intervals is absent

Reading = tuple[tuple[str, float], ...]  # ((direction, bytes per second), ...)


class PcieSampler(BackgroundRounds):
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
        super().__init__("pcie", interval, first_wait=first_wait)
        self.call = call
        self.nvml = nvml
        self.clock = clock
        self._handles: dict[str, Any] = {}
        self._readings: dict[str, tuple[float, Reading]] = {}

    def start(self, handles: Mapping[str, Any]) -> None:
        """Read ``handles`` (``{GPU UUID: NVML handle}``; no MIG handles: NVML measures the physical
        link) from now on: run a first round, waiting at most ``first_wait`` seconds for it, then
        start the timer thread if it is not running."""
        self.set_handles(handles)
        self._start_rounds()

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

    def _stopped(self) -> None:
        self._readings = {}  # every reading is dropped: NVML is about to shut down

    def _stuck_consequence(self) -> str:
        return f"its GPUs' values go absent after {STALE_INTERVALS * self.interval:g}s"

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
