"""The one place NVML is called: error classification and "not available" sentinels.

Every NVML call of the backend goes through :class:`NvmlCaller` (as nvitop's
``nvmlQuery``). It answers:

* a value, or ``None`` for NOT_SUPPORTED, DEPRECATED, NOT_FOUND where the caller says so, and NVML's
  "value not available" sentinels (2^32-1, 2^64-1 and their signed forms);
* ``None`` for a function the driver's library does not have — FUNCTION_NOT_FOUND, or pynvml's
  ``NVMLLibraryMismatchError`` (a plain ``Exception`` its ``@throwOnVersionMismatch`` functions
  raise when the versioned symbol they call is missing: ``nvmlDeviceGetComputeRunningProcesses`` calls
  ``_v3``, which libraries before R510 lack). Logged once, counted as FUNCTION_NOT_FOUND, and never
  called again (:meth:`NvmlCaller.missing` tells the caller, which may fall back to an older call);
* raises :class:`DeviceLostError` for errors that mean the device stopped answering
  (GPU_IS_LOST, UNKNOWN, TIMEOUT, GPU_NOT_FOUND, RESET_REQUIRED, IRQ_ISSUE): the device is then
  reported with ``accelstats_gpu_up 0``;
* raises :class:`NvmlUnavailableError` for errors that mean the library as a whole is unusable
  (UNINITIALIZED, DRIVER_NOT_LOADED, LIBRARY_NOT_FOUND, LIB_RM_VERSION_MISMATCH): the backend then
  re-initialises NVML on its retry schedule.

Any other NVML error (NO_PERMISSION, INVALID_ARGUMENT, ...) is logged once per (call, error), counted
in :attr:`NvmlCaller.errors` and answered with ``None``.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

log = logging.getLogger(__name__)

# NVML "value not available" sentinels (nvml.h NVML_VALUE_NOT_AVAILABLE and unsigned casts of -1).
SENTINELS = frozenset({2**32 - 1, 2**64 - 1, 2**31 - 1, 2**63 - 1, -1})

LOST_ERRORS = frozenset({"GPU_IS_LOST", "UNKNOWN", "TIMEOUT", "GPU_NOT_FOUND", "RESET_REQUIRED", "IRQ_ISSUE"})
UNAVAILABLE_ERRORS = frozenset(
    {"UNINITIALIZED", "DRIVER_NOT_LOADED", "LIBRARY_NOT_FOUND", "LIB_RM_VERSION_MISMATCH"}
)
ABSENT_ERRORS = frozenset({"NOT_SUPPORTED", "FUNCTION_NOT_FOUND", "DEPRECATED"})
_UNSET: Any = object()


class _NeverRaisedError(Exception):
    """Stands for pynvml's NVMLLibraryMismatchError where pynvml has none."""


class DeviceLostError(Exception):
    """The device did not answer (NVML GPU_IS_LOST, UNKNOWN, TIMEOUT, ...): report it down."""


class NvmlUnavailableError(Exception):
    """NVML as a whole is unusable (library missing, driver not loaded, not initialised)."""


def error_name(nvml: Any, exc: BaseException) -> str:
    """Name of an ``NVMLError``'s code without the ``NVML_ERROR_`` prefix, e.g. ``"GPU_IS_LOST"``.

    Looks the numeric ``exc.value`` up among the ``NVML_ERROR_*`` constants of ``nvml`` (pynvml or
    the replay); answers ``"CODE_<n>"`` for a code this pynvml does not name.
    """
    code = getattr(exc, "value", None)
    for name in dir(nvml):
        if name.startswith("NVML_ERROR_") and getattr(nvml, name) == code:
            return name[len("NVML_ERROR_") :]
    import pynvml  # an nvml object that does not list pynvml's constants (a wrapper): use pynvml's

    for name in dir(pynvml):
        if name.startswith("NVML_ERROR_") and getattr(pynvml, name) == code:
            return name[len("NVML_ERROR_") :]
    return f"CODE_{code}"


class NvmlCaller:
    """Calls ``nvml.<function>`` by name and classifies its outcome (see module docstring).

    ``nvml`` is the ``pynvml`` module, or pynvml over the replayed library
    (:class:`collectors.replay.lib.ReplayedNVML`). ``errors`` counts (call, error name) pairs that
    were answered with ``None`` or raised; it is read by the exporter as
    ``accelstats_nvml_errors_total``.
    """

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.errors: Counter[tuple[str, str]] = Counter()
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._names: dict[int, str] = {}
        self._missing: set[tuple[str, tuple[str, ...]]] = set()
        # pynvml's NVMLLibraryMismatchError (nvidia-ml-py 12.560+; a class that never matches before)
        self._mismatch: type[BaseException] = getattr(nvml, "NVMLLibraryMismatchError", _NeverRaisedError)

    def _name(self, exc: BaseException) -> str:
        code = getattr(exc, "value", -1)
        name = self._names.get(code)
        if name is None:
            name = error_name(self.nvml, exc)
            self._names[code] = name
        return name

    def failed(self, call: str, exc: BaseException, level: int = logging.WARNING) -> str:
        """Count and log (once) ``exc``, raised by ``call`` where the caller must handle the error
        itself (``nvmlInit``, ``nvmlShutdown``); returns the error's name."""
        err = self._name(exc)
        self._note(call, err, level)
        return err

    def _note(self, call: str, err: str, level: int) -> None:
        with self._lock:
            self.errors[(call, err)] += 1
            first = (call, err) not in self._logged
            self._logged.add((call, err))
        log.log(level if first else logging.DEBUG, "NVML %s: %s", call, err)

    def missing(self, call: str, **kwargs: Any) -> bool:
        """True once ``call`` (with these keyword names) was found missing from the library."""
        return (call, tuple(sorted(kwargs))) in self._missing

    def __call__(self, call: str, *args: Any, not_found: Any = _UNSET, timeout: Any = _UNSET, absent: Any = None,
                 unsupported: Any = _UNSET, **kwargs: Any) -> Any:
        """Return ``nvml.<call>(*args, **kwargs)``, ``None`` when absent; see the module docstring.

        ``not_found``: what to answer for NVML NOT_FOUND, which some calls use for "no new samples
        since that timestamp" (``nvmlDeviceGetSamples``, ``nvmlDeviceGetProcessUtilization``);
        without it NOT_FOUND is logged, counted and answered with ``None``. ``timeout``: what to
        answer for NVML TIMEOUT where it is the normal outcome (``nvmlEventSetWait_v2``), neither
        logged nor counted; without it TIMEOUT means the device stopped answering. ``absent``: what
        to answer instead of ``None`` when there is no value (for calls whose value is ``None``).
        ``unsupported``: what to answer for NOT_SUPPORTED or DEPRECATED, to tell them from the other
        ways of having no value.
        Raises DeviceLostError or NvmlUnavailableError as classified above.
        """
        key = (call, tuple(sorted(kwargs)))  # nvmlDeviceGetMemoryInfo(version=v2) can be missing alone
        if key in self._missing:
            return absent
        fn = getattr(self.nvml, call, None)
        if fn is None:
            self._missing.add(key)
            self._note(call, "FUNCTION_NOT_FOUND", logging.WARNING)
            return absent
        try:
            value = fn(*args, **kwargs)
        except self.nvml.NVMLError as exc:
            err = self._name(exc)
            if err == "TIMEOUT" and timeout is not _UNSET:
                return timeout
            if err in ABSENT_ERRORS:
                if err == "FUNCTION_NOT_FOUND":  # pynvml newer than the driver: ask once, not every scrape
                    self._missing.add(key)
                    self._note(call, err, logging.WARNING)
                    return absent
                return absent if unsupported is _UNSET else unsupported
            if err == "NOT_FOUND" and not_found is not _UNSET:
                return not_found
            if err in LOST_ERRORS:
                self._note(call, err, logging.WARNING)
                raise DeviceLostError(f"{call}: {err}") from exc
            if err in UNAVAILABLE_ERRORS:
                self._note(call, err, logging.WARNING)
                raise NvmlUnavailableError(f"{call}: {err}") from exc
            self._note(call, err, logging.WARNING)
            return absent
        except self._mismatch as exc:  # pynvml: the versioned symbol behind this call is missing
            self._missing.add(key)
            self._note(call, "FUNCTION_NOT_FOUND", logging.WARNING)
            log.debug("NVML %s: %s", call, exc)
            return absent
        if isinstance(value, int) and not isinstance(value, bool) and value in SENTINELS:
            return absent
        return value
