"""The settings model: every setting of accelstats, for both front ends (``accelstats`` and the Nomad
plugin), as frozen dataclasses with their defaults. :mod:`accelstats.config` fills one
:class:`Settings` from the TOML file and the command line; :mod:`accelstats.nomad.config` fills one
from the plugin's configuration block (SetConfig). Every wing reads its part from here, so this module
imports nothing of accelstats.

Field paths are the TOML keys (``file_devices.dir``, ``nvml_replay``, ``collectors``, ``mps.resources``;
the key ``listen`` is ``listen_host`` and ``listen_port``; :class:`NomadSettings` has no TOML key).
:class:`SetupError` names a setting by its path, and each front end words it as its own input does
(``<file>: key 'file_devices.dir'``, ``config: file_devices.dir``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

# 9847: inside Prometheus' exporter range (9100-9999), clear of node_exporter (9100), dcgm-exporter
# (9400), nvidia_gpu_exporter (9835) and the NVIDIA exporters people run beside this one.
DEFAULT_PORT = 9847
LOG_FORMATS = ("text", "json", "logfmt")
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the file (if any), the key and the reason."""


class SetupError(ConfigError):
    """Settings that loaded but cannot be set up (a replay file that does not parse, a file-devices
    directory that does not exist, an unknown collector).

    ``field``: the setting at fault as a path in :class:`Settings` (``nvml_replay``,
    ``file_devices.dir``, ``collectors``); ``reason``: what is wrong, naming the value. ``str()`` is
    ``"<field>: <reason>"``; a front end words the field as its input names it.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


ACCOUNTING_INTERVAL_MIN = 0.1
"""Seconds: a shorter accounting interval reads NVML faster than its drivers sample (1/6 s at best)
and costs a core for nothing (docs/accounting.md)."""


@dataclass(frozen=True)
class FileDevicesSettings:
    """Nomad example-plugin file devices (docs/nomad.md): every file in ``dir`` is a device (None: no
    file devices); a file whose ``ls -l`` permission string equals ``unhealthy_perm`` is unhealthy;
    ``vendor``/``type``/``name`` form the device group. ``list_period``: seconds between the Nomad
    plugin's checks of the directory for a changed fingerprint (its ``file_devices`` block; ``/metrics``
    reads the directory on every scrape, so the TOML file has no such key)."""

    dir: Path | None = None
    list_period: float = 5.0
    unhealthy_perm: str = "-rwxrwxrwx"
    vendor: str = "nomad"
    type: str = "file"
    name: str = "mock"


@dataclass(frozen=True)
class RuntimeRoots:
    """Where the container runtimes keep their state, as host paths (read under ``rootfs``): the
    ``[runtimes]`` table.  Defaults are each runtime's own (docker ``data-root``, containerd
    ``root``/``state``, containers-storage.conf ``graphroot``/``runroot`` for podman and CRI-O,
    Nomad's packaged ``data_dir``); ``explicit`` names the keys the config file set.
    :mod:`accelstats.attribution.runtimes` says what is read where."""

    SETTINGS: ClassVar[tuple[str, ...]] = ("docker_data_root", "containerd_root", "containerd_state",
                                           "storage_graphroot", "storage_runroot", "nomad_data_dir")

    docker_data_root: Path = Path("/var/lib/docker")
    containerd_root: Path = Path("/var/lib/containerd")
    containerd_state: Path = Path("/run/containerd")
    storage_graphroot: Path = Path("/var/lib/containers/storage")
    storage_runroot: Path = Path("/run/containers/storage")
    nomad_data_dir: Path = Path("/opt/nomad/data")
    explicit: frozenset[str] = frozenset()


@dataclass(frozen=True)
class MpsResourceSettings:
    """One MPS resource: ``devices`` is ``"all"`` or GPU UUIDs and NVML indices (docs/mps.md)."""

    name: str
    replicas: int
    devices: str | tuple[str | int, ...] = "all"


@dataclass(frozen=True)
class MpsSettings:
    """The ``[mps]`` table: where daemons keep their pipes and logs, the control-command timeout
    (seconds), whether to set EXCLUSIVE_PROCESS compute mode (opt-in, restored on stop), resources."""

    root: Path = Path("/run/accelstats/mps")
    timeout: float = 3.0
    exclusive_process: bool = False
    resources: tuple[MpsResourceSettings, ...] = ()


DEFAULT_POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
"""The kubelet's pod-resources socket (``accelstats.kubernetes.podresources.DEFAULT_SOCKET``)."""


@dataclass(frozen=True)
class KubernetesSettings:
    """The ``[kubernetes]`` table (docs/kubernetes.md): the kubelet's pod-resources socket (no socket
    there: the feature is off, one info line) and the extended-resource names whose allocations are
    read (``None``: every resource whose device IDs resolve to a GPU or MIG instance of this host)."""

    pod_resources_socket: Path = DEFAULT_POD_RESOURCES_SOCKET
    resources: tuple[str, ...] | None = None


@dataclass(frozen=True)
class NomadSettings:
    """What only the Nomad plugin reads (its ``config`` block, docs/nomad.md).

    ``ignored_gpu_ids``: GPU or MIG UUIDs left out of the fingerprint; ``fingerprint_period``: seconds
    between two full fingerprints; ``visible_devices_env``: the variables a reservation names the
    reserved UUIDs in (``CUDA_VISIBLE_DEVICES`` and/or ``NVIDIA_VISIBLE_DEVICES``); ``serve_metrics``:
    the plugin process serves ``/metrics`` on :attr:`Settings.listen` (its ``metrics_listen`` is set);
    ``fail_mps_requests_greater_than_one``: Reserve refuses more than one MPS replica in one request
    (the ``mps`` block's ``fail_requests_greater_than_one``; NVIDIA k8s-device-plugin's default).
    """

    ignored_gpu_ids: tuple[str, ...] = ()
    fingerprint_period: float = 60.0
    visible_devices_env: tuple[str, ...] = ("CUDA_VISIBLE_DEVICES",)
    serve_metrics: bool = False
    fail_mps_requests_greater_than_one: bool = True


@dataclass(frozen=True)
class Settings:
    """Every setting of one front end: ``accelstats serve|dump|devices|containers|mps`` (TOML file and
    command line) or the Nomad plugin (its ``config`` block; the plugin's ``enabled`` is the ``nvidia``
    collector, ``metrics_listen`` is ``listen``, ``metrics_web_config`` is ``web_config``, and
    :attr:`nomad` holds what only the plugin reads). Paths are absolute or cwd-relative; periods and
    deadlines in seconds."""

    listen_host: str = ""
    listen_port: int = DEFAULT_PORT
    nvml_replay: Path | None = None
    cgroup_root: Path = Path("/sys/fs/cgroup")
    proc_root: Path = Path("/proc")
    sysfs_root: Path = Path("/sys")
    rootfs: Path = Path("/")
    open_fd_scan: bool = True
    attribution: bool = True  # tie devices to containers (the Nomad plugin turns it off without metrics_listen)
    log_level: str = "info"
    log_format: str = "text"
    nvml_retry_interval: float = 30.0
    nvml_deadline: float = 1.5
    collection_deadline: float = 4.0  # a collection answers by then; a late part serves its last result
    nvml_pcie_interval: float = 10.0  # 0: PCIe throughput not read (collectors/pcie.py)
    nvml_profiling_interval: float = 10.0  # 0: GPM profiling metrics and NVLink not read (collectors/profiling.py)
    dcgm_names: bool = False  # also publish the profiling and NVLink readings under dcgm-exporter's names
    accounting_interval: float = 1.0  # 0: no GPU accounting counters (accelstats/accounting/)
    collectors: tuple[str, ...] | None = None  # None: each collector's default
    file_devices: FileDevicesSettings = field(default_factory=FileDevicesSettings)
    mps: MpsSettings = field(default_factory=MpsSettings)
    web_config: Path | None = None  # /metrics: exporter-toolkit web configuration file (accelstats/web/config.py)
    runtimes: RuntimeRoots = field(default_factory=RuntimeRoots)
    kubernetes: KubernetesSettings = field(default_factory=KubernetesSettings)
    nomad: NomadSettings = field(default_factory=NomadSettings)

    @property
    def listen(self) -> str:
        """``HOST:PORT`` as given (IPv6 hosts in brackets)."""
        host = f"[{self.listen_host}]" if ":" in self.listen_host else self.listen_host
        return f"{host}:{self.listen_port}"
