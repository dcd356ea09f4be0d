"""Which cgroup mode the host is in: v1, hybrid, v2 or none (docs/containers.md).

The answer comes from ``/proc/self/mountinfo`` (``man 5 proc``, "mountinfo"): cgroup v1
hierarchies are ``cgroup`` mounts whose super options name their controllers (``rw,devices``),
the unified hierarchy is a ``cgroup2`` mount.  Roots are parameters because the exporter often runs
in a container with the host's tree at ``/host/sys/fs/cgroup`` and ``/host/proc``: mount points
under the configured root are used as they are; mount points under the default ``/sys/fs/cgroup``
are mapped onto the configured root and used only if the mapped files exist.  When mountinfo is
unreadable or says nothing usable about the root (fixture trees in tests), the files are probed.
Only reads; never creates a directory.
"""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from collectors.fsread import read_small

DEFAULT_CGROUP_ROOT = Path("/sys/fs/cgroup")
DEFAULT_PROC_ROOT = Path("/proc")
_MOUNTINFO_ESCAPE_RE = re.compile(r"\\([0-7]{3})")
_MAX_MOUNTINFO_BYTES = 16 << 20


class CgroupMode(enum.Enum):
    """The host's cgroup mode (spec §1).

    ``V1``: v1 hierarchies only, per-cgroup ``devices.list``.  ``HYBRID``: v1 controllers including
    ``devices`` plus a ``cgroup2`` mount (``/sys/fs/cgroup/unified``); read ``devices.list``.
    ``V2``: unified only; device access is a BPF program, no readable rules.  ``NONE``: no cgroup
    filesystem found under the root.
    """

    V1 = "v1"
    HYBRID = "hybrid"
    V2 = "v2"
    NONE = "none"


@dataclass(frozen=True)
class CgroupLayout:
    """Where the hierarchies that matter are, as paths under the configured cgroup root.

    ``devices_root``: the v1 ``devices`` hierarchy's directory (``/sys/fs/cgroup/devices``), ``None``
    when there is none.  ``unified_root``: the ``cgroup2`` mount (``/sys/fs/cgroup`` on v2,
    ``/sys/fs/cgroup/unified`` on hybrid), ``None`` when there is none.
    """

    mode: CgroupMode
    devices_root: Path | None
    unified_root: Path | None


@dataclass(frozen=True)
class Mount:
    """One ``mountinfo`` line: ids, the mounted ``root`` within the filesystem, the mount point,
    per-mount options, filesystem type, source and super-block options (octal escapes decoded)."""

    mount_id: int
    parent_id: int
    root: str
    mount_point: str
    mount_options: tuple[str, ...]
    fstype: str
    source: str
    super_options: tuple[str, ...]


def _unescape(field: str) -> str:
    """Decode the kernel's ``\\NNN`` octal escapes (space, tab, newline, backslash)."""
    return _MOUNTINFO_ESCAPE_RE.sub(lambda m: chr(int(m.group(1), 8)), field)


def _mount_id(field: str) -> bool:
    """A mount ID: ASCII decimal, at most 10 digits (``str.isdigit`` accepts ``²``, and ``int()``
    refuses 4301+ digits: both found by fuzzing, tests/fuzz/test_fuzz_cgroupns.py)."""
    return field.isascii() and field.isdigit() and len(field) <= 10


def parse_mountinfo(text: str) -> list[Mount]:
    """Parse ``/proc/<pid>/mountinfo`` text into mounts, in file order.

    Line shape: ``id parent maj:min root mount_point options [optional…] - fstype source super``.
    Malformed lines are ignored (this file is written by the kernel).  Never raises.
    """
    mounts: list[Mount] = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        head, tail = fields[:sep], fields[sep + 1 :]
        if len(head) < 6 or len(tail) < 2 or not (_mount_id(head[0]) and _mount_id(head[1])):
            continue
        mounts.append(
            Mount(
                mount_id=int(head[0]),
                parent_id=int(head[1]),
                root=_unescape(head[3]),
                mount_point=_unescape(head[4]),
                mount_options=tuple(head[5].split(",")),
                fstype=tail[0],
                source=_unescape(tail[1]),
                super_options=tuple(tail[2].split(",")) if len(tail) > 2 else (),
            )
        )
    return mounts


def _relative_to(path: PurePosixPath, root: PurePosixPath) -> PurePosixPath | None:
    try:
        return path.relative_to(root)
    except ValueError:
        return None


def _layout_from_mounts(mounts: list[Mount], cgroup_root: Path) -> CgroupLayout | None:
    """Layout from the cgroup mounts under ``cgroup_root`` (else under the default root, mapped)."""
    root = PurePosixPath(cgroup_root)
    direct: list[tuple[Mount, Path]] = []
    mapped: list[tuple[Mount, Path]] = []
    for mount in mounts:
        if mount.fstype not in ("cgroup", "cgroup2"):
            continue
        point = PurePosixPath(mount.mount_point)
        rel = _relative_to(point, root)
        if rel is not None:
            direct.append((mount, Path(point)))
            continue
        rel = _relative_to(point, PurePosixPath(DEFAULT_CGROUP_ROOT))
        if rel is not None:
            mapped.append((mount, cgroup_root / rel))
    for candidates, verify in ((direct, False), (mapped, True)):
        devices_root: Path | None = None
        unified_root: Path | None = None
        other_v1 = False
        for mount, local in candidates:
            if mount.fstype == "cgroup2":
                if unified_root is None and (not verify or (local / "cgroup.controllers").is_file()):
                    unified_root = local
            elif "devices" in mount.super_options:
                if devices_root is None and (not verify or (local / "devices.list").is_file()):
                    devices_root = local
            elif not verify or local.is_dir():
                other_v1 = True
        if devices_root is not None:
            mode = CgroupMode.HYBRID if unified_root is not None else CgroupMode.V1
            return CgroupLayout(mode, devices_root, unified_root)
        if unified_root is not None:
            return CgroupLayout(CgroupMode.V2, None, unified_root)
        if other_v1:
            return CgroupLayout(CgroupMode.V1, None, None)
    return None


def _probe(cgroup_root: Path) -> CgroupLayout:
    """Layout from the files alone (spec §1 "how to tell"), for when mountinfo does not help."""
    if (cgroup_root / "devices" / "devices.list").is_file():
        unified = cgroup_root / "unified"
        if (unified / "cgroup.controllers").is_file():
            return CgroupLayout(CgroupMode.HYBRID, cgroup_root / "devices", unified)
        return CgroupLayout(CgroupMode.V1, cgroup_root / "devices", None)
    if (cgroup_root / "cgroup.controllers").is_file():
        return CgroupLayout(CgroupMode.V2, None, cgroup_root)
    return CgroupLayout(CgroupMode.NONE, None, None)


def _read_mountinfo(proc_root: Path) -> str | None:
    """``<proc_root>/self/mountinfo`` when it is a regular file (procfs's is): read non-blocking and
    bounded, so a FIFO or a device planted in a mounted tree cannot hang start-up."""
    data = read_small(proc_root / "self" / "mountinfo", _MAX_MOUNTINFO_BYTES)
    return None if data is None else data.decode("utf-8", errors="replace")


def detect_layout(cgroup_root: Path = DEFAULT_CGROUP_ROOT, proc_root: Path = DEFAULT_PROC_ROOT) -> CgroupLayout:
    """Detect the cgroup mode and where the devices and unified hierarchies are.

    Reads ``<proc_root>/self/mountinfo``; falls back to probing ``<cgroup_root>/devices/devices.list``
    (v1, hybrid if ``<cgroup_root>/unified/cgroup.controllers`` exists too) and
    ``<cgroup_root>/cgroup.controllers`` (v2).  A v1 host whose ``devices`` controller is not mounted
    gives ``V1`` with ``devices_root=None``.  Never raises on a missing or unreadable file; never
    creates anything.
    """
    cgroup_root = Path(os.path.abspath(cgroup_root))
    text = _read_mountinfo(proc_root)
    if text is not None:
        layout = _layout_from_mounts(parse_mountinfo(text), cgroup_root)
        if layout is not None:
            return layout
    return _probe(cgroup_root)
