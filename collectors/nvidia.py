"""NVIDIA GPUs through NVML: device list, one sample per device per collection, processes.

``NvidiaBackend`` runs over the ``pynvml`` module (nvidia-ml-py), on the driver's ``libnvidia-ml`` or
on the replayed one (:class:`collectors.replay.lib.ReplayedNVML`: pynvml itself, with a replayed
library underneath). Rules it follows:

* NVIDIA devices are looked for on the PCI bus (vendor ``0x10de`` under
  ``<sysfs>/bus/pci/devices/*/vendor``) before NVML is touched; a host without them stays quiet.
* NVML that cannot be initialised (library missing, driver not loaded) is a *state*, not a crash:
  :meth:`NvidiaBackend.update` retries at most once per ``retry_interval`` seconds, so a driver
  installed after start-up is picked up without a restart.
* Handles and static facts (name, UUID, minor, max clocks) are read once per NVML session.
* One device's error never blanks another: a device that stops answering gets ``up=False``.
* Slow calls (total energy ~3 ms, BAR1 / ECC / PCIe replay ~0.1 ms, measured on an H200) are refreshed at
  most every ``slow_interval`` seconds; PCIe throughput (~21 ms, blocking) is read by the background
  :class:`collectors.pcie.PcieSampler`, whose last reading the pass copies; GPM profiling metrics and
  NVLink links likewise by :class:`collectors.profiling.ProfilingSampler`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collectors.deadline import DeadlineWorker
from collectors.fsread import read_regular
from collectors.model import Device, DeviceSample, DeviceSnapshot, NoDataError, ProcessType, ProcessUsage
from collectors.nvml_call import DeviceLostError, NvmlCaller, NvmlUnavailableError
from collectors.pcie import PcieSampler
from collectors.processes import running_processes
from collectors.procsampler import ProcessRound, ProcessSampler
from collectors.profiling import ProfilingSampler, Target
from collectors.xid import XidWatcher

log = logging.getLogger(__name__)

NVIDIA_PCI_VENDOR = "0x10de"
MIB = 1 << 20

CLOCKS = (("graphics", "NVML_CLOCK_GRAPHICS"), ("sm", "NVML_CLOCK_SM"), ("memory", "NVML_CLOCK_MEM"),
          ("video", "NVML_CLOCK_VIDEO"))
# nvmlClocksEventReason* bit -> reason label (nvml.h "Clock event reasons").
CLOCK_EVENT_REASONS = (
    ("gpu_idle", 0x1), ("applications_clocks_setting", 0x2), ("sw_power_cap", 0x4),
    ("hw_slowdown", 0x8), ("sync_boost", 0x10), ("sw_thermal_slowdown", 0x20),
    ("hw_thermal_slowdown", 0x40), ("hw_power_brake_slowdown", 0x80), ("display_clocks_setting", 0x100),
)
COMPUTE_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}
ARCHITECTURES = {2: "kepler", 3: "maxwell", 4: "pascal", 5: "volta", 6: "turing", 7: "ampere",
                 8: "ada", 9: "hopper", 10: "blackwell"}
_UNSUPPORTED: Any = object()
NVML_STATES = ("ready", "no_device", "unavailable")  # DeviceSnapshot.nvml_state, accelstats_nvml_state{state}


def nvidia_pci_devices(sysfs_root: Path) -> list[str]:
    """PCI addresses of NVIDIA devices: ``<sysfs_root>/bus/pci/devices/*/vendor`` == ``0x10de``.

    Returns a sorted list such as ``["0000:00:06.0"]``; an unreadable tree gives ``[]``. Each file
    is read with :func:`collectors.fsread.read_regular`: only a regular file (sysfs attributes are;
    the ``<address>`` directories before it are links, followed), never a symbolic link, at most its
    first 64 bytes: a FIFO or a device planted in a mounted tree cannot hang start-up nor be opened.
    """
    found = []
    for vendor in sorted((sysfs_root / "bus" / "pci" / "devices").glob("*/vendor")):
        text = read_regular(vendor, 64, past_limit="truncate").data
        if text is not None and text.strip().lower() == NVIDIA_PCI_VENDOR.encode():
            found.append(vendor.parent.name)
    return found


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def _mode(value: Any) -> str:
    return "" if value is None else ("enabled" if int(value) else "disabled")


class _DeviceState:
    """Per-device handle and what must persist between collections."""

    def __init__(self, device: Device, handle: Any) -> None:
        self.device = device
        self.handle = handle
        self.last_util_ts = 0
        self.last_proc_util_ts = 0
        self.slow: dict[str, Any] = {}
        self.slow_read_at = -1e18
        self.up = True
        self.failure_logged = ""


@dataclass
class _Pass:
    """One NVML pass over every device, filled by the worker thread while scrapes may read it."""

    done: bool = False
    no_data: str = ""
    versions: tuple[str, str, str] = ("", "", "")
    devices: list[Device] = field(default_factory=list)
    samples: dict[str, DeviceSample] = field(default_factory=dict)
    current: str = ""  # UUID of the device being read now


class NvidiaBackend:
    """The ``nvidia`` collector: reads NVIDIA GPUs and MIG instances through NVML.

    ``nvml``: the ``pynvml`` module (default, imported lazily) or a replay object; ``source``:
    ``"nvml"`` or ``"replay"`` (taken from ``nvml.source`` when it has one). ``sysfs_root``: where
    the PCI scan looks (``/sys``); ``pci_scan=False`` skips it (the replay has no PCI devices).
    ``deadline``: seconds a collection waits for NVML (see :meth:`update`); ``retry_interval``:
    seconds between NVML init attempts while it is unavailable (0: a one-shot command, which says no
    "retrying"); ``slow_interval``: seconds between reads of the slow values (energy, BAR1, ECC,
    remapped rows, PCIe replays); ``pcie_interval``:
    seconds between background PCIe throughput rounds (0: not read; :mod:`collectors.pcie`);
    ``profiling_interval``: seconds between GPM samples and NVLink reads (0: not read;
    :mod:`collectors.profiling`).
    """

    name = "nvidia"
    bounds_own_calls = True  # every NVML call has its own deadline: the manager does not wrap it

    def __init__(self, nvml: Any = None, *, sysfs_root: Path = Path("/sys"), pci_scan: bool | None = None,
                 retry_interval: float = 30.0, slow_interval: float = 10.0, deadline: float = 1.5,
                 pcie_interval: float = 10.0, profiling_interval: float = 0.0) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self.nvml = nvml
        self.source: str = getattr(nvml, "source", "nvml")
        self.call = NvmlCaller(nvml)
        self.sysfs_root = sysfs_root
        self.pci_scan = (self.source == "nvml") if pci_scan is None else pci_scan
        self.retry_interval = retry_interval
        self.slow_interval = slow_interval
        self.status = "not initialised"
        self.driver_version = ""
        self.cuda_driver_version = ""
        self.nvml_version = ""
        self._initialised = False
        self._devices: list[_DeviceState] = []
        self._last_attempt = -1e18
        self._status_logged = ""
        self._lock = threading.Lock()
        self.xid_watcher: XidWatcher | None = None
        self.deadline = deadline
        self._worker = DeadlineWorker("accelstats-nvml")
        self._pass: _Pass | None = None
        self._last_complete: _Pass | None = None
        self._last_success: dict[str, float] = {}  # uuid -> Unix time of the last pass that read it up
        self._stuck_logged = ""
        self._said: set[str] = set()  # warnings given once (enumeration failures), at debug after
        self.no_device = False  # the last setup found no NVIDIA PCI device (a GPU-less host, not a failure)
        # The first PCIe round is waited for during setup, within a third of the scrape's deadline.
        self.pcie: PcieSampler | None = None
        self.accounting: ProcessSampler | None = None  # enable_accounting: per-process accounting reads
        if pcie_interval > 0:
            self.pcie = PcieSampler(self.call, nvml, pcie_interval, first_wait=min(0.5, deadline / 3))
        self.profiling: ProfilingSampler | None = None
        if profiling_interval > 0:
            self.profiling = ProfilingSampler(self.call, nvml, profiling_interval, first_wait=min(0.5, deadline / 3))

    # -- session -----------------------------------------------------------------------------
    def setup(self) -> bool:
        """Initialise NVML and enumerate devices; True when usable. Never raises.

        On failure ``status`` holds the reason, logged the first time at info level on a host without
        NVIDIA PCI devices (nothing to read: not a failure, ``accelstats_nvml_state{state="no_device"}``)
        and at warning level otherwise (NVIDIA devices NVML cannot read), at debug level after.
        """
        self._last_attempt = time.monotonic()
        self.no_device = self.pci_scan and not nvidia_pci_devices(self.sysfs_root)
        if self.no_device:
            return self._fail(f"no NVIDIA PCI device (vendor {NVIDIA_PCI_VENDOR}) under "
                              f"{self.sysfs_root}/bus/pci/devices")
        try:
            self.nvml.nvmlInit()  # not through self.call: its failure is the session's status
        except self.nvml.NVMLError as exc:
            return self._fail(f"nvmlInit failed: {self.call.failed('nvmlInit', exc, logging.DEBUG)}")
        except OSError as exc:  # pynvml raises OSError subclasses from ctypes on odd hosts
            return self._fail(f"nvmlInit failed: {exc}")
        self._initialised = True
        try:
            self.driver_version = _text(self.call("nvmlSystemGetDriverVersion"))
            cuda = self.call("nvmlSystemGetCudaDriverVersion")
            self.cuda_driver_version = f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else ""
            self.nvml_version = _text(self.call("nvmlSystemGetNVMLVersion"))
            self._devices = list(self._enumerate())
        except (NvmlUnavailableError, DeviceLostError) as exc:
            self.shutdown()
            return self._fail(f"device enumeration failed: {exc}")
        self.status = ""
        self._status_logged = ""
        log.info("NVML ready (%s): %d device(s), driver %s", self.source, len(self._devices),
                 self.driver_version)
        self.xid_watcher = XidWatcher(self.call, {s.device.uuid: s.handle for s in self._devices
                                                  if s.device.kind == "gpu"})
        self.xid_watcher.start()
        if self.pcie is not None:
            self.pcie.start(self._gpu_handles())
        if self.profiling is not None:
            self.profiling.start(self._profiling_targets())
        if self.accounting is not None:
            self.accounting.start([(s.device, s.handle) for s in self._devices])
        return True

    def enable_accounting(self, interval: float, sink: Callable[[list[ProcessRound]], None]) -> ProcessSampler:
        """Read processes for GPU accounting every ``interval`` seconds from the next NVML setup on
        (:mod:`collectors.procsampler`), handing each round to ``sink``; call before the first
        collection. Returns the sampler (tests drive its rounds by hand)."""
        self.accounting = ProcessSampler(self.call, interval, sink)
        return self.accounting

    def _gpu_handles(self) -> dict[str, Any]:
        """``{uuid: handle}`` of the physical GPUs (MIG instances share their parent's link)."""
        return {s.device.uuid: s.handle for s in self._devices if s.device.kind == "gpu"}

    def _profiling_targets(self) -> list[Target]:
        """Every GPU, and every MIG instance through its parent's handle and GPU instance id (GPM
        samples a GPU instance: ``nvmlGpmMigSampleGet``)."""
        handles = self._gpu_handles()
        out = []
        for s in self._devices:
            if s.device.kind == "gpu":
                out.append(Target(s.device.uuid, s.handle))
            elif s.device.parent_uuid in handles and s.device.gpu_instance_id is not None:
                out.append(Target(s.device.uuid, handles[s.device.parent_uuid], s.device.gpu_instance_id))
        return out

    def _fail(self, reason: str) -> bool:
        self.status = reason
        level = logging.DEBUG if reason == self._status_logged else logging.INFO if self.no_device else logging.WARNING
        retry = f" (retrying every {self.retry_interval:g}s)" if self.retry_interval > 0 else ""
        log.log(level, "NVIDIA GPUs not available: %s%s", reason, retry)
        self._status_logged = reason
        return False

    SHUTDOWN_DEADLINE = 2.0
    """Seconds :meth:`shutdown` waits for ``nvmlShutdown`` itself (it runs on the NVML worker thread):
    a hung driver must not keep SIGTERM from ending the process."""

    def shutdown(self) -> None:
        """Shut NVML down (``nvmlShutdown``) if it was initialised; forget handles. Never raises.

        When a pass is stuck in an NVML call, NVML is left as it is (shutting it down under a running
        call is undefined): the process is exiting, or the next retry starts a new session.
        ``nvmlShutdown`` runs on the NVML worker thread and is waited for at most
        :attr:`SHUTDOWN_DEADLINE` seconds; when it hangs, the caller goes on (logged).
        """
        if self._worker.busy and threading.current_thread().name != self._worker.name:
            log.warning("NVML left initialised: a call has not returned")
            return
        for sampler in (self.pcie, self.accounting, self.profiling):
            if sampler is None:
                continue
            sampler.stop()
            if not sampler.wait_idle(0.1):  # a round ends after its current call (~21 ms for PCIe)
                log.warning("NVML left initialised: a %s call has not returned", sampler.what)
                sampler.resume()  # NVML stays up: so does the sampler (its stuck round is not doubled)
                return
        if self.profiling is not None and self._initialised:
            self.profiling.release()  # its GPM samples, while NVML is up and no round runs
        watcher, self.xid_watcher = self.xid_watcher, None
        self._devices = []
        if self._initialised:
            self._initialised = False
            # The XID thread may be inside an event wait (up to xid.WAIT_MS): rather than wait for it
            # (every SIGTERM and CLI exit would), it shuts NVML down itself as it ends.
            if watcher is not None and watcher.stop_then(self._nvml_shutdown):
                log.debug("nvmlShutdown left to the XID thread: it ends after its current event wait")
            elif threading.current_thread().name == self._worker.name:
                self._nvml_shutdown()
            elif not self._worker.run(self._nvml_shutdown, self.SHUTDOWN_DEADLINE):
                log.warning("nvmlShutdown did not return within %gs: left running", self.SHUTDOWN_DEADLINE)
        elif watcher is not None:
            watcher.request_stop()

    def _nvml_shutdown(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError as exc:
            self.call.failed("nvmlShutdown", exc, logging.DEBUG)

    def close(self) -> None:
        """Shut NVML down and end the NVML worker and PCIe sampler threads: the backend is not used
        after this."""
        self.shutdown()
        self._worker.stop()
        for sampler in (self.pcie, self.accounting, self.profiling):
            if sampler is not None:
                sampler.close()

    def _enumerate(self) -> Iterable[_DeviceState]:
        count = self.call("nvmlDeviceGetCount") or 0
        for i in range(count):
            try:
                handle = self.call("nvmlDeviceGetHandleByIndex", i)
                gpu = self._identity(handle, i)
            except DeviceLostError as exc:  # said once per index and reason; a refresh asks again quietly
                message = f"GPU index {i} not enumerated: {exc}"
                log.log(logging.DEBUG if message in self._said else logging.WARNING, "%s", message)
                self._said.add(message)
                continue
            yield _DeviceState(gpu, handle)
            if gpu.mig_mode == "enabled":
                try:
                    migs = list(self._mig_devices(handle, gpu))
                except DeviceLostError as exc:  # the parent stays; its instances are found on a refresh
                    message = f"MIG instances of GPU {gpu.uuid} not enumerated: {exc}"
                    log.log(logging.DEBUG if message in self._said else logging.WARNING, "%s", message)
                    self._said.add(message)
                    migs = []
                yield from migs

    def _identity(self, handle: Any, index: int) -> Device:
        c = self.call
        mig = c("nvmlDeviceGetMigMode", handle)
        cap = c("nvmlDeviceGetCudaComputeCapability", handle)
        max_clocks = []
        for label, const in CLOCKS:
            mhz = c("nvmlDeviceGetMaxClockInfo", handle, getattr(self.nvml, const))
            if mhz is not None:
                max_clocks.append((label, float(mhz) * 1e6))
        pci = c("nvmlDeviceGetPciInfo", handle)
        real_index = c("nvmlDeviceGetIndex", handle)
        return Device(
            uuid=_text(c("nvmlDeviceGetUUID", handle)),
            index=index if real_index is None else int(real_index),
            minor=c("nvmlDeviceGetMinorNumber", handle),
            name=_text(c("nvmlDeviceGetName", handle)),
            pci_bus_id=_text(getattr(pci, "busId", "")) if pci is not None else "",
            vbios_version=_text(c("nvmlDeviceGetVbiosVersion", handle)),
            mig_mode=_mode(mig[0]) if mig is not None else "",
            compute_mode=COMPUTE_MODES.get(c("nvmlDeviceGetComputeMode", handle), ""),
            persistence_mode=_mode(c("nvmlDeviceGetPersistenceMode", handle)),
            compute_capability=f"{cap[0]}.{cap[1]}" if cap is not None else "",
            architecture=ARCHITECTURES.get(c("nvmlDeviceGetArchitecture", handle), ""),
            max_clocks_hz=tuple(max_clocks),
            max_pcie_generation=c("nvmlDeviceGetMaxPcieLinkGeneration", handle),
            max_pcie_width=c("nvmlDeviceGetMaxPcieLinkWidth", handle),
            display_mode=_mode(c("nvmlDeviceGetDisplayMode", handle)),
        )

    def _mig_devices(self, parent_handle: Any, parent: Device) -> Iterable[_DeviceState]:
        c = self.call
        for slot in range(c("nvmlDeviceGetMaxMigDeviceCount", parent_handle) or 0):
            handle = c("nvmlDeviceGetMigDeviceHandleByIndex", parent_handle, slot, not_found=None)
            if handle is None:
                continue
            name = _text(c("nvmlDeviceGetName", handle))
            profile = name.split(" MIG ", 1)[1] if " MIG " in name else ""
            yield _DeviceState(Device(
                uuid=_text(c("nvmlDeviceGetUUID", handle)), index=parent.index, minor=None, name=name,
                pci_bus_id=parent.pci_bus_id, kind="mig", parent_uuid=parent.uuid,
                gpu_instance_id=c("nvmlDeviceGetGpuInstanceId", handle),
                compute_instance_id=c("nvmlDeviceGetComputeInstanceId", handle), mig_profile=profile,
                compute_capability=parent.compute_capability, architecture=parent.architecture,
            ), handle)

    # -- collection ----------------------------------------------------------------------------
    def devices(self) -> list[Device]:
        """The devices of the current NVML session (GPUs, then each GPU's MIG instances)."""
        return [s.device for s in self._devices]

    def update(self, snapshot: DeviceSnapshot) -> None:
        """The collector's read method: add devices and one sample each to ``snapshot``.

        NVML is read by a pass on the backend's own thread; this waits for it at most ``deadline``
        seconds. A pass that misses the deadline (a call hangs: a GPU fell off the bus) goes on
        alone, and until it ends every collection gets, at once, the devices it already read in
        that pass, ``up=0`` for the device it is stuck on, and the last complete readings for the
        rest. Raises NoDataError when NVML is unavailable (``snapshot.nvml_status`` says why) or
        answered nothing at all in time; setup is retried at most once per ``retry_interval``.
        """
        with self._lock:
            snapshot.source = self.source
            current = self._pass
            if current is None or current.done:
                fresh = _Pass()
                # A pass is marked done a moment before its worker is free: then no new pass starts,
                # and this collection gets the one that just ended (never a pass that will not run).
                done = self._worker.start(lambda: self._run_pass(fresh))
                if done is not None:
                    self._pass = current = fresh
                    done.wait(self.deadline)
            self._fill(snapshot, current or _Pass())

    def _run_pass(self, p: _Pass) -> None:
        """One NVML pass (on the worker thread): retry setup if due, refresh if a device is down,
        then sample every device into ``p``."""
        try:
            if not self._initialised and time.monotonic() - self._last_attempt >= self.retry_interval:
                self.setup()
            if not self._initialised:
                p.no_data = self.status
                return
            p.versions = (self.driver_version, self.cuda_driver_version, self.nvml_version)
            now = time.monotonic()
            if not all(s.up for s in self._devices) and now - self._last_attempt >= self.retry_interval:
                self._last_attempt = now
                self._refresh()
            states = list(self._devices)
            p.devices = [s.device for s in states]
            for state in states:
                p.current = state.device.uuid
                try:
                    sample = self.sample(state)
                except DeviceLostError as exc:
                    sample = self._down(state, str(exc))
                except NvmlUnavailableError as exc:
                    self.shutdown()
                    self._last_attempt = time.monotonic()
                    self.status = p.no_data = f"NVML became unavailable: {exc}"
                    return
                except Exception as exc:  # noqa: BLE001 - one device's surprise must not blank the others
                    sample = self._down(state, f"{type(exc).__name__}: {exc}", unexpected=True)
                state.up = sample.up
                if sample.up:
                    state.failure_logged = ""
                    self._last_success[state.device.uuid] = time.time()
                p.samples[state.device.uuid] = sample
            p.current = ""
            self._last_complete = p
        finally:
            p.done = True

    def _fill(self, snapshot: DeviceSnapshot, p: _Pass) -> None:
        """Copy pass ``p`` (complete, or still stuck past the deadline) into ``snapshot``."""
        if p.done and p.no_data:
            snapshot.nvml_status = p.no_data
            snapshot.nvml_state = "no_device" if self.no_device else "unavailable"
            raise NoDataError(p.no_data)
        if not p.done and not p.devices:
            reason = f"NVML did not answer within {self.deadline:g}s (setup or enumeration)"
            snapshot.nvml_status, snapshot.nvml_state = reason, "unavailable"
            raise NoDataError(reason)
        snapshot.nvml_state = "ready"
        snapshot.driver_version, snapshot.cuda_driver_version, snapshot.nvml_version = p.versions
        snapshot.last_success = {d.uuid: self._last_success[d.uuid] for d in p.devices
                                 if d.uuid in self._last_success}
        last = self._last_complete.samples if self._last_complete is not None else {}
        for device in p.devices:
            sample = p.samples.get(device.uuid)
            if sample is None and device.uuid == p.current:
                sample = DeviceSample(uuid=device.uuid, up=False,
                                      error=f"NVML did not answer within {self.deadline:g}s")
                if self._stuck_logged != device.uuid:
                    log.warning("device %s: NVML call did not answer within %gs; marked down until it does",
                                device.uuid, self.deadline)
                    self._stuck_logged = device.uuid
            elif sample is None:
                sample = last.get(device.uuid) or DeviceSample(uuid=device.uuid, up=False,
                                                               error="not read yet: NVML busy with another device")
            snapshot.devices.append(device)
            snapshot.samples[device.uuid] = sample
        if p.done:
            self._stuck_logged = ""

    def _down(self, state: _DeviceState, error: str, unexpected: bool = False) -> DeviceSample:
        """A down sample for ``state``; the first failure of a run is logged (with a traceback when
        ``unexpected``), repeats at debug level."""
        if state.failure_logged != error:
            log.log(logging.ERROR if unexpected else logging.WARNING, "device %s down: %s", state.device.uuid,
                    error, exc_info=unexpected)
            state.failure_logged = error
        return DeviceSample(uuid=state.device.uuid, up=False, error=error)

    def _refresh(self) -> None:
        """Enumerate again without ending the NVML session, while some device is down: a device that
        answers again (or a new one) gets a fresh handle; devices that stay lost keep their place and
        report ``up=0`` (so an alert on ``accelstats_gpu_up == 0`` never resolves by the series
        vanishing); healthy devices keep their state (sample timestamps, slow-value cache)."""
        try:
            fresh = list(self._enumerate())
        except (NvmlUnavailableError, DeviceLostError) as exc:
            log.debug("re-enumeration failed: %s", exc)
            return
        known = {s.device.uuid: s for s in self._devices}
        merged: list[_DeviceState] = []
        for state in fresh:
            old = known.pop(state.device.uuid, None)
            merged.append(old if old is not None and old.up else state)
        merged.extend(known.values())
        self._devices = merged
        if self.pcie is not None:
            self.pcie.set_handles(self._gpu_handles())
        if self.profiling is not None:
            self.profiling.set_targets(self._profiling_targets())
        if self.accounting is not None:
            self.accounting.set_devices([(s.device, s.handle) for s in self._devices])

    def sample(self, state: _DeviceState) -> DeviceSample:
        """Read one device now. Raises DeviceLostError / NvmlUnavailableError (see nvml_call)."""
        c, h, nv, dev = self.call, state.handle, self.nvml, state.device
        mem = c("nvmlDeviceGetMemoryInfo", h, version=nv.nvmlMemory_v2, unsupported=_UNSUPPORTED)
        if mem is _UNSUPPORTED or (mem is None and c.missing("nvmlDeviceGetMemoryInfo", version=None)):
            # v1 counts reserved memory as used: only for a library without nvmlDeviceGetMemoryInfo_v2
            # (before R510), for good, or a device that answers v2 NOT_SUPPORTED, for this reading.
            # Any other failed v2 call leaves memory out of this reading, never the overstated figure.
            mem = c("nvmlDeviceGetMemoryInfo", h)
        processes, process_types = self._processes(state)
        profile, profiling_state, nvlinks = (self.profiling.reading(dev.uuid) if self.profiling is not None
                                             else ((), ("", ""), ()))
        if dev.kind == "mig":
            return DeviceSample(
                uuid=dev.uuid, up=True, processes=processes, process_types=process_types,
                profiling=profile, profiling_state=profiling_state,
                memory_total_bytes=getattr(mem, "total", None), memory_used_bytes=getattr(mem, "used", None),
                memory_free_bytes=getattr(mem, "free", None),
                memory_reserved_bytes=getattr(mem, "reserved", None),
            )
        now = time.monotonic()
        if now - state.slow_read_at >= self.slow_interval:
            state.slow = self._slow(h)
            state.slow_read_at = now
        slow = state.slow
        rates = c("nvmlDeviceGetUtilizationRates", h)
        enc = c("nvmlDeviceGetEncoderUtilization", h)
        dec = c("nvmlDeviceGetDecoderUtilization", h)
        power = c("nvmlDeviceGetPowerUsage", h)
        limit = c("nvmlDeviceGetEnforcedPowerLimit", h)
        temps = []
        gpu_temp = c("nvmlDeviceGetTemperature", h, nv.NVML_TEMPERATURE_GPU)
        if gpu_temp is not None:
            temps.append(("gpu", float(gpu_temp)))
        if slow.get("memory_temp") is not None:
            temps.append(("memory", float(slow["memory_temp"])))
        clocks = []
        for label, const in CLOCKS:
            mhz = c("nvmlDeviceGetClockInfo", h, getattr(nv, const))
            if mhz is not None:
                clocks.append((label, float(mhz) * 1e6))
        reasons = c("nvmlDeviceGetCurrentClocksEventReasons", h)
        if reasons is None:
            reasons = c("nvmlDeviceGetCurrentClocksThrottleReasons", h)
        remap = slow.get("remap")
        fan = c("nvmlDeviceGetFanSpeed", h)
        return DeviceSample(
            uuid=dev.uuid, up=True,
            utilization_ratio=self._utilization(state, rates),
            memory_utilization_ratio=rates.memory / 100.0 if rates is not None else None,
            encoder_utilization_ratio=enc[0] / 100.0 if enc is not None else None,
            decoder_utilization_ratio=dec[0] / 100.0 if dec is not None else None,
            memory_total_bytes=getattr(mem, "total", None), memory_used_bytes=getattr(mem, "used", None),
            memory_free_bytes=getattr(mem, "free", None), memory_reserved_bytes=getattr(mem, "reserved", None),
            bar1_total_bytes=slow.get("bar1_total"), bar1_used_bytes=slow.get("bar1_used"),
            power_watts=power / 1000.0 if power is not None else None,
            power_limit_watts=limit / 1000.0 if limit is not None else None,
            energy_joules=slow["energy_mj"] / 1000.0 if slow.get("energy_mj") is not None else None,
            temperatures_celsius=tuple(temps), clocks_hz=tuple(clocks), max_clocks_hz=dev.max_clocks_hz,
            performance_state=_pstate(c("nvmlDeviceGetPerformanceState", h)),
            clock_events=tuple((n, bool(reasons & bit)) for n, bit in CLOCK_EVENT_REASONS)
            if reasons is not None else (),
            ecc_errors=slow.get("ecc", ()),
            remapped_rows=(("correctable", remap[0]), ("uncorrectable", remap[1])) if remap else (),
            row_remap_pending=bool(remap[2]) if remap else None,
            row_remap_failure=bool(remap[3]) if remap else None,
            pcie_link_generation=c("nvmlDeviceGetCurrPcieLinkGeneration", h),
            pcie_link_width=c("nvmlDeviceGetCurrPcieLinkWidth", h),
            pcie_replays=slow.get("pcie_replays"),
            pcie_throughput_bytes_per_second=self.pcie.reading(dev.uuid) if self.pcie is not None else (),
            fan_speed_ratio=fan / 100.0 if fan is not None else None,
            profiling=profile, profiling_state=profiling_state, nvlinks=nvlinks,
            processes=processes, process_types=process_types,
            xid_errors=self.xid_watcher.counts(dev.uuid) if self.xid_watcher is not None else (),
            xid_critical=self.xid_watcher.critical(dev.uuid) if self.xid_watcher is not None else None,
        )

    def _slow(self, h: Any) -> dict[str, Any]:
        """Values whose calls cost 0.1-3 ms (measured on an H200), refreshed every ``slow_interval``."""
        c, nv = self.call, self.nvml
        bar1 = c("nvmlDeviceGetBAR1MemoryInfo", h)
        ecc = []
        for etype, econst in (("corrected", "NVML_MEMORY_ERROR_TYPE_CORRECTED"),
                              ("uncorrected", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED")):
            for scope, sconst in (("volatile", "NVML_VOLATILE_ECC"), ("aggregate", "NVML_AGGREGATE_ECC")):
                n = c("nvmlDeviceGetTotalEccErrors", h, getattr(nv, econst), getattr(nv, sconst))
                if n is not None:
                    ecc.append((etype, scope, int(n)))
        memory_temp = None
        fields = c("nvmlDeviceGetFieldValues", h, [nv.NVML_FI_DEV_MEMORY_TEMP])
        if fields:
            f = fields[0]
            if f.nvmlReturn == 0 and f.value.uiVal not in (0, 2**32 - 1):
                memory_temp = f.value.uiVal
        return {
            "bar1_total": getattr(bar1, "bar1Total", None), "bar1_used": getattr(bar1, "bar1Used", None),
            "ecc": tuple(ecc), "memory_temp": memory_temp,
            "energy_mj": c("nvmlDeviceGetTotalEnergyConsumption", h),
            "remap": c("nvmlDeviceGetRemappedRows", h),
            "pcie_replays": c("nvmlDeviceGetPcieReplayCounter", h),
        }

    def _utilization(self, state: _DeviceState, rates: Any) -> float | None:
        """Mean of the GPU-utilisation samples newer than the previous read (``nvmlDeviceGetSamples``);
        NOT_FOUND (no new sample yet) falls back to ``nvmlDeviceGetUtilizationRates().gpu``."""
        got = self.call("nvmlDeviceGetSamples", state.handle, self.nvml.NVML_GPU_UTILIZATION_SAMPLES,
                        state.last_util_ts, not_found=None)
        if got:
            samples = got[1]
            if samples:
                state.last_util_ts = max(s.timeStamp for s in samples)
                return float(sum(s.sampleValue.uiVal for s in samples)) / len(samples) / 100.0
        return float(rates.gpu) / 100.0 if rates is not None else None

    def _processes(self, state: _DeviceState) -> tuple[tuple[ProcessUsage, ...] | None, tuple[ProcessType, ...]]:
        """Compute, graphics and MPS processes with used memory and SM utilisation since last read.

        Returns (processes, the types whose list NVML answered); processes is None when no list was
        readable. A PID NVML lists more than once (a "C+G" process is in both the compute and the
        graphics list) is one process, of the first type listed, so its memory is counted once
        (:func:`collectors.processes.running_processes`).
        """
        c, h = self.call, state.handle
        listed, readable = running_processes(c, h)
        if not readable:
            return None, ()
        sm: dict[int, float] | None = None
        if listed and state.device.kind == "gpu":
            util = c("nvmlDeviceGetProcessUtilization", h, state.last_proc_util_ts, not_found=[])
            if util is not None:
                per_pid: dict[int, list[float]] = {}
                for s in util:
                    per_pid.setdefault(int(s.pid), []).append(s.smUtil / 100.0)
                    state.last_proc_util_ts = max(state.last_proc_util_ts, int(s.timeStamp))
                sm = {pid: sum(v) / len(v) for pid, v in per_pid.items()}
        return tuple(
            ProcessUsage(pid=pid, type=p.type, used_memory_bytes=p.used_memory_bytes,
                         sm_utilization_ratio=(sm.get(pid, 0.0) if sm is not None else None), types=p.types)
            for pid, p in listed.items()
        ), readable


def _pstate(value: Any) -> int | None:
    """NVML P-state 0-15; 32 is NVML_PSTATE_UNKNOWN (absent)."""
    return int(value) if value is not None and 0 <= int(value) <= 15 else None

