# ruff: noqa: N802, N803, N815
# (method and argument names are pynvml's)
"""The state behind the replayed ``libnvidia-ml``: GPUs answered from ``nvidia-smi -q -x`` captures.

For tests, benchmarks and demos on machines without a GPU. Everything it reports is labelled
``source="replay"``, never passed off as a live reading.

:class:`ReplayState` holds the GPUs of a capture or scenario and answers NVML's questions about them,
one method per NVML function, named as pynvml names the function and taking the arguments pynvml's
function takes. Nothing in accelstats calls these methods directly: :mod:`collectors.replay.lib`
exports NVML's C functions (the symbols of the driver generation the capture names), decodes the C
arguments pynvml passes, calls the method and writes its answer into the caller's C structures. The
real ``pynvml`` module, unchanged, runs on top (:func:`collectors.replay.lib.open_replay`).

Errors are ``pynvml.NVMLError(pynvml.NVML_ERROR_<X>)``; the library returns their codes. Behaviour
follows NVML: every call but init raises UNINITIALIZED before ``nvmlInit`` and after the last
``nvmlShutdown`` (init is reference-counted); a value the capture gives as N/A raises NOT_SUPPORTED
("Requested functionality has been deprecated": DEPRECATED), and so does one NVML's unsigned type
cannot hold (``-36 C``: listed in ``GpuCapture.invalid``); MIG device handles answer identity,
memory and process calls and raise NOT_SUPPORTED for everything else (utilisation, power, clocks,
events, …), as real MIG devices do.

Events: ``nvmlEventSetCreate`` / ``nvmlEventSetFree``, ``nvmlDeviceGetSupportedEventTypes``,
``nvmlDeviceRegisterEvents`` and ``nvmlEventSetWait_v2`` keep NVML's rules for sets; what falls due
comes from :attr:`ReplayState.event_source` (none: a wait times out, as on a healthy GPU). Every call
passes :attr:`ReplayState.call_hooks` first. Both are how a scenario's device state (a GPU lost,
calls that fail or hang, XIDs: :mod:`collectors.replay.device_state`) and the test support's
call-counting faults (``tests/support/replay_faults.py``, not part of the product) act.

Values NVML has but ``nvidia-smi -q -x`` does not print are documented where they are made up:
samples and process-utilisation timestamps come from the wall clock, total energy grows at the
captured power draw from :data:`ENERGY_BASE_MJ`, the encoder/decoder sampling period is
:data:`SAMPLING_PERIOD_US`, compute capability and architecture come from tables in
:mod:`collectors.replay.capture`, MIG UUIDs from :func:`mig_uuid`.
"""

from __future__ import annotations

import ctypes
import re
import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pynvml

from collectors.replay.capture import (
    CaptureError,
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
from collectors.replay.gpm import GpmReplay, GpmSample, nvlink_field

__all__ = ["CALL_ALIASES", "IMPLEMENTED_CALLS", "CallHook", "DueEvent", "EventSource", "ReplayError", "ReplayEventData",
           "ReplayEventSet", "ReplayHandle", "ReplayState", "mig_uuid"]

SAMPLE_PERIOD_US = 1_000_000 // 6  # one utilisation sample per 1/6 s, as NVML's sampler
SAMPLE_BUFFER = 120  # samples NVML keeps per type (20 s at 6 Hz)
SAMPLING_PERIOD_US = 100_000  # encoder/decoder sampling period the H200 reported (nvml_probe.json)
ENERGY_BASE_MJ = 0  # total energy at ReplayState construction; then + power_usage_mw x seconds
UINT_MAX = 0xFFFFFFFF  # NVML's "no instance" gpuInstanceId / computeInstanceId of non-MIG processes
MIG_MAX_DEVICES = 7  # nvmlDeviceGetMaxMigDeviceCount with MIG enabled (A30: 4)
NVML_MEMORY_V2 = 40 | 2 << 24  # nvml.h: NVML_STRUCT_VERSION(Memory, 2); sizeof(nvmlMemory_v2_t) is 40
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

# A call hook: (the NVML call's names, the NVML index of the GPU it names or None) -> None; it may
# sleep or raise pynvml.NVMLError (collectors/replay/device_state.py, tests/support/replay_faults.py).
CallHook = Callable[[tuple[str, ...], "int | None"], None]


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

    __slots__ = ("__weakref__", "_owner", "gpu", "mig")

    def __init__(self, owner: ReplayState, gpu: int, mig: MigCapture | None = None) -> None:
        self._owner, self.gpu, self.mig = owner, gpu, mig

    def __repr__(self) -> str:
        return f"<ReplayHandle gpu={self.gpu}{'' if self.mig is None else f' mig={self.mig.index}'}>"


def _getter(call: str, attrs: str | tuple[str, ...], doc: str, mig: bool = False) -> Callable[[ReplayState, Any], Any]:
    """A method answering ``call(handle)`` with GpuCapture ``attrs`` (one value, or a list of
    them); NOT_SUPPORTED (DEPRECATED) when one is None."""

    def method(self: ReplayState, handle: Any) -> Any:
        gpu = self._device(call, handle, mig=mig).gpu
        return self._need(gpu, attrs) if isinstance(attrs, str) else [self._need(gpu, a) for a in attrs]

    method.__name__ = method.__qualname__ = call
    method.__doc__ = doc
    return method


class ReplayEventSet:
    """Opaque event-set handle (nvmlEventSetCreate); its state is the replay's, under its lock."""

    __slots__ = ("__weakref__", "_owner", "delivered", "live", "registered")

    def __init__(self, owner: ReplayState) -> None:
        self._owner, self.live = owner, True
        self.registered: dict[tuple[int, int], float] = {}  # (NVML index, event type bit) -> clock when
        self.delivered: set[int] = set()  # what the event source delivered to this set (its keys)

    def __repr__(self) -> str:
        return f"<ReplayEventSet {'live' if self.live else 'freed'} registered={sorted(self.registered)}>"


class ReplayEventData:
    """An event to deliver: the fields of NVML's ``nvmlEventData_t``, with ``.device`` the
    :class:`ReplayHandle` of the GPU (the library writes its pointer)."""

    __slots__ = ("computeInstanceId", "device", "eventData", "eventType", "gpuInstanceId")

    def __init__(self, device: ReplayHandle, eventType: int, eventData: int, gpuInstanceId: int,
                 computeInstanceId: int) -> None:
        self.device, self.eventType, self.eventData = device, eventType, eventData
        self.gpuInstanceId, self.computeInstanceId = gpuInstanceId, computeInstanceId


class DueEvent:
    """What an :class:`EventSource` hands out: NVML index ``gpu``, nvmlEventType* bit ``event_type``,
    ``xid`` (eventData), MIG instance ids (None: the whole GPU) and ``key`` (marks it delivered)."""

    __slots__ = ("compute_instance_id", "event_type", "gpu", "gpu_instance_id", "key", "xid")

    def __init__(self, key: int, gpu: int, event_type: int, xid: int, gpu_instance_id: int | None = None,
                 compute_instance_id: int | None = None) -> None:
        self.key, self.gpu, self.event_type, self.xid = key, gpu, event_type, xid
        self.gpu_instance_id, self.compute_instance_id = gpu_instance_id, compute_instance_id


class EventSource:
    """Where events come from: :meth:`take` answers (the event to deliver to an event set now, or
    None, and the clock time the next one falls due, or None). This one has none (a capture; a
    scenario's ``[[gpu.xid]]``: :class:`collectors.replay.device_state.ScheduledXids`)."""

    def take(self, es: ReplayEventSet, now: float, start: float) -> tuple[DueEvent | None, float | None]:
        """Called under the state's lock; ``start`` is the clock at the first nvmlInit."""
        return None, None


class _Target:
    """A resolved handle: NVML index, capture of the physical GPU, MIG instance (or None)."""

    __slots__ = ("gpu", "index", "mig")

    def __init__(self, index: int, gpu: GpuCapture, mig: MigCapture | None) -> None:
        self.index, self.gpu, self.mig = index, gpu, mig


class ReplayState(GpmReplay):
    """NVML's answers for a :class:`SystemCapture` (module docstring: behaviour).

    ``capture``: the GPUs in NVML index order and the system versions. ``path``: the file it came
    from (None when built in code). ``clock`` (seconds since the epoch; drives sample and
    process-utilisation timestamps and the energy counter) and ``sleep`` (used by
    nvmlEventSetWait_v2, and by call hooks that hang) are injectable for tests. ``call_hooks`` run
    before every call (:data:`CallHook`); ``event_source`` says which events fall due. ``extra``:
    the scenario's tables that the product does not read (``[[fault]]``), for the test support.
    Thread-safe.
    """

    source = "replay"

    def __init__(self, capture: SystemCapture, *, path: Path | None = None,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                 extra: dict[str, Any] | None = None, missing_functions: Sequence[str] = ()) -> None:
        self.path = path
        self.capture = capture
        self.clock, self.sleep = clock, sleep
        self.extra = extra or {}
        self.missing_functions = tuple(missing_functions)
        self.call_hooks: list[CallHook] = []
        self.event_source = EventSource()
        self.lock = threading.Lock()
        self._refcount = 0
        self._handles = [ReplayHandle(self, i) for i in range(len(capture.gpus))]
        self._mig_handles = {(i, m.index): ReplayHandle(self, i, m)
                             for i, g in enumerate(capture.gpus) for m in g.migs}
        self._t0 = clock()
        self._energy_last: dict[int, int] = {}
        self.t_init: float | None = None  # clock at the first nvmlInit: scenario events count from it
        self._sets: list[ReplayEventSet] = []
        self.gpm_samples: set[GpmSample] = set()  # allocated GPM samples not freed (collectors.replay.gpm)

    @property
    def initialised(self) -> int:
        """How many nvmlInit calls have not been matched by nvmlShutdown (0: NVML is shut down)."""
        return self._refcount

    @classmethod
    def from_path(cls, path: str | Path, *, tables: Sequence[str] = (), **kwargs: Any) -> ReplayState:
        """Load an ``nvidia-smi -q -x`` XML file, or a scenario when the suffix is ``.toml``.

        ``tables``: top-level scenario tables to accept unread and keep in :attr:`extra` (the test
        support's ``fault`` and ``event``). ``kwargs`` go to the constructor (``clock``, ``sleep``).
        Raises ReplayError, and nothing else whatever the file holds, naming the file and the
        line/column (malformed XML or TOML, a ``<gpu>`` without a UUID or with another's), the line
        and byte offset (a scenario that is not UTF-8), the OS reason (unreadable: missing, a
        directory, no permission) or the offending key (scenario errors,
        :func:`collectors.replay.capture.load_scenario`).
        """
        path = Path(path)
        if "\0" in str(path):
            raise ReplayError(f"cannot read {path!r}: the name holds a NUL character")
        try:
            if path.suffix.lower() == ".toml":
                scenario = load_scenario(path, tables=tables, calls=IMPLEMENTED_CALLS | CALL_ALIASES)
                return cls(scenario.capture, path=path, extra=scenario.extra,
                           missing_functions=scenario.missing_functions, **kwargs)
            return cls(parse_capture(path), path=path, **kwargs)
        except CaptureError as exc:
            raise ReplayError(str(exc)) from exc
        except OSError as exc:
            raise ReplayError(f"cannot read {path}: {exc.strerror or exc}") from exc

    @property
    def gpu_count(self) -> int:
        """Number of physical GPUs."""
        return len(self._handles)

    def handle(self, index: int) -> ReplayHandle:
        """The handle of GPU ``index`` (no NVML rules: for the test support's events)."""
        return self._handles[index]

    # -- plumbing -----------------------------------------------------------------------------
    def _enter(self, call: str, gpu: int | None = None, *, also: tuple[str, ...] = ()) -> None:
        """UNINITIALIZED check (except init), then the call hooks with ``(call, *also)`` and ``gpu``."""
        with self.lock:
            if self._refcount == 0 and call != "nvmlInit":
                raise _err("UNINITIALIZED")
        for hook in self.call_hooks:
            hook((call, *also), gpu)

    def _device(self, call: str, handle: Any, *, mig: bool = False, also: tuple[str, ...] = ()) -> _Target:
        """Resolve a handle of this replay (INVALID_ARGUMENT otherwise) after :meth:`_enter`;
        MIG handles raise NOT_SUPPORTED unless ``mig``."""
        ours = isinstance(handle, ReplayHandle) and handle._owner is self
        self._enter(call, handle.gpu if ours else None, also=also)
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
        return int(self.clock() * 1_000_000)

    # -- system -------------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        """Initialise (reference-counted, like NVML). The library's ``nvmlInit``, ``nvmlInit_v2``
        and ``nvmlInitWithFlags`` all come here; call hooks see the names ``nvmlInit`` and
        ``nvmlInitWithFlags``."""
        self._enter("nvmlInit", also=("nvmlInitWithFlags",))
        with self.lock:
            self._refcount += 1
            if self.t_init is None:
                self.t_init = self.clock()

    def nvmlInitWithFlags(self, flags: int) -> None:
        """Initialise with NVML_INIT_FLAG_* ``flags`` (accepted, no effect): :meth:`nvmlInit`."""
        self.nvmlInit()

    def nvmlShutdown(self) -> None:
        """Drop one init reference; at zero every call but init raises UNINITIALIZED again, and the
        event sets are freed (NVML releases them with the library)."""
        self._enter("nvmlShutdown")
        with self.lock:
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
        """``nvmlPciInfo_t`` from ``<pci>``: ``.busId`` (str ``"00000000:00:06.0"``),
        ``.busIdLegacy`` (``"0000:00:06.0"``), ``.domain .bus .device .pciDeviceId .pciSubSystemId``;
        MIG handles answer their parent's."""
        g = self._device("nvmlDeviceGetPciInfo", handle, mig=True, also=("nvmlDeviceGetPciInfo_v3",)).gpu
        info = pynvml.nvmlPciInfo_t()
        bus_id = str(self._need(g, "pci_bus_id"))
        info.busId = bus_id.encode()
        info.busIdLegacy = bus_id[4:].encode() if len(bus_id) == 16 else bus_id.encode()[:15]
        for attr, name in (("domain", "pci_domain"), ("bus", "pci_bus"), ("device", "pci_device"),
                           ("pciDeviceId", "pci_device_id"), ("pciSubSystemId", "pci_subsystem_id")):
            setattr(info, attr, getattr(g, name) or 0)
        return info

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
        """``(major, minor)`` from collectors.replay.capture.compute_capability (the XML has none); MIG: parent's."""
        cc = compute_capability(self._device("nvmlDeviceGetCudaComputeCapability", handle, mig=True).gpu)
        if cc is None:
            raise _err("NOT_SUPPORTED")
        return cc

    def nvmlDeviceGetArchitecture(self, device: Any) -> int:
        """NVML_DEVICE_ARCH_* from ``<product_architecture>`` or the PCI device id's chip (UNKNOWN
        0xFFFFFFFF when neither)."""
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
        if version != NVML_MEMORY_V2:
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
        value = ENERGY_BASE_MJ + int(power * max(0.0, self.clock() - self._t0))
        with self.lock:
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
        POWER_AVERAGE / POWER_INSTANT (mW), PCIE_REPLAY_COUNTER, NVLINK_THROUGHPUT_DATA_TX / _RX (KiB, ``scopeId``
        the link, ``.value.ullVal``: :func:`collectors.replay.gpm.nvlink_field`); per-field NOT_SUPPORTED otherwise."""
        g = self._device("nvmlDeviceGetFieldValues", handle).gpu
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        for v, fid in zip(values, fieldIds, strict=True):
            v.fieldId, v.scopeId = fid if isinstance(fid, tuple) else (fid, 0)
            v.timestamp, v.valueType = self._now_us(), pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
            nvlink = nvlink_field(g, v.fieldId, v.scopeId)
            if nvlink is not None:
                v.valueType, v.nvmlReturn, value = nvlink
                if v.valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT:
                    v.value.uiVal = value
                else:
                    v.value.ullVal = value
                continue
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
    def _since_init(self) -> float:
        """Seconds from the first ``nvmlInit`` to now on the replay's clock: the time scenario process
        timelines count in."""
        now = self.clock()
        return now - (self.t_init if self.t_init is not None else now)

    def _processes(self, call: str, handle: Any) -> list[Any]:
        t = self._device(call, handle, mig=True)
        kind = _PROCESS_CALLS[call]
        out = []
        elapsed = self._since_init()
        for p in t.gpu.processes:
            if kind not in p.types or (t.mig is not None and (p.gpu_instance_id, p.compute_instance_id)
                                       != (t.mig.gpu_instance_id, t.mig.compute_instance_id)):
                continue
            now = p.at(elapsed)
            if now is None:
                continue  # not running now (scenario timeline)
            out.append(pynvml.nvmlFriendlyObject({
                "pid": p.pid, "usedGpuMemory": now[1],
                "gpuInstanceId": UINT_MAX if p.gpu_instance_id is None else p.gpu_instance_id,
                "computeInstanceId": UINT_MAX if p.compute_instance_id is None else p.compute_instance_id}))
        return out

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        """``nvmlFriendlyObject`` per compute process (``<processes>`` type C, scenario "compute")
        running now (scenario ``start_s``/``end_s``): ``.pid .usedGpuMemory`` (bytes, None when N/A;
        a scenario's ``step`` changes it) ``.gpuInstanceId .computeInstanceId`` (0xFFFFFFFF outside
        MIG). Parent handles list all instances' processes; MIG handles their own."""
        return self._processes("nvmlDeviceGetComputeRunningProcesses", handle)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[Any]:
        """As :meth:`nvmlDeviceGetComputeRunningProcesses` for graphics processes (type G)."""
        return self._processes("nvmlDeviceGetGraphicsRunningProcesses", handle)

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: Any) -> list[Any]:
        """As :meth:`nvmlDeviceGetComputeRunningProcesses` for MPS clients (type M+C, scenario "mps")."""
        return self._processes("nvmlDeviceGetMPSComputeRunningProcesses", handle)

    def nvmlDeviceGetProcessUtilization(self, handle: Any, timeStamp: int) -> list[Any]:
        """Per-process SM samples newer than ``timeStamp`` (µs), in one of the two shapes NVML's words
        allow ("one utilization sample structure is returned per process running, that had some non-zero
        utilization during the last sample period"; ``lastSeenTimeStamp``: "read utilization since the
        previous query"), chosen by the scenario's ``process_samples``.

        The replayed driver samples every process with a scenario ``sm_utilization_percent`` on a grid of
        :data:`SAMPLE_PERIOD_US` from the first ``nvmlInit`` (at most :data:`SAMPLE_BUFFER` samples back),
        each sample the process's value at that instant (its timeline's steps; 0 while it does not run),
        standing for the period that ends there.

        * ``"mean"`` (default): one sample per process with a non-zero sample in the window: ``.timeStamp``
          its newest non-zero sample (so each process has its own, lagging the read while it idles, as
          NVIDIA/go-nvml#51 shows), ``.smUtil`` the mean over the window's samples up to it, rounded to a
          whole percent (NVML's unsigned int): utilisation since ``timeStamp``, idle samples included.
        * ``"every"``: one sample per non-zero driver sample in the window, its own value.

        ``.pid``; ``.memUtil .encUtil .decUtil`` 0. NOT_FOUND when no sample is left (as on the H200);
        NOT_SUPPORTED on a GPU in MIG mode.
        """
        g = self._device("nvmlDeviceGetProcessUtilization", handle).gpu
        if g.migs:  # MIG mode: per-process utilisation is not reported (nor for the instances)
            raise _err("NOT_SUPPORTED")
        now = self._now_us()
        base = int(self.t_init * 1_000_000) if self.t_init is not None else now
        newest = (now - base) // SAMPLE_PERIOD_US
        after = int(timeStamp) - base
        first = max(0, after // SAMPLE_PERIOD_US + 1 if after >= 0 else 0, newest - SAMPLE_BUFFER + 1)
        every = g.process_samples == ("every",)
        out = []
        for p in g.processes:
            if p.sm_utilization_percent is None and not any(s[1] is not None for s in p.steps):
                continue
            values = [(k, (got[0] or 0) if (got := p.at(k * SAMPLE_PERIOD_US / 1_000_000)) is not None else 0)
                      for k in range(first, newest + 1)]
            busy = [k for k, v in values if v]
            if not busy:
                continue
            if every:
                out += [pynvml.c_nvmlProcessUtilizationSample_t(pid=p.pid, timeStamp=base + k * SAMPLE_PERIOD_US,
                                                                smUtil=v) for k, v in values if v]
                continue
            upto = [v for k, v in values if k <= busy[-1]]
            out.append(pynvml.c_nvmlProcessUtilizationSample_t(
                pid=p.pid, timeStamp=base + busy[-1] * SAMPLE_PERIOD_US, smUtil=int(sum(upto) / len(upto) + 0.5)))
        if not out:
            raise _err("NOT_FOUND")
        return out

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
        with self.lock:
            self._sets.append(es)
        return es

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        """Free ``eventSet``; INVALID_ARGUMENT for a set that is not this replay's or already freed.
        A wait on it in another thread then raises INVALID_ARGUMENT (within one wait slice)."""
        self._enter("nvmlEventSetFree")
        with self.lock:
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
        with self.lock:
            es = self._event_set(eventSet)
            if types & ~pynvml.nvmlEventTypeAll:
                raise _err("INVALID_ARGUMENT")
            if types & ~_supported_events(t.gpu):
                raise _err("NOT_SUPPORTED")
            now = self.clock()
            for bit in (1 << k for k in range(types.bit_length()) if types >> k & 1):
                es.registered.setdefault((t.index, bit), now)

    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> ReplayEventData:
        """The next event :attr:`event_source` hands out for ``eventSet`` (:class:`ReplayEventData`:
        ``.device`` the GPU's handle, ``.eventType``, ``.eventData`` the XID, ``.gpuInstanceId`` /
        ``.computeInstanceId`` or 0xFFFFFFFF), blocking up to ``timeoutms`` (unsigned int: -1 is
        2^32-1 ms), then TIMEOUT, as NVML.

        Sleeps in slices of at most :data:`EVENT_WAIT_SLICE_S` (the injectable sleep), until the
        next event falls due or the timeout; a set freed meanwhile raises INVALID_ARGUMENT, a last
        nvmlShutdown UNINITIALIZED. The wait names no GPU: call hooks see ``gpu`` None.
        """
        timeout = ctypes.c_uint(timeoutms).value / 1000
        self._enter("nvmlEventSetWait_v2", also=("nvmlEventSetWait",))
        waited = 0.0
        while True:
            with self.lock:
                if self._refcount == 0:
                    raise _err("UNINITIALIZED")
                es = self._event_set(eventSet)
                now = self.clock()
                found, next_due = self.event_source.take(es, now, self.t_init if self.t_init is not None else now)
                if found is not None:
                    es.delivered.add(found.key)
            if found is not None:
                return ReplayEventData(
                    self._handles[found.gpu], found.event_type, found.xid,
                    UINT_MAX if found.gpu_instance_id is None else found.gpu_instance_id,
                    UINT_MAX if found.compute_instance_id is None else found.compute_instance_id)
            left = timeout - waited
            if left <= 0:
                raise _err("TIMEOUT")
            step = min(EVENT_WAIT_SLICE_S, left, max(0.001, next_due - now) if next_due is not None else left)
            self.sleep(step)
            waited += step

    def _event_set(self, eventSet: Any) -> ReplayEventSet:
        """``eventSet`` if it is a live set of this replay, else INVALID_ARGUMENT (hold the lock)."""
        if not isinstance(eventSet, ReplayEventSet) or eventSet._owner is not self or not eventSet.live:
            raise _err("INVALID_ARGUMENT")
        return eventSet


def _supported_events(gpu: GpuCapture) -> int:
    """nvmlDeviceGetSupportedEventTypes of a GPU (see :data:`_EVENTS_EVERY_GPU`)."""
    return int(_EVENTS_EVERY_GPU | (_EVENTS_ECC if gpu.ecc_current == 1 else 0))


def _mig_slots(gpu: GpuCapture) -> int:
    """nvmlDeviceGetMaxMigDeviceCount: 0 unless MIG is enabled, else 7 (A30: 4) or more if needed."""
    if gpu.mig_current != 1:
        return 0
    slots = 4 if re.search(r"\bA30\b", gpu.name or "") else MIG_MAX_DEVICES
    return max([slots, *(m.index + 1 for m in gpu.migs)])



# Every pynvml function name ReplayState answers (a call hook sees these names).
IMPLEMENTED_CALLS = frozenset(n for n in dir(ReplayState) if n.startswith("nvml"))
# the other names call hooks see: the library's nvmlDeviceGetPciInfo_v3 and the older nvmlEventSetWait symbol
CALL_ALIASES = frozenset({"nvmlDeviceGetPciInfo_v3", "nvmlEventSetWait"})
