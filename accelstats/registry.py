"""The table of collectors: name -> (factory, enabled by default, help) (node_exporter's
registerCollector).

The ``serve`` command builds its ``--collector`` choices and help from this table, so the help can
never go stale. The table is explicit rather than filled by import side effects.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from accelstats.settings import Settings, SetupError
from collectors.files import FileDevices, FileDevicesError
from collectors.model import DeviceSnapshot
from collectors.nvidia import NvidiaBackend


class Collector(Protocol):
    """What the runner needs of a collector: a name and one read method."""

    name: str

    def update(self, snapshot: DeviceSnapshot) -> None:
        """Add what this collector reads to ``snapshot``; raise NoDataError for "nothing here"."""


@dataclass(frozen=True)
class CollectorEntry:
    """One row of the table: ``factory(settings, nvml)`` returns the collector, or None when the
    settings give it nothing to do (e.g. no file-devices directory configured); it raises
    :class:`accelstats.settings.SetupError` naming the setting that makes it unusable."""

    name: str
    enabled_by_default: bool
    help: str
    factory: Callable[[Settings, Any], Collector | None]
    when: str = ""  # what makes the factory return a collector, for --help ("" = always)

    @property
    def default_note(self) -> str:
        """``(default on)``, ``(default on when …)`` or ``""``, for ``serve --help``."""
        if not self.enabled_by_default:
            return ""
        return f" (default on when {self.when})" if self.when else " (default on)"


def _nvidia(settings: Settings, nvml: Any) -> Collector:
    return NvidiaBackend(nvml, sysfs_root=settings.sysfs_root, retry_interval=settings.nvml_retry_interval,
                         deadline=settings.nvml_deadline, pcie_interval=settings.nvml_pcie_interval,
                         profiling_interval=settings.nvml_profiling_interval)


def _files(settings: Settings, nvml: Any) -> Collector | None:
    fd = settings.file_devices
    if fd.dir is None:
        return None
    files = FileDevices(fd.dir, unhealthy_perm=fd.unhealthy_perm, vendor=fd.vendor, device_type=fd.type,
                        name=fd.name)
    try:
        files.check()
    except FileDevicesError as exc:
        raise SetupError("file_devices.dir", str(exc)) from exc
    return files


def _mps(settings: Settings, nvml: Any) -> Collector | None:
    if not settings.mps.resources:
        return None
    from accelstats.mps.host import MpsCollector

    return MpsCollector(settings.mps)


def _kubernetes(settings: Settings, nvml: Any) -> Collector:
    from accelstats.kubernetes.collector import KubernetesCollector

    return KubernetesCollector(settings.kubernetes, rootfs=settings.rootfs, proc_root=settings.proc_root)


COLLECTORS: tuple[CollectorEntry, ...] = (
    CollectorEntry("nvidia", True, "NVIDIA GPUs and MIG instances through NVML (or --nvml-replay)", _nvidia),
    CollectorEntry("files", True, "file devices in --file-devices DIR (Nomad example-plugin model)", _files,
                   "a file-devices directory is set"),
    CollectorEntry("mps", True, "NVIDIA MPS control daemons of the [mps] resources in the config", _mps,
                   "the config has [mps] resources"),
    CollectorEntry("kubernetes", True, "the kubelet's pod-resources allocations (--pod-resources-socket)",
                   _kubernetes, "the kubelet's pod-resources socket exists"),
)


def enabled_names(settings: Settings) -> tuple[str, ...]:
    """Names of the collectors to run: ``settings.collectors`` or the enabled-by-default ones."""
    if settings.collectors is not None:
        return settings.collectors
    return tuple(e.name for e in COLLECTORS if e.enabled_by_default)
