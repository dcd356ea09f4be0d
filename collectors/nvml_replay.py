# ruff: noqa: N802, N803, N815
# (method and argument names are pynvml's)
"""A replay of NVML: a pynvml-compatible stand-in answering from captured ``nvidia-smi -q -x`` output.

For tests, benchmarks and demos on machines without a GPU. Everything it reports is labelled
``source="replay"`` (:attr:`ReplayNVML.source`), never passed off as a live reading.

:class:`ReplayNVML` instances can be used wherever the ``pynvml`` module is: each implemented call
has pynvml's name, arguments, return shape (pynvml's own ctypes structures and ``nvmlFriendlyObject``)
and errors (``pynvml.NVMLError(pynvml.NVML_ERROR_<X>)``, which pynvml turns into subclasses such as
``NVMLError_NotSupported``). Attributes it does not define fall back to the ``pynvml`` module for
constants and classes (``NVML_CLOCK_SM``, ``nvmlMemory_v2``, ``NVMLError``, …); any pynvml NVML
*function* it does not implement raises NVML_ERROR_FUNCTION_NOT_FOUND, so nothing reaches the real
library. Behaviour follows NVML: every call but init raises UNINITIALIZED before ``nvmlInit`` and
after the last ``nvmlShutdown`` (init is reference-counted); a value the capture gives as N/A raises
NOT_SUPPORTED ("Requested functionality has been deprecated": DEPRECATED), and so does one NVML's
unsigned type cannot hold (``-36 C``: listed in ``GpuCapture.invalid``); MIG device handles answer
identity, memory and process calls and raise NOT_SUPPORTED for everything else (utilisation, power,
clocks, events, …), as real MIG devices do.

Events: ``nvmlEventSetCreate`` / ``nvmlEventSetFree``, ``nvmlDeviceGetSupportedEventTypes``,
``nvmlDeviceRegisterEvents`` and ``nvmlEventSetWait_v2`` / ``nvmlEventSetWait`` deliver the XIDs a
scenario schedules (``[[event]]``, :class:`collectors.nvml_capture.EventCapture`), each due
``after_seconds`` after the replay's first ``nvmlInit``, to the sets registered for that GPU and
event type; a wait sleeps in slices of at most :data:`EVENT_WAIT_SLICE_S` and raises TIMEOUT when
nothing is due within ``timeoutms`` (:meth:`ReplayNVML.nvmlEventSetWait_v2` has the rules).

Inputs (:meth:`ReplayNVML.from_path`): an ``nvidia-smi -q -x`` XML file (every ``<gpu>``, NVML index
= position), or a scenario TOML (suffix ``.toml``; keys in :mod:`collectors.nvml_capture`) that picks
GPUs out of captures, overrides their identity and readings, adds processes and MIG instances, and
injects faults (errors, ``after_calls``, ``times``, hangs) into any call, and schedules XID events.

Values NVML has but ``nvidia-smi -q -x`` does not print are documented where they are made up:
samples and process-utilisation timestamps come from the wall clock, total energy grows at the
captured power draw from :data:`ENERGY_BASE_MJ`, the encoder/decoder sampling period is
:data:`SAMPLING_PERIOD_US`, compute capability and architecture come from tables in
:mod:`collectors.nvml_capture`, MIG UUIDs from :func:`mig_uuid`.
"""

from __future__ import annotations

import ctypes
import inspect
import re
import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pynvml

from collectors.nvml_capture import (
    EVENT_TYPES,
    CaptureError,
    EventCapture,
    Fault,
    GpuCapture,
    MigCapture,
    SystemCapture,
    architecture_code,
    compute_capability,
    load_scenario,
    mig_profile,
    parse_capture,
    pci_bus_id_parts,
)

__all__ = ["IMPLEMENTED_CALLS", "EventCapture", "Fault", "ReplayError", "ReplayEventData", "ReplayEventSet",
           "ReplayHandle", "ReplayNVML", "mig_uuid"]

SAMPLE_PERIOD_US = 1_000_000 // 6  # one utilisation sample per 1/6 s, as NVML's sampler
SAMPLE_BUFFER = 120  # samples NVML keeps per type (20 s at 6 Hz)
SAMPLING_PERIOD_US = 100_000  # encoder/decoder sampling period the H200 reported (nvml_probe.json)
ENERGY_BASE_MJ = 0  # total energy at ReplayNVML construction; then + power_usage_mw x seconds
UINT_MAX = 0xFFFFFFFF  # NVML's "no instance" gpuInstanceId / computeInstanceId of non-MIG processes
MIG_MAX_DEVICES = 7  # nvmlDeviceGetMaxMigDeviceCount with MIG enabled (A30: 4)
EVENT_WAIT_SLICE_S = 0.05  # nvmlEventSetWait_v2 sleeps in slices of at most this (and of at least 1 ms)
# nvmlDeviceGetSupportedEventTypes: every GPU (nvml.h: "for Fermi or newer fully supported devices"),
# plus the single and double bit ECC events where ECC is enabled ("ECC events are available only on ECC
# enabled devices"). Clock events are Kepler only; the others (MIG config change, DRAM retirement,
# poison, recovery action, …) depend on the GPU and driver in ways a capture does not show: left out.
_EVENTS_EVERY_GPU = pynvml.nvmlEventTypePState | pynvml.nvmlEventTypeXidCriticalError
_EVENTS_ECC = pynvml.nvmlEventTypeSingleBitEccError | pynvml.nvmlEventTypeDoubleBitEccError

# nvmlDeviceGetFieldValues fields the replay answers: field id -> GpuCapture attribute.
_FIELD_IDS = {getattr(pynvml, k): v for k, v in {
    "NVML_FI_DEV_MEMORY_TEMP": "temp_memory_c", "NVML_FI_DEV_POWER_AVERAGE": "power_average_mw",
    "NVML_FI_DEV_POWER_INSTANT": "power_instant_mw", "NVML_FI_DEV_PCIE_REPLAY_COUNTER": "pcie_replay_counter",
}.items() if hasattr(pynvml, k)}
_CLOCKS = {0: "graphics", 1: "sm", 2: "mem", 3: "video"}  # NVML_CLOCK_GRAPHICS/SM/MEM/VIDEO
_SAMPLES = {0: "power_usage_mw", 1: "util_gpu_percent", 2: "util_memory_percent", 3: "util_encoder_percent",
            4: "util_decoder_percent", 5: "clock_graphics_mhz", 6: "clock_mem_mhz"}  # NVML_*_SAMPLES
_PROCESS_CALLS = {"nvmlDeviceGetComputeRunningProcesses": "compute",
                  "nvmlDeviceGetGraphicsRunningProcesses": "graphics",
                  "nvmlDeviceGetMPSComputeRunningProcesses": "mps"}
_PURE_HELPERS = frozenset({"nvmlStructToFriendlyObject", "nvmlFriendlyObjectToStruct"})


class ReplayError(ValueError):
    """A replay input is unusable; the message names the file and the line/column or the key."""


def _err(name: str) -> pynvml.NVMLError:
    """``pynvml.NVMLError`` for ``NVML_ERROR_<name>`` (pynvml picks the subclass)."""
    return pynvml.NVMLError(getattr(pynvml, f"NVML_ERROR_{name}"))


def mig_uuid(parent_uuid: str, gpu_instance_id: int, compute_instance_id: int) -> str:
    """Stable made-up MIG UUID: ``MIG-`` + uuid5(NAMESPACE_OID, "<parent>/<gi>/<ci>") (8-4-4-4-12)."""
    return f"MIG-{uuidlib.uuid5(uuidlib.NAMESPACE_OID, f'{parent_uuid}/{gpu_instance_id}/{compute_instance_id}')}"


class ReplayHandle:
    """Opaque device handle: NVML index ``gpu`` and, for MIG devices, the :class:`MigCapture`."""

    __slots__ = ("_owner", "gpu", "mig")

    def __init__(self, owner: ReplayNVML, gpu: int, mig: MigCapture | None = None) -> None:
        self._owner, self.gpu, self.mig = owner, gpu, mig

    def __repr__(self) -> str:
        return f"<ReplayHandle gpu={self.gpu}{'' if self.mig is None else f' mig={self.mig.index}'}>"


def _getter(call: str, attrs: str | tuple[str, ...], doc: str, mig: bool = False) -> Callable[[ReplayNVML, Any], Any]:
    """A method answering ``call(handle)`` with GpuCapture ``attrs`` (one value, or a list of
    them); NOT_SUPPORTED (DEPRECATED) when one is None."""

    def method(self: ReplayNVML, handle: Any) -> Any:
        gpu = self._device(call, handle, mig=mig).gpu
        return self._need(gpu, attrs) if isinstance(attrs, str) else [self._need(gpu, a) for a in attrs]

    method.__name__ = method.__qualname__ = call
    method.__doc__ = doc
    return method


class ReplayEventSet:
    """Opaque event-set handle (nvmlEventSetCreate); its state is the replay's, under its lock."""

    __slots__ = ("_owner", "delivered", "live", "registered")

    def __init__(self, owner: ReplayNVML) -> None:
        self._owner, self.live = owner, True
        self.registered: dict[tuple[int, int], float] = {}  # (NVML index, event type bit) -> clock when
        self.delivered: set[int] = set()  # positions in ReplayNVML._events

    def __repr__(self) -> str:
        return f"<ReplayEventSet {'live' if self.live else 'freed'} registered={sorted(self.registered)}>"


class ReplayEventData:
    """What nvmlEventSetWait_v2 returns: the fields of pynvml's ``c_nvmlEventData_t`` (``_fields_``,
    so ``nvmlStructToFriendlyObject`` takes it), with ``.device`` the :class:`ReplayHandle` of the GPU
    (ctypes cannot hold one); printed as pynvml prints the structure."""

    __slots__ = ("computeInstanceId", "device", "eventData", "eventType", "gpuInstanceId")
    _fields_ = pynvml.c_nvmlEventData_t._fields_

    def __init__(self, device: ReplayHandle, eventType: int, eventData: int, gpuInstanceId: int,
                 computeInstanceId: int) -> None:
        self.device, self.eventType, self.eventData = device, eventType, eventData
        self.gpuInstanceId, self.computeInstanceId = gpuInstanceId, computeInstanceId

    def __str__(self) -> str:
        return (f"c_nvmlEventData_t(device: {self.device}, eventType: 0x{self.eventType:08X}, "
                f"eventData: {self.eventData}, gpuInstanceId: {self.gpuInstanceId}, "
                f"computeInstanceId: {self.computeInstanceId})")

    __repr__ = __str__


class _Target:
    """A resolved handle: NVML index, capture of the physical GPU, MIG instance (or None)."""

    __slots__ = ("gpu", "index", "mig")

    def __init__(self, index: int, gpu: GpuCapture, mig: MigCapture | None) -> None:
        self.index, self.gpu, self.mig = index, gpu, mig


class ReplayNVML:
    """pynvml-compatible NVML replay of a :class:`SystemCapture` (module docstring: behaviour).

    ``capture``: the GPUs in NVML index order and the system versions. ``faults``: injected
    failures. ``path``: the file it came from (None when built in code). ``clock`` (seconds since
    the epoch; drives sample and process-utilisation timestamps and the energy counter) and
    ``sleep`` (used by ``hang_seconds`` and nvmlEventSetWait_v2) are injectable for tests; the clock
    also times scenario events. Thread-safe.
    """

    source = "replay"

    def __init__(self, capture: SystemCapture, faults: Sequence[Fault] = (), *, path: Path | None = None,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> None:
        self.path = path
        self.capture = capture
        self.faults = tuple(faults)
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._refcount = 0
        self._fault_calls = [0] * len(self.faults)
        self._fault_hits = [0] * len(self.faults)
        self._handles = [ReplayHandle(self, i) for i in range(len(capture.gpus))]
        self._mig_handles = {(i, m.index): ReplayHandle(self, i, m)
                             for i, g in enumerate(capture.gpus) for m in g.migs}
        self._t0 = clock()
        self._energy_last: dict[int, int] = {}
        self._t_init: float | None = None  # clock at the first nvmlInit: scenario events count from it
        # events in the order they fall due (file order among equals): (position, event)
        self._events = sorted(enumerate(capture.events), key=lambda e: (e[1].after_seconds, e[0]))
        self._claimed: set[int] = set()  # positions of events delivered to some set
        self._sets: list[ReplayEventSet] = []

    @classmethod
    def from_path(cls, path: str | Path, **kwargs: Any) -> ReplayNVML:
        """Load an ``nvidia-smi -q -x`` XML file, or a scenario when the suffix is ``.toml``.

        ``kwargs`` go to the constructor (``clock``, ``sleep``). Raises ReplayError, and nothing
        else whatever the file holds, naming the file and the line/column (malformed XML or TOML,
        a ``<gpu>`` without a UUID or with another's), the line and byte offset (a scenario that is
        not UTF-8), the OS reason (unreadable: missing, a directory, no permission) or the offending
        key (scenario errors, :func:`collectors.nvml_capture.load_scenario`).
        """
        path = Path(path)
        if "\0" in str(path):
            raise ReplayError(f"cannot read {path!r}: the name holds a NUL character")
        try:
            if path.suffix.lower() == ".toml":
                errors = [n.removeprefix("NVML_ERROR_") for n in dir(pynvml) if n.startswith("NVML_ERROR_")]
                capture, faults = load_scenario(path, calls=IMPLEMENTED_CALLS, errors=errors)
                return cls(capture, faults, path=path, **kwargs)
            return cls(parse_capture(path), path=path, **kwargs)
        except CaptureError as exc:
            raise ReplayError(str(exc)) from exc
        except OSError as exc:
            raise ReplayError(f"cannot read {path}: {exc.strerror or exc}") from exc

    # -- pynvml module emulation ---------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        """pynvml's constants and classes; its unimplemented NVML functions raise FUNCTION_NOT_FOUND."""
        if name.startswith("__"):
            raise AttributeError(name)
        value = getattr(pynvml, name)
        if inspect.isfunction(value) and "nvml" in name.lower() and name not in _PURE_HELPERS:
            def not_found(*args: Any, **kwargs: Any) -> Any:
                raise _err("FUNCTION_NOT_FOUND")
            not_found.__name__ = name
            return not_found
        return value

    def __dir__(self) -> list[str]:
        names = {n for n in dir(pynvml) if not inspect.isfunction(getattr(pynvml, n))}
        return sorted(names | set(object.__dir__(self)))

    # -- plumbing -----------------------------------------------------------------------------
    def _enter(self, call: str, gpu: int | None = None) -> None:
        """UNINITIALIZED check (except init), then the faults matching ``call`` and ``gpu``."""
        hang, error = 0.0, None
        with self._lock:
            if self._refcount == 0 and call not in ("nvmlInit", "nvmlInitWithFlags"):
                raise _err("UNINITIALIZED")
            for i, f in enumerate(self.faults):
                if f.call not in (call, "*") or (f.gpu is not None and f.gpu != gpu) or \
                        (f.call == "*" and gpu is None):
                    continue
                self._fault_calls[i] += 1
                if self._fault_calls[i] <= f.after_calls or (f.times is not None and self._fault_hits[i] >= f.times):
                    continue
                self._fault_hits[i] += 1
                hang, error = max(hang, f.hang_seconds), error or f.error
        if hang:
            self._sleep(hang)
        if error:
            raise _err(error)

    def _device(self, call: str, handle: Any, *, mig: bool = False) -> _Target:
        """Resolve a handle of this replay (INVALID_ARGUMENT otherwise) after :meth:`_enter`;
        MIG handles raise NOT_SUPPORTED unless ``mig``."""
        ours = isinstance(handle, ReplayHandle) and handle._owner is self
        self._enter(call, handle.gpu if ours else None)
        if not ours:
            raise _err("INVALID_ARGUMENT")
        if handle.mig is not None and not mig:
            raise _err("NOT_SUPPORTED")
        return _Target(handle.gpu, self.capture.gpus[handle.gpu], handle.mig)

    @staticmethod
    def _need(obj: Any, attr: str) -> Any:
        value = getattr(obj, attr)
        if value is None:
            raise _err("DEPRECATED" if attr in getattr(obj, "deprecated", ()) else "NOT_SUPPORTED")
        return value

    def _now_us(self) -> int:
        return int(self._clock() * 1_000_000)

    # -- system -------------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        """Initialise (reference-counted, like NVML); faults on ``nvmlInit`` or ``nvmlInitWithFlags``."""
        self._enter("nvmlInit")
        self.nvmlInitWithFlags(0)

    def nvmlInitWithFlags(self, flags: int) -> None:
        """Initialise with NVML_INIT_FLAG_* ``flags`` (accepted, no effect); reference-counted."""
        self._enter("nvmlInitWithFlags")
        with self._lock:
            self._refcount += 1
            if self._t_init is None:
                self._t_init = self._clock()

    def nvmlShutdown(self) -> None:
        """Drop one init reference; at zero every call but init raises UNINITIALIZED again, and the
        event sets are freed (NVML releases them with the library)."""
        self._enter("nvmlShutdown")
        with self._lock:
            self._refcount = max(0, self._refcount - 1)
            if self._refcount == 0:
                for es in self._sets:
                    es.live = False
                self._sets.clear()

    def nvmlSystemGetDriverVersion(self) -> str:
        """Driver version (str) from ``<driver_version>``."""
        self._enter("nvmlSystemGetDriverVersion")
        return str(self._need(self.capture, "driver_version"))

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        """CUDA driver version as NVML encodes it, major x 1000 + minor x 10 (``13.0`` → 13000)."""
        self._enter("nvmlSystemGetCudaDriverVersion")
        m = re.fullmatch(r"(\d+)\.(\d+)", self.capture.cuda_version or "")
        if m is None:
            raise _err("NOT_SUPPORTED")
        return int(m.group(1)) * 1000 + int(m.group(2)) * 10

    def nvmlSystemGetNVMLVersion(self) -> str:
        """NVML version, which NVML spells ``<CUDA major>.<driver version>`` (``13.580.159.04``)."""
        self._enter("nvmlSystemGetNVMLVersion")
        cuda, driver = self.capture.cuda_version, self.capture.driver_version
        if not cuda or not driver:
            raise _err("NOT_SUPPORTED")
        return f"{cuda.split('.')[0]}.{driver}"

    def nvmlDeviceGetCount(self) -> int:
        """Number of physical GPUs (MIG instances not counted)."""
        self._enter("nvmlDeviceGetCount")
        return len(self.capture.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> ReplayHandle:
        """Handle of GPU ``index``; INVALID_ARGUMENT when out of range. Faults with ``gpu`` match it."""
        self._enter("nvmlDeviceGetHandleByIndex", index)
        if not isinstance(index, int) or not 0 <= index < len(self._handles):
            raise _err("INVALID_ARGUMENT")
        return self._handles[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> ReplayHandle:
        """Handle of the GPU or MIG device with ``uuid`` (str or bytes); NOT_FOUND when none."""
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        found = [h for h in self._all_handles() if self._uuid(h) == text]
        self._enter("nvmlDeviceGetHandleByUUID", found[0].gpu if found else None)
        if not found:
            raise _err("NOT_FOUND")
        return found[0]

    def nvmlDeviceGetHandleByPciBusId(self, pciBusId: str | bytes) -> ReplayHandle:
        """Handle of the GPU at ``pciBusId`` (``"00000000:00:06.0"`` or ``"0000:00:06.0"``); NOT_FOUND."""
        want = pci_bus_id_parts(pciBusId.decode() if isinstance(pciBusId, bytes) else pciBusId)
        found = [h for h, g in zip(self._handles, self.capture.gpus, strict=True)
                 if want is not None and pci_bus_id_parts(g.pci_bus_id or "") == want]
        self._enter("nvmlDeviceGetHandleByPciBusId", found[0].gpu if found else None)
        if not found:
            raise _err("NOT_FOUND")
        return found[0]

    def _all_handles(self) -> list[ReplayHandle]:
        return [*self._handles, *self._mig_handles.values()]

    def _uuid(self, handle: ReplayHandle) -> str | None:
        gpu = self.capture.gpus[handle.gpu]
        if handle.mig is None:
            return gpu.uuid
        return handle.mig.uuid or mig_uuid(gpu.uuid or "", handle.mig.gpu_instance_id,
                                           handle.mig.compute_instance_id)

    # -- identity -----------------------------------------------------------------------------
    def nvmlDeviceGetName(self, handle: Any) -> str:
        """Product name from ``<product_name>``; MIG: ``"<parent name> MIG <profile>"`` (mig_profile)."""
        t = self._device("nvmlDeviceGetName", handle, mig=True)
        name = str(self._need(t.gpu, "name"))
        return name if t.mig is None else f"{name} MIG {mig_profile(t.gpu, t.mig)}"

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        """``GPU-…`` from ``<uuid>``; MIG: the scenario's uuid or :func:`mig_uuid`."""
        t = self._device("nvmlDeviceGetUUID", handle, mig=True)
        return str(self._need(t.gpu, "uuid") if t.mig is None else self._uuid(handle))

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        """NVML index (position in the capture / scenario order)."""
        return self._device("nvmlDeviceGetIndex", handle).index

    def nvmlDeviceGetPciInfo_v3(self, handle: Any) -> pynvml.nvmlPciInfo_t:
        """pynvml ``nvmlPciInfo_t`` from ``<pci>``: ``.busId`` (str ``"00000000:00:06.0"``),
        ``.busIdLegacy`` (``"0000:00:06.0"``), ``.domain .bus .device .pciDeviceId .pciSubSystemId``;
        MIG handles answer their parent's."""
        g = self._device("nvmlDeviceGetPciInfo_v3", handle, mig=True).gpu
        info = pynvml.nvmlPciInfo_t()
        bus_id = str(self._need(g, "pci_bus_id"))
        info.busId = bus_id.encode()
        info.busIdLegacy = bus_id[4:].encode() if len(bus_id) == 16 else bus_id.encode()[:15]
        for attr, name in (("domain", "pci_domain"), ("bus", "pci_bus"), ("device", "pci_device"),
                           ("pciDeviceId", "pci_device_id"), ("pciSubSystemId", "pci_subsystem_id")):
            setattr(info, attr, getattr(g, name) or 0)
        return info

    def nvmlDeviceGetPciInfo(self, handle: Any) -> pynvml.nvmlPciInfo_t:
        """Same as :meth:`nvmlDeviceGetPciInfo_v3` (pynvml's alias); faults match either name."""
        self._device("nvmlDeviceGetPciInfo", handle, mig=True)
        return self.nvmlDeviceGetPciInfo_v3(handle)

    nvmlDeviceGetSerial = _getter("nvmlDeviceGetSerial", "serial", "Board serial (str) from ``<serial>``.")
    nvmlDeviceGetMinorNumber = _getter(
        "nvmlDeviceGetMinorNumber", "minor", "Minor number of ``/dev/nvidia<minor>`` from ``<minor_number>``.")
    nvmlDeviceGetVbiosVersion = _getter("nvmlDeviceGetVbiosVersion", "vbios_version", "``<vbios_version>`` (str).")
    nvmlDeviceGetBoardPartNumber = _getter(
        "nvmlDeviceGetBoardPartNumber", "board_part_number", "``<board_part_number>``; absent before v12.")
    nvmlDeviceGetComputeMode = _getter(
        "nvmlDeviceGetComputeMode", "compute_mode", "NVML_COMPUTEMODE_* from ``<compute_mode>``.")
    nvmlDeviceGetPersistenceMode = _getter(
        "nvmlDeviceGetPersistenceMode", "persistence_mode", "1 enabled / 0 disabled, ``<persistence_mode>``.")
    nvmlDeviceGetDisplayActive = _getter(
        "nvmlDeviceGetDisplayActive", "display_active", "1 / 0 from ``<display_active>``.")
    nvmlDeviceGetDisplayMode = _getter(
        "nvmlDeviceGetDisplayMode", "display_mode", "1 / 0 from ``<display_mode>``; DEPRECATED on v13 captures.")

    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        """``[current, pending]`` (1 enabled) from ``<mig_mode>``; NOT_SUPPORTED where N/A."""
        g = self._device("nvmlDeviceGetMigMode", device).gpu
        return [int(self._need(g, "mig_current")), int(self._need(g, "mig_pending"))]

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        """``(major, minor)`` from nvml_capture.COMPUTE_CAPABILITY (the XML has none); MIG: parent's."""
        cc = compute_capability(self._device("nvmlDeviceGetCudaComputeCapability", handle, mig=True).gpu)
        if cc is None:
            raise _err("NOT_SUPPORTED")
        return cc

    def nvmlDeviceGetArchitecture(self, device: Any) -> int:
        """NVML_DEVICE_ARCH_* from ``<product_architecture>`` (UNKNOWN 0xFFFFFFFF when unlisted)."""
        return architecture_code(self._device("nvmlDeviceGetArchitecture", device, mig=True).gpu)

    # -- memory and utilisation ----------------------------------------------------------------
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        """Frame-buffer memory in bytes from ``<fb_memory_usage>`` (MIG: the instance's).

        ``version`` falsy: ``c_nvmlMemory_t`` ``.total .free .used`` with used = total - free (v1
        counts reserved memory as used; 0 when a scenario makes free exceed total);
        ``pynvml.nvmlMemory_v2``: ``c_nvmlMemory_v2_t`` ``.version .total .reserved .free .used`` as
        captured. Another version: ARGUMENT_VERSION_MISMATCH.
        """
        t = self._device("nvmlDeviceGetMemoryInfo", handle, mig=True)
        src: Any = t.mig or t.gpu
        total, free, used = (self._need(src, f"memory_{k}_bytes") for k in ("total", "free", "used"))
        if not version:
            return pynvml.c_nvmlMemory_t(total=total, free=free, used=max(0, total - free))
        if version != pynvml.nvmlMemory_v2:
            raise _err("ARGUMENT_VERSION_MISMATCH")
        reserved = src.memory_reserved_bytes
        reserved = max(0, total - free - used) if reserved is None else reserved
        return pynvml.c_nvmlMemory_v2_t(version=version, total=total, reserved=reserved, free=free, used=used)

    def nvmlDeviceGetBAR1MemoryInfo(self, handle: Any) -> Any:
        """``c_nvmlBAR1Memory_t`` ``.bar1Total .bar1Free .bar1Used`` bytes from ``<bar1_memory_usage>``."""
        t = self._device("nvmlDeviceGetBAR1MemoryInfo", handle, mig=True)
        src: Any = t.mig or t.gpu
        return pynvml.c_nvmlBAR1Memory_t(**{f"bar1{k.title()}": self._need(src, f"bar1_{k}_bytes")
                                            for k in ("total", "free", "used")})

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        """``c_nvmlUtilization_t`` ``.gpu .memory`` percent from ``<utilization>``."""
        g = self._device("nvmlDeviceGetUtilizationRates", handle).gpu
        return pynvml.c_nvmlUtilization_t(gpu=self._need(g, "util_gpu_percent"),
                                          memory=self._need(g, "util_memory_percent"))

    def nvmlDeviceGetEncoderUtilization(self, handle: Any) -> list[int]:
        """``[percent, sampling period µs]``: ``<encoder_util>`` and :data:`SAMPLING_PERIOD_US`."""
        g = self._device("nvmlDeviceGetEncoderUtilization", handle).gpu
        return [int(self._need(g, "util_encoder_percent")), SAMPLING_PERIOD_US]

    def nvmlDeviceGetDecoderUtilization(self, handle: Any) -> list[int]:
        """``[percent, sampling period µs]``: ``<decoder_util>`` and :data:`SAMPLING_PERIOD_US`."""
        g = self._device("nvmlDeviceGetDecoderUtilization", handle).gpu
        return [int(self._need(g, "util_decoder_percent")), SAMPLING_PERIOD_US]

    def nvmlDeviceGetSamples(self, device: Any, sampling_type: int, timeStamp: int) -> tuple[int, list[Any]]:
        """``(NVML_VALUE_TYPE_UNSIGNED_INT, [c_nvmlSample_t])`` newer than ``timeStamp`` (µs).

        Samples sit on a wall-clock grid of :data:`SAMPLE_PERIOD_US`, at most :data:`SAMPLE_BUFFER`
        of them, each ``.sampleValue.uiVal`` the captured value: types TOTAL_POWER (mW), GPU /
        MEMORY / ENC / DEC utilisation (percent), PROCESSOR / MEMORY clock (MHz). NOT_FOUND when no
        sample is newer than ``timeStamp``; NOT_SUPPORTED for other types, N/A values and MIG.
        """
        g = self._device("nvmlDeviceGetSamples", device).gpu
        if sampling_type not in _SAMPLES:
            raise _err("NOT_SUPPORTED")
        value = self._need(g, _SAMPLES[sampling_type])
        newest = self._now_us() // SAMPLE_PERIOD_US
        first = max(int(timeStamp) // SAMPLE_PERIOD_US + 1, newest - SAMPLE_BUFFER + 1)
        if first > newest:
            raise _err("NOT_FOUND")
        samples = []
        for k in range(first, newest + 1):
            s = pynvml.c_nvmlSample_t(timeStamp=k * SAMPLE_PERIOD_US)
            s.sampleValue.uiVal = value
            samples.append(s)
        return pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, samples

    # -- power, temperature, clocks -------------------------------------------------------------
    nvmlDeviceGetPowerUsage = _getter(
        "nvmlDeviceGetPowerUsage", "power_usage_mw",
        "Power draw in mW: ``average_power_draw`` (v13), else ``power_draw`` (NVML: 1 s average on "
        "Ampere but GA100 and newer, instantaneous before).")
    nvmlDeviceGetEnforcedPowerLimit = _getter(
        "nvmlDeviceGetEnforcedPowerLimit", "power_limit_enforced_mw",
        "mW from ``current_power_limit`` (v12+) or ``enforced_power_limit`` (v11).")
    nvmlDeviceGetPowerManagementLimit = _getter(
        "nvmlDeviceGetPowerManagementLimit", "power_limit_mw",
        "mW from ``requested_power_limit`` (v12+) or ``power_limit`` (v11).")
    nvmlDeviceGetPowerManagementDefaultLimit = _getter(
        "nvmlDeviceGetPowerManagementDefaultLimit", "power_limit_default_mw", "mW from ``default_power_limit``.")
    nvmlDeviceGetFanSpeed = _getter("nvmlDeviceGetFanSpeed", "fan_speed_percent", "Percent, ``<fan_speed>``.")
    nvmlDeviceGetPerformanceState = _getter(
        "nvmlDeviceGetPerformanceState", "performance_state", "P-state number (``P0`` → 0).")

    nvmlDeviceGetPowerManagementLimitConstraints = _getter(
        "nvmlDeviceGetPowerManagementLimitConstraints", ("power_limit_min_mw", "power_limit_max_mw"),
        "``[min, max]`` mW from ``min_power_limit`` / ``max_power_limit``.")

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        """mJ: the capture has no energy counter, so :data:`ENERGY_BASE_MJ` + power draw (mW) x
        seconds since the replay was built; never decreases. NOT_SUPPORTED when power is N/A."""
        t = self._device("nvmlDeviceGetTotalEnergyConsumption", handle)
        power = int(self._need(t.gpu, "power_usage_mw"))
        value = ENERGY_BASE_MJ + int(power * max(0.0, self._clock() - self._t0))
        with self._lock:
            value = self._energy_last[t.index] = max(value, self._energy_last.get(t.index, 0))
        return value

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        """°C from ``<gpu_temp>`` for NVML_TEMPERATURE_GPU (the only sensor; others INVALID_ARGUMENT)."""
        g = self._device("nvmlDeviceGetTemperature", handle).gpu
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _err("INVALID_ARGUMENT")
        return int(self._need(g, "temp_gpu_c"))

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: Sequence[Any]) -> Any:
        """ctypes array of ``c_nvmlFieldValue_t`` (``.fieldId .scopeId .timestamp .valueType
        .nvmlReturn .value.uiVal``), one per id (or ``(id, scope)``): MEMORY_TEMP (°C, ``<memory_temp>``),
        POWER_AVERAGE / POWER_INSTANT (mW), PCIE_REPLAY_COUNTER; per-field NOT_SUPPORTED otherwise."""
        g = self._device("nvmlDeviceGetFieldValues", handle).gpu
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        for v, fid in zip(values, fieldIds, strict=True):
            v.fieldId, v.scopeId = fid if isinstance(fid, tuple) else (fid, 0)
            v.timestamp, v.valueType = self._now_us(), pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
            reading = getattr(g, _FIELD_IDS[v.fieldId]) if v.fieldId in _FIELD_IDS else None
            v.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED if reading is None else pynvml.NVML_SUCCESS
            v.value.uiVal = reading or 0
        return values

    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
        """Current MHz from ``<clocks>`` for NVML_CLOCK_GRAPHICS / SM / MEM / VIDEO."""
        return self._clock_mhz("nvmlDeviceGetClockInfo", handle, type, "clock")

    def nvmlDeviceGetMaxClockInfo(self, handle: Any, type: int) -> int:
        """Maximum MHz from ``<max_clocks>`` for NVML_CLOCK_GRAPHICS / SM / MEM / VIDEO."""
        return self._clock_mhz("nvmlDeviceGetMaxClockInfo", handle, type, "max_clock")

    def _clock_mhz(self, call: str, handle: Any, clock: int, prefix: str) -> int:
        g = self._device(call, handle).gpu
        if clock not in _CLOCKS:
            raise _err("INVALID_ARGUMENT")
        return int(self._need(g, f"{prefix}_{_CLOCKS[clock]}_mhz"))

    nvmlDeviceGetCurrentClocksEventReasons = _getter(
        "nvmlDeviceGetCurrentClocksEventReasons", "clock_reasons",
        "nvmlClocksEventReason* bitmask of the reasons ``Active`` in ``<clocks_event_reasons>`` (v11: "
        "``<clocks_throttle_reasons>``).")
    nvmlDeviceGetCurrentClocksThrottleReasons = _getter(
        "nvmlDeviceGetCurrentClocksThrottleReasons", "clock_reasons",
        "The older name of nvmlDeviceGetCurrentClocksEventReasons: the same bits.")

    # -- ECC, retired pages, PCIe ---------------------------------------------------------------
    nvmlDeviceGetEccMode = _getter(
        "nvmlDeviceGetEccMode", ("ecc_current", "ecc_pending"), "``[current, pending]`` (1 enabled), ``<ecc_mode>``.")

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        """Count for NVML_MEMORY_ERROR_TYPE_CORRECTED / UNCORRECTED x NVML_VOLATILE_ECC /
        AGGREGATE_ECC: the sum of ``<ecc_errors>`` SRAM and DRAM cells; NOT_SUPPORTED where N/A."""
        g = self._device("nvmlDeviceGetTotalEccErrors", handle).gpu
        if errorType not in (0, 1) or counterType not in (0, 1):
            raise _err("INVALID_ARGUMENT")
        scope = ("volatile", "aggregate")[counterType]
        return int(self._need(g, f"ecc_{scope}_{('corrected', 'uncorrected')[errorType]}"))

    def nvmlDeviceGetRetiredPages(self, device: Any, sourceFilter: int) -> list[int]:
        """Retired page addresses for NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS (0)
        / DOUBLE_BIT_ECC_ERROR (1); NOT_SUPPORTED where ``<retired_count>`` is N/A (row remapping)."""
        g = self._device("nvmlDeviceGetRetiredPages", device).gpu
        if sourceFilter not in (0, 1):
            raise _err("INVALID_ARGUMENT")
        return list(self._need(g, ("retired_pages_sbe", "retired_pages_dbe")[sourceFilter]))

    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]:
        """``(corrRows, uncRows, isPending, failureOccurred)`` from ``<remapped_rows>`` (pending and
        failure 1 for "Yes"); NOT_SUPPORTED where the capture has ``<remapped_rows>N/A``."""
        g = self._device("nvmlDeviceGetRemappedRows", device).gpu
        corr, unc, pending, failure = (int(self._need(g, f"remapped_{k}"))
                                       for k in ("corr", "unc", "pending", "failure"))
        return corr, unc, pending, failure

    nvmlDeviceGetCurrPcieLinkGeneration = _getter(
        "nvmlDeviceGetCurrPcieLinkGeneration", "pcie_gen_current", "``<current_link_gen>``.")
    nvmlDeviceGetMaxPcieLinkGeneration = _getter(
        "nvmlDeviceGetMaxPcieLinkGeneration", "pcie_gen_max", "``<max_link_gen>`` (device and system).")
    nvmlDeviceGetCurrPcieLinkWidth = _getter(
        "nvmlDeviceGetCurrPcieLinkWidth", "pcie_width_current", "Lanes, ``<current_link_width>`` (16x → 16).")
    nvmlDeviceGetMaxPcieLinkWidth = _getter(
        "nvmlDeviceGetMaxPcieLinkWidth", "pcie_width_max", "Lanes, ``<max_link_width>``.")
    nvmlDeviceGetPcieReplayCounter = _getter(
        "nvmlDeviceGetPcieReplayCounter", "pcie_replay_counter", "``<replay_counter>``.")

    def nvmlDeviceGetPcieThroughput(self, device: Any, counter: int) -> int:
        """KB/s for NVML_PCIE_UTIL_TX_BYTES (``<tx_util>``) / RX_BYTES (``<rx_util>``); answers at
        once (the real call blocks ~21 ms)."""
        g = self._device("nvmlDeviceGetPcieThroughput", device).gpu
        if counter not in (0, 1):
            raise _err("INVALID_ARGUMENT")
        return int(self._need(g, ("pcie_tx_kbps", "pcie_rx_kbps")[counter]))

    # -- processes ------------------------------------------------------------------------------
    def _processes(self, call: str, handle: Any) -> list[Any]:
        t = self._device(call, handle, mig=True)
        kind = _PROCESS_CALLS[call]
        out = []
        for p in t.gpu.processes:
            if kind not in p.types or (t.mig is not None and (p.gpu_instance_id, p.compute_instance_id)
                                       != (t.mig.gpu_instance_id, t.mig.compute_instance_id)):
                continue
            out.append(pynvml.nvmlFriendlyObject({
                "pid": p.pid, "usedGpuMemory": p.used_memory_bytes,
                "gpuInstanceId": UINT_MAX if p.gpu_instance_id is None else p.gpu_instance_id,
                "computeInstanceId": UINT_MAX if p.compute_instance_id is None else p.compute_instance_id}))
        return out

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        """``nvmlFriendlyObject`` per compute process (``<processes>`` type C, scenario "compute"):
        ``.pid .usedGpuMemory`` (bytes, None when N/A) ``.gpuInstanceId .computeInstanceId``
        (0xFFFFFFFF outside MIG). Parent handles list all instances' processes; MIG handles their own."""
        return self._processes("nvmlDeviceGetComputeRunningProcesses", handle)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[Any]:
        """As :meth:`nvmlDeviceGetComputeRunningProcesses` for graphics processes (type G)."""
        return self._processes("nvmlDeviceGetGraphicsRunningProcesses", handle)

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: Any) -> list[Any]:
        """As :meth:`nvmlDeviceGetComputeRunningProcesses` for MPS clients (type M+C, scenario "mps")."""
        return self._processes("nvmlDeviceGetMPSComputeRunningProcesses", handle)

    def nvmlDeviceGetProcessUtilization(self, handle: Any, timeStamp: int) -> list[Any]:
        """``c_nvmlProcessUtilizationSample_t`` (``.pid .timeStamp`` µs now ``.smUtil`` percent,
        ``.memUtil .encUtil .decUtil`` 0) per process with a scenario ``sm_utilization_percent``.
        NOT_FOUND when there is none or ``timeStamp`` is not older than now (as on the H200)."""
        g = self._device("nvmlDeviceGetProcessUtilization", handle).gpu
        now = self._now_us()
        busy = {p.pid: p.sm_utilization_percent for p in g.processes if p.sm_utilization_percent is not None}
        if not busy or now <= timeStamp:
            raise _err("NOT_FOUND")
        return [pynvml.c_nvmlProcessUtilizationSample_t(pid=pid, timeStamp=now, smUtil=sm)
                for pid, sm in busy.items()]

    # -- MIG --------------------------------------------------------------------------------
    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        """MIG device slots: 0 unless MIG is enabled, then :data:`MIG_MAX_DEVICES` (A30: 4)."""
        return _mig_slots(self._device("nvmlDeviceGetMaxMigDeviceCount", device).gpu)

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> ReplayHandle:
        """MIG device in slot ``index`` (``<mig_device><index>``); INVALID_ARGUMENT beyond the
        slot count, NOT_FOUND for an empty slot."""
        t = self._device("nvmlDeviceGetMigDeviceHandleByIndex", device)
        if not 0 <= index < _mig_slots(t.gpu):
            raise _err("INVALID_ARGUMENT")
        found = self._mig_handles.get((t.index, index))
        if found is None:
            raise _err("NOT_FOUND")
        return found

    def nvmlDeviceIsMigDeviceHandle(self, device: Any) -> ctypes.c_uint:
        """``ctypes.c_uint`` (1 for MIG handles) — pynvml returns the c_uint, not its ``.value``."""
        return ctypes.c_uint(int(self._device("nvmlDeviceIsMigDeviceHandle", device, mig=True).mig is not None))

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: Any) -> ReplayHandle:
        """The parent GPU's migDevice; INVALID_ARGUMENT for a migDevice that is not a MIG device."""
        t = self._device("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", migDevice, mig=True)
        if t.mig is None:
            raise _err("INVALID_ARGUMENT")
        return self._handles[t.index]

    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int:
        """GPU instance id of a MIG device (``<gpu_instance_id>``); NOT_SUPPORTED for a GPU."""
        return self._instance_id("nvmlDeviceGetGpuInstanceId", device, "gpu_instance_id")

    def nvmlDeviceGetComputeInstanceId(self, device: Any) -> int:
        """Compute instance id of a MIG device (``<compute_instance_id>``); NOT_SUPPORTED for a GPU."""
        return self._instance_id("nvmlDeviceGetComputeInstanceId", device, "compute_instance_id")

    def _instance_id(self, call: str, handle: Any, attr: str) -> int:
        mig = self._device(call, handle, mig=True).mig
        if mig is None:
            raise _err("NOT_SUPPORTED")
        return int(getattr(mig, attr))

    # -- events ----------------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> ReplayEventSet:
        """A new, empty event set (:class:`ReplayEventSet`)."""
        self._enter("nvmlEventSetCreate")
        es = ReplayEventSet(self)
        with self._lock:
            self._sets.append(es)
        return es

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        """Free ``eventSet``; INVALID_ARGUMENT for a set that is not this replay's or already freed.
        A wait on it in another thread then raises INVALID_ARGUMENT (within one wait slice)."""
        self._enter("nvmlEventSetFree")
        with self._lock:
            es = self._event_set(eventSet)
            es.live = False
            self._sets.remove(es)

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        """nvmlEventType* bitmask: PState and XidCriticalError, plus SingleBitEccError and
        DoubleBitEccError where ECC is enabled (``<ecc_mode><current_ecc>``); MIG handles NOT_SUPPORTED."""
        return _supported_events(self._device("nvmlDeviceGetSupportedEventTypes", handle).gpu)

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        """Add the nvmlEventType* bits ``eventTypes`` of GPU ``handle`` to ``eventSet`` (registering
        a type again keeps it). INVALID_ARGUMENT for a set that is not this replay's or is freed and
        for bits NVML does not define; NOT_SUPPORTED for a type the GPU does not support
        (:meth:`nvmlDeviceGetSupportedEventTypes`) and for MIG handles, as NVML."""
        types = ctypes.c_ulonglong(eventTypes).value  # pynvml's conversion: TypeError for a non-int
        t = self._device("nvmlDeviceRegisterEvents", handle)
        with self._lock:
            es = self._event_set(eventSet)
            if types & ~pynvml.nvmlEventTypeAll:
                raise _err("INVALID_ARGUMENT")
            if types & ~_supported_events(t.gpu):
                raise _err("NOT_SUPPORTED")
            now = self._clock()
            for bit in (1 << k for k in range(types.bit_length()) if types >> k & 1):
                es.registered.setdefault((t.index, bit), now)

    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> ReplayEventData:
        """The next due event for ``eventSet`` (:class:`ReplayEventData`: ``.device`` the GPU's
        handle, ``.eventType`` nvmlEventTypeXidCriticalError, ``.eventData`` the XID,
        ``.gpuInstanceId`` / ``.computeInstanceId`` the scenario's or 0xFFFFFFFF), blocking up to
        ``timeoutms`` (unsigned int as pynvml passes it: -1 is 2^32-1 ms), then TIMEOUT, as NVML.

        A scenario event falls due ``after_seconds`` after the replay's first nvmlInit (by the
        injectable clock). It is delivered to a set registered for its GPU and type, once per set,
        the earliest due first: to every set registered before it fell due and, when none took it,
        to the first set registered later that waits (so ``after_seconds = 0`` reaches the watcher
        that registers after init); a set created after another took it does not get it again.
        Sleeps in slices of at most :data:`EVENT_WAIT_SLICE_S` (the injectable sleep), until the
        next event falls due or the timeout; a set freed meanwhile raises INVALID_ARGUMENT, a last
        nvmlShutdown UNINITIALIZED. The wait names no GPU: faults with ``gpu`` or ``call = "*"`` do
        not apply to it, faults naming this call (or nvmlEventSetWait) without ``gpu`` do.
        """
        timeout = ctypes.c_uint(timeoutms).value / 1000  # pynvml's conversion: TypeError for a non-int
        self._enter("nvmlEventSetWait_v2")
        waited = 0.0
        while True:
            with self._lock:
                if self._refcount == 0:
                    raise _err("UNINITIALIZED")
                es = self._event_set(eventSet)
                now = self._clock()
                found, next_due = self._take(es, now)
            if found is not None:
                return ReplayEventData(
                    self._handles[found.gpu], EVENT_TYPES[found.kind], found.xid,
                    UINT_MAX if found.gpu_instance_id is None else found.gpu_instance_id,
                    UINT_MAX if found.compute_instance_id is None else found.compute_instance_id)
            left = timeout - waited
            if left <= 0:
                raise _err("TIMEOUT")
            step = min(EVENT_WAIT_SLICE_S, left, max(0.001, next_due - now) if next_due is not None else left)
            self._sleep(step)
            waited += step

    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> ReplayEventData:
        """pynvml's alias of :meth:`nvmlEventSetWait_v2`; faults match either name."""
        ctypes.c_uint(timeoutms)  # pynvml converts before anything reaches NVML: TypeError for a non-int
        self._enter("nvmlEventSetWait")
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    def _event_set(self, eventSet: Any) -> ReplayEventSet:
        """``eventSet`` if it is a live set of this replay, else INVALID_ARGUMENT (hold the lock)."""
        if not isinstance(eventSet, ReplayEventSet) or eventSet._owner is not self or not eventSet.live:
            raise _err("INVALID_ARGUMENT")
        return eventSet

    def _take(self, es: ReplayEventSet, now: float) -> tuple[EventCapture | None, float | None]:
        """(the event to deliver to ``es`` now, marked delivered; else None, and the clock time the
        next event ``es`` is registered for falls due, None when there is none). Hold the lock."""
        start = self._t_init if self._t_init is not None else now
        for pos, event in self._events:
            due = start + event.after_seconds
            registered = es.registered.get((event.gpu, EVENT_TYPES[event.kind]))
            if registered is None or pos in es.delivered:
                continue
            if due > now:
                return None, due
            if registered > due and pos in self._claimed:
                continue  # it happened before this set listened, and another set took it
            es.delivered.add(pos)
            self._claimed.add(pos)
            return event, None
        return None, None


def _supported_events(gpu: GpuCapture) -> int:
    """nvmlDeviceGetSupportedEventTypes of a GPU (see :data:`_EVENTS_EVERY_GPU`)."""
    return int(_EVENTS_EVERY_GPU | (_EVENTS_ECC if gpu.ecc_current == 1 else 0))


def _mig_slots(gpu: GpuCapture) -> int:
    """nvmlDeviceGetMaxMigDeviceCount: 0 unless MIG is enabled, else 7 (A30: 4) or more if needed."""
    if gpu.mig_current != 1:
        return 0
    slots = 4 if re.search(r"\bA30\b", gpu.name or "") else MIG_MAX_DEVICES
    return max([slots, *(m.index + 1 for m in gpu.migs)])



# Every pynvml function name ReplayNVML answers (a scenario fault may name any of them).
IMPLEMENTED_CALLS = frozenset(n for n in dir(ReplayNVML) if n.startswith("nvml"))
