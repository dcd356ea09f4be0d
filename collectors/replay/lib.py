# (argument names are NVML's)
"""The replayed ``libnvidia-ml``: NVML's C functions, answered by a :class:`ReplayState`, under the
real, unchanged ``pynvml``.

pynvml reaches NVML through one object, ``pynvml.nvmlLib`` (the ``ctypes.CDLL`` of
``libnvidia-ml.so.1``): it looks each C function up by symbol name (``getattr``; a missing symbol is
NVML_ERROR_FUNCTION_NOT_FOUND), calls it with ctypes arguments (``byref`` of its own structures,
``c_uint``, device handles, string buffers) and reads the ``nvmlReturn_t``. :class:`ReplayLibrary`
stands in that place: each exported symbol is a C function pointer (``ctypes.CFUNCTYPE``, declared
with the parameter types NVIDIA's ``nvml.h`` gives that function) whose body is Python. A call
therefore crosses the C ABI both ways — pynvml's arguments are converted by libffi as for the real
library, the body reads and writes raw memory at the pointers it is given — and everything of
pynvml's own runs: the symbol look-up, its ``_v2``/``_v3`` choices and ``@throwOnVersionMismatch``,
its structures and their ``version`` fields, the two-call size protocol of the list functions,
``NVML_VALUE_NOT_AVAILABLE`` handling and the error classes. Nothing of pynvml is patched; the only
thing set is ``pynvml.nvmlLib``, which pynvml leaves None until its first ``nvmlInit`` and loads itself
otherwise (:func:`install`); its cache of looked-up symbols is never touched (the exported set only
grows: :meth:`ReplayLibrary.activate`). Why Python function pointers rather than a compiled C library:
docs/replay.md.

Driver generations: :func:`generation_for` picks, from the driver version a capture or scenario
names, the symbol list of the newest known ``nvml.h`` not newer than it (every branch from R470 to
R590: ``collectors/replay/symbols.json``, each list read from the header NVIDIA publishes with that
driver; ``scripts/nvml-symbols.py`` regenerates it and records the source). The library exports
exactly those symbols, less a scenario's ``missing_functions``: on a R470 library pynvml's
``nvmlDeviceGetComputeRunningProcesses`` (``_v3``) fails as it does on a real R470 host.

An exported symbol the replay has no answer for returns NVML_ERROR_NOT_SUPPORTED and is counted in
:attr:`ReplayLibrary.unanswered`. An exception in a function body returns NVML_ERROR_UNKNOWN and is
logged (ctypes would otherwise print it and return garbage).
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import json
import logging
import re
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml

from collectors.replay import device_state, gpm
from collectors.replay.state import ReplayError, ReplayEventData, ReplayEventSet, ReplayState

__all__ = ["LIBRARY", "Generation", "ReplayExtension", "ReplayLibrary", "ReplayedNVML", "generation_for",
           "generations", "install", "older_than_known", "open_replay", "register_extension"]

log = logging.getLogger(__name__)

SYMBOLS_FILE = Path(__file__).with_name("symbols.json")
SUCCESS, ERR_INVALID_ARGUMENT, ERR_NOT_SUPPORTED, ERR_INSUFFICIENT_SIZE = 0, 2, 3, 7
ERR_FUNCTION_NOT_FOUND, ERR_UNKNOWN = 13, 999
VALUE_NOT_AVAILABLE_ULL = 2**64 - 1
UINT_MAX = 0xFFFFFFFF


# -- driver generations -------------------------------------------------------------------------
@dataclass(frozen=True)
class Generation:
    """One driver generation's ``libnvidia-ml``: ``version`` (of the header read), ``major``,
    ``source`` and ``sha256`` of that header, and the ``symbols`` it declares."""

    version: str
    major: int
    source: str
    sha256: str
    symbols: frozenset[str]


@functools.lru_cache(maxsize=1)
def _data() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(SYMBOLS_FILE.read_text())
    return data


def generations() -> tuple[Generation, ...]:
    """The known generations, oldest first (``collectors/replay/symbols.json``)."""
    out = [Generation(v, int(v.split(".")[0]), g["source"], g["sha256"], frozenset(g["symbols"]))
           for v, g in _data()["generations"].items()]
    return tuple(sorted(out, key=lambda g: g.major))


def generation_for(driver_version: str | None) -> Generation:
    """The generation whose symbols a library of ``driver_version`` exports: the newest known one
    whose major version is not newer (``"515.105.01"`` → R515, ``"525.60.13"`` → R515, ``"999.1"`` →
    R590). None or no leading number: the newest. A driver older than the oldest known (R470, e.g.
    ``"418.43"``) gets the oldest: no header of those drivers is in ``symbols.json``, and the oldest
    is the nearest list known (:func:`older_than_known` says when that guess is made)."""
    known = generations()
    m = re.match(r"(\d+)", driver_version or "")
    if m is None:
        return known[-1]
    major = int(m.group(1))
    fit = [g for g in known if g.major <= major]
    return fit[-1] if fit else known[0]


def older_than_known(driver_version: str | None) -> bool:
    """True when ``driver_version``'s major number is older than every known generation's (R470):
    :func:`generation_for` then guesses the oldest."""
    m = re.match(r"(\d+)", driver_version or "")
    return m is not None and int(m.group(1)) < generations()[0].major


# -- C types from nvml.h ---------------------------------------------------------------------------
_SCALARS: dict[str, Any] = {"unsigned int": ctypes.c_uint, "int": ctypes.c_int, "unsigned long": ctypes.c_ulong,
                            "unsigned long long": ctypes.c_ulonglong, "nvmlReturn_t": ctypes.c_int}
_HANDLES = frozenset({"nvmlDevice_t", "nvmlEventSet_t", "nvmlUnit_t", "nvmlGpuInstance_t",
                      "nvmlComputeInstance_t", "nvmlGpmSample_t"})
_UINT_TYPEDEFS = frozenset({"nvmlVgpuInstance_t", "nvmlVgpuTypeId_t", "nvmlDeviceArchitecture_t",
                            "nvmlBusType_t", "nvmlPowerSource_t"})
_OUT_SCALARS: dict[str, Any] = {"unsigned int*": ctypes.c_uint, "int*": ctypes.c_int,
                                "unsigned long long*": ctypes.c_ulonglong, "unsigned long*": ctypes.c_ulong}


def _ctype(c: str) -> Any:
    """The ctypes type a parameter of C type ``c`` (as ``scripts/nvml-symbols.py`` writes it) is
    passed as: pointers and handles ``c_void_p``, enums ``c_int`` (their C size)."""
    if c.endswith("*") or c in _HANDLES:
        return ctypes.c_void_p
    if c in _UINT_TYPEDEFS:
        return ctypes.c_uint
    return _SCALARS.get(c, ctypes.c_int)


def _is_out(c: str) -> bool:
    return c.endswith("*") and not c.startswith("const ")


# -- the library ------------------------------------------------------------------------------------
class _Unknown:
    """A handle value no replay gave out (the state answers INVALID_ARGUMENT)."""


_UNKNOWN = _Unknown()
_TLS = threading.local()
_FIRST_ADDRESS, _ADDRESS_STEP = 0x7E5700000000, 0x10  # opaque handle values: far from NULL, aligned


class ReplayLibrary:
    """What ``pynvml.nvmlLib`` holds under a replay (module docstring). One per process, like the
    real library (:data:`LIBRARY`); it answers for the :class:`ReplayState` that made the call —
    the owner of the handle passed, else the one the calling :class:`ReplayedNVML` selected, else
    the last activated — and exports the symbols of that state's generation.

    ``unanswered``: exported symbols called that the replay has no answer for (NOT_SUPPORTED), by
    name. ``calls``: calls by symbol, for benchmarks that count NVML passes.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pointers: dict[str, Any] = {}  # symbol -> the function pointer pynvml gets (kept alive)
        # handles and event sets <-> the opaque pointer values standing for them; weak, so a replay
        # that is no longer used goes away with its objects
        self._objects: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self._addresses: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._next_address = _FIRST_ADDRESS
        self.default: ReplayState | None = None
        self.symbols: weakref.WeakKeyDictionary[ReplayState, frozenset[str]] = weakref.WeakKeyDictionary()
        self.unanswered: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._exported: frozenset[str] = frozenset()

    # pynvml looks symbols up with getattr
    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in self._exported:
            raise AttributeError(name)
        return self._pointer(name)

    def activate(self, state: ReplayState, symbols: frozenset[str]) -> None:
        """Register ``state`` with the ``symbols`` its library exports and make it the default.

        The library exports the union of the symbols of the states registered: exactly one
        generation's in a process that opens replays of one driver (every process but the tests').
        With several generations open, a symbol that the calling state's generation lacks is found
        but answers FUNCTION_NOT_FOUND, which pynvml raises as it raises a failed look-up. The
        exported set only grows, so pynvml's cache of looked-up symbols never needs emptying.
        """
        with self._lock:
            self.symbols[state] = symbols
            self.default = state
            if not symbols <= self._exported:
                self._exported = self._exported | symbols

    def state(self) -> ReplayState | None:
        """The state a call without a handle is for."""
        chosen: ReplayState | None = getattr(_TLS, "state", None)
        return chosen if chosen is not None else self.default

    # -- handles and event sets as C pointers ---------------------------------------------------
    def address(self, obj: Any) -> int:
        """A stable, non-NULL, never reused pointer value standing for ``obj`` (a handle or an event
        set). Opaque, as NVML's are: pynvml never dereferences a handle."""
        with self._lock:
            addr = self._addresses.get(obj)
            if addr is None:
                addr = self._next_address
                self._next_address += _ADDRESS_STEP
                self._addresses[obj] = addr
                self._objects[addr] = obj
            return addr

    def lookup(self, address: int | None) -> Any:
        """The object behind ``address``; None for NULL, an object no state owns otherwise."""
        if not address:
            return None
        return self._objects.get(address, _UNKNOWN)

    # -- function pointers -------------------------------------------------------------------------
    def _pointer(self, name: str) -> Any:
        ptr = self._pointers.get(name)
        if ptr is None:
            with self._lock:
                ptr = self._pointers.get(name)
                if ptr is None:
                    ptr = self._pointers[name] = self._make(name)
        return ptr

    def _make(self, name: str) -> Any:
        params: list[str] = _data()["signatures"].get(name, [])
        if name == "nvmlErrorString":
            proto = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_int)
            body: Callable[..., Any] = self._error_string
        else:
            proto = ctypes.CFUNCTYPE(ctypes.c_int, *(_ctype(p) for p in params))
            body = self._body(name, params)
        callback = proto(body)
        # pynvml calls through a pointer without declared argument types, as it calls the CDLL's
        # functions: ctypes converts its arguments by the default rules, libffi passes them, and the
        # callback decodes them by nvml.h's types.
        caller = ctypes.CFUNCTYPE(proto._restype_)(ctypes.cast(callback, ctypes.c_void_p).value or 0)
        caller._replay_callback = callback  # type: ignore[attr-defined]
        return caller

    @staticmethod
    def _error_string(code: int) -> int:
        """``const char *nvmlErrorString(nvmlReturn_t)``: the address of a string that lives as long
        as the process (built at import, never replaced)."""
        try:
            return ctypes.addressof(_ERROR_BUFFERS.get(code, _ERROR_BUFFERS[ERR_UNKNOWN]))
        except Exception:  # never let ctypes return garbage as a pointer
            log.exception("replayed nvmlErrorString raised")
            return 0

    def _body(self, name: str, params: list[str]) -> Callable[..., int]:
        adapter = _ADAPTERS.get(name)

        def body(*args: Any) -> int:
            try:
                state = self._state_for(params, args)
                if state is None:
                    return ERR_FUNCTION_NOT_FOUND  # no replay opened: nothing to answer for
                self.calls[name] += 1
                if name not in self.symbols.get(state, self._exported):
                    return ERR_FUNCTION_NOT_FOUND  # looked up under another generation's library
                if adapter is None:
                    self.unanswered[name] += 1
                    return ERR_NOT_SUPPORTED
                return adapter(self, state, params, args)
            except pynvml.NVMLError as exc:
                return int(exc.value)
            except Exception:  # a bug in a body: never let ctypes return garbage as SUCCESS
                log.exception("replayed %s raised", name)
                return ERR_UNKNOWN

        body.__name__ = name
        return body

    def _state_for(self, params: list[str], args: Sequence[Any]) -> ReplayState | None:
        for c, value in zip(params, args, strict=True):
            if c in ("nvmlDevice_t", "nvmlEventSet_t", "nvmlGpmSample_t"):
                obj = self.lookup(value)
                owner = getattr(obj, "_owner", None)
                if isinstance(owner, ReplayState):
                    return owner
        return self.state()


LIBRARY = ReplayLibrary()
"""The one replayed library of this process."""


def install(state: ReplayState, symbols: frozenset[str]) -> None:
    """Put :data:`LIBRARY` where pynvml keeps its library and make ``state`` its default. Raises
    ReplayError when pynvml has already loaded the real ``libnvidia-ml`` in this process."""
    with pynvml.libLoadLock:
        if pynvml.nvmlLib is not LIBRARY:
            if pynvml.nvmlLib is not None:
                raise ReplayError("the real libnvidia-ml is already loaded in this process; a replay "
                                  "needs a process of its own")
            pynvml.nvmlLib = LIBRARY
    LIBRARY.activate(state, symbols)


# -- argument decoding and answer writing -------------------------------------------------------------
_ERROR_STRINGS = {0: "Success", 1: "Uninitialized", 2: "Invalid Argument", 3: "Not Supported",
                  4: "Insufficient Permissions", 5: "Already Initialized", 6: "Not Found",
                  7: "Insufficient Size", 8: "Insufficient External Power", 9: "Driver Not Loaded",
                  10: "Timeout", 11: "Interrupted request", 12: "Unable to communicate with GPU",
                  13: "Function Not Found", 14: "Corrupted infoROM", 15: "GPU is lost",
                  16: "GPU requires restart", 17: "Operating System Call Failed",
                  18: "RM has detected an NVML/RM version mismatch.", 19: "In use by another client",
                  20: "Insufficient Memory", 21: "No data", 22: "The requested vgpu operation is not "
                  "available on target device, because ECC is enabled", 25: "Argument version mismatch",
                  26: "Requested functionality has been deprecated", 999: "Unknown Error"}
_ERROR_BUFFERS = {code: ctypes.create_string_buffer(text.encode()) for code, text in _ERROR_STRINGS.items()}


def _write_scalar(ptr: int, ctype: Any, value: Any) -> None:
    ctypes.cast(ptr, ctypes.POINTER(ctype))[0] = int(value.value if isinstance(value, ctypes._SimpleCData) else value)


def _write_text(buf: int, length: int, text: Any) -> int:
    data = text if isinstance(text, bytes) else str(text).encode()
    if not buf:
        return ERR_INVALID_ARGUMENT
    if len(data) + 1 > length:
        return ERR_INSUFFICIENT_SIZE
    ctypes.memmove(buf, data + b"\0", len(data) + 1)
    return SUCCESS


def _inputs(lib: ReplayLibrary, params: list[str], args: Sequence[Any]) -> list[Any]:
    """The in-parameters as the state's methods take them: handles as objects, strings as str."""
    out: list[Any] = []
    for c, value in zip(params, args, strict=True):
        if c in _HANDLES:
            out.append(lib.lookup(value))
        elif c == "const char*":
            out.append(ctypes.string_at(value).decode(errors="replace") if value else "")
        elif not _is_out(c):
            out.append(value)
    return out


def _generic(method: str) -> Callable[..., int]:
    """An adapter calling ``state.<method>(*inputs)`` and writing its answer (one value, or a list
    or tuple of them) into the out-parameters in order: scalars, handles (as their address) and
    ctypes structures (copied); ``char*`` + ``unsigned int`` length pairs get the text."""

    def adapter(lib: ReplayLibrary, state: ReplayState, params: list[str], args: Sequence[Any]) -> int:
        outs = [(c, a) for c, a in zip(params, args, strict=True) if _is_out(c)]
        text = outs and outs[0][0] == "char*"
        if text:
            outs = []
        if any(not a for _, a in outs):
            return ERR_INVALID_ARGUMENT
        value = getattr(state, method)(*_call_args(lib, params, args))
        if text:
            buf = next(a for c, a in zip(params, args, strict=True) if c == "char*")
            return _write_text(buf, int(args[-1]), value)
        values = [value] if len(outs) == 1 else list(value) if outs else []
        for (c, ptr), v in zip(outs, values, strict=True):
            if c in ("nvmlDevice_t*", "nvmlEventSet_t*"):
                _write_scalar(ptr, ctypes.c_void_p, lib.address(v))
            elif isinstance(v, ctypes.Structure):
                ctypes.memmove(ptr, ctypes.byref(v), ctypes.sizeof(v))
            else:
                _write_scalar(ptr, _OUT_SCALARS.get(c, ctypes.c_int), v)
        return SUCCESS

    return adapter


def _call_args(lib: ReplayLibrary, params: list[str], args: Sequence[Any]) -> list[Any]:
    """In-parameters, less a ``char*`` out-buffer's length."""
    keep = [(c, a) for i, (c, a) in enumerate(zip(params, args, strict=True))
            if not (c == "unsigned int" and i > 0 and params[i - 1] == "char*")]
    return _inputs(lib, [c for c, _ in keep], [a for _, a in keep])


# nvml.h's layouts of the structures whose version the symbol decides
class _ProcessInfoV1(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


class _ProcessInfoV2(ctypes.Structure):  # nvmlProcessInfo_v2_t = nvmlProcessInfo_t (_v2 and _v3 calls)
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]


class _EventData(ctypes.Structure):  # nvmlEventData_t
    _fields_ = [("device", ctypes.c_void_p), ("eventType", ctypes.c_ulonglong), ("eventData", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]


def _processes(method: str, struct: Any) -> Callable[..., int]:
    """``(device, unsigned int *infoCount, <struct> *infos)``: NULL infos or too small a count
    sets the count and answers INSUFFICIENT_SIZE (SUCCESS when there is none), as NVML."""

    def adapter(lib: ReplayLibrary, state: ReplayState, params: list[str], args: Sequence[Any]) -> int:
        handle, count_ptr, infos = lib.lookup(args[0]), args[1], args[2]
        if not count_ptr:
            return ERR_INVALID_ARGUMENT
        procs = getattr(state, method)(handle)
        count = ctypes.cast(count_ptr, ctypes.POINTER(ctypes.c_uint))
        if not procs:
            count[0] = 0
            return SUCCESS
        if not infos or count[0] < len(procs):
            count[0] = len(procs)
            return ERR_INSUFFICIENT_SIZE
        out = ctypes.cast(infos, ctypes.POINTER(struct))
        for i, p in enumerate(procs):
            out[i].pid = p.pid
            out[i].usedGpuMemory = VALUE_NOT_AVAILABLE_ULL if p.usedGpuMemory is None else p.usedGpuMemory
            if struct is _ProcessInfoV2:
                out[i].gpuInstanceId, out[i].computeInstanceId = p.gpuInstanceId, p.computeInstanceId
        count[0] = len(procs)
        return SUCCESS

    return adapter


def _memory_v2(lib: ReplayLibrary, state: ReplayState, params: list[str], args: Sequence[Any]) -> int:
    """``(device, nvmlMemory_v2_t *memory)``: the caller sets ``memory->version`` first."""
    if not args[1]:
        return ERR_INVALID_ARGUMENT
    version = ctypes.cast(args[1], ctypes.POINTER(ctypes.c_uint))[0]
    value = state.nvmlDeviceGetMemoryInfo(lib.lookup(args[0]), version)
    ctypes.memmove(args[1], ctypes.byref(value), ctypes.sizeof(value))
    return SUCCESS


def _samples(lib: ReplayLibrary, state: ReplayState, params: list[str], args: Sequence[Any]) -> int:
    """``(device, type, unsigned long long lastSeenTimeStamp, nvmlValueType_t *sampleValType,
    unsigned int *sampleCount, nvmlSample_t *samples)``: NULL samples sets the count."""
    handle, kind, last, vtype_ptr, count_ptr, samples = lib.lookup(args[0]), *args[1:]
    if not vtype_ptr or not count_ptr:
        return ERR_INVALID_ARGUMENT
    vtype, values = state.nvmlDeviceGetSamples(handle, kind, last)
    _write_scalar(vtype_ptr, ctypes.c_int, vtype)
    count = ctypes.cast(count_ptr, ctypes.POINTER(ctypes.c_uint))
    if not samples:
        count[0] = len(values)
        return SUCCESS
    n = min(count[0], len(values))
    size = ctypes.sizeof(pynvml.c_nvmlSample_t)
    for i, v in enumerate(values[:n]):
        ctypes.memmove(samples + i * size, ctypes.byref(v), size)
    count[0] = n
    return SUCCESS


def _process_utilization(lib: ReplayLibrary, state: ReplayState, params: list[str], args: Sequence[Any]) -> int:
    """``(device, nvmlProcessUtilizationSample_t *utilization, unsigned int *processSamplesCount,
    unsigned long long lastSeenTimeStamp)``: NULL or too small a buffer sets the count and answers
    INSUFFICIENT_SIZE."""
    handle, buf, count_ptr, last = lib.lookup(args[0]), args[1], args[2], args[3]
    if not count_ptr:
        return ERR_INVALID_ARGUMENT
    values = state.nvmlDeviceGetProcessUtilization(handle, last)
    count = ctypes.cast(count_ptr, ctypes.POINTER(ctypes.c_uint))
    if not buf or count[0] < len(values):
        count[0] = len(values)
        return ERR_INSUFFICIENT_SIZE
    size = ctypes.sizeof(pynvml.c_nvmlProcessUtilizationSample_t)
    for i, v in enumerate(values):
        ctypes.memmove(buf + i * size, ctypes.byref(v), size)
    count[0] = len(values)
    return SUCCESS


def _field_values(lib: ReplayLibrary, state: ReplayState, params: list[str], args: Sequence[Any]) -> int:
    """``(device, int valuesCount, nvmlFieldValue_t *values)``: ``fieldId`` / ``scopeId`` read, the
    rest written."""
    handle, n, ptr = lib.lookup(args[0]), int(args[1]), args[2]
    if n < 0 or (n and not ptr):
        return ERR_INVALID_ARGUMENT
    given = (pynvml.c_nvmlFieldValue_t * n).from_address(ptr) if n else []
    answer = state.nvmlDeviceGetFieldValues(handle, [(v.fieldId, v.scopeId) for v in given])
    if n:
        ctypes.memmove(ptr, ctypes.byref(answer), ctypes.sizeof(answer))
    return SUCCESS


def _retired_pages(lib: ReplayLibrary, state: ReplayState, params: list[str], args: Sequence[Any]) -> int:
    """``(device, cause, unsigned int *pageCount, unsigned long long *addresses)``."""
    handle, cause, count_ptr, addresses = lib.lookup(args[0]), args[1], args[2], args[3]
    if not count_ptr:
        return ERR_INVALID_ARGUMENT
    pages = state.nvmlDeviceGetRetiredPages(handle, cause)
    count = ctypes.cast(count_ptr, ctypes.POINTER(ctypes.c_uint))
    if not addresses or count[0] < len(pages):
        count[0] = len(pages)
        return ERR_INSUFFICIENT_SIZE if pages else SUCCESS
    out = ctypes.cast(addresses, ctypes.POINTER(ctypes.c_ulonglong))
    for i, page in enumerate(pages):
        out[i] = page
    count[0] = len(pages)
    return SUCCESS


def _event_wait(legacy: bool) -> Callable[..., int]:
    """``(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)``. ``legacy``: the
    unversioned ``nvmlEventSetWait`` of old binaries, whose structure ends before the instance ids:
    only device, type and data are written."""

    def adapter(lib: ReplayLibrary, state: ReplayState, params: list[str], args: Sequence[Any]) -> int:
        es, data_ptr, timeout = lib.lookup(args[0]), args[1], args[2]
        if not data_ptr:
            return ERR_INVALID_ARGUMENT
        event: ReplayEventData = state.nvmlEventSetWait_v2(es if isinstance(es, ReplayEventSet) else None, timeout)
        data = ctypes.cast(data_ptr, ctypes.POINTER(_EventData))[0]
        data.device = lib.address(event.device)
        data.eventType, data.eventData = event.eventType, event.eventData
        if not legacy:
            data.gpuInstanceId, data.computeInstanceId = event.gpuInstanceId, event.computeInstanceId
        return SUCCESS

    return adapter


_PROCESS_KINDS = ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses",
                  "nvmlDeviceGetMPSComputeRunningProcesses")
_GENERIC = {  # symbol -> the ReplayState method answering it
    **{s: s.split("_v")[0] for s in (
        "nvmlInit", "nvmlInit_v2", "nvmlInitWithFlags", "nvmlShutdown", "nvmlSystemGetDriverVersion",
        "nvmlSystemGetNVMLVersion", "nvmlSystemGetCudaDriverVersion", "nvmlSystemGetCudaDriverVersion_v2",
        "nvmlDeviceGetCount", "nvmlDeviceGetCount_v2", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByIndex_v2",
        "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetHandleByPciBusId", "nvmlDeviceGetHandleByPciBusId_v2",
        "nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetIndex", "nvmlDeviceGetSerial",
        "nvmlDeviceGetMinorNumber", "nvmlDeviceGetVbiosVersion", "nvmlDeviceGetBoardPartNumber",
        "nvmlDeviceGetComputeMode", "nvmlDeviceGetPersistenceMode", "nvmlDeviceGetDisplayActive",
        "nvmlDeviceGetDisplayMode", "nvmlDeviceGetMigMode", "nvmlDeviceGetCudaComputeCapability",
        "nvmlDeviceGetArchitecture", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetBAR1MemoryInfo",
        "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetEncoderUtilization", "nvmlDeviceGetDecoderUtilization",
        "nvmlDeviceGetPowerUsage", "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetPowerManagementLimit",
        "nvmlDeviceGetPowerManagementDefaultLimit", "nvmlDeviceGetFanSpeed", "nvmlDeviceGetPerformanceState",
        "nvmlDeviceGetPowerManagementLimitConstraints", "nvmlDeviceGetTotalEnergyConsumption",
        "nvmlDeviceGetTemperature", "nvmlDeviceGetClockInfo", "nvmlDeviceGetMaxClockInfo",
        "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons",
        "nvmlDeviceGetEccMode", "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkGeneration",
        "nvmlDeviceGetCurrPcieLinkWidth", "nvmlDeviceGetMaxPcieLinkWidth", "nvmlDeviceGetPcieReplayCounter",
        "nvmlDeviceGetPcieThroughput", "nvmlDeviceGetMaxMigDeviceCount", "nvmlDeviceGetMigDeviceHandleByIndex",
        "nvmlDeviceIsMigDeviceHandle", "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
        "nvmlDeviceGetGpuInstanceId", "nvmlDeviceGetComputeInstanceId", "nvmlEventSetCreate", "nvmlEventSetFree",
        "nvmlDeviceGetSupportedEventTypes", "nvmlDeviceRegisterEvents", "nvmlDeviceGetNvLinkState",
        "nvmlDeviceGetNvLinkErrorCounter")},
    "nvmlDeviceGetPciInfo_v3": "nvmlDeviceGetPciInfo_v3",
}
_ADAPTERS: dict[str, Callable[..., int]] = {
    **{s: _generic(m) for s, m in _GENERIC.items()},
    **{k: _processes(k, _ProcessInfoV1) for k in _PROCESS_KINDS},
    **{f"{k}_{v}": _processes(k, _ProcessInfoV2) for k in _PROCESS_KINDS for v in ("v2", "v3")},
    "nvmlDeviceGetMemoryInfo_v2": _memory_v2,
    "nvmlDeviceGetSamples": _samples,
    "nvmlDeviceGetProcessUtilization": _process_utilization,
    "nvmlDeviceGetFieldValues": _field_values,
    "nvmlDeviceGetRetiredPages": _retired_pages,
    "nvmlEventSetWait": _event_wait(legacy=True),
    "nvmlEventSetWait_v2": _event_wait(legacy=False),
    **gpm.ADAPTERS,
}
ANSWERED_SYMBOLS = frozenset(_ADAPTERS) | {"nvmlErrorString"}
"""The C functions the replay answers (the others a generation exports answer NOT_SUPPORTED)."""


# -- pynvml bound to a replay -------------------------------------------------------------------------
class ReplayedNVML:
    """The ``pynvml`` module with a replay underneath: what the NVIDIA backend gets instead of
    ``pynvml`` under ``--nvml-replay``. Attribute access answers pynvml's own constants, classes and
    functions; a function call first selects this replay for calls that name no handle (the process
    may hold several replays; handles find their own). ``source`` is ``"replay"``; ``state`` the
    :class:`ReplayState`, ``generation`` the driver generation whose symbols are exported and
    ``symbols`` those symbols, less the scenario's ``missing_functions``.
    """

    source = "replay"

    def __init__(self, state: ReplayState) -> None:
        self.state = state
        self.generation = generation_for(state.capture.driver_version)
        self.symbols = self.generation.symbols - set(state.missing_functions)
        self.library = LIBRARY
        install(state, self.symbols)

    @property
    def path(self) -> Path | None:
        """The capture or scenario file."""
        return self.state.path

    @property
    def capture(self) -> Any:
        """The :class:`collectors.replay.capture.SystemCapture` replayed."""
        return self.state.capture

    def __getattr__(self, name: str) -> Any:
        value = getattr(pynvml, name)
        if not (inspect.isfunction(value) and name.startswith("nvml")):
            return value
        state = self.state

        @functools.wraps(value)
        def bound(*args: Any, **kwargs: Any) -> Any:
            previous = getattr(_TLS, "state", None)
            _TLS.state = state
            try:
                return value(*args, **kwargs)
            finally:
                _TLS.state = previous

        self.__dict__[name] = bound
        return bound


@dataclass(frozen=True)
class ReplayExtension:
    """Code that reads scenario tables the replay itself does not: ``tables`` (their names, e.g. the
    test support's ``("fault",)``), handed to ``attach(state)`` with the scenario's tables in
    ``state.extra``; ``attach`` may add ``state.call_hooks`` and set ``state.event_source``, and raises
    (any exception; it becomes a ReplayError) for a table it refuses. ``name`` says where it comes from,
    for messages."""

    name: str
    tables: tuple[str, ...]
    attach: Callable[[ReplayState], None]


_extension: ReplayExtension | None = None
_extension_lock = threading.Lock()


def register_extension(extension: ReplayExtension | None) -> ReplayExtension | None:
    """Make ``extension`` the one that :func:`open_replay` hands its tables to, in this process, from
    now on (None: none); returns the one it replaces. accelstats registers none, so a scenario with
    tables only an extension reads is refused (:func:`open_replay`). Code that imports the replay
    registers one in-process; nothing is loaded from a file or the environment."""
    global _extension
    with _extension_lock:
        previous, _extension = _extension, extension
    return previous


def open_replay(path: str | Path, **kwargs: Any) -> ReplayedNVML:
    """Load a capture or scenario (:meth:`ReplayState.from_path`; ``kwargs``: ``clock``, ``sleep``)
    and put it under pynvml. A scenario's tables that the :func:`register_extension`-ed extension
    reads (the test support's ``[[fault]]``) are handed to it; without one such a scenario is
    refused. The GPUs' device state is applied (:func:`collectors.replay.device_state.attach`).
    Raises ReplayError (a bad file, fault tables without the extension, a table the extension
    refuses, the real library already loaded)."""
    extension = _extension
    state = ReplayState.from_path(path, tables=extension.tables if extension is not None else (), **kwargs)
    key = "driver_version" if Path(path).suffix.lower() == ".toml" else "<driver_version>"
    driver = state.capture.driver_version
    if older_than_known(driver):
        oldest = generations()[0]
        log.warning("%s: %s: driver %s is older than the oldest NVML generation replayed; replaying it as "
                    "R%d (%s), whose functions a driver this old may lack", path, key, driver, oldest.major,
                    oldest.version)
    known = frozenset().union(*(g.symbols for g in generations()))
    unknown = sorted(set(state.missing_functions) - known)
    if unknown:
        raise ReplayError(f"{path}: missing_functions: {', '.join(unknown)}: not a function of any "
                          "libnvidia-ml replayed (R470-R590)")
    device_state.attach(state)
    if extension is not None and state.extra:  # only a scenario with its tables needs the extension
        try:
            extension.attach(state)
        except ReplayError:
            raise
        except Exception as exc:  # the extension's own errors (CaptureError for its tables)
            raise ReplayError(str(exc)) from exc
    return ReplayedNVML(state)
