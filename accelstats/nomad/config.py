"""The Nomad device plugin's configuration: its hclspec schema and the SetConfig decoder.

Nomad asks the plugin for its schema (ConfigSchema), evaluates the agent's
``plugin "nomad-device-accelstats" { config { … } }`` block against it, fills every default, and
sends the result msgpack-encoded by go-cty (docs/nomad.md): a map with sorted keys, every
attribute present, numbers possibly as decimal strings, an absent block as nil. :func:`decode`
turns that into a :class:`PluginConfig` or raises :class:`ConfigError` naming the field and the
reason (the servicer answers INVALID_ARGUMENT with it).

Every list and size the configuration controls is bounded, far above what an operator needs, and a
value past a bound is refused by name before anything is built from it: ``replicas`` at most 48
(NVIDIA's MPS limit of 48 clients per GPU), at most 256 MPS resources of at most 256 devices each,
1024 ``ignored_gpu_ids``, strings of 4096 characters (paths), 256 (IDs, device names) or 255 (a
resource name). The ``mps.resource`` block list carries its bound in the schema too, so Nomad itself
refuses more blocks.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from accelstats.config import (
    MPS_MAX_DEVICES,
    MPS_MAX_NAME,
    MPS_MAX_REPLICAS,
    MPS_MAX_RESOURCES,
    check_perm,
    parse_listen,
)
from accelstats.settings import ConfigError, MpsResourceSettings, MpsSettings

# Go's time.ParseDuration units, in seconds.
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"([0-9]*(?:\.[0-9]*)?)(ns|us|µs|μs|ms|s|m|h)")


MAX_PERIOD = 8760 * 3600.0  # a year: longer periods are typing mistakes
MAX_STRING = 4096  # characters of any string setting (PATH_MAX)
MAX_ID = 256  # characters of a GPU/MIG UUID, an MPS device, a file-device vendor, type or name
MAX_IGNORED_IDS = 1024  # ignored_gpu_ids entries (a host has a few dozen GPUs and MIG instances at most)


def parse_duration(text: str, where: str) -> float:
    """Seconds of a Go duration string (``300ms``, ``1.5s``, ``1m30s``, ``2h``; ``0`` alone too),
    as ``time.ParseDuration`` reads it. Raises ConfigError naming ``where`` otherwise; negative
    durations are refused (no period here can be negative)."""
    s = text.strip()
    if s in ("0", "+0"):
        return 0.0
    if s.startswith("-"):
        raise ConfigError(f"{where}: a period cannot be negative, got {text[:100]!r}")
    s = s.removeprefix("+")
    pos, total = 0, 0.0
    while pos < len(s):
        m = _DURATION.match(s, pos)
        if m is None or m.group(1) in ("", "."):
            raise ConfigError(f"{where}: {text[:100]!r} is not a Go duration (like 300ms, 1.5s, 1m30s, 2h)")
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if not s or not math.isfinite(total):
        raise ConfigError(f"{where}: {text!r} is not a Go duration (like 300ms, 1.5s, 1m30s, 2h)")
    return total


@dataclass(frozen=True)
class FileDevicesConfig:
    """The ``file_devices`` block (Nomad's example plugin's settings); ``dir`` None = none."""

    dir: Path | None = None
    list_period: float = 5.0
    unhealthy_perm: str = "-rwxrwxrwx"
    vendor: str = "nomad"
    type: str = "file"
    name: str = "mock"


@dataclass(frozen=True)
class PluginConfig:
    """Decoded plugin settings (defaults as in :data:`SCHEMA`). Periods in seconds."""

    enabled: bool = True
    ignored_gpu_ids: tuple[str, ...] = ()
    fingerprint_period: float = 60.0
    file_devices: FileDevicesConfig = field(default_factory=FileDevicesConfig)
    metrics_listen: str = ""
    metrics_web_config: Path | None = None
    nvml_replay: Path | None = None
    cgroup_root: Path = Path("/sys/fs/cgroup")
    proc_root: Path = Path("/proc")
    mps: MpsSettings = field(default_factory=MpsSettings)
    visible_devices_env: tuple[str, ...] = ("CUDA_VISIBLE_DEVICES",)


#: The variables a reservation may name the reserved GPUs in (``visible_devices_env``): CUDA's, read
#: by CUDA in any task driver; NVIDIA's, read by the NVIDIA container runtime, which Nomad's docker
#: driver then requires (hashicorp/nomad drivers/docker/driver.go:1065-1073).
VISIBLE_ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")


# name -> (hcl type, default as an HCL expression) — the schema Nomad shows and fills in.
ATTRIBUTES: dict[str, tuple[str, str]] = {
    "enabled": ("bool", "true"),
    "ignored_gpu_ids": ("list(string)", "[]"),
    "fingerprint_period": ("string", '"1m"'),
    "metrics_listen": ("string", '""'),
    "metrics_web_config": ("string", '""'),
    "nvml_replay": ("string", '""'),
    "cgroup_root": ("string", '"/sys/fs/cgroup"'),
    "proc_root": ("string", '"/proc"'),
    "visible_devices_env": ("list(string)", '["CUDA_VISIBLE_DEVICES"]'),
}
MPS_ATTRIBUTES: dict[str, tuple[str, str]] = {
    "root": ("string", '"/run/accelstats/mps"'),
    "timeout": ("string", '"3s"'),
    "exclusive_process": ("bool", "false"),
}
FILE_DEVICE_ATTRIBUTES: dict[str, tuple[str, str]] = {
    "dir": ("string", '""'),
    "list_period": ("string", '"5s"'),
    "unhealthy_perm": ("string", '"-rwxrwxrwx"'),
    "vendor": ("string", '"nomad"'),
    "type": ("string", '"file"'),
    "name": ("string", '"mock"'),
}


def schema(hclspec: Any) -> Any:
    """The ConfigSchema answer: an hclspec ``Spec`` (``hclspec`` is the generated ``hclspec_pb2``)
    of an Object whose attributes each carry their default, plus the ``file_devices`` block."""

    def attrs(table: dict[str, tuple[str, str]]) -> dict[str, Any]:
        return {name: hclspec.Spec(default=hclspec.Default(
            primary=hclspec.Spec(Attr=hclspec.Attr(name=name, type=typ, required=False)),
            default=hclspec.Spec(literal=hclspec.Literal(value=literal))))
            for name, (typ, literal) in table.items()}

    top = attrs(ATTRIBUTES)
    top["file_devices"] = hclspec.Spec(block_value=hclspec.Block(
        name="file_devices", required=False,
        nested=hclspec.Spec(object=hclspec.Object(attributes=attrs(FILE_DEVICE_ATTRIBUTES)))))
    resource = hclspec.Spec(object=hclspec.Object(attributes={
        "name": hclspec.Spec(Attr=hclspec.Attr(name="name", type="string", required=True)),
        "replicas": hclspec.Spec(Attr=hclspec.Attr(name="replicas", type="number", required=True)),
        **attrs({"devices": ("list(string)", "[]")}),
    }))
    mps = attrs(MPS_ATTRIBUTES)
    mps["resource"] = hclspec.Spec(block_list=hclspec.BlockList(name="resource", min_items=0,
                                                                 max_items=MPS_MAX_RESOURCES, nested=resource))
    top["mps"] = hclspec.Spec(block_value=hclspec.Block(
        name="mps", required=False, nested=hclspec.Spec(object=hclspec.Object(attributes=mps))))
    return hclspec.Spec(object=hclspec.Object(attributes=top))


def decode(data: bytes) -> PluginConfig:
    """Decode SetConfig's ``msgpack_config`` (see module docstring). Raises ConfigError naming the field."""
    if not data:
        return PluginConfig()
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:  # TypeError: a map key that is a map or array
        raise ConfigError(f"config: not msgpack: {exc}") from exc
    if raw is None:
        return PluginConfig()
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a map, got {type(raw).__name__}")
    _string_keys(raw, "config")
    unknown = sorted(set(raw) - set(ATTRIBUTES) - {"file_devices", "mps"})
    if unknown:
        known = ", ".join(sorted([*ATTRIBUTES, "file_devices", "mps"]))
        raise ConfigError(f"config: unknown key {unknown[0][:100]!r} (known: {known})")
    out: dict[str, Any] = {}
    if raw.get("enabled") is not None:
        out["enabled"] = _bool(raw["enabled"], "enabled")
    if raw.get("ignored_gpu_ids") is not None:
        ids = raw["ignored_gpu_ids"]
        if not isinstance(ids, list):
            raise ConfigError("config: ignored_gpu_ids: expected a list of GPU or MIG UUIDs (strings)")
        if len(ids) > MAX_IGNORED_IDS:
            raise ConfigError(f"config: ignored_gpu_ids: at most {MAX_IGNORED_IDS} IDs, got {len(ids)}")
        if not all(isinstance(i, str) for i in ids):
            raise ConfigError("config: ignored_gpu_ids: expected a list of GPU or MIG UUIDs (strings)")
        long = next((i for i in ids if len(i) > MAX_ID), None)
        if long is not None:
            raise ConfigError(f"config: ignored_gpu_ids: {long[:100]!r}… is longer than {MAX_ID} characters "
                              "(not a GPU or MIG UUID)")
        out["ignored_gpu_ids"] = tuple(ids)
    if raw.get("fingerprint_period") is not None:
        period = parse_duration(_str(raw["fingerprint_period"], "fingerprint_period"), "config: fingerprint_period")
        if not 1.0 <= period <= MAX_PERIOD:
            raise ConfigError("config: fingerprint_period: must be between 1s and 8760h")
        out["fingerprint_period"] = period
    if raw.get("metrics_listen") is not None:
        listen = _str(raw["metrics_listen"], "metrics_listen")
        if listen:
            parse_listen(listen[:200], "config: metrics_listen")
            out["metrics_listen"] = listen
    if raw.get("metrics_web_config") is not None:
        web = _str(raw["metrics_web_config"], "metrics_web_config")
        if web:
            if not out.get("metrics_listen"):
                raise ConfigError("config: metrics_web_config: set, but metrics_listen is not: there is no /metrics "
                                  "endpoint to protect")
            out["metrics_web_config"] = Path(web).absolute()
    for key in ("nvml_replay", "cgroup_root", "proc_root"):
        if raw.get(key) is not None:
            value = _str(raw[key], key)
            if value:
                out[key] = Path(value)
    if raw.get("visible_devices_env") is not None:
        out["visible_devices_env"] = _visible_env(raw["visible_devices_env"])
    if raw.get("file_devices") is not None:
        out["file_devices"] = _file_devices(raw["file_devices"])
    if raw.get("mps") is not None:
        out["mps"] = _mps(raw["mps"])
    return PluginConfig(**out)


def _visible_env(value: Any) -> tuple[str, ...]:
    """``visible_devices_env``: one or both of :data:`VISIBLE_ENV_NAMES`, each once."""
    names = ", ".join(VISIBLE_ENV_NAMES)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"config: visible_devices_env: expected a list of variable names ({names})")
    if not value or len(set(value)) != len(value) or any(v not in VISIBLE_ENV_NAMES for v in value):
        shown = ", ".join(repr(v[:100]) for v in value[:4]) or "an empty list"
        raise ConfigError(f"config: visible_devices_env: {shown}: name one or both of {names}, each once "
                          "(NVIDIA_VISIBLE_DEVICES makes Nomad's docker driver require the nvidia runtime)")
    return tuple(value)


def _mps(block: Any) -> MpsSettings:
    """The ``mps { root, timeout, exclusive_process, resource "…" { name, replicas, devices } }`` block
    (docs/mps.md)."""
    if not isinstance(block, dict):
        raise ConfigError("config: mps: expected a block")
    _string_keys(block, "config: mps")
    unknown = sorted(set(block) - {*MPS_ATTRIBUTES, "resource"})
    if unknown:
        raise ConfigError(f"config: mps.{unknown[0][:100]}: unknown key")
    out: dict[str, Any] = {}
    if block.get("root") is not None and _str(block["root"], "mps.root"):
        out["root"] = Path(_str(block["root"], "mps.root")).absolute()
    if block.get("timeout") is not None:
        timeout = parse_duration(_str(block["timeout"], "mps.timeout"), "config: mps.timeout")
        if not 0.1 <= timeout <= 600:
            raise ConfigError("config: mps.timeout: must be between 100ms and 10m")
        out["timeout"] = timeout
    if block.get("exclusive_process") is not None:
        out["exclusive_process"] = _bool(block["exclusive_process"], "mps.exclusive_process")
    resources = []
    items = block.get("resource") or []
    if not isinstance(items, list):
        raise ConfigError("config: mps.resource: expected resource blocks")
    if len(items) > MPS_MAX_RESOURCES:
        raise ConfigError(f"config: mps.resource: at most {MPS_MAX_RESOURCES} resource blocks, got {len(items)}")
    for i, item in enumerate(items):
        where = f"mps.resource[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(f"config: {where}: expected a block")
        _string_keys(item, f"config: {where}")
        name = _str(item.get("name"), f"{where}.name") if item.get("name") is not None else ""
        parts = name.split("/")
        if not name or ".." in parts or "" in parts or len(name) > MPS_MAX_NAME:
            raise ConfigError(f"config: {where}.name: {name[:100]!r} is not a usable resource name (a relative "
                              f"path of at most {MPS_MAX_NAME} characters)")
        replicas = item.get("replicas")
        if isinstance(replicas, str) and _decimal(replicas):
            replicas = int(replicas)  # go-cty may send a number as a decimal string
        if isinstance(replicas, float) and replicas.is_integer():
            replicas = int(replicas)
        if not isinstance(replicas, int) or isinstance(replicas, bool) or not 2 <= replicas <= MPS_MAX_REPLICAS:
            got = f", got {replicas}" if isinstance(replicas, int) and not isinstance(replicas, bool) else ""
            raise ConfigError(f"config: {where}.replicas: mps resource {name!r}: replicas must be a whole number "
                              f"from 2 to {MPS_MAX_REPLICAS} (NVIDIA MPS: up to {MPS_MAX_REPLICAS} clients per "
                              f"GPU){got}")
        devices = item.get("devices") or []
        if not isinstance(devices, list):
            raise ConfigError(f"config: {where}.devices: mps resource {name!r}: devices must be a list of GPU UUIDs "
                              "or indices")
        if len(devices) > MPS_MAX_DEVICES:
            raise ConfigError(f"config: {where}.devices: mps resource {name!r}: at most {MPS_MAX_DEVICES} devices, "
                              f"got {len(devices)}")
        if not all(isinstance(d, str) and len(d) <= MAX_ID for d in devices):
            raise ConfigError(f"config: {where}.devices: mps resource {name!r}: devices must be a list of GPU UUIDs "
                              f"or indices (strings of at most {MAX_ID} characters)")
        for d in devices:
            if not (_decimal(d) or d.startswith("GPU-")):
                raise ConfigError(f"config: mps resource {name!r}: device {d[:100]!r} is neither a GPU UUID (GPU-…) "
                                  "nor an NVML index")
        resolved: tuple[str | int, ...] = tuple(int(d) if _decimal(d) else d for d in devices)
        resources.append(MpsResourceSettings(name=name, replicas=replicas, devices=resolved or "all"))
    out["resources"] = tuple(resources)
    return MpsSettings(**out)


def _file_devices(block: Any) -> FileDevicesConfig:
    if not isinstance(block, dict):
        raise ConfigError("config: file_devices: expected a block")
    _string_keys(block, "config: file_devices")
    unknown = sorted(set(block) - set(FILE_DEVICE_ATTRIBUTES))
    if unknown:
        raise ConfigError(f"config: file_devices.{unknown[0][:100]}: unknown key")
    out: dict[str, Any] = {}
    for key in ("vendor", "type", "name"):
        if block.get(key) is not None:
            value = _str(block[key], f"file_devices.{key}")
            if not value or "/" in value or len(value) > MAX_ID:
                raise ConfigError(f"config: file_devices.{key}: must be non-empty, at most {MAX_ID} characters and "
                                  "without '/' (it is part of the device group's vendor/type/name)")
            out[key] = value
    if block.get("dir") is not None and _str(block["dir"], "file_devices.dir"):
        out["dir"] = Path(_str(block["dir"], "file_devices.dir")).absolute()
    if block.get("list_period") is not None:
        period = parse_duration(_str(block["list_period"], "file_devices.list_period"),
                                "config: file_devices.list_period")
        if not 0.1 <= period <= MAX_PERIOD:
            raise ConfigError("config: file_devices.list_period: must be between 100ms and 8760h")
        out["list_period"] = period
    if block.get("unhealthy_perm") is not None:
        out["unhealthy_perm"] = check_perm(_str(block["unhealthy_perm"], "file_devices.unhealthy_perm"),
                                           "config: file_devices.unhealthy_perm")
    return FileDevicesConfig(**out)


def _string_keys(block: dict[Any, Any], where: str) -> None:
    """HCL attribute names are strings; a map key of another type (found by fuzzing) is refused."""
    for key in block:
        if not isinstance(key, str):
            raise ConfigError(f"{where}: keys must be strings, got {type(key).__name__} {str(key)[:100]!r}")


def _decimal(text: str) -> bool:
    """An ASCII decimal of at most 19 digits, as many as an int64 has (str.isdigit() accepts '²', and
    int() refuses 4301+ digits)."""
    return text.isascii() and text.isdigit() and len(text) <= 19


def _str(value: Any, key: str) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # go-cty may send a number where HCL had one; a string attr accepts it
    if not isinstance(value, str):
        raise ConfigError(f"config: {key}: expected a string, got {type(value).__name__}")
    if len(value) > MAX_STRING:
        raise ConfigError(f"config: {key}: longer than {MAX_STRING} characters")
    return value


def _bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value in ("true", "false"):
        return value == "true"
    raise ConfigError(f"config: {key}: expected true or false, got {value!r}")
