"""``AcceleratorManager``: cAdvisor's seed interface, and the one collection path both sinks read.

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
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelstats.cgroups import CgroupLayout, CgroupMode, detect_layout, discover_v1_containers
from accelstats.config import Settings
from accelstats.containers import (
    AcceleratorCollector,
    ContainerMetadata,
    ContainerStats,
    DevicesCgroupCollector,
    NoopCollector,
    cgroup_of_pids,
)
from accelstats.registry import COLLECTORS, Collector, enabled_names
from collectors.model import CollectorResult, DeviceSnapshot, NoDataError
from collectors.nvidia import NvidiaBackend

log = logging.getLogger(__name__)


@dataclass
class Collection:
    """One collection: the device snapshot and every container's accelerator stats.

    ``devices_list_skipped_lines_total`` and ``cgroups_vanished_total`` are counters over the
    manager's lifetime (malformed ``devices.list`` lines skipped; cgroups removed mid-walk).
    """

    snapshot: DeviceSnapshot
    containers: list[ContainerStats] = field(default_factory=list)
    cgroup_mode: str = ""
    devices_list_skipped_lines_total: int = 0
    cgroups_vanished_total: int = 0
    nvml_errors: dict[tuple[str, str], int] = field(default_factory=dict)
    started: float = 0.0


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
        self._last: Collection | None = None
        self._skipped_lines = 0
        self._skipped_seen: set[tuple[str, str]] = set()
        self._vanished = 0
        self._errors_logged: set[tuple[str, str]] = set()

    # -- seed interface ---------------------------------------------------------------------------
    def setup(self) -> None:
        """Build the enabled collectors and detect the cgroup layout.

        Raises ``collectors.files.FileDevicesError`` when a configured file-devices directory does not
        exist (a start-up error) and KeyError for an unknown collector name in the settings.
        """
        names = enabled_names(self.settings)
        table = {e.name: e for e in COLLECTORS}
        for name in names:
            if name not in table:
                raise KeyError(f"unknown collector {name!r} (known: {', '.join(table)})")
            collector = table[name].factory(self.settings, self.nvml)
            if collector is None:
                continue
            check = getattr(collector, "check", None)
            if check is not None:
                check()
            self.collectors.append(collector)
        self.layout = detect_layout(self.settings.cgroup_root, self.settings.proc_root)
        log.info("cgroup mode %s (devices %s, unified %s)", self.layout.mode.value, self.layout.devices_root,
                 self.layout.unified_root)

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

    def __enter__(self) -> AcceleratorManager:
        self.setup()
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def get_collector(self, devices_cgroup_path: Path, cgroup: str = "",
                      snapshot: DeviceSnapshot | None = None,
                      pid_cgroups: dict[int, str] | None = None) -> AcceleratorCollector:
        """The collector for one container: ``devices_cgroup_path`` is its directory in the v1 devices
        hierarchy (holding ``devices.list``); ``cgroup`` its path as the kernel names it (derived from
        the directory when empty). Uses the latest collection's snapshot unless one is given. A cgroup
        that cannot be used gives a :class:`NoopCollector` with the reason, never an exception.
        """
        snap = snapshot or (self._last.snapshot if self._last is not None else None)
        if snap is None:
            return NoopCollector("no collection yet")
        layout = self.layout
        if layout is None or layout.devices_root is None:
            return NoopCollector("no cgroup v1 devices hierarchy on this host")
        try:
            rel = devices_cgroup_path.resolve().relative_to(layout.devices_root.resolve())
        except ValueError:
            return NoopCollector(f"{devices_cgroup_path} is not under {layout.devices_root}")
        cgroup = cgroup or "/" + rel.as_posix().strip(".")
        return DevicesCgroupCollector(devices_cgroup_path, cgroup, snap, pid_cgroups or {}, self._count_skipped)

    def _count_skipped(self, cgroup: str, lines: tuple[str, ...]) -> None:
        """Count each malformed (cgroup, line) once, however many collections re-read it."""
        for line in lines:
            if (cgroup, line) not in self._skipped_seen:
                self._skipped_seen.add((cgroup, line))
                self._skipped_lines += 1
                if len(self._skipped_seen) <= 20:
                    log.warning("devices.list of %s: skipped malformed line %r", cgroup, line[:200])

    # -- the collection path ----------------------------------------------------------------------
    def collect(self) -> Collection:
        """One collection. A caller that arrives while another collection runs waits for it to end,
        then reuses the newest collection if that one started after the caller arrived, else runs
        one itself; so N concurrent scrapes cost at most two collections. Never raises."""
        arrived = time.monotonic()
        with self._lock:
            if self._last is not None and self._last.started >= arrived:
                return self._last
            started = time.monotonic()
            snapshot = DeviceSnapshot()
            for collector in self.collectors:
                snapshot.collector_results.append(self._run(collector, snapshot))
            collection = Collection(snapshot=snapshot, started=started)
            collection.containers = self._containers(snapshot)
            collection.cgroup_mode = self.layout.mode.value if self.layout else ""
            collection.devices_list_skipped_lines_total = self._skipped_lines
            collection.cgroups_vanished_total = self._vanished
            for c in self.collectors:
                if isinstance(c, NvidiaBackend):
                    collection.nvml_errors = dict(c.call.errors)
            self._last = collection
            return collection

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

    def _containers(self, snapshot: DeviceSnapshot) -> list[ContainerStats]:
        layout = self.layout
        if layout is None or layout.mode not in (CgroupMode.V1, CgroupMode.HYBRID) or layout.devices_root is None:
            return []
        found = discover_v1_containers(layout.devices_root)
        self._vanished += found.stats.skipped_vanished
        pids = {p.pid for s in snapshot.samples.values() for p in s.processes or ()}
        pid_cgroups = cgroup_of_pids(pids, self.settings.proc_root, "devices")
        out = []
        for cg in found.containers:
            stats = ContainerStats(cgroup=cg.path, identity=cg.identity,
                                   metadata=ContainerMetadata(name=cg.identity.name if cg.identity else ""))
            collector = DevicesCgroupCollector(cg.directory, cg.path, snapshot, pid_cgroups, self._count_skipped)
            collector.update_stats(stats)
            out.append(stats)
        return out

    @property
    def last(self) -> Collection | None:
        """The latest collection, or None before the first."""
        return self._last
