# ruff: noqa: N802, N803
# (method and argument names are NVML's)
"""GPM profiling samples and NVLink links in the replay: NVML's answers and their C structures.

:class:`GpmReplay` is part of :class:`collectors.replay.state.ReplayState` (one method per NVML
function, as the rest of the state); :data:`ADAPTERS` are the C-ABI bodies
:mod:`collectors.replay.lib` exports for the GPM symbols, reading and writing ``nvml.h``'s layouts
(:class:`GpmMetricsGetHeader`, :class:`GpmMetric`, :class:`GpmSupport`) at the pointers pynvml passes.

What NVML does and the replay keeps (nvml.h, "GPM"):

* ``nvmlGpmQueryDeviceSupport(device, nvmlGpmSupport_t *)``: ``version`` must be
  ``NVML_GPM_SUPPORT_VERSION`` (1; else ARGUMENT_VERSION_MISMATCH); ``isSupportedDevice`` is 1 for a
  GPU whose scenario has a ``[gpu.gpm]`` table, 0 otherwise (every capture: GPM needs Hopper or
  newer and a capture holds no GPM data), SUCCESS either way.
* ``nvmlGpmSampleAlloc(nvmlGpmSample_t *)`` / ``nvmlGpmSampleFree(sample)``: an opaque sample;
  freeing one twice, or using a freed one, is INVALID_ARGUMENT.
* ``nvmlGpmSampleGet(device, sample)`` fills the sample for the GPU (NOT_SUPPORTED without GPM);
  ``nvmlGpmMigSampleGet(device, gpuInstanceId, sample)`` for one GPU instance of a GPU in MIG mode
  (NOT_SUPPORTED when MIG is off or that instance has no ``[gpu.mig.gpm]``; INVALID_ARGUMENT for an
  instance id the GPU does not have).
* ``nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *)``: ``version`` must be ``NVML_GPM_METRICS_GET_VERSION``
  (1; else ARGUMENT_VERSION_MISMATCH); ``numMetrics`` at most ``NVML_GPM_METRIC_MAX``; both samples
  filled, of the same GPU or instance, ``sample1`` taken before ``sample2`` (INVALID_ARGUMENT
  otherwise). Each ``metrics[i]`` gets its own ``nvmlReturn``: SUCCESS and the scenario's value
  (constant over time: the activity between any two samples), NOT_SUPPORTED for a metric the table
  leaves out, INVALID_ARGUMENT for an id outside 1..MAX-1. ``metricInfo``'s strings stay NULL.

NVLink (scenario ``[[gpu.nvlink]]``): ``nvmlDeviceGetNvLinkState`` answers 1/0 for a link the scenario
lists, NOT_SUPPORTED for one it does not (the H200 PCIe card answers so for link 0:
``tests/shared/fixtures/h200/nvml_probe.json``), INVALID_ARGUMENT from ``NVML_NVLINK_MAX_LINKS``;
``nvmlDeviceGetNvLinkErrorCounter`` answers REPLAY / RECOVERY / CRC_FLIT (CRC_DATA and ECC_DATA are
NOT_SUPPORTED); field values ``NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX``/``_RX`` with ``scopeId`` the
link answer the KiB counters, ``NVML_FI_DEV_NVLINK_LINK_COUNT`` the highest link listed + 1
(:func:`nvlink_field`). MIG handles answer NOT_SUPPORTED, as for the other physical-GPU calls.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pynvml

from collectors.replay.capture import NVLINK_MAX_LINKS, GpuCapture, MigCapture, NvLinkCapture

SUCCESS, ERR_INVALID_ARGUMENT, ERR_NOT_SUPPORTED = 0, 2, 3
ERR_ARGUMENT_VERSION_MISMATCH = 25
GPM_SUPPORT_VERSION = 1  # nvml.h NVML_GPM_SUPPORT_VERSION
GPM_METRICS_GET_VERSION = 1  # nvml.h NVML_GPM_METRICS_GET_VERSION
GPM_METRIC_MAX = int(pynvml.NVML_GPM_METRIC_MAX)  # nvml.h NVML_GPM_METRIC_MAX of the newest header
# nvmlNvLinkErrorCounter_t -> NvLinkCapture attribute (NVML_NVLINK_ERROR_DL_CRC_DATA / ECC_DATA: none)
_ERROR_COUNTERS = {pynvml.NVML_NVLINK_ERROR_DL_REPLAY: "replay_errors",
                   pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: "recovery_errors",
                   pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc_flit_errors"}
_ERROR_COUNTER_COUNT = 5  # NVML_NVLINK_ERROR_DL_REPLAY .. NVML_NVLINK_ERROR_DL_ECC_DATA
_NVLINK_FIELDS = {pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: "throughput_data_tx",
                  pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: "throughput_data_rx"}


# -- nvml.h's layouts ----------------------------------------------------------------------------------
class GpmSupport(ctypes.Structure):
    """``nvmlGpmSupport_t``: ``unsigned int version; unsigned int isSupportedDevice``."""

    _fields_ = [("version", ctypes.c_uint), ("isSupportedDevice", ctypes.c_uint)]


class GpmMetric(ctypes.Structure):
    """``nvmlGpmMetric_t``: metricId, nvmlReturn, double value, metricInfo (three ``char *``)."""

    _fields_ = [("metricId", ctypes.c_uint), ("nvmlReturn", ctypes.c_int), ("value", ctypes.c_double),
                ("shortName", ctypes.c_void_p), ("longName", ctypes.c_void_p), ("unit", ctypes.c_void_p)]


class GpmMetricsGetHeader(ctypes.Structure):
    """The head of ``nvmlGpmMetricsGet_t`` (version, numMetrics, sample1, sample2); the
    ``nvmlGpmMetric_t metrics[NVML_GPM_METRIC_MAX]`` array follows at its size."""

    _fields_ = [("version", ctypes.c_uint), ("numMetrics", ctypes.c_uint), ("sample1", ctypes.c_void_p),
                ("sample2", ctypes.c_void_p)]


def _err(name: str) -> pynvml.NVMLError:
    return pynvml.NVMLError(getattr(pynvml, f"NVML_ERROR_{name}"))


class GpmSample:
    """An opaque ``nvmlGpmSample_t``: ``of`` (NVML index, GPU instance id or None) and ``taken_at``
    (the state's clock) once filled; ``live`` until freed."""

    __slots__ = ("__weakref__", "_owner", "live", "of", "taken_at")

    def __init__(self, owner: Any) -> None:
        self._owner, self.live = owner, True
        self.of: tuple[int, int | None] | None = None
        self.taken_at = 0.0

    def __repr__(self) -> str:
        return f"<GpmSample of={self.of} {'live' if self.live else 'freed'}>"


class GpmReplay:
    """The GPM and NVLink methods of :class:`collectors.replay.state.ReplayState` (module docstring)."""

    if TYPE_CHECKING:
        clock: Callable[[], float]
        gpm_samples: set[GpmSample]

        def _device(self, call: str, handle: Any, *, mig: bool = False, also: tuple[str, ...] = ()) -> Any: ...
        def _enter(self, call: str, gpu: int | None = None, *, also: tuple[str, ...] = ()) -> None: ...

    def nvmlGpmQueryDeviceSupport(self, device: Any) -> int:
        """1 when the GPU has a scenario ``[gpu.gpm]`` table, else 0 (isSupportedDevice)."""
        g: GpuCapture = self._device("nvmlGpmQueryDeviceSupport", device).gpu
        return int(g.gpm is not None)

    def nvmlGpmSampleAlloc(self) -> GpmSample:
        """A new, unfilled sample."""
        self._enter("nvmlGpmSampleAlloc")
        sample = GpmSample(self)
        self.gpm_samples.add(sample)  # alive until freed: the library keeps only a weak reference
        return sample

    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:
        """Free ``gpmSample``; INVALID_ARGUMENT for one not ours or already freed."""
        self._enter("nvmlGpmSampleFree")
        sample = self._sample(gpmSample)
        sample.live = False
        self.gpm_samples.discard(sample)

    def nvmlGpmSampleGet(self, device: Any, gpmSample: Any) -> None:
        """Fill ``gpmSample`` for the GPU; NOT_SUPPORTED without GPM."""
        t = self._device("nvmlGpmSampleGet", device)
        sample = self._sample(gpmSample)
        if t.gpu.gpm is None:
            raise _err("NOT_SUPPORTED")
        sample.of, sample.taken_at = (t.index, None), self.clock()

    def nvmlGpmMigSampleGet(self, device: Any, gpuInstanceId: int, gpmSample: Any) -> None:
        """Fill ``gpmSample`` for GPU instance ``gpuInstanceId`` of the GPU (MIG mode)."""
        t = self._device("nvmlGpmMigSampleGet", device)
        sample = self._sample(gpmSample)
        if not t.gpu.migs:
            raise _err("NOT_SUPPORTED")
        mig = _instance(t.gpu, gpuInstanceId)
        if mig is None:
            raise _err("INVALID_ARGUMENT")
        if mig.gpm is None:
            raise _err("NOT_SUPPORTED")
        sample.of, sample.taken_at = (t.index, int(gpuInstanceId)), self.clock()

    def nvmlGpmMetricsGet(self, sample1: Any, sample2: Any, metricIds: Sequence[int]) -> list[tuple[int, float]]:
        """``(nvmlReturn, value)`` per metric id between two filled samples of one GPU or instance."""
        self._enter("nvmlGpmMetricsGet")
        first, second = self._sample(sample1), self._sample(sample2)
        if first.of is None or first.of != second.of or second.taken_at < first.taken_at:
            raise _err("INVALID_ARGUMENT")
        gpu = self._gpus()[first.of[0]]
        mig = _instance(gpu, first.of[1]) if first.of[1] is not None else None
        values = dict((mig.gpm if mig is not None else gpu.gpm) or ())
        out = []
        for mid in metricIds:
            if not 0 < mid < GPM_METRIC_MAX:
                out.append((ERR_INVALID_ARGUMENT, 0.0))
            elif mid in values:
                out.append((SUCCESS, values[mid]))
            else:
                out.append((ERR_NOT_SUPPORTED, 0.0))
        return out

    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        """1 (NVML_FEATURE_ENABLED) for an active link, 0 for a down one."""
        return int(self._link("nvmlDeviceGetNvLinkState", device, link).up)

    def nvmlDeviceGetNvLinkErrorCounter(self, device: Any, link: int, counter: int) -> int:
        """The link's REPLAY / RECOVERY / CRC_FLIT error count."""
        nvlink = self._link("nvmlDeviceGetNvLinkErrorCounter", device, link)
        if not 0 <= counter < _ERROR_COUNTER_COUNT:
            raise _err("INVALID_ARGUMENT")
        if counter not in _ERROR_COUNTERS:
            raise _err("NOT_SUPPORTED")
        return int(getattr(nvlink, _ERROR_COUNTERS[counter]))

    def _link(self, call: str, device: Any, link: int) -> NvLinkCapture:
        g: GpuCapture = self._device(call, device).gpu
        if not 0 <= link < NVLINK_MAX_LINKS:
            raise _err("INVALID_ARGUMENT")
        found = next((n for n in g.nvlinks if n.link == link), None)
        if found is None:
            raise _err("NOT_SUPPORTED")
        return found

    def _sample(self, sample: Any) -> GpmSample:
        if not isinstance(sample, GpmSample) or sample._owner is not self or not sample.live:
            raise _err("INVALID_ARGUMENT")
        return sample

    def _gpus(self) -> tuple[GpuCapture, ...]:
        return self.capture.gpus  # type: ignore[attr-defined, no-any-return]


def _instance(gpu: GpuCapture, gpu_instance_id: int) -> MigCapture | None:
    return next((m for m in gpu.migs if m.gpu_instance_id == gpu_instance_id), None)


def nvlink_field(gpu: GpuCapture, field_id: int, scope: int) -> tuple[int, int, int] | None:
    """``(valueType, nvmlReturn, value)`` for an NVLink field: THROUGHPUT_DATA_TX / _RX of link ``scope``
    (KiB, unsigned long long), LINK_COUNT (the highest link listed + 1, unsigned int; NOT_SUPPORTED
    without links, as the H200 PCIe card answers); None for a field this module does not answer."""
    if field_id == pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT:
        count = max((n.link + 1 for n in gpu.nvlinks), default=0)
        return pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, (SUCCESS if count else ERR_NOT_SUPPORTED), count
    attr = _NVLINK_FIELDS.get(field_id)
    if attr is None:
        return None
    link = next((n for n in gpu.nvlinks if n.link == scope), None)
    ull = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    return (ull, ERR_NOT_SUPPORTED, 0) if link is None else (ull, SUCCESS, int(getattr(link, attr)))


# -- the C bodies ----------------------------------------------------------------------------------------
def _query_support(lib: Any, state: Any, params: list[str], args: Sequence[Any]) -> int:
    """``(nvmlDevice_t, nvmlGpmSupport_t *)``."""
    if not args[1]:
        return ERR_INVALID_ARGUMENT
    support = GpmSupport.from_address(args[1])
    supported = state.nvmlGpmQueryDeviceSupport(lib.lookup(args[0]))
    if support.version != GPM_SUPPORT_VERSION:
        return ERR_ARGUMENT_VERSION_MISMATCH
    support.isSupportedDevice = supported
    return SUCCESS


def _sample_alloc(lib: Any, state: Any, params: list[str], args: Sequence[Any]) -> int:
    """``(nvmlGpmSample_t *)``."""
    if not args[0]:
        return ERR_INVALID_ARGUMENT
    ctypes.c_void_p.from_address(args[0]).value = lib.address(state.nvmlGpmSampleAlloc())
    return SUCCESS


def _sample_free(lib: Any, state: Any, params: list[str], args: Sequence[Any]) -> int:
    """``(nvmlGpmSample_t)``."""
    state.nvmlGpmSampleFree(lib.lookup(args[0]))
    return SUCCESS


def _sample_get(lib: Any, state: Any, params: list[str], args: Sequence[Any]) -> int:
    """``(nvmlDevice_t, nvmlGpmSample_t)``."""
    state.nvmlGpmSampleGet(lib.lookup(args[0]), lib.lookup(args[1]))
    return SUCCESS


def _mig_sample_get(lib: Any, state: Any, params: list[str], args: Sequence[Any]) -> int:
    """``(nvmlDevice_t, unsigned int gpuInstanceId, nvmlGpmSample_t)``."""
    state.nvmlGpmMigSampleGet(lib.lookup(args[0]), int(args[1]), lib.lookup(args[2]))
    return SUCCESS


def _metrics_get(lib: Any, state: Any, params: list[str], args: Sequence[Any]) -> int:
    """``(nvmlGpmMetricsGet_t *)``: version and numMetrics checked, each metric's id read and its
    nvmlReturn and value written."""
    if not args[0]:
        return ERR_INVALID_ARGUMENT
    head = GpmMetricsGetHeader.from_address(args[0])
    if head.version != GPM_METRICS_GET_VERSION:
        return ERR_ARGUMENT_VERSION_MISMATCH
    n = int(head.numMetrics)
    if n > GPM_METRIC_MAX:
        return ERR_INVALID_ARGUMENT
    metrics: Any = (GpmMetric * n).from_address(args[0] + ctypes.sizeof(GpmMetricsGetHeader)) if n else []
    owner = getattr(lib.lookup(head.sample1), "_owner", state)
    answers = owner.nvmlGpmMetricsGet(lib.lookup(head.sample1), lib.lookup(head.sample2),
                                      [int(m.metricId) for m in metrics])
    for m, (ret, value) in zip(metrics, answers, strict=True):
        m.nvmlReturn, m.value = ret, value
        m.shortName = m.longName = m.unit = None
    return SUCCESS


ADAPTERS: dict[str, Callable[..., int]] = {
    "nvmlGpmQueryDeviceSupport": _query_support,
    "nvmlGpmSampleAlloc": _sample_alloc,
    "nvmlGpmSampleFree": _sample_free,
    "nvmlGpmSampleGet": _sample_get,
    "nvmlGpmMigSampleGet": _mig_sample_get,
    "nvmlGpmMetricsGet": _metrics_get,
}
"""The GPM symbols' C bodies (NVLink's go through :mod:`collectors.replay.lib`'s generic adapter)."""
