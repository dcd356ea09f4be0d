"""Per-process reads for GPU accounting, in the background at a fixed period, never on a scrape.

Counters that integrate (SM-seconds, memory byte-seconds, energy) must not depend on when or how
often anyone scrapes, so :class:`ProcessSampler` reads every device once per ``interval`` seconds
(:class:`collectors.rounds.BackgroundRounds`) and hands each round to a sink
(:class:`accelstats.accounting.Ledger`); scrapes only read what the sink integrated.

Per device and round, one :class:`ProcessRound`:

* the processes NVML lists now (MPS, compute, graphics lists; a PID once) with ``usedGpuMemory``;
* SM-busy seconds per PID from ``nvmlDeviceGetProcessUtilization(lastSeenTimeStamp)``. NVML returns
  one sample per process that was busy since ``lastSeenTimeStamp`` ("one utilization sample
  structure is returned per process running, that had some non-zero utilization during the last
  sample period"; "set lastSeenTimeStamp to a timeStamp retrieved from a previous query to read
  utilization since the previous query", NVML API reference), with a CPU timestamp in µs. Each
  sample therefore covers ``(lastSeenTimeStamp, timeStamp]``, and the next read asks from the newest
  timestamp seen: every driver sample is integrated once (:func:`busy_seconds`). GPUs only: NVML
  gives no per-process utilisation for MIG instances (``sm`` is None there);
* the GPU's total energy counter (``nvmlDeviceGetTotalEnergyConsumption``, mJ; ~3 ms on the H200)
  every :data:`ENERGY_EVERY` rounds.

The first round of a device primes it (``elapsed`` 0): accounting starts there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from collectors.model import Device
from collectors.nvml_call import DeviceLostError, NvmlCaller, NvmlUnavailableError
from collectors.rounds import BackgroundRounds

log = logging.getLogger(__name__)

ENERGY_EVERY = 10
"""Rounds between two energy reads of a GPU (10 s at the default 1 s interval): the call costs ~3 ms."""

PROCESS_LISTS = ("nvmlDeviceGetMPSComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses",
                 "nvmlDeviceGetGraphicsRunningProcesses")
_NOT_AVAILABLE = (2**64 - 1, 2**32 - 1)  # NVML_VALUE_NOT_AVAILABLE as usedGpuMemory


@dataclass(frozen=True)
class ProcessRound:
    """One device in one round.

    ``at``: monotonic seconds of the read; ``elapsed``: seconds since the device's previous read (0 at
    the first: nothing to integrate yet); ``memory``: ``(pid, usedGpuMemory bytes or None)`` of every
    process listed now, None when no list answered; ``sm``: ``(pid, SM-busy seconds)`` for the
    processes NVML sampled busy in this read, None when the device gives no per-process utilisation
    (MIG instances, NOT_SUPPORTED, an error); ``energy_joules``: the GPU's total energy counter when
    read in this round, else None.
    """

    uuid: str
    at: float
    elapsed: float
    memory: tuple[tuple[int, int | None], ...] | None
    sm: tuple[tuple[int, float], ...] | None
    energy_joules: float | None = None


def busy_seconds(samples: Iterable[Any], last_seen_us: int, elapsed: float) -> tuple[dict[int, float], int]:
    """SM-busy seconds per PID from ``nvmlProcessUtilizationSample_t`` ``samples`` (``.pid``,
    ``.timeStamp`` µs, ``.smUtil`` percent) read with ``lastSeenTimeStamp`` = ``last_seen_us``.

    A sample covers ``(last_seen_us, timeStamp]`` (NVML: "utilization since the previous query"), at
    most ``elapsed`` seconds (the time since the previous read: a ``last_seen_us`` that did not move
    while NVML answered NOT_FOUND must not stretch one sample over an idle hour). Returns
    ``({pid: smUtil / 100 x covered seconds}, the newest timestamp seen or last_seen_us)``; a PID
    sampled twice adds both. smUtil above 100 (seen with zombie processes, nvtop #110) counts as 100.
    """
    out: dict[int, float] = {}
    newest = last_seen_us
    for s in samples:
        ts = int(s.timeStamp)
        covered = min(max(0.0, (ts - last_seen_us) / 1e6), elapsed)
        pid = int(s.pid)
        out[pid] = out.get(pid, 0.0) + min(int(s.smUtil), 100) / 100.0 * covered
        newest = max(newest, ts)
    return out, newest


class _DeviceReads:
    """What persists between rounds for one device."""

    def __init__(self, device: Device, handle: Any) -> None:
        self.device = device
        self.handle = handle
        self.last_seen_us = 0
        self.previous_at: float | None = None
        self.rounds = 0


class ProcessSampler(BackgroundRounds):
    """Reads processes, per-process SM samples and energy of every device every ``interval`` seconds.

    ``call``: the backend's NVML wrapper; ``sink``: called with each round's :class:`ProcessRound`
    list (on the sampler's worker thread; it must not raise); ``clock``: monotonic seconds
    (injectable). :meth:`read_round` runs one round on the caller's thread (tests drive a fake clock
    with it). Lifecycle as :class:`collectors.rounds.BackgroundRounds`; :meth:`set_devices` after a
    re-enumeration (devices that stay keep their state).
    """

    def __init__(self, call: NvmlCaller, interval: float, sink: Callable[[list[ProcessRound]], None], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__("accounting", interval, first_wait=0.5)
        self.call = call
        self.sink = sink
        self.clock = clock
        self._devices: list[_DeviceReads] = []

    def start(self, devices: Sequence[tuple[Device, Any]]) -> None:
        """Read ``devices`` (``(Device, NVML handle)``: GPUs and MIG instances) from now on; the first
        round primes them (waited for at most ``first_wait`` seconds), then the timer runs."""
        self.set_devices(devices)
        self._start_rounds()

    def set_devices(self, devices: Sequence[tuple[Device, Any]]) -> None:
        """Replace the devices read; a device already read keeps its timestamps (no gap, no double)."""
        with self._lock:
            known = {d.device.uuid: d for d in self._devices}
            fresh = []
            for device, handle in devices:
                reads = known.get(device.uuid)
                if reads is None:
                    reads = _DeviceReads(device, handle)
                reads.handle = handle
                fresh.append(reads)
            self._devices = fresh

    def _stopped(self) -> None:
        # NVML shuts down: timestamps stay (the same driver's clock), but the next read is a new start
        for reads in self._devices:
            reads.previous_at = None

    def _round(self) -> None:
        self.read_round()

    def read_round(self) -> list[ProcessRound]:
        """Read every device once, hand the rounds to the sink and return them. A device that is lost
        gives a round with nothing read (its next read starts afresh); NVML becoming unavailable ends
        the round early (the backend's pass re-initialises it)."""
        with self._lock:
            devices = list(self._devices)
        out = []
        for reads in devices:
            if self._stop.is_set():
                break
            try:
                out.append(self._read(reads))
            except DeviceLostError:
                reads.previous_at = None
                out.append(ProcessRound(reads.device.uuid, self.clock(), 0.0, None, None))
            except NvmlUnavailableError:
                for r in devices:
                    r.previous_at = None
                break
        self.rounds += 1
        self.sink(out)
        return out

    def _read(self, reads: _DeviceReads) -> ProcessRound:
        c, h = self.call, reads.handle
        memory: dict[int, int | None] = {}
        readable = False
        for call in PROCESS_LISTS:
            procs = c(call, h)
            if procs is None and c.missing(call):  # pynvml calls the _v3 symbol, new in R510: try _v2
                procs = c(f"{call}_v2", h)
            if procs is not None:
                readable = True
                for p in procs:
                    used = getattr(p, "usedGpuMemory", None)
                    memory.setdefault(int(p.pid), None if used is None or used in _NOT_AVAILABLE else int(used))
        at = self.clock()
        elapsed = 0.0 if reads.previous_at is None else max(0.0, at - reads.previous_at)
        sm: tuple[tuple[int, float], ...] | None = None
        energy = None
        if reads.device.kind == "gpu":
            util = c("nvmlDeviceGetProcessUtilization", h, reads.last_seen_us, not_found=[])
            if util is not None:
                busy, reads.last_seen_us = busy_seconds(util, reads.last_seen_us, elapsed)
                sm = tuple(busy.items())
            if reads.rounds % ENERGY_EVERY == 0:
                mj = c("nvmlDeviceGetTotalEnergyConsumption", h)
                energy = None if mj is None else mj / 1000.0
        reads.previous_at = at
        reads.rounds += 1
        return ProcessRound(reads.device.uuid, at, elapsed, tuple(memory.items()) if readable else None, sm, energy)
