"""NVML critical-XID events, counted per GPU by a background thread (never on the scrape path).

An XID is the driver's error report for a GPU (``dmesg``: ``NVRM: Xid (PCI:…): 79, …``). NVML
delivers the critical ones as ``nvmlEventTypeXidCriticalError`` events through an event set
(``nvmlEventSetCreate``, ``nvmlDeviceRegisterEvents``, ``nvmlEventSetWait_v2``). :class:`XidWatcher`
waits on such a set in its own daemon thread and keeps, per GPU UUID, a count per XID (exported as
``accelstats_gpu_xid_errors_total{xid}``) and the last XID that makes the GPU unfit for new work.

XIDs that an application causes by itself (13 graphics engine exception, 31 MMU fault, 43 GPU stopped
processing, 45 preemptive cleanup, 68 video processor exception, 109 context switch timeout) are
counted but do not make the GPU unhealthy — the same rule NVIDIA's Kubernetes device plugin applies.
Every other critical XID (48 double-bit ECC, 63/64 row remapping, 74 NVLink, 79 fallen off the bus,
92 high single-bit ECC rate, 94/95 contained/uncontained ECC, 119/120 GSP errors, …) does, until the
exporter or plugin restarts (the driver needs a reset or reload to recover from those).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from collectors.nvml_call import DeviceLostError, NvmlCaller, NvmlUnavailableError

log = logging.getLogger(__name__)

APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
WAIT_MS = 250  # each wait is one NVML call; shutdown does not wait for it (see NvidiaBackend.shutdown)
_TIMED_OUT = object()
_FAILED = object()


def handle_address(handle: Any) -> int | None:
    """The pointer value of an NVML device handle (pynvml's ``c_nvmlDevice_t``), which is what
    identifies the device: pynvml builds a new ctypes object for every handle it returns, and the
    ``device`` of an event is one of those."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return None


class XidWatcher:
    """Counts critical XIDs per GPU UUID from NVML events (see module docstring).

    ``call``: the backend's :class:`collectors.nvml_call.NvmlCaller` (every NVML call goes through
    it, so failures are logged once and counted in ``accelstats_nvml_errors_total``); ``handles``:
    ``{uuid: handle}`` of the GPUs to watch. Start with :meth:`start`, stop with :meth:`stop` (the
    thread ends within one wait, :data:`WAIT_MS`; :meth:`stop_then` hands it what to do then). GPUs
    whose driver does not support the event type are skipped. Thread-safe readers: :meth:`counts` and :meth:`critical`.
    """

    def __init__(self, call: NvmlCaller, handles: dict[str, Any]) -> None:
        self.call = call
        self.handles = handles
        self._counts: dict[str, Counter[int]] = {}
        self._critical: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._finished = False
        self._then: Callable[[], None] | None = None  # run by the thread as it ends (a deferred nvmlShutdown)
        self._set: Any = None
        self.watching: list[str] = []

    def start(self) -> None:
        """Register every GPU for critical-XID events and start waiting in a daemon thread.
        Does nothing when no GPU supports the event (a message is logged)."""
        c = self.call
        kind = getattr(c.nvml, "nvmlEventTypeXidCriticalError", 8)
        try:
            self._set = c("nvmlEventSetCreate")
        except (DeviceLostError, NvmlUnavailableError) as exc:
            log.warning("XID events not watched: %s", exc)
            return
        if self._set is None:
            log.warning("XID events not available: nvmlEventSetCreate failed")
            return
        for uuid, handle in self.handles.items():  # one GPU that does not answer leaves the others watched
            try:
                supported = c("nvmlDeviceGetSupportedEventTypes", handle)
                if not supported or not supported & kind:
                    continue
                if c("nvmlDeviceRegisterEvents", handle, kind, self._set, absent=_FAILED) is _FAILED:
                    log.info("XID events not watched on %s", uuid)
                    continue
            except (DeviceLostError, NvmlUnavailableError) as exc:
                log.warning("XID events not watched on %s: %s", uuid, exc)
                continue
            self.watching.append(uuid)
        if not self.watching:
            self._free()
            return
        self._thread = threading.Thread(target=self._run, name="accelstats-xid", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._watch()
        except Exception:  # a bug must not take the deferred nvmlShutdown with it
            log.exception("XID event thread failed; XID events are not watched any more")
        finally:
            try:
                self._free()
            finally:
                with self._lock:
                    self._finished, then = True, self._then
                if then is not None:
                    then()

    def _watch(self) -> None:
        by_address = {handle_address(h): u for u, h in self.handles.items()}
        failures = 0
        while not self._stop.is_set():
            try:
                event = self.call("nvmlEventSetWait_v2", self._set, WAIT_MS, timeout=_TIMED_OUT)
            except (DeviceLostError, NvmlUnavailableError) as exc:
                event, reason = None, str(exc)
            else:
                reason = "no event data"
            if event is _TIMED_OUT:
                failures = 0
                continue
            if event is None and self.call.missing("nvmlEventSetWait_v2"):
                log.warning("XID events not watched: the NVML library has no nvmlEventSetWait_v2")
                with self._lock:
                    self.watching = []
                break
            if event is None:
                failures += 1
                log.log(logging.WARNING if failures == 1 else logging.DEBUG, "XID events: %s", reason)
                self._stop.wait(min(30.0, failures))
                continue
            uuid = by_address.get(handle_address(event.device)) or self._uuid_of(event.device)
            xid = int(event.eventData)
            with self._lock:
                self._counts.setdefault(uuid, Counter())[xid] += 1
                if xid not in APPLICATION_XIDS:
                    self._critical[uuid] = xid
            what = (" (an application's own fault)" if xid in APPLICATION_XIDS else
                    f": unfit for new work until the driver is reset (accelstats_gpu_critical_xid {xid}; the "
                    "Nomad plugin reports it unhealthy)")
            log.warning("GPU %s reported XID %d%s", uuid, xid, what)

    def _uuid_of(self, handle: Any) -> str:
        try:
            value = self.call("nvmlDeviceGetUUID", handle)
        except (DeviceLostError, NvmlUnavailableError):
            value = None
        if value is None:
            return "unknown"
        return value.decode() if isinstance(value, bytes) else str(value)

    def _free(self) -> None:
        if self._set is None:
            return
        try:
            self.call("nvmlEventSetFree", self._set)
        except (DeviceLostError, NvmlUnavailableError) as exc:
            log.debug("nvmlEventSetFree: %s", exc)
        self._set = None

    def counts(self, uuid: str) -> tuple[tuple[int, int], ...]:
        """``((xid, count), …)`` seen on ``uuid`` since start, sorted by XID."""
        with self._lock:
            return tuple(sorted(self._counts.get(uuid, Counter()).items()))

    def critical(self, uuid: str) -> int | None:
        """The last XID that made ``uuid`` unfit for new work; 0 when none did (XIDs start at 1); None
        when the GPU is not watched."""
        with self._lock:
            if uuid not in self.watching:
                return None
            return self._critical.get(uuid, 0)

    def stop_then(self, then: Callable[[], None]) -> bool:
        """Ask the thread to end and run ``then`` as it ends (after freeing its event set), without
        waiting: True when the thread will, False when it already ended (the caller runs ``then``)."""
        self._stop.set()
        with self._lock:
            if self._thread is None or self._finished:
                return False
            self._then = then
            return True

    def request_stop(self) -> None:
        """Ask the thread to end after its current wait, without waiting for it (so that the caller
        can stop other threads meanwhile); :meth:`stop` then waits."""
        self._stop.set()

    def stop(self, timeout: float = 2.0) -> None:
        """End the thread (it notices within one wait, :data:`WAIT_MS`)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
