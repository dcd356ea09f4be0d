"""The TOML config file and command-line overrides (command line wins) onto the settings model
(:mod:`accelstats.settings`), and the log formats.

The config file (``/etc/accelstats/config.toml`` when present, or ``--config FILE``) holds the same
settings as the command line::

    listen = "127.0.0.1:9847"          # HOST:PORT; ":9847" = every interface
    nvml_replay = ""                   # "" = live NVML; a path = the replay backend
    cgroup_root = "/sys/fs/cgroup"
    proc_root = "/proc"
    sysfs_root = "/sys"
    rootfs = "/"                       # the host's / (runtime state files: docker, containerd, CRI-O)
    open_fd_scan = true                # attribute by /proc/<pid>/fd (open /dev/nvidia<N>)
    log_level = "info"
    log_format = "text"                # text | json | logfmt (one record per line on stderr)
    nvml_retry_interval = 30.0         # seconds between NVML init attempts while unavailable
    nvml_deadline = 1.5                # seconds a collection waits for NVML before marking a GPU down
    collection_deadline = 4.0          # seconds a whole collection may take; late parts are served as of their last run
    nvml_pcie_interval = 10.0          # seconds between background PCIe throughput reads; 0 = off
    nvml_profiling_interval = 10.0     # seconds between GPM samples and NVLink reads (background); 0 = off
    dcgm_names = false                 # also publish profiling/NVLink readings under dcgm-exporter's names
    accounting_interval = 1.0          # seconds between per-process accounting reads (>= 0.1); 0 = off
    collectors = ["nvidia", "files"]   # enabled collectors (default: those enabled by default)
    web_config = ""                    # exporter-toolkit web config (TLS, basic auth); "" = plain HTTP

    [runtimes]                         # where the container runtimes keep their state (host paths)
    docker_data_root = "/var/lib/docker"
    containerd_root = "/var/lib/containerd"
    containerd_state = "/run/containerd"
    storage_graphroot = "/var/lib/containers/storage"   # podman and CRI-O (containers-storage.conf)
    storage_runroot = "/run/containers/storage"
    nomad_data_dir = "/opt/nomad/data"

    [kubernetes]                       # the kubelet's pod-resources API (docs/kubernetes.md)
    pod_resources_socket = "/var/lib/kubelet/pod-resources/kubelet.sock"   # no socket there = off
    resources = ["nvidia.com/gpu"]     # default: every resource whose device IDs name a GPU of this host

    [file_devices]
    dir = ""                           # "" = no file devices
    unhealthy_perm = "-rwxrwxrwx"
    vendor = "nomad"
    type = "file"
    name = "mock"

    [mps]                              # NVIDIA MPS control daemons (docs/mps.md)
    root = "/run/accelstats/mps"
    timeout = 3.0                      # seconds for each control command (0.1 to 600)
    exclusive_process = false
    [[mps.resources]]
    name = "shared"
    replicas = 4                       # 2..48 (per GPU: 16 before compute capability 7.0)
    devices = "all"                    # or GPU UUIDs and NVML indices: ["GPU-…", 1]

Every error is a :class:`ConfigError` naming the file, the key and the reason. The ``[mps]`` rules are
:func:`accelstats.mps.rules.check_settings`'s, the same the Nomad plugin's decoder applies. A setting
that loads but cannot be set up (:class:`accelstats.settings.SetupError`, raised by
:func:`accelstats.manager.build_manager`) is worded with :meth:`Origin.word`: the file and key when the
file set it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
from dataclasses import dataclass, fields, is_dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from accelstats.mps.rules import MpsSettingError, check_settings
from accelstats.settings import (
    ACCOUNTING_INTERVAL_MIN,
    LOG_FORMATS,
    LOG_LEVELS,
    ConfigError,
    FileDevicesSettings,
    KubernetesSettings,
    MpsResourceSettings,
    MpsSettings,
    RuntimeRoots,
    Settings,
    SetupError,
)

DEFAULT_CONFIG = Path("/etc/accelstats/config.toml")
#: The ``[file_devices]`` keys (``list_period`` is the Nomad plugin's alone: ``/metrics`` reads the
#: directory on every scrape).
FILE_DEVICES_KEYS = ("dir", "unhealthy_perm", "vendor", "type", "name")


@dataclass(frozen=True)
class Origin:
    """Where the settings of one ``accelstats`` command came from, so that a setting that cannot be
    set up is named as the operator wrote it.

    ``file``: the config file read (None: none); ``from_file``: the settings it set that the command
    line left alone, as paths in :class:`accelstats.settings.Settings` (``nvml_replay``,
    ``file_devices.dir``, ``collectors``; :func:`changed_settings`).
    """

    file: Path | None = None
    from_file: frozenset[str] = frozenset()

    def word(self, error: SetupError) -> str:
        """``<file>: key '<field>': <reason>`` when the config file set the field; else the reason
        alone, as the command line's own errors read (it names the value: the replay file, the
        directory)."""
        if self.file is not None and error.field in self.from_file:
            return f"{self.file}: key '{error.field}': {error.reason}"
        return error.reason


def changed_settings(settings: object, base: object, prefix: str = "") -> frozenset[str]:
    """The paths (``nvml_replay``, ``file_devices.dir``) of the fields of ``settings`` that differ from
    ``base``'s, down through the nested settings dataclasses."""
    out: set[str] = set()
    for f in fields(settings):  # type: ignore[arg-type]
        mine, theirs = getattr(settings, f.name), getattr(base, f.name)
        if mine == theirs:
            continue
        if is_dataclass(mine) and is_dataclass(theirs):
            out |= changed_settings(mine, theirs, f"{prefix}{f.name}.")
        else:
            out.add(prefix + f.name)
    return frozenset(out)


def parse_listen(value: str, where: str = "--listen") -> tuple[str, int]:
    """Split ``HOST:PORT``, ``:PORT`` or ``[v6]:PORT`` into (host, port); host "" = all interfaces.

    Raises ConfigError naming ``where`` when the port is missing or not in 1-65535.
    """
    host, sep, port_s = value.rpartition(":")
    if not sep or not (port_s.isascii() and port_s.isdigit() and len(port_s) <= 5) or not 0 < int(port_s) < 65536:
        raise ConfigError(f"{where}: expected HOST:PORT with a port in 1-65535, got {value[:100]!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port_s)


def _expect(where: str, key: str, value: Any, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ConfigError(f"{where}: key {key!r}: expected {names}, got {type(value).__name__} {value!r}")
    return value


def _path(base: Path, value: str) -> Path | None:
    return None if value == "" else (base / value if not Path(value).is_absolute() else Path(value))


def load_config(path: Path, base: Settings | None = None) -> Settings:
    """Read a TOML config file onto ``base`` (defaults when None); relative paths are relative to the file.

    Raises ConfigError naming the file (and line/column for TOML syntax errors, the key otherwise).
    """
    if sys.version_info >= (3, 11):  # imported with a config file only (start-up without one)
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    settings = base or Settings()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    where = str(path)
    folder = path.parent
    known = {"listen", "nvml_replay", "cgroup_root", "proc_root", "sysfs_root", "rootfs", "open_fd_scan", "log_level",
             "log_format",
             "nvml_retry_interval", "nvml_deadline", "collection_deadline", "nvml_pcie_interval",
             "nvml_profiling_interval", "dcgm_names", "accounting_interval", "collectors", "file_devices", "mps",
             "web_config", "runtimes", "kubernetes"}
    changes: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(known))})")
        if key == "listen":
            changes["listen_host"], changes["listen_port"] = parse_listen(
                _expect(where, key, value, str), f"{where}: key 'listen'")
        elif key in ("open_fd_scan", "dcgm_names"):
            changes[key] = _expect(where, key, value, bool)
        elif key in ("nvml_replay", "cgroup_root", "proc_root", "sysfs_root", "rootfs", "web_config"):
            p = _path(folder, _expect(where, key, value, str))
            if p is None and key not in ("nvml_replay", "web_config"):
                raise ConfigError(f"{where}: key {key!r}: must not be empty")
            changes[key] = p
        elif key in ("log_format", "log_level"):
            choices = LOG_FORMATS if key == "log_format" else LOG_LEVELS
            choice = _expect(where, key, value, str).lower()
            if choice not in choices:
                raise ConfigError(f"{where}: key {key!r}: expected one of {', '.join(choices)}, got {value!r}")
            changes[key] = choice
        elif key in ("nvml_retry_interval", "nvml_deadline", "collection_deadline"):
            seconds = float(_expect(where, key, value, (int, float)))
            if not math.isfinite(seconds) or seconds <= 0:
                raise ConfigError(f"{where}: key {key!r}: must be a finite number > 0, got {value!r}")
            changes[key] = seconds
        elif key in ("nvml_pcie_interval", "nvml_profiling_interval", "accounting_interval"):
            seconds = float(_expect(where, key, value, (int, float)))
            least = ACCOUNTING_INTERVAL_MIN if key == "accounting_interval" else 0.0
            if not math.isfinite(seconds) or seconds < 0 or 0 < seconds < least:
                at_least = f" and at least {least:g} when on" if least else ""
                raise ConfigError(f"{where}: key {key!r}: must be a finite number >= 0 (0 = off){at_least}, "
                                  f"got {value!r}")
            changes[key] = seconds
        elif key == "collectors":
            items = _expect(where, key, value, list)
            changes[key] = tuple(_expect(where, f"collectors[{i}]", v, str) for i, v in enumerate(items))
        elif key == "mps":
            changes[key] = _mps(where, folder, _expect(where, key, value, dict))
        elif key == "kubernetes":
            changes[key] = _kubernetes(where, folder, _expect(where, key, value, dict), settings.kubernetes)
        elif key == "runtimes":
            changes[key] = _runtimes(where, _expect(where, key, value, dict), settings.runtimes)
        elif key == "file_devices":
            changes[key] = _file_devices(where, folder, _expect(where, key, value, dict),
                                         settings.file_devices)
    return replace(settings, **changes)


def _file_devices(where: str, folder: Path, table: dict[str, Any],
                  base: FileDevicesSettings) -> FileDevicesSettings:
    changes: dict[str, Any] = {}
    for key, value in table.items():
        if key not in FILE_DEVICES_KEYS:
            raise ConfigError(f"{where}: unknown key 'file_devices.{key}' "
                              f"(known: {', '.join(sorted(FILE_DEVICES_KEYS))})")
        text = _expect(where, f"file_devices.{key}", value, str)
        if key == "dir":
            changes[key] = _path(folder, text)
        elif key == "unhealthy_perm":
            changes[key] = check_perm(text, f"{where}: key 'file_devices.unhealthy_perm'")
        else:
            changes[key] = text
    return replace(base, **changes)


def _kubernetes(where: str, folder: Path, table: dict[str, Any], base: KubernetesSettings) -> KubernetesSettings:
    """The ``[kubernetes]`` table: ``pod_resources_socket`` (a path, not empty; relative to the file) and
    ``resources`` (a list of extended-resource names such as ``nvidia.com/gpu``, each once)."""
    known = ("pod_resources_socket", "resources")
    changes: dict[str, Any] = {}
    for key, value in table.items():
        if key not in known:
            raise ConfigError(f"{where}: unknown key 'kubernetes.{key}' (known: {', '.join(known)})")
        if key == "pod_resources_socket":
            socket = _path(folder, _expect(where, f"kubernetes.{key}", value, str))
            if socket is None or "\0" in str(socket):
                raise ConfigError(f"{where}: key 'kubernetes.{key}': expected a socket path, got {value!r}")
            changes[key] = socket
        else:
            names = [_expect(where, f"kubernetes.resources[{i}]", v, str)
                     for i, v in enumerate(_expect(where, "kubernetes.resources", value, list))]
            for i, name in enumerate(names):
                if not _RESOURCE_NAME.fullmatch(name):
                    raise ConfigError(f"{where}: key 'kubernetes.resources[{i}]': expected an extended-resource "
                                      f"name such as 'nvidia.com/gpu', got {name!r}")
                if name in names[:i]:
                    raise ConfigError(f"{where}: key 'kubernetes.resources[{i}]': {name!r} listed twice")
            changes[key] = tuple(names)
    return replace(base, **changes)


# A Kubernetes extended-resource name: a DNS subdomain prefix, '/', a qualified name (k8s IsQualifiedName).
_RESOURCE_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


def _runtimes(where: str, table: dict[str, Any], base: RuntimeRoots) -> RuntimeRoots:
    """The ``[runtimes]`` table: absolute host paths (they are read under ``rootfs``)."""
    changes: dict[str, Any] = {}
    for key, value in table.items():
        if key not in RuntimeRoots.SETTINGS:
            raise ConfigError(f"{where}: unknown key 'runtimes.{key}' (known: {', '.join(RuntimeRoots.SETTINGS)})")
        text = _expect(where, f"runtimes.{key}", value, str)
        if not text.startswith("/") or "\0" in text:
            raise ConfigError(f"{where}: key 'runtimes.{key}': expected an absolute host path, got {text!r}")
        # "//x" and "/a/../b" name host paths too: normalised, and ".." never climbs above the root
        changes[key] = Path("/" + os.path.normpath(text).lstrip("/"))
    return replace(base, **changes, explicit=base.explicit | frozenset(changes))


def _mps(where: str, folder: Path, table: dict[str, Any]) -> MpsSettings:
    """The ``[mps]`` table: TOML types checked here, every rule by :func:`accelstats.mps.rules.check_settings`."""
    known = {"root", "timeout", "exclusive_process", "resources"}
    for key in table:
        if key not in known:
            raise ConfigError(f"{where}: unknown key 'mps.{key}' (known: {', '.join(sorted(known))})")
    out: dict[str, Any] = {}
    if "root" in table:
        root = _path(folder, _expect(where, "mps.root", table["root"], str))
        if root is None:
            raise ConfigError(f"{where}: key 'mps.root': must not be empty")
        out["root"] = root
    if "timeout" in table:
        seconds = float(_expect(where, "mps.timeout", table["timeout"], (int, float)))
        if not math.isfinite(seconds) or seconds <= 0:
            raise ConfigError(f"{where}: key 'mps.timeout': must be a finite number > 0, got {table['timeout']!r}")
        out["timeout"] = seconds
    if "exclusive_process" in table:
        out["exclusive_process"] = _expect(where, "mps.exclusive_process", table["exclusive_process"], bool)
    resources = []
    for i, item in enumerate(_expect(where, "mps.resources", table.get("resources", []), list)):
        key = f"mps.resources[{i}]"
        entry = _expect(where, key, item, dict)
        unknown = set(entry) - {"name", "replicas", "devices"}
        if unknown:
            raise ConfigError(f"{where}: unknown key '{key}.{sorted(unknown)[0]}' (known: devices, name, replicas)")
        name = _expect(where, f"{key}.name", entry.get("name"), str)
        replicas = _expect(where, f"{key}.replicas", entry.get("replicas"), int)
        devices: str | tuple[str | int, ...] = "all"
        if "devices" in entry and entry["devices"] != "all":
            listed = _expect(where, f"{key}.devices", entry["devices"], list)
            if not all(isinstance(d, (str, int)) and not isinstance(d, bool) for d in listed):
                raise ConfigError(f"{where}: key '{key}.devices': resource {name!r}: devices must be \"all\" or a "
                                  "list of GPU UUIDs (strings) and NVML indices (whole numbers)")
            devices = tuple(listed)
        resources.append(MpsResourceSettings(name=name, replicas=replicas, devices=devices))
    settings = MpsSettings(**out, resources=tuple(resources))
    try:
        check_settings(settings)
    except MpsSettingError as exc:
        raise ConfigError(f"{where}: key 'mps.{exc.field}': {exc}") from None
    return settings


def check_perm(value: str, where: str) -> str:
    """Validate an ``ls -l`` permission string such as ``-rwxrwxrwx`` (10 characters)."""
    ok = len(value) == 10 and value[0] in "-dlcbps" and all(
        ch in (allowed, "-") or (i % 3 == 2 and ch in "sStT")
        for i, (ch, allowed) in enumerate(zip(value[1:], "rwxrwxrwx", strict=True)))
    if not ok:
        raise ConfigError(f"{where}: expected a 10-character permission string like '-rwxrwxrwx', got {value!r}")
    return value


class _JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (RFC 3339, UTC), ``level``, ``logger``, ``msg`` and, with an
    exception, ``error``; the fields a record was given with ``extra=`` follow."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {"time": _rfc3339(record.created), "level": record.levelname.lower(),
                                  "logger": record.name, "msg": record.getMessage()}
        out.update(_extra_fields(record))
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class _LogfmtFormatter(logging.Formatter):
    """``time=… level=… logger=… msg="…"``: logfmt as Prometheus' own components write it; values
    with spaces, quotes or ``=`` are quoted with backslash escapes."""

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, object] = {"time": _rfc3339(record.created), "level": record.levelname.lower(),
                                     "logger": record.name, "msg": record.getMessage()}
        fields.update(_extra_fields(record))
        if record.exc_info:
            fields["error"] = self.formatException(record.exc_info)
        return " ".join(f"{k}={_logfmt_value(v)}" for k, v in fields.items())


_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


def _extra_fields(record: logging.LogRecord) -> dict[str, object]:
    return {k: v for k, v in vars(record).items() if k not in _RECORD_FIELDS and not k.startswith("_")}


def _rfc3339(created: float) -> str:
    return datetime.fromtimestamp(created, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _logfmt_value(value: object) -> str:
    text = str(value)
    if text and not any(c in text for c in ' "=\\\n\t'):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t") + '"'


def configure_logging(level: str, fmt: str = "text") -> None:
    """Log to stderr at ``level`` (debug/info/warning/error), one record per line: ``text``
    (``time level logger: message``), ``json`` or ``logfmt`` (:data:`LOG_FORMATS`)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    elif fmt == "logfmt":
        handler.setFormatter(_LogfmtFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])
