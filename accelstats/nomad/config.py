"""The Nomad device plugin's configuration: its hclspec schema and the SetConfig decoder.

Nomad asks the plugin for its schema (ConfigSchema), evaluates the agent's
``plugin "nomad-device-accelstats" { config { … } }`` block against it, fills every default, and
sends the result msgpack-encoded by go-cty (docs/nomad.md): a map with sorted keys, every
attribute present, numbers possibly as decimal strings, an absent block as nil. :func:`decode`
turns that into the project's one settings model, :class:`accelstats.settings.Settings` (the block's
own fields in :attr:`~accelstats.settings.Settings.nomad`), or raises :class:`ConfigError` naming the
field (``config: <field>: <reason>``; the servicer answers INVALID_ARGUMENT with it).
:func:`plugin_field` names a setting of the model as the block does, for errors found later (at
setup: :class:`accelstats.settings.SetupError`).

Every list and size the configuration controls is bounded, far above what an operator needs, and a
value past a bound is refused by name before the manager is built from it: the ``mps`` block by the
one MPS validator, :func:`accelstats.mps.rules.check_settings` (``replicas`` 2 to 48, NVIDIA's MPS
limit of 48 clients per GPU; at most 256 resources of at most 256 devices each; names of 255
characters), and here 1024 ``ignored_gpu_ids``, strings of 4096 characters (paths) or 256 (IDs,
device names), periods from :data:`MIN_PERIOD` to :data:`MAX_PERIOD`. The ``mps.resource`` block list
carries its bound in the schema too, so Nomad itself refuses more blocks.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgpack

from accelstats.config import check_perm, parse_listen
from accelstats.mps.rules import (
    MAX_REPLICAS_VOLTA_ON,
    MAX_RESOURCES,
    MIN_REPLICAS,
    MpsSettingError,
    check_settings,
)
from accelstats.settings import (
    ConfigError,
    FileDevicesSettings,
    MpsResourceSettings,
    MpsSettings,
    NomadSettings,
    Settings,
)

# Go's time.ParseDuration units, in seconds.
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"([0-9]*(?:\.[0-9]*)?)(ns|us|µs|μs|ms|s|m|h)")


MIN_PERIOD = 0.1  # seconds: the shortest list_period, and the fastest any stream loops
MAX_PERIOD = 8760 * 3600.0  # seconds (a year): a longer period, or Stats interval, is a typing mistake
MIN_FINGERPRINT_PERIOD = 1.0  # seconds
MAX_STRING = 4096  # characters of any string setting (PATH_MAX)
MAX_ID = 256  # characters of a GPU/MIG UUID, a file-device vendor, type or name
MAX_IGNORED_IDS = 1024  # ignored_gpu_ids entries (a host has a few dozen GPUs and MIG instances at most)

#: The plugin's settings when its block sets nothing: the shared defaults, with the ``nvidia`` collector
#: alone, no open-fd scan and no attribution (Fingerprint, Stats and Reserve use no container data; the
#: cgroup walk runs only for ``metrics_listen``).
DEFAULTS = Settings(collectors=("nvidia",), open_fd_scan=False, attribution=False)


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
    "fail_requests_greater_than_one": ("bool", "true"),
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
                                                                 max_items=MAX_RESOURCES, nested=resource))
    top["mps"] = hclspec.Spec(block_value=hclspec.Block(
        name="mps", required=False, nested=hclspec.Spec(object=hclspec.Object(attributes=mps))))
    return hclspec.Spec(object=hclspec.Object(attributes=top))


#: Settings paths (:class:`accelstats.settings.Settings`) whose field in the plugin's block has another
#: name; ``nomad.<x>`` is ``<x>``, and every other path is the block's own.
_BLOCK_NAMES = {"collectors": "enabled", "listen_host": "metrics_listen", "listen_port": "metrics_listen",
                "web_config": "metrics_web_config", "mps.resources": "mps.resource",
                "fail_mps_requests_greater_than_one": "mps.fail_requests_greater_than_one"}


def plugin_field(path: str) -> str:
    """The plugin block's name of the setting at ``path`` in the settings model: ``web_config`` →
    ``metrics_web_config``, ``mps.resources[0].replicas`` → ``mps.resource[0].replicas``,
    ``nomad.fingerprint_period`` → ``fingerprint_period``, ``nvml_replay`` → ``nvml_replay``."""
    path = path.removeprefix("nomad.")
    for model, block in _BLOCK_NAMES.items():
        if path == model or path.startswith((model + ".", model + "[")):
            return block + path[len(model):]
    return path


def decode(data: bytes) -> Settings:
    """Decode SetConfig's ``msgpack_config`` (see module docstring) onto :data:`DEFAULTS`. Raises
    ConfigError naming the field."""
    if not data:
        return DEFAULTS
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:  # TypeError: a map key that is a map or array
        raise ConfigError(f"config: not msgpack: {exc}") from exc
    if raw is None:
        return DEFAULTS
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a map, got {type(raw).__name__}")
    _string_keys(raw, "config")
    unknown = sorted(set(raw) - set(ATTRIBUTES) - {"file_devices", "mps"})
    if unknown:
        known = ", ".join(sorted([*ATTRIBUTES, "file_devices", "mps"]))
        raise ConfigError(f"config: unknown key {unknown[0][:100]!r} (known: {known})")
    out: dict[str, Any] = {}
    nomad: dict[str, Any] = {}
    enabled = _bool(raw["enabled"], "enabled") if raw.get("enabled") is not None else True
    if raw.get("ignored_gpu_ids") is not None:
        nomad["ignored_gpu_ids"] = _ignored_ids(raw["ignored_gpu_ids"])
    if raw.get("fingerprint_period") is not None:
        period = parse_duration(_str(raw["fingerprint_period"], "fingerprint_period"), "config: fingerprint_period")
        if not MIN_FINGERPRINT_PERIOD <= period <= MAX_PERIOD:
            raise ConfigError(f"config: fingerprint_period: must be between {MIN_FINGERPRINT_PERIOD:g}s and "
                              f"{MAX_PERIOD / 3600:g}h")
        nomad["fingerprint_period"] = period
    if raw.get("metrics_listen") is not None:
        listen = _str(raw["metrics_listen"], "metrics_listen")
        if listen:
            out["listen_host"], out["listen_port"] = parse_listen(listen, "config: metrics_listen")
            nomad["serve_metrics"] = True
    if raw.get("metrics_web_config") is not None:
        web = _str(raw["metrics_web_config"], "metrics_web_config")
        if web:
            if not nomad.get("serve_metrics"):
                raise ConfigError("config: metrics_web_config: set, but metrics_listen is not: there is no /metrics "
                                  "endpoint to protect")
            out["web_config"] = Path(web).absolute()
    for key in ("nvml_replay", "cgroup_root", "proc_root"):
        if raw.get(key) is not None:
            value = _str(raw[key], key)
            if value:
                out[key] = Path(value)
    if raw.get("visible_devices_env") is not None:
        nomad["visible_devices_env"] = _visible_env(raw["visible_devices_env"])
    file_devices = _file_devices(raw["file_devices"]) if raw.get("file_devices") is not None else DEFAULTS.file_devices
    mps = _mps(raw["mps"]) if raw.get("mps") is not None else DEFAULTS.mps
    if isinstance(raw.get("mps"), dict) and raw["mps"].get("fail_requests_greater_than_one") is not None:
        nomad["fail_mps_requests_greater_than_one"] = _bool(raw["mps"]["fail_requests_greater_than_one"],
                                                            "mps.fail_requests_greater_than_one")
    collectors = tuple(name for name, on in (("nvidia", enabled), ("files", file_devices.dir is not None),
                                             ("mps", bool(mps.resources))) if on)
    return replace(DEFAULTS, **out, file_devices=file_devices, mps=mps, collectors=collectors,
                   nomad=NomadSettings(**nomad), attribution=bool(nomad.get("serve_metrics")))


def _ignored_ids(ids: Any) -> tuple[str, ...]:
    """``ignored_gpu_ids``: at most :data:`MAX_IGNORED_IDS` strings of at most :data:`MAX_ID` characters."""
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
    return tuple(ids)


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
    (docs/mps.md): go-cty's types decoded here (numbers sent as decimal strings, ``devices = []`` for
    every GPU), every rule by :func:`accelstats.mps.rules.check_settings`. The block's
    ``fail_requests_greater_than_one`` is Reserve's, not the daemons': :func:`decode` reads it into
    :class:`~accelstats.settings.NomadSettings`."""
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
        out["timeout"] = parse_duration(_str(block["timeout"], "mps.timeout"), "config: mps.timeout")
    if block.get("exclusive_process") is not None:
        out["exclusive_process"] = _bool(block["exclusive_process"], "mps.exclusive_process")
    items = block.get("resource") or []
    if not isinstance(items, list):
        raise ConfigError("config: mps.resource: expected resource blocks")
    settings = MpsSettings(**out, resources=tuple(_resource(i, item) for i, item in enumerate(items)))
    try:
        check_settings(settings)
    except MpsSettingError as exc:
        raise ConfigError(f"config: {plugin_field('mps.' + exc.field)}: {exc}") from None
    return settings


def _resource(i: int, item: Any) -> MpsResourceSettings:
    """One ``resource`` block, its values as the settings model types them (the rules come after)."""
    where = f"mps.resource[{i}]"
    if not isinstance(item, dict):
        raise ConfigError(f"config: {where}: expected a block")
    _string_keys(item, f"config: {where}")
    name = _str(item.get("name"), f"{where}.name") if item.get("name") is not None else ""
    replicas = item.get("replicas")
    if isinstance(replicas, str) and _decimal(replicas):
        replicas = int(replicas)  # go-cty may send a number as a decimal string
    if isinstance(replicas, float) and replicas.is_integer():
        replicas = int(replicas)
    if not isinstance(replicas, int) or isinstance(replicas, bool):
        raise ConfigError(f"config: {where}.replicas: mps resource {name[:100]!r}: replicas must be a whole number "
                          f"from {MIN_REPLICAS} to {MAX_REPLICAS_VOLTA_ON} (NVIDIA MPS: up to {MAX_REPLICAS_VOLTA_ON} "
                          "clients per GPU)")
    devices = item.get("devices") or []
    if not isinstance(devices, list) or not all(isinstance(d, str) for d in devices):
        raise ConfigError(f"config: {where}.devices: mps resource {name[:100]!r}: devices must be a list of GPU "
                          "UUIDs or NVML indices (strings)")
    listed = tuple(int(d) if _decimal(d) else d for d in devices)
    return MpsResourceSettings(name=name, replicas=replicas, devices=listed or "all")


def _file_devices(block: Any) -> FileDevicesSettings:
    """The ``file_devices`` block (Nomad's example plugin's settings and the device group's names)."""
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
        if not MIN_PERIOD <= period <= MAX_PERIOD:
            raise ConfigError(f"config: file_devices.list_period: must be between {MIN_PERIOD * 1000:g}ms and "
                              f"{MAX_PERIOD / 3600:g}h")
        out["list_period"] = period
    if block.get("unhealthy_perm") is not None:
        out["unhealthy_perm"] = check_perm(_str(block["unhealthy_perm"], "file_devices.unhealthy_perm"),
                                           "config: file_devices.unhealthy_perm")
    return FileDevicesSettings(**out)


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
