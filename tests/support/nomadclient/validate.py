"""The checks a Nomad client applies to a device plugin's answers (spec/nomad-plugin.md §3).

Each function takes a generated protobuf message (``accelstats.nomad.proto``) and returns a list
of problems, empty when Nomad would accept the message. Texts follow Nomad's own errors where
Nomad has one:

* PluginInfo — ``helper/pluginutils/loader/init.go`` (``fingerprintPlugin``, ``selectApiVersion``,
  ``convertVersions``) with hashicorp/go-version's ``NewVersion``; ``api_versions.go`` (devices:
  ``v0.1.0``).
* Fingerprint — ``plugins/device/device.go`` ``DeviceGroup.Validate``/``Device.Validate`` and
  ``plugins/shared/structs/attribute.go`` ``Attribute.Validate`` with the unit list of
  ``plugins/shared/structs/units.go``; ``client/devicemanager/instance.go`` ``handleFingerprint``
  prefixes ``device group N: `` and, on any error, clears the devices and kills the plugin.
* Stats — ``plugins/device/util.go`` ``convertProtoDeviceStats`` drops a device whose timestamp
  is missing or invalid (``ptypes.Timestamp``).
* Reserve — ``plugins/device/client.go`` (a nil ``container_res`` becomes a nil reservation) and
  the cgroup device rule permission letters ``r``, ``w``, ``m``.

A few checks go beyond what Nomad enforces and say so in their text: they catch output Nomad
accepts but that breaks what users see (duplicate IDs, NUL-padded PCI bus IDs, stats for devices
that were never fingerprinted).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

# plugins/shared/structs/units.go UnitIndex
UNITS: frozenset[str] = frozenset(
    ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"]
    + ["kB", "KB", "MB", "GB", "TB", "PB", "EB"]
    + ["KiB/s", "MiB/s", "GiB/s", "TiB/s", "PiB/s", "EiB/s"]
    + ["kB/s", "KB/s", "MB/s", "GB/s", "TB/s", "PB/s", "EB/s"]
    + ["MHz", "GHz"]
    + ["mW", "W", "kW", "MW", "GW"]
)

PLUGIN_TYPE_DEVICE = 3  # plugins/base/proto/base.proto PluginType.DEVICE
NOMAD_DEVICE_API_VERSION = "v0.1.0"  # plugins/device/versions.go ApiVersion010

# hashicorp/go-version version.go VersionRegexpRaw, anchored as in NewVersion.
_GO_VERSION = re.compile(
    r"v?([0-9]+(\.[0-9]+)*?)"
    r"(-([0-9]+[0-9A-Za-z\-~]*(\.[0-9A-Za-z\-~]+)*)|(-?([A-Za-z\-~]+[0-9A-Za-z\-~]*(\.[0-9A-Za-z\-~]+)*)))?"
    r"(\+([0-9A-Za-z\-~]+(\.[0-9A-Za-z\-~]+)*))?"
)

# google.golang.org/protobuf timestamppb CheckValid: 0001-01-01T00:00:00Z .. 9999-12-31T23:59:59Z
_TS_MIN_SECONDS = -62135596800
_TS_MAX_SECONDS = 253402300799


def _q(text: str) -> str:
    """Go's ``%q`` for the strings seen here (JSON quoting matches it for printable text)."""
    return json.dumps(text, ensure_ascii=False)


def parse_go_version(text: str) -> tuple[tuple[int, ...], str] | None:
    """``version.NewVersion`` from hashicorp/go-version: ``(segments padded to 3, prerelease)``, or
    None where Nomad fails with "Malformed version" (or a segment overflows int64). A leading
    ``v`` is optional; ``1``, ``1.2.3.4``, ``1.0.0-beta.1+meta`` all parse."""
    m = _GO_VERSION.fullmatch(text)
    if m is None:
        return None
    segments: list[int] = []
    for part in m.group(1).split("."):
        value = int(part)
        if value > 2**63 - 1:
            return None
        segments.append(value)
    while len(segments) < 3:
        segments.append(0)
    pre = m.group(7) or m.group(4) or ""
    return tuple(segments), pre


def _version_equal(a: tuple[tuple[int, ...], str], b: tuple[tuple[int, ...], str]) -> bool:
    """go-version ``Equal``: segments compared with zero padding, then the prerelease."""
    sa, sb = list(a[0]), list(b[0])
    width = max(len(sa), len(sb))
    sa += [0] * (width - len(sa))
    sb += [0] * (width - len(sb))
    return sa == sb and a[1] == b[1]


def select_api_version(resp: Any) -> str | None:
    """The API version Nomad picks from PluginInfo (``selectApiVersion``): the plugin's *own*
    spelling of the first version equal to ``v0.1.0`` (``pv.Original()``); that string is what
    Nomad sends back in ``SetConfig.plugin_api_version``. None when none matches or one does not
    parse."""
    want = parse_go_version(NOMAD_DEVICE_API_VERSION)
    assert want is not None
    parsed = [(v, parse_go_version(v)) for v in resp.plugin_api_versions]
    if any(p is None for _, p in parsed):
        return None
    for original, p in parsed:
        if p is not None and _version_equal(p, want):
            return str(original)
    return None


def validate_plugin_info(resp: Any) -> list[str]:
    """PluginInfoResponse as Nomad's loader checks it: type DEVICE, at least one API version, all
    parseable, one equal to v0.1.0, ``plugin_version`` parseable by go-version, a non-empty name."""
    problems: list[str] = []
    if resp.type != PLUGIN_TYPE_DEVICE:
        problems.append(f"plugin type is {resp.type}, want DEVICE ({PLUGIN_TYPE_DEVICE})")
    versions = list(resp.plugin_api_versions)
    if not versions:
        problems.append("plugin provided no compatible API versions")
    else:
        bad = [v for v in versions if parse_go_version(v) is None]
        if bad:
            problems.append(f"plugin provided invalid versions: failed to convert version {_q(bad[0])}")
        elif select_api_version(resp) is None:
            problems.append(
                f"supported API versions for plugin {versions} and Nomad ({NOMAD_DEVICE_API_VERSION}) do not overlap: "
                "Nomad skips the plugin"
            )
    if parse_go_version(resp.plugin_version) is None:
        problems.append(f"failed to parse plugin {_q(resp.name)} version {_q(resp.plugin_version)}: Malformed version")
    if not resp.name:
        problems.append("plugin name must be non-empty")
    return problems


def attribute_problem(attr: Any) -> str | None:
    """``Attribute.Validate`` (plugins/shared/structs/attribute.go) on the converted attribute:
    the unit is checked first (known unit, and only on an int/float value), then exactly one
    value must be set (a proto oneof can hold at most one, so "none set" is the failure left)."""
    which = attr.WhichOneof("value")
    if attr.unit:
        if attr.unit not in UNITS:
            return f"unrecognized unit {_q(attr.unit)}"
        if which in ("string_val", "bool_val"):
            return "unit can not be specified on a boolean or string attribute"
    if which is None:
        return "no attribute value set"
    return None


def validate_fingerprint(resp: Any) -> list[str]:
    """FingerprintResponse as ``DeviceGroup.Validate`` checks each group (vendor, device_type,
    device_name and every device ID non-empty; every attribute valid). Any of these makes Nomad
    clear the node's devices and kill the plugin without retry. Also (beyond Nomad): duplicate
    device IDs in a group, duplicate groups, and NUL characters in a PCI bus ID."""
    problems: list[str] = []
    seen_groups: set[tuple[str, str, str]] = set()
    for gi, group in enumerate(resp.device_group):
        prefix = f"device group {gi}: "
        if not group.vendor:
            problems.append(prefix + "device vendor must be specified")
        if not group.device_type:
            problems.append(prefix + "device type must be specified")
        if not group.device_name:
            problems.append(prefix + "device name must be specified")
        ids: set[str] = set()
        for di, dev in enumerate(group.devices):
            if not dev.ID:
                problems.append(prefix + f"device {di}: device ID must be specified")
            elif dev.ID in ids:
                problems.append(prefix + f"device {di}: duplicate device ID {_q(dev.ID)} (beyond Nomad's checks: "
                                "the scheduler would hand the same device out twice)")
            ids.add(dev.ID)
            if dev.HasField("hw_locality") and "\x00" in dev.hw_locality.pci_bus_id:
                problems.append(prefix + f"device {di}: pci_bus_id {dev.hw_locality.pci_bus_id!r} holds NUL "
                                "characters (spec §2: a clean string)")
        for name in sorted(group.attributes):
            err = attribute_problem(group.attributes[name])
            if err:
                problems.append(prefix + f"device attribute {_q(name)} invalid: {err}")
        key = (group.vendor, group.device_type, group.device_name)
        if key in seen_groups:
            problems.append(prefix + f"duplicate group {'/'.join(key)} (beyond Nomad's checks)")
        seen_groups.add(key)
    return problems


def timestamp_problem(ts: Any) -> str | None:
    """``ptypes.Timestamp``'s validity rule for a set Timestamp."""
    if not _TS_MIN_SECONDS <= ts.seconds <= _TS_MAX_SECONDS:
        return f"timestamp seconds {ts.seconds} out of range"
    if not 0 <= ts.nanos < 1_000_000_000:
        return f"timestamp nanos {ts.nanos} out of range"
    return None


def _fingerprinted(fingerprint: Any) -> dict[tuple[str, str, str], set[str]]:
    return {
        (g.vendor, g.device_type, g.device_name): {d.ID for d in g.devices} for g in fingerprint.device_group
    }


def validate_stats(resp: Any, fingerprint: Any | None = None) -> list[str]:
    """StatsResponse: every DeviceStats must carry a valid timestamp, or Nomad silently drops that
    device's stats; group vendor/type/name and device ID keys must be non-empty (Nomad matches
    stats to devices by them). Nomad puts no rule on stat units or values. With ``fingerprint``
    (the latest FingerprintResponse), also report stats for groups or IDs it does not hold —
    Nomad accepts them but never shows them (beyond Nomad's checks)."""
    problems: list[str] = []
    known = _fingerprinted(fingerprint) if fingerprint is not None else None
    for gi, group in enumerate(resp.groups):
        label = f"{group.vendor}/{group.type}/{group.name}"
        prefix = f"stats group {gi} ({label}): "
        for field in ("vendor", "type", "name"):
            if not getattr(group, field):
                problems.append(prefix + f"{field} must be non-empty")
        ids = known.get((group.vendor, group.type, group.name)) if known is not None else None
        if known is not None and ids is None:
            problems.append(prefix + "no fingerprinted group has this vendor/type/name: Nomad never shows these stats "
                            "(beyond Nomad's checks)")
        for dev_id in sorted(group.instance_stats):
            stats = group.instance_stats[dev_id]
            if not dev_id:
                problems.append(prefix + "empty device ID key in instance_stats")
            if not stats.HasField("timestamp"):
                problems.append(prefix + f"device {_q(dev_id)}: timestamp missing: Nomad drops this device's stats")
            else:
                err = timestamp_problem(stats.timestamp)
                if err:
                    problems.append(prefix + f"device {_q(dev_id)}: {err}: Nomad drops this device's stats")
            if ids is not None and dev_id not in ids:
                problems.append(prefix + f"device {_q(dev_id)} is not in the fingerprint: Nomad never shows its stats "
                                "(beyond Nomad's checks)")
    return problems


def _path_problems(paths: Iterable[tuple[str, str]]) -> list[str]:
    return [f"{what} {_q(path)} is not an absolute path" for what, path in paths if not path.startswith("/")]


def validate_reserve(resp: Any) -> list[str]:
    """ReserveResponse: ``container_res`` always present (even empty); every DeviceSpec's
    permissions only from ``r``, ``w``, ``m``; host and task paths of devices and mounts absolute;
    environment variable names non-empty and without ``=``."""
    if not resp.HasField("container_res"):
        return ["container_res missing: Nomad gets a nil reservation (spec §2: always present, even when empty)"]
    res = resp.container_res
    problems: list[str] = []
    for i, dev in enumerate(res.devices):
        bad = sorted(set(dev.permissions) - set("rwm"))
        if bad:
            problems.append(
                f"device {i}: permissions {_q(dev.permissions)} hold {''.join(bad)!r}: only r, w, m allowed"
            )
        problems += [f"device {i}: {p}" for p in _path_problems([("host_path", dev.host_path),
                                                                  ("task_path", dev.task_path)])]
    for i, mount in enumerate(res.mounts):
        problems += [f"mount {i}: {p}" for p in _path_problems([("host_path", mount.host_path),
                                                                 ("task_path", mount.task_path)])]
    for name in sorted(res.envs):
        if not name or "=" in name:
            problems.append(f"env {_q(name)}: not a valid environment variable name")
    return problems


def docker_requires_nvidia_runtime(envs: dict[str, str]) -> bool:
    """Whether Nomad's docker driver demands its ``gpu_runtime`` (default ``nvidia``) for a task with
    this reservation env: whenever ``NVIDIA_VISIBLE_DEVICES`` is set, and the task fails with
    ``requested docker runtime "nvidia" was not found`` on a host without that runtime
    (hashicorp/nomad ``drivers/docker/driver.go:1065-1073``)."""
    return "NVIDIA_VISIBLE_DEVICES" in envs
