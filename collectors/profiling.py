"""GPM profiling metrics and NVLink links, read by a background sampler: never on the scrape path.

NVML's GPM (GPU Performance Monitoring; Hopper and newer, drivers from R525, MIG instances included)
reports how much of the GPU worked, not only that a kernel ran: ``nvmlGpmSampleGet`` (or
``nvmlGpmMigSampleGet`` for one GPU instance) takes a sample of the GPU's counters and
``nvmlGpmMetricsGet`` turns two samples into metrics over the time between them. So
:class:`ProfilingSampler` keeps two samples per GPU and per MIG instance, takes one every
``interval`` seconds on its own worker (:class:`collectors.rounds.BackgroundRounds`, as the PCIe
sampler) and keeps the metrics of the last two; the scrape pass only copies them. The same round
reads each GPU's NVLink links (:mod:`collectors.nvlink`).

Units: NVML answers percentages 0.0-100.0 (pynvml's NVML_GPM_METRIC_* comments); they are exported
as ratios 0-1 (:data:`METRICS`). GPM's PCIe and NVLink rates are not exported: PCIe throughput is
already read (:mod:`collectors.pcie`), NVLink data as per-link byte counters (:mod:`collectors.nvlink`),
which Prometheus turns into rates without losing what happened between samples.

Unsupported is absent, never 0, with the reason in the device's ``profiling_state``:

* ``("ready", "")``: the last round gave metrics (a metric NVML answers NOT_SUPPORTED for is absent
  on its own);
* ``("unsupported", reason)``: ``nvmlGpmQueryDeviceSupport`` is missing (a driver before R525), says
  ``isSupportedDevice`` 0 (before Hopper), or a MIG instance's sample is NOT_SUPPORTED; asked again
  only in the next NVML session;
* ``("waiting", reason)``: no pair of samples yet (the first round), or the last round failed.

A reading older than :data:`STALE_INTERVALS` intervals is dropped (``waiting``), as the PCIe sampler's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from collectors import nvlink
from collectors.model import NvLinkReading
from collectors.nvml_call import DeviceLostError, NvmlCaller, NvmlUnavailableError
from collectors.rounds import BackgroundRounds

log = logging.getLogger(__name__)

STALE_INTERVALS = 3
_UNSUPPORTED: Any = object()

#: (family key, label value, NVML_GPM_METRIC_* name): the metrics read, each a percentage 0-100.
METRICS: tuple[tuple[str, str, str], ...] = (
    ("sm_active", "", "SM_UTIL"),
    ("sm_occupancy", "", "SM_OCCUPANCY"),
    ("graphics_engine_active", "", "GRAPHICS_UTIL"),
    ("dram_active", "", "DRAM_BW_UTIL"),
    ("tensor_active", "any", "ANY_TENSOR_UTIL"),
    ("tensor_active", "hmma", "HMMA_TENSOR_UTIL"),
    ("tensor_active", "imma", "IMMA_TENSOR_UTIL"),
    ("tensor_active", "dfma", "DFMA_TENSOR_UTIL"),
    ("tensor_active", "dmma", "DMMA_TENSOR_UTIL"),
    ("pipe_active", "fp64", "FP64_UTIL"),
    ("pipe_active", "fp32", "FP32_UTIL"),
    ("pipe_active", "fp16", "FP16_UTIL"),
    ("pipe_active", "integer", "INTEGER_UTIL"),
    *((("nvdec_active", str(i), f"NVDEC_{i}_UTIL")) for i in range(8)),
    *((("nvjpg_active", str(i), f"NVJPG_{i}_UTIL")) for i in range(8)),
)

Profile = tuple[tuple[str, str, float], ...]  # (family key, label value, ratio)


@dataclass(frozen=True)
class Target:
    """What one GPM reading is of: ``uuid`` (GPU or MIG instance), the physical GPU's ``handle``, and
    for a MIG instance its ``gpu_instance_id`` (read through the parent, ``nvmlGpmMigSampleGet``)."""

    uuid: str
    handle: Any
    gpu_instance_id: int | None = None


@dataclass
class _Track:
    target: Target
    supported: bool | None = None  # None: not asked in this session
    reason: str = ""
    samples: list[Any] = field(default_factory=list)  # [previous, spare] once allocated
    have_previous: bool = False
    links: tuple[int, ...] | None = None  # NVLink link numbers (GPUs), found once per session


class ProfilingSampler(BackgroundRounds):
    """Reads GPM metrics of every GPU and MIG instance, and NVLink links of every GPU, every
    ``interval`` seconds in the background (module docstring).

    ``call``: the backend's NVML wrapper; ``nvml``: pynvml or the replay (constants and structures);
    ``interval``: seconds between rounds (> 0), also the span each metric averages over;
    ``first_wait``: seconds :meth:`start` waits for the first round; ``clock``: monotonic seconds.
    Lifecycle as :class:`collectors.pcie.PcieSampler`, plus :meth:`release` (frees the GPM samples:
    call after :meth:`stop` once no round runs, before ``nvmlShutdown``). Thread-safe reader: :meth:`reading`.
    """

    def __init__(self, call: NvmlCaller, nvml: Any, interval: float, *, first_wait: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__("profiling", interval, first_wait=first_wait)
        self.call, self.nvml, self.clock = call, nvml, clock
        self._tracks: dict[str, _Track] = {}
        self._readings: dict[str, tuple[float, Profile, tuple[NvLinkReading, ...]]] = {}
        self._ids = [(key, label, getattr(nvml, f"NVML_GPM_METRIC_{name}", None)) for key, label, name in METRICS]

    def start(self, targets: Sequence[Target]) -> None:
        """Read ``targets`` from now on: a first round (waited for at most ``first_wait`` seconds;
        it takes the first samples, so metrics follow from the second), then the timer."""
        self.set_targets(targets)
        self._start_rounds()

    def set_targets(self, targets: Sequence[Target]) -> None:
        """Replace the devices read; tracks and readings of devices no longer listed are dropped
        (their GPM samples are left to :meth:`release`, since a round may be using them)."""
        with self._lock:
            old = self._tracks
            self._tracks = {t.uuid: old[t.uuid] if t.uuid in old and old[t.uuid].target == t else _Track(t)
                            for t in targets}
            self._readings = {u: r for u, r in self._readings.items() if u in self._tracks}

    def reading(self, uuid: str) -> tuple[Profile, tuple[str, str], tuple[NvLinkReading, ...]]:
        """``(metrics, (state, reason), NVLink links)`` of the device's last round: metrics as
        ``(family key, label value, ratio)``; ``()`` and a state saying why when there are none."""
        with self._lock:
            track, got = self._tracks.get(uuid), self._readings.get(uuid)
        if track is None:
            return (), ("waiting", "not read yet"), ()
        fresh = got is not None and self.clock() - got[0] <= STALE_INTERVALS * self.interval
        links = got[2] if got is not None and fresh else ()
        if track.supported is False:
            return (), ("unsupported", track.reason), links
        if got is None or not fresh or not got[1]:
            return (), ("waiting", track.reason or "no two GPM samples yet"), links
        return got[1], ("ready", ""), links

    def release(self) -> None:
        """Free every GPM sample (``nvmlGpmSampleFree``) and forget the tracks: NVML is about to shut
        down. Call only when no round runs (after :meth:`stop` and ``wait_idle``)."""
        with self._lock:
            tracks, self._tracks, self._readings = list(self._tracks.values()), {}, {}
        for track in tracks:
            for sample in track.samples:
                try:
                    self.call("nvmlGpmSampleFree", sample)
                except (DeviceLostError, NvmlUnavailableError):
                    break

    def _stopped(self) -> None:
        self._readings = {}

    def _stuck_consequence(self) -> str:
        return f"its devices' profiling values go absent after {STALE_INTERVALS * self.interval:g}s"

    def _round(self) -> None:
        """One GPM sample (and metrics since the previous one) per device, NVLink links per GPU."""
        with self._lock:
            tracks = list(self._tracks.values())
        for track in tracks:
            if self._stop.is_set():
                return
            try:
                profile = self._profile(track)
                links = self._links(track)
            except DeviceLostError as exc:
                track.have_previous, track.reason = False, str(exc)
                profile, links = (), ()
            except NvmlUnavailableError:
                with self._lock:
                    self._readings = {}
                return  # the backend's pass finds it too and re-initialises NVML
            with self._lock:
                if self._tracks.get(track.target.uuid) is track and not self._stop.is_set():
                    self._readings[track.target.uuid] = (self.clock(), profile, links)
        self.rounds += 1

    def _links(self, track: _Track) -> tuple[NvLinkReading, ...]:
        if track.target.gpu_instance_id is not None:
            return ()  # links belong to the physical GPU
        if track.links is None:
            track.links = nvlink.links(self.call, self.nvml, track.target.handle)
        return nvlink.read(self.call, self.nvml, track.target.handle, track.links)

    def _profile(self, track: _Track) -> Profile:
        t, c = track.target, self.call
        if track.supported is None:
            support = c("nvmlGpmQueryDeviceSupport", t.handle)
            track.supported = bool(support is not None and support.isSupportedDevice)
            if support is None:
                track.reason = "nvmlGpmQueryDeviceSupport not answered (GPM needs a driver from R525)"
            elif not track.supported:
                track.reason = "nvmlGpmQueryDeviceSupport: isSupportedDevice 0 (GPM needs a Hopper or newer GPU)"
        if not track.supported:
            return ()
        while len(track.samples) < 2:
            sample = c("nvmlGpmSampleAlloc")
            if sample is None:
                track.reason = "nvmlGpmSampleAlloc failed"
                return ()
            track.samples.append(sample)
        previous, spare = track.samples
        if t.gpu_instance_id is None:
            got = c("nvmlGpmSampleGet", t.handle, spare, unsupported=_UNSUPPORTED)
            call = "nvmlGpmSampleGet"
        else:
            got = c("nvmlGpmMigSampleGet", t.handle, t.gpu_instance_id, spare, unsupported=_UNSUPPORTED)
            call = "nvmlGpmMigSampleGet"
        if got is _UNSUPPORTED:
            track.supported, track.reason = False, f"{call}: NOT_SUPPORTED"
            for sample in track.samples:  # not asked again in this session: give them back now
                c("nvmlGpmSampleFree", sample)
            track.samples = []
            return ()
        if got is None:
            track.have_previous, track.reason = False, f"{call} failed"
            return ()
        profile: Profile = ()
        if track.have_previous:
            profile = self._metrics(previous, spare)
            track.reason = "" if profile else "nvmlGpmMetricsGet answered no metric"
        track.samples = [spare, previous]
        track.have_previous = True
        return profile

    def _metrics(self, first: Any, second: Any) -> Profile:
        """The :data:`METRICS` NVML answers between two samples, as ratios (percent / 100)."""
        known = [(key, label, mid) for key, label, mid in self._ids if mid is not None]
        mg = self.nvml.c_nvmlGpmMetricsGet_t()
        mg.version, mg.numMetrics = self.nvml.NVML_GPM_METRICS_GET_VERSION, len(known)
        mg.sample1, mg.sample2 = first, second
        for i, (_, _, mid) in enumerate(known):
            mg.metrics[i].metricId = mid
        if self.call("nvmlGpmMetricsGet", mg) is None:
            return ()
        out = []
        for i, (key, label, _) in enumerate(known):
            m = mg.metrics[i]
            if m.nvmlReturn == 0 and m.value == m.value:  # NaN is absent too
                out.append((key, label, min(max(float(m.value), 0.0), 100.0) / 100.0))
        return tuple(out)
