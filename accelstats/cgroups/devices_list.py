"""Pure parsers for cgroup v1 ``devices.list`` and NVIDIA's ``mig-minors``, and the GPU grant they imply.

Facts used here (docs/containers.md; kernel ``Documentation/admin-guide/cgroup-v1/devices.rst``):

* ``devices.list`` holds one rule per line, ``<type> <major>:<minor> <access>``; type ``a`` (all
  devices), ``c`` (char) or ``b`` (block); major and minor a decimal number or ``*``; access a
  subset of ``rwm``.  The kernel prints ``a *:* rwm`` (and nothing else) for a cgroup whose default
  is "allow", so an ``a`` rule means the container is not restricted at all.
* ``/dev/nvidia<N>`` is char ``195:N`` with N the NVML minor number; ``195:255`` is ``nvidiactl``
  and ``195:254`` is ``nvidia-modeset``: neither is a GPU.  ``nvidia-uvm`` and ``nvidia-caps`` have
  dynamic majors (``/proc/devices``).
* ``/proc/driver/nvidia-caps/mig-minors`` maps MIG capability names (``gpu0/gi11/access``,
  ``gpu0/gi11/ci0/access``, ``config``, ``monitor``) to minors of the ``nvidia-caps`` major.

Nothing here reads files or raises on content: malformed lines are returned so that the caller can
count them (``accelstats_devices_list_skipped_lines_total``).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import NamedTuple

NVIDIA_MAJOR = 195
"""Char major of ``/dev/nvidia<N>``, ``/dev/nvidiactl`` and ``/dev/nvidia-modeset`` (spec §2)."""
NVIDIA_CTL_MINOR = 255
"""Minor of ``/dev/nvidiactl``: the control node, not a GPU."""
NVIDIA_MODESET_MINOR = 254
"""Minor of ``/dev/nvidia-modeset``: not a GPU."""

_NOT_GPU_MINORS = frozenset({NVIDIA_CTL_MINOR, NVIDIA_MODESET_MINOR})
_ACCESS_ORDER = "rwm"
_USABLE_ACCESS = frozenset("rw")
# The kernel stores major/minor as u32 and prints ~0 as '*'; anything larger is not a kernel line.
_MAX_NUMBER = 0xFFFFFFFE
_NUMBER_RE = re.compile(r"[0-9]{1,10}")
_ACCESS_RE = re.compile(r"[rwm]+")


@dataclass(frozen=True)
class DeviceRule:
    """One ``devices.list`` rule.

    ``type`` is ``'a'`` (all devices), ``'c'`` (char) or ``'b'`` (block); ``major``/``minor`` are
    the device numbers, ``None`` standing for ``*``; ``access`` is a subset of ``{'r', 'w', 'm'}``.
    ``str(rule)`` gives the kernel's spelling (access in ``rwm`` order), which
    :func:`parse_devices_list` reads back to an equal rule.
    """

    type: str
    major: int | None
    minor: int | None
    access: frozenset[str]

    def __str__(self) -> str:
        return format_rule(self)


@dataclass(frozen=True)
class DevicesList:
    """A parsed ``devices.list``: the rules in file order and the lines that were not rules.

    ``skipped_lines`` holds each malformed, non-blank line stripped of surrounding whitespace;
    blank lines are neither rules nor skipped.
    """

    rules: tuple[DeviceRule, ...]
    skipped_lines: tuple[str, ...]


@dataclass(frozen=True)
class GpuGrant:
    """Which NVIDIA device nodes a container's ``devices.list`` lets it read or write.

    * ``minors``: NVML minor numbers of the GPUs granted (only minors present in the host's GPU
      list; never 254/255).
    * ``unrestricted``: the rules allow every char device (``a *:* rw…``, ``c *:* rw…``): they prove
      nothing about which GPU is used, so attribute by process evidence instead (docs/containers.md,
      "Attribution").  ``minors`` and ``mig_caps_minors`` are then empty.
    * ``mig_caps_minors``: readable minors of the ``nvidia-caps`` major (MIG capabilities); resolve
      them with :func:`mig_instances`.
    """

    minors: frozenset[int]
    unrestricted: bool
    mig_caps_minors: frozenset[int]


class MigCap(NamedTuple):
    """One ``mig-minors`` entry: ``(gpu_minor, gi, ci, kind)``.

    ``gpu_minor`` is the N of ``gpuN`` (the parent GPU's device minor, as in ``/dev/nvidiaN``; the
    driver and its consumers such as Slurm's gpu_nvml plugin key it by minor), ``None`` for the
    global ``config``/``monitor`` capabilities.  ``gi``/``ci`` are the GPU and compute instance ids,
    ``None`` where the line has none.  ``kind`` is ``"access"``, ``"config"`` or ``"monitor"``.
    """

    gpu_minor: int | None
    gi: int | None
    ci: int | None
    kind: str


class MigInstance(NamedTuple):
    """A MIG compute instance: parent GPU minor, GPU instance id, compute instance id."""

    gpu_minor: int
    gi: int
    ci: int


def format_rule(rule: DeviceRule) -> str:
    """Spell ``rule`` as the kernel prints it in ``devices.list``, e.g. ``"c 195:* rw"``."""
    major = "*" if rule.major is None else str(rule.major)
    minor = "*" if rule.minor is None else str(rule.minor)
    access = "".join(ch for ch in _ACCESS_ORDER if ch in rule.access)
    return f"{rule.type} {major}:{minor} {access}"


def _parse_number(token: str) -> tuple[bool, int | None]:
    """``(ok, value)``: value ``None`` for ``*``, the integer for a decimal in u32 range."""
    if token == "*":
        return True, None
    if _NUMBER_RE.fullmatch(token) is None:
        return False, None
    value = int(token)
    return value <= _MAX_NUMBER, value


def parse_rule(line: str) -> DeviceRule | None:
    """Parse one ``devices.list`` line; ``None`` when it is not exactly ``<type> <maj>:<min> <access>``.

    Strict on shape (three fields, ``a``/``b``/``c``, decimal or ``*``, non-empty ``rwm`` access) so
    that lines such as ``c 1:2 rwm badformat`` are rejected rather than half-read.  Never raises.
    """
    fields = line.split()
    if len(fields) != 3:
        return None
    kind, numbers, access = fields
    if kind not in ("a", "b", "c") or _ACCESS_RE.fullmatch(access) is None:
        return None
    major_text, sep, minor_text = numbers.partition(":")
    if not sep:
        return None
    major_ok, major = _parse_number(major_text)
    minor_ok, minor = _parse_number(minor_text)
    if not (major_ok and minor_ok):
        return None
    return DeviceRule(type=kind, major=major, minor=minor, access=frozenset(access))


def parse_devices_list(text: str) -> DevicesList:
    """Parse the whole text of a cgroup v1 ``devices.list``.

    Returns every well-formed rule in file order and every other non-blank line (stripped) in
    ``skipped_lines``.  An empty text gives no rules and no skipped lines.  Never raises on content
    (spec §2: cAdvisor failed the whole container on one odd line; we skip and count it).
    """
    rules: list[DeviceRule] = []
    skipped: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        rule = parse_rule(line)
        if rule is None:
            skipped.append(line)
        else:
            rules.append(rule)
    return DevicesList(rules=tuple(rules), skipped_lines=tuple(skipped))


def _major_matches(rule_major: int | None, major: int) -> bool:
    return rule_major is None or rule_major == major


def gpu_grant(
    devices: DevicesList,
    gpu_minors: Collection[int],
    *,
    nvidia_major: int = NVIDIA_MAJOR,
    caps_major: int | None = None,
    known_caps_minors: Collection[int] = (),
) -> GpuGrant:
    """The GPUs (by NVML minor number) and MIG capabilities a container may use, from its rules.

    ``gpu_minors`` are the minors of the GPUs that exist on the host (``nvmlDeviceGetMinorNumber``);
    a granted minor outside it is not a GPU and is not reported.  ``caps_major`` is the
    ``nvidia-caps`` major from ``/proc/devices`` (``None``: no MIG capabilities are collected);
    ``known_caps_minors`` (the keys of :func:`parse_mig_minors`) is what a ``c <caps>:* r`` rule
    expands to.  Rows of docs/containers.md implemented here:

    * only rules with ``r`` or ``w`` count (``c 195:* m``, left by ``systemctl daemon-reload``,
      grants nothing);
    * any ``a`` rule, or ``c *:*``, is "unrestricted" (attribute by process evidence instead);
    * ``c 195:*`` grants every GPU in ``gpu_minors``; ``195:255``/``195:254`` are not GPUs;
    * ``b`` rules and other majors (``nvidia-uvm``) are ignored; duplicates count once;
    * caps minors need ``r`` (the driver checks read access on ``nvidia-cap<M>``).

    A ``c *:N`` rule matches minor N of both the GPU and the caps major, as the kernel would.
    Never raises.
    """
    gpus = frozenset(m for m in gpu_minors if m not in _NOT_GPU_MINORS)
    granted: set[int] = set()
    caps: set[int] = set()
    for rule in devices.rules:
        if not rule.access & _USABLE_ACCESS or rule.type == "b":
            continue
        if rule.type == "a" or (rule.major is None and rule.minor is None):
            return GpuGrant(minors=frozenset(), unrestricted=True, mig_caps_minors=frozenset())
        if _major_matches(rule.major, nvidia_major):
            if rule.minor is None:
                granted.update(gpus)
            elif rule.minor in gpus:
                granted.add(rule.minor)
        if caps_major is not None and "r" in rule.access and _major_matches(rule.major, caps_major):
            if rule.minor is None:
                caps.update(known_caps_minors)
            else:
                caps.add(rule.minor)
    return GpuGrant(minors=frozenset(granted), unrestricted=False, mig_caps_minors=frozenset(caps))


_MIG_ACCESS_RE = re.compile(r"gpu([0-9]{1,10})/gi([0-9]{1,10})(?:/ci([0-9]{1,10}))?/access")


def _mig_cap(name: str) -> MigCap | None:
    if name in ("config", "monitor"):
        return MigCap(gpu_minor=None, gi=None, ci=None, kind=name)
    match = _MIG_ACCESS_RE.fullmatch(name)
    if match is None:
        return None
    gpu, gi, ci = match.groups()
    return MigCap(gpu_minor=int(gpu), gi=int(gi), ci=None if ci is None else int(ci), kind="access")


def parse_mig_minors(text: str) -> tuple[dict[int, MigCap], tuple[str, ...]]:
    """Parse ``/proc/driver/nvidia-caps/mig-minors`` into ``({minor: MigCap}, skipped_lines)``.

    Lines are ``<capability> <minor>``: ``config 1``, ``monitor 2``, ``gpu0/gi11/access 102``,
    ``gpu0/gi11/ci0/access 103``.  Unknown or malformed lines, and a second line for a minor
    already seen, are returned stripped in ``skipped_lines`` (for the caller to count).  Never
    raises on content.
    """
    caps: dict[int, MigCap] = {}
    skipped: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        fields = line.split()
        cap = _mig_cap(fields[0]) if len(fields) == 2 else None
        minor_ok, minor = _parse_number(fields[1]) if cap is not None else (False, None)
        if cap is None or not minor_ok or minor is None or minor in caps:
            skipped.append(line)
            continue
        caps[minor] = cap
    return caps, tuple(skipped)


def mig_instances(grant: GpuGrant, caps: Mapping[int, MigCap]) -> frozenset[MigInstance]:
    """The MIG compute instances a grant lets the container use (spec §2, MIG row).

    Using MIG compute instance ``ci`` of GPU instance ``gi`` on GPU N needs ``/dev/nvidiaN`` plus
    read access to both ``gpuN/giG/access`` and ``gpuN/giG/ciC/access``; an instance is returned
    only when all three are granted.  ``caps`` comes from :func:`parse_mig_minors`.  An
    unrestricted grant gives none (attribute by process evidence).
    """
    if grant.unrestricted:
        return frozenset()
    readable = {caps[m] for m in grant.mig_caps_minors if m in caps}
    gi_access = {(c.gpu_minor, c.gi) for c in readable if c.kind == "access" and c.ci is None}
    found: set[MigInstance] = set()
    for cap in readable:
        if cap.kind != "access" or cap.gpu_minor is None or cap.gi is None or cap.ci is None:
            continue
        if cap.gpu_minor in grant.minors and (cap.gpu_minor, cap.gi) in gi_access:
            found.add(MigInstance(gpu_minor=cap.gpu_minor, gi=cap.gi, ci=cap.ci))
    return frozenset(found)
