"""Per-process reads for GPU accounting, in the background at a fixed period, never on a scrape.

Counters that integrate (SM-seconds, memory byte-seconds, energy) must not depend on when or how
often anyone scrapes, so :class:`ProcessSampler` reads every device once per ``interval`` seconds
(:class:`collectors.rounds.BackgroundRounds`) and hands each round to a sink
(:class:`accelstats.accounting.Ledger`); scrapes only read what the sink integrated.

Per device and round, one :class:`ProcessRound`:

* the processes NVML lists now (:func:`collectors.processes.running_processes`: a PID once, a known
  ``usedGpuMemory`` winning over "not available"); a GPU in MIG mode lists its instances' processes too, which are left
  to their instances (each instance is read as a device of its own);
* SM-busy seconds and busy spans per PID from ``nvmlDeviceGetProcessUtilization(lastSeenTimeStamp)``
  (:class:`collectors.smsamples.SmSamples`: what period a sample covers, for both answer shapes NVML's
  words allow, whatever the interval). GPUs outside MIG mode only: NVML gives no per-process
  utilisation for MIG instances (``sm`` is None there); a wall clock that steps back (the timestamps
  are its µs) restarts every device's reads;
* the GPU's total energy counter (``nvmlDeviceGetTotalEnergyConsumption``, mJ; ~3 ms on the H200)
  every :data:`ENERGY_EVERY` rounds.

The first round of a device primes it (``elapsed`` 0): accounting starts there.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from collectors.model import Device
from collectors.nvml_call import DeviceLostError, NvmlCaller, NvmlUnavailableError
from collectors.processes import NO_INSTANCE, running_processes
from collectors.rounds import BackgroundRounds
from collectors.smsamples import SmReading, SmSamples

GPU_UTILIZATION_SAMPLES = 1  # nvml.h NVML_GPU_UTILIZATION_SAMPLES
ENERGY_EVERY = 10
"""Rounds between two energy reads of a GPU (10 s at the default 1 s interval): the call costs ~3 ms."""


@dataclass(frozen=True)
class ProcessRound:
    """One device in one round.

    ``at``: monotonic seconds of the read; ``elapsed``: seconds since the device's previous read (0 at
    the first: nothing to integrate yet); ``memory``: ``(pid, usedGpuMemory bytes or None)`` of every
    process listed now, None when no list answered; ``sm``: ``(pid, SM-busy seconds)`` for the
    processes NVML sampled busy in this read, None when the device gives no per-process utilisation
    (MIG instances and GPUs in MIG mode, NOT_SUPPORTED, an error); ``energy_joules``: the GPU's total
    energy counter when read in this round, else None; ``discarded``: (reason, count) of what this read
    left out (``sample_from_future``, ``clock_stepped_back``); ``busy``: ``(pid, begin, end)`` monotonic
    seconds with SM activity, from the samples' own periods (not the round's).
    """

    uuid: str
    at: float
    elapsed: float
    memory: tuple[tuple[int, int | None], ...] | None
    sm: tuple[tuple[int, float], ...] | None
    energy_joules: float | None = None
    discarded: tuple[tuple[str, int], ...] = ()
    busy: tuple[tuple[int, float, float], ...] = ()


class _DeviceReads:
    """What persists between rounds for one device."""

    def __init__(self, device: Device, handle: Any) -> None:
        self.device = device
        self.handle = handle
        self.samples = SmSamples()
        self.previous_at: float | None = None
        self.rounds = 0


class ProcessSampler(BackgroundRounds):
    """Reads processes, per-process SM samples and energy of every device every ``interval`` seconds.

    ``call``: the backend's NVML wrapper; ``sink``: called with each round's :class:`ProcessRound` list (on the
    sampler's worker thread; it must not raise); ``clock``: monotonic seconds, ``wall``: Unix seconds (both
    injectable; the wall clock judges NVML's timestamps and sees it step back). :meth:`read_round` runs one
    round on the caller's thread (tests drive a fake clock with it). Lifecycle as
    :class:`collectors.rounds.BackgroundRounds`; :meth:`set_devices` after a re-enumeration (devices that stay
    keep their state).
    """

    def __init__(self, call: NvmlCaller, interval: float, sink: Callable[[list[ProcessRound]], None], *,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        super().__init__("accounting", interval, first_wait=0.5)
        self.call = call
        self.sink = sink
        self.clock = clock
        self.wall = wall
        self._devices: list[_DeviceReads] = []
        self._wall_offset: float | None = None  # wall - monotonic at the previous round

    def start(self, devices: Sequence[tuple[Device, Any]]) -> None:
        """Read ``devices`` (``(Device, NVML handle)``: GPUs and MIG instances) from now on; the first
        round primes them (waited for at most ``first_wait`` seconds), then the timer runs. After a stop
        (NVML shut down and set up again) the first read of each device starts afresh."""
        self.set_devices(devices)
        with self._lock:
            for reads in self._devices:
                reads.previous_at = None
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

    def answer_shapes(self) -> dict[str, tuple[str | None, int | None]]:
        """Per device UUID, how ``nvmlDeviceGetProcessUtilization`` answers as learnt so far
        (:class:`collectors.smsamples.SmSamples`: ``"mean"``, ``"every"`` or None) and the driver period
        seen (µs, or None): what scripts/accounting_check.py reports from a real GPU."""
        with self._lock:
            return {r.device.uuid: (r.samples.shape, r.samples.period_us) for r in self._devices}

    def _round(self) -> None:
        self.read_round()

    def _stuck_consequence(self) -> str:
        return "accounting waits for it (or rounds take longer than accounting_interval)"

    def read_round(self) -> list[ProcessRound]:
        """Read every device once, hand the rounds to the sink and return them. A device that is lost
        gives a round with nothing read (its next read starts afresh); NVML becoming unavailable ends
        the round early (the backend's pass re-initialises it)."""
        with self._lock:
            devices = list(self._devices)
        discarded: list[tuple[str, int]] = []
        offset = self.wall() - self.clock()
        if self._wall_offset is not None and offset < self._wall_offset - 1.0:
            # the wall clock stepped back: NVML's timestamps (wall-clock µs) restart below lastSeenTimeStamp
            discarded.append(("clock_stepped_back", 1))
            for reads in devices:
                reads.samples.restart()
                reads.previous_at = None
        self._wall_offset = offset
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
        if discarded and out:
            out[0] = dataclasses.replace(out[0], discarded=(*out[0].discarded, *discarded))
        self.rounds += 1
        self.sink(out)
        return out

    def _read(self, reads: _DeviceReads) -> ProcessRound:
        c, h, device = self.call, reads.handle, reads.device
        # a GPU in MIG mode lists its instances' processes too: they are counted on their instances
        own_only = device.kind == "gpu" and device.mig_mode == "enabled"
        listed, readable = running_processes(c, h)
        memory = {pid: p.used_memory_bytes for pid, p in listed.items()
                  if not (own_only and p.gpu_instance_id != NO_INSTANCE)}
        at = self.clock()
        elapsed = 0.0 if reads.previous_at is None else max(0.0, at - reads.previous_at)
        sm: tuple[tuple[int, float], ...] | None = None
        energy = None
        discarded: tuple[tuple[str, int], ...] = ()
        busy: tuple[tuple[int, float, float], ...] = ()
        if device.kind == "gpu" and not own_only:
            now_us = int(self.wall() * 1e6)
            state = reads.samples
            if reads.previous_at is None and state.period_hint_us is None:  # the driver's period, once
                got_samples = c("nvmlDeviceGetSamples", h, GPU_UTILIZATION_SAMPLES, 0, not_found=None)
                if got_samples is not None:
                    state.hint_period(int(x.timeStamp) for x in got_samples[1])
            util = c("nvmlDeviceGetProcessUtilization", h, state.ask(now_us), not_found=[])
            if util is not None:
                if util:
                    got = state.answer(util, now_us, prime=reads.previous_at is None,
                                       query=lambda since: c("nvmlDeviceGetProcessUtilization", h, since,
                                                             not_found=[]))
                elif reads.previous_at is None:
                    state.prime(now_us)
                    got = SmReading()
                else:
                    got = state.not_found(now_us)
                if readable:
                    state.exited(memory, got)  # a job shorter than a window: its span before its PID retires
                sm = tuple(got.seconds.items())
                offset = self.wall() - at  # wall-clock seconds at monotonic 0: the spans' clock
                busy = tuple((pid, b - offset, e - offset) for pid, spans in got.spans.items() for b, e in spans)
                discarded = (("sample_from_future", got.future),) if got.future else ()
        if device.kind == "gpu" and reads.rounds % ENERGY_EVERY == 0:
            mj = c("nvmlDeviceGetTotalEnergyConsumption", h)
            energy = None if mj is None else mj / 1000.0
        reads.previous_at = at
        reads.rounds += 1
        return ProcessRound(device.uuid, at, elapsed, tuple(memory.items()) if readable else None, sm, energy,
                            discarded, busy)
