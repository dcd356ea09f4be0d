"""``AcceleratorManager``: cAdvisor's seed interface, and the one collection path both sinks read.

* :func:`build_manager` is the one factory of both front ends (``accelstats`` and the Nomad plugin):
  the NVML source (live, or the replay of ``nvml_replay``) and a manager on it, set up; a setting that
  cannot be set up is a :class:`accelstats.settings.SetupError` naming it.
* :meth:`AcceleratorManager.setup` builds the enabled collectors (registry table); NVML is started
  by the first collection on the backend's own thread, under its deadline (a hung ``nvmlInit`` must
  not keep the exporter from serving), when NVIDIA devices are present; an NVML that cannot start is
  retried later, never fatal.
* :meth:`AcceleratorManager.destroy` shuts NVML down (SIGTERM, context-manager exit).
* :meth:`AcceleratorManager.get_collector` gives the collector for one container's devices cgroup.
* :meth:`AcceleratorManager.collect` makes one :class:`Collection`: every collector run once
  (timed, errors isolated: node_exporter's scrape_collector_success/duration), then every container
  cgroup found and its accelerators attributed. Concurrent callers share collections: a caller
  never gets data from a collection that started before it arrived, and callers that queued behind
  a running collection share the next one.
* The whole collection has a deadline (``collection_deadline``): NVML and MPS bound their own
  calls; the other collectors and the attribution run on a worker thread each, and one that is not
  done in time (a hung network filesystem under a state directory, a file-devices directory on a
  dead NFS server) is left to finish alone while the collection answers with its last complete
  result, marked late (``accelstats_scrape_collector_success`` 0, and
  ``accelstats_scrape_collector_last_success_timestamp_seconds`` says as of when). While it runs,
  no second one starts: a hang costs one thread, however many scrapes come.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelstats.accounting import AccountingView, CgroupLookup, Ledger
from accelstats.attribution.attributor import Attributor
from accelstats.attribution.containers import (
    AcceleratorCollector,
    ContainerCollector,
    ContainerStats,
    HostView,
    NoopCollector,
)
from accelstats.cgroups import CgroupLayout, detect_layout
from accelstats.registry import COLLECTORS, Collector, enabled_names
from accelstats.settings import Settings, SetupError
from collectors.deadline import DeadlineWorker
from collectors.model import CollectorResult, DeviceSnapshot, NoDataError
from collectors.nvidia import NvidiaBackend

log = logging.getLogger(__name__)

MIN_WAIT = 0.25
"""Seconds a collection waits at least for the attribution and each bounded collector, even when
NVML used up the collection deadline (they usually take milliseconds)."""


@dataclass(frozen=True)
class _Attributed:
    """One complete attribution: containers and view, the skip counters and notes as it ended, and
    the Unix time it ended."""

    containers: list[ContainerStats]
    view: HostView
    skipped: dict[str, int]
    notes: dict[str, str]
    finished: float


_NOT_COPIED = frozenset({"timestamp", "collector_results"})


def _merge_into(snapshot: DeviceSnapshot, part: DeviceSnapshot) -> None:
    """Copy what a collector read into ``part`` (a snapshot of its own) into ``snapshot``: lists are
    extended, dicts updated, other fields set where ``part`` differs from a fresh snapshot."""
    fresh = DeviceSnapshot()
    for f in dataclasses.fields(DeviceSnapshot):
        if f.name in _NOT_COPIED:
            continue
        value = getattr(part, f.name)
        if value == getattr(fresh, f.name):
            continue
        current = getattr(snapshot, f.name)
        if isinstance(current, list):
            current.extend(value)
        elif isinstance(current, dict):
            current.update(value)
        else:
            setattr(snapshot, f.name, value)


@dataclass
class Collection:
    """One collection: the device snapshot and every container's accelerator stats.

    ``devices_list_skipped_lines_total`` (each malformed ``devices.list`` line once) and
    ``attribution_skipped`` (reason -> count: cgroups or PIDs that vanished mid-read, unreadable fd
    directories) are counters over the manager's lifetime; ``view`` is what the containers were
    attributed from.
    """

    snapshot: DeviceSnapshot
    containers: list[ContainerStats] = field(default_factory=list)
    cgroup_mode: str = ""
    devices_list_skipped_lines_total: int = 0
    attribution_skipped: dict[str, int] = field(default_factory=dict)
    view: HostView | None = None
    nvml_errors: dict[tuple[str, str], int] = field(default_factory=dict)
    started: float = 0.0
    notes: dict[str, str] = field(default_factory=dict)  # host-wide attribution conditions, for the CLI
    collector_last_success: dict[str, float] = field(default_factory=dict)  # name -> Unix time
    accounting: AccountingView | None = None  # GPU accounting counters (None: accounting off)
    dcgm_names: bool = False  # also render dcgm-exporter's names (accelstats/dcgm.py; setting dcgm_names)


class AcceleratorManager:
    """Owns the collectors and the cgroup view of one host. Thread-safe; use as a context manager.

    ``nvml``: ``None`` for the live ``pynvml`` module, or a replay object (``--nvml-replay``).
    """

    def __init__(self, settings: Settings, nvml: Any = None) -> None:
        self.settings = settings
        self.nvml = nvml
        self.collectors: list[Collector] = []
        self.layout: CgroupLayout | None = None
        self._lock = threading.Lock()
        self._latest: Collection | None = None
        self._skipped_lines = 0
        self._skipped_seen: set[tuple[str, str]] = set()
        self._skipped_lock = threading.Lock()
        self._attributor: Attributor | None = None
        self._errors_logged: set[tuple[str, str]] = set()
        self._workers: dict[str, DeadlineWorker] = {}  # collectors (and attribution) under the deadline
        self._last_ok: dict[str, DeviceSnapshot] = {}  # a bounded collector's last successful result
        self._last_success: dict[str, float] = {}  # name -> Unix time of its last success
        self._attributed: _Attributed | None = None  # the last complete attribution
        self._late_logged: set[str] = set()
        self.ledger: Ledger | None = None  # GPU accounting (accelstats/accounting/), with attribution only

    # -- seed interface ---------------------------------------------------------------------------
    def setup(self) -> None:
        """Build the enabled collectors and detect the cgroup layout.

        Raises :class:`accelstats.settings.SetupError` naming the setting at fault: ``collectors`` for
        an unknown collector name, or the setting a collector's factory names (``file_devices.dir``:
        the file-devices directory does not exist; :mod:`accelstats.registry`). A second call does
        nothing (``with AcceleratorManager(...)`` already set it up; a second set of collectors would
        read every GPU twice per collection).
        """
        if self.layout is not None:
            return
        names = enabled_names(self.settings)
        table = {e.name: e for e in COLLECTORS}
        unknown = next((name for name in names if name not in table), None)
        if unknown is not None:
            raise SetupError("collectors", f"unknown collector {unknown!r} (known: {', '.join(table)})")
        for name in names:
            collector = table[name].factory(self.settings, self.nvml)
            if collector is not None:
                self.collectors.append(collector)
        self.layout = detect_layout(self.settings.cgroup_root, self.settings.proc_root)
        if self.settings.attribution:  # off in a Nomad plugin without /metrics: Fingerprint/Stats need no containers
            self._attributor = Attributor(self.layout, self.settings.proc_root, self.settings.rootfs,
                                          open_fds=self.settings.open_fd_scan, runtimes=self.settings.runtimes)
        log.info("cgroup mode %s (devices %s, unified %s)", self.layout.mode.value, self.layout.devices_root,
                 self.layout.unified_root)
        backend = next((c for c in self.collectors if isinstance(c, NvidiaBackend)), None)
        if self._attributor is not None and backend is not None and self.settings.accounting_interval > 0:
            attributor = self._attributor
            self.ledger = Ledger(CgroupLookup(attributor.hierarchy, self.settings.proc_root, attributor.controller,
                                              attributor.namespace))
            backend.enable_accounting(self.settings.accounting_interval, self.ledger.add_rounds)

    def destroy(self, timeout: float = 5.0) -> None:
        """Shut NVML down once no collection is running (waits at most ``timeout`` seconds for one
        to finish, so a hung NVML call cannot keep the process from exiting); idempotent."""
        acquired = self._lock.acquire(timeout=timeout)
        try:
            for c in self.collectors:
                if isinstance(c, NvidiaBackend):
                    c.shutdown()
        finally:
            if acquired:
                self._lock.release()

    def close(self) -> None:
        """After :meth:`destroy`, also end the collectors' threads (NVML's, MPS's): for a manager
        that is replaced (the Nomad plugin's SetConfig), not for one that may collect again."""
        for c in self.collectors:
            close = getattr(c, "close", None)  # nvidia, mps: their worker threads
            if callable(close):
                close()
        for worker in self._workers.values():
            worker.stop()

    def __enter__(self) -> AcceleratorManager:
        self.setup()
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def get_collector(self, devices_cgroup_path: Path, cgroup: str = "") -> AcceleratorCollector:
        """The collector for one container, bound to the latest collection: ``devices_cgroup_path``
        is its cgroup directory (v1: in the devices hierarchy, holding ``devices.list``; v2: in the
        unified hierarchy), ``cgroup`` its path as the kernel names it (derived from the directory
        when empty). A cgroup that cannot be used gives a :class:`NoopCollector` with the reason,
        never an exception.
        """
        last, attributor = self._latest, self._attributor
        if last is None or last.view is None:
            return NoopCollector("no collection yet")
        if attributor is None or attributor.hierarchy is None:
            return NoopCollector("no cgroup hierarchy found on this host")
        try:
            rel = devices_cgroup_path.resolve().relative_to(attributor.hierarchy.resolve())
        except ValueError:
            return NoopCollector(f"{devices_cgroup_path} is not under {attributor.hierarchy}")
        cgroup = cgroup or "/" + rel.as_posix().strip(".")
        # Without the per-container process index: this cgroup may be a sub- or parent cgroup of one
        # the collection indexed, so its processes are found by prefix instead. And with the checked
        # reads: the path is the caller's, checked by name only (accelstats/cgroups/plainreads.py).
        view = dataclasses.replace(last.view, by_container=None, plain_reads=False)
        return ContainerCollector(devices_cgroup_path, cgroup, view, devices_list=attributor.devices_list,
                                  on_skipped=self._count_skipped)

    def _count_skipped(self, cgroup: str, lines: tuple[str, ...]) -> None:
        """Count each malformed (cgroup, line) once, however many collections re-read it. The set
        remembering them is bounded (100 000 pairs; beyond that a line may be counted again)."""
        with self._skipped_lock:
            if len(self._skipped_seen) > 100_000:
                self._skipped_seen.clear()
            for line in lines:
                if (cgroup, line) not in self._skipped_seen:
                    self._skipped_seen.add((cgroup, line))
                    self._skipped_lines += 1
                    if self._skipped_lines <= 20:  # its text is never logged: the file may not be the kernel's
                        log.warning("devices.list of %s: skipped a line of %d characters that is not a device rule "
                                    "(counted in accelstats_devices_list_skipped_lines_total)", cgroup, len(line))

    # -- the collection path ----------------------------------------------------------------------
    @property
    def latest(self) -> Collection | None:
        """The newest collection, without collecting (None before the first)."""
        return self._latest

    def collect(self) -> Collection:
        """One collection. A caller that arrives while another collection runs waits for it to end,
        then reuses the newest collection if that one started after the caller arrived, else runs
        one itself; so N concurrent scrapes cost at most two collections. Never raises."""
        arrived = time.monotonic()
        with self._lock:
            if self._latest is not None and self._latest.started >= arrived:
                return self._latest
            started = time.monotonic()
            deadline_at = started + self.settings.collection_deadline
            snapshot = DeviceSnapshot()
            for collector in self.collectors:
                if getattr(collector, "bounds_own_calls", False):  # nvidia, mps: they bound their own calls
                    result = self._run(collector, snapshot)
                else:
                    result = self._run_bounded(collector, snapshot, deadline_at)
                snapshot.collector_results.append(result)
                if result.success:
                    self._last_success[result.name] = time.time()
            collection = Collection(snapshot=snapshot, started=started, dcgm_names=self.settings.dcgm_names)
            if self._attributor is not None:
                snapshot.collector_results.append(self._attribute(collection, deadline_at))
            if self.ledger is not None:
                index = {d.uuid: str(d.index) for d in snapshot.devices}
                attributed = snapshot.collector_results[-1].success or collection.view is not None
                holders = [c for c in collection.containers if c.accelerators]
                collection.accounting = self.ledger.settle(holders if attributed else None,
                                                           lambda uuid: index.get(uuid, ""))
            collection.collector_last_success = dict(self._last_success)
            collection.cgroup_mode = self.layout.mode.value if self.layout else ""
            collection.devices_list_skipped_lines_total = self._skipped_lines
            for c in self.collectors:
                if isinstance(c, NvidiaBackend):
                    collection.nvml_errors = dict(c.call.errors)
            self._latest = collection
            return collection

    def _attribute(self, collection: Collection, deadline_at: float) -> CollectorResult:
        """Attribute devices to containers, timed and isolated like a collector (``attribution`` in
        ``accelstats_scrape_collector_success``): a failure leaves the containers empty, never the
        device families. It runs on its own worker and is waited for until ``deadline_at`` (at
        least :data:`MIN_WAIT` seconds); when late, the last complete attribution is served."""
        attributor = self._attributor
        assert attributor is not None
        t0 = time.perf_counter()
        snapshot = collection.snapshot
        outcome: list[BaseException | None] = []

        def job() -> None:
            try:
                containers, view = attributor.attribute(snapshot, self._count_skipped)
            except Exception as exc:
                outcome.append(exc)
                if ("attribution", type(exc).__name__) not in self._errors_logged:
                    self._errors_logged.add(("attribution", type(exc).__name__))
                    log.exception("attribution failed")
                return
            finally:
                skipped, notes = dict(attributor.skipped), dict(attributor.notes)
            self._attributed = _Attributed(containers, view, skipped, notes, time.time())
            outcome.append(None)

        worker = self._workers.setdefault("attribution", DeadlineWorker("accelstats-attribution"))
        finished = worker.run(job, max(MIN_WAIT, deadline_at - time.monotonic()))
        if finished and outcome and outcome[0] is not None:
            collection.attribution_skipped = dict(attributor.skipped)
            return CollectorResult("attribution", False, time.perf_counter() - t0, str(outcome[0]))
        last = self._attributed
        if last is not None:
            collection.containers, collection.view = last.containers, last.view
            collection.attribution_skipped, collection.notes = dict(last.skipped), dict(last.notes)
            self._last_success["attribution"] = last.finished
        if finished:
            self._late_logged.discard("attribution")
            return CollectorResult("attribution", True, time.perf_counter() - t0)
        return self._late("attribution", time.perf_counter() - t0, last.finished if last else None)

    def _late(self, name: str, duration: float, as_of: float | None) -> CollectorResult:
        """The result of a collector (or the attribution) that missed the collection deadline."""
        when = time.strftime("%H:%M:%S", time.localtime(as_of)) if as_of is not None else "never"
        reason = (f"past the collection deadline ({self.settings.collection_deadline:g}s): still running, "
                  f"last complete result from {when}")
        if name not in self._late_logged:
            self._late_logged.add(name)
            log.warning("%s %s", name, reason)
        return CollectorResult(name, False, duration, reason)

    def _run_bounded(self, collector: Collector, snapshot: DeviceSnapshot, deadline_at: float) -> CollectorResult:
        """:meth:`_run` on the collector's own worker, into a snapshot of its own, waited for until
        ``deadline_at`` (at least :data:`MIN_WAIT` seconds); what it read is then copied into
        ``snapshot``. When late, its last successful result is copied instead (a collector that
        never succeeded adds nothing) and the result says so."""
        t0 = time.perf_counter()
        scratch = DeviceSnapshot()
        results: list[CollectorResult] = []

        def job() -> None:
            result = self._run(collector, scratch)
            if result.success:
                self._last_ok[collector.name] = scratch
                self._last_success[collector.name] = time.time()
            results.append(result)

        worker = self._workers.setdefault(collector.name, DeadlineWorker(f"accelstats-{collector.name}"))
        if worker.run(job, max(MIN_WAIT, deadline_at - time.monotonic())) and results:
            _merge_into(snapshot, scratch)
            self._late_logged.discard(collector.name)
            return results[0]
        last = self._last_ok.get(collector.name)
        if last is not None:
            _merge_into(snapshot, last)
        return self._late(collector.name, time.perf_counter() - t0, self._last_success.get(collector.name))

    def _run(self, collector: Collector, snapshot: DeviceSnapshot) -> CollectorResult:
        t0 = time.perf_counter()
        try:
            collector.update(snapshot)
        except NoDataError as exc:
            log.debug("collector %s: no data: %s", collector.name, exc)
            return CollectorResult(collector.name, False, time.perf_counter() - t0, str(exc))
        except Exception as exc:
            key = (collector.name, type(exc).__name__)
            if key not in self._errors_logged:
                self._errors_logged.add(key)
                log.exception("collector %s failed", collector.name)
            else:
                log.debug("collector %s failed again: %s", collector.name, exc)
            return CollectorResult(collector.name, False, time.perf_counter() - t0, str(exc))
        return CollectorResult(collector.name, True, time.perf_counter() - t0)


def build_manager(settings: Settings) -> AcceleratorManager:
    """The one factory of both front ends: the NVML source (live ``pynvml``, or the replay of
    ``settings.nvml_replay``), an :class:`AcceleratorManager` on it, set up.

    Raises :class:`accelstats.settings.SetupError` naming the setting at fault: ``nvml_replay`` (the
    replay cannot be read or does not parse: the reason names the file and position),
    ``file_devices.dir``, ``collectors`` (:meth:`AcceleratorManager.setup`). Each front end words the
    field as its input names it; any other exception is no setting's fault and propagates.
    """
    nvml: Any = None
    if settings.nvml_replay is not None:
        from collectors.replay.lib import open_replay
        from collectors.replay.state import ReplayError

        try:
            nvml = open_replay(settings.nvml_replay)
        except ReplayError as exc:
            raise SetupError("nvml_replay", str(exc)) from exc
        except OSError as exc:
            raise SetupError("nvml_replay", f"{settings.nvml_replay}: {exc.strerror or exc}") from exc
        if not nvml.state.gpu_count:
            log.warning("%s: the replay holds no GPU (no <gpu> element, no [[gpu]] table)", settings.nvml_replay)
    manager = AcceleratorManager(settings, nvml)
    manager.setup()
    return manager
