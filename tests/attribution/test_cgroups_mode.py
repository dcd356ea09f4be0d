"""Cgroup mode detection (spec/cgroups.md §1): mountinfo parsing, fixture trees, the real host."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from accelstats.cgroups.mode import CgroupLayout, CgroupMode, Mount, detect_layout, parse_mountinfo

# /proc/self/mountinfo of the hybrid development host (trimmed).
HYBRID_MOUNTINFO = """\
22 1 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
36 31 0:33 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V2_MOUNTINFO = "29 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw\n"


def _proc(tmp_path: Path, mountinfo: str | None) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    if mountinfo is not None:
        (proc / "self" / "mountinfo").write_text(mountinfo)
    return proc


def _tree(root: Path, *files: str) -> Path:
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")
    return root


def _snapshot(root: Path) -> list[Path]:
    return sorted(root.rglob("*"))


# ---- mountinfo -----------------------------------------------------------------------------------


def test_parse_mountinfo_fields() -> None:
    mounts = parse_mountinfo(HYBRID_MOUNTINFO)
    assert len(mounts) == 6
    assert mounts[0] == Mount(
        mount_id=22,
        parent_id=1,
        root="/",
        mount_point="/proc",
        mount_options=("rw", "nosuid", "nodev", "noexec", "relatime"),
        fstype="proc",
        source="proc",
        super_options=("rw",),
    )
    devices = mounts[3]
    assert (devices.fstype, devices.mount_point, devices.super_options) == (
        "cgroup",
        "/sys/fs/cgroup/devices",
        ("rw", "devices"),
    )
    assert mounts[5].fstype == "cgroup2"


def test_parse_mountinfo_escapes_and_optional_fields() -> None:
    line = (
        r"50 31 0:40 /docker/abc /host/sys\040fs/cgroup/devices rw shared:3 master:1"
        " - cgroup cgroup rw,devices"
    )
    (mount,) = parse_mountinfo(line + "\nnot a mountinfo line\n\n1 2 3 - x\n")
    assert mount.root == "/docker/abc"
    assert mount.mount_point == "/host/sys fs/cgroup/devices"
    assert mount.super_options == ("rw", "devices")


@given(st.text())
def test_parse_mountinfo_never_raises(text: str) -> None:
    parse_mountinfo(text)


# ---- fixture trees (mountinfo unreadable: probe the files) -----------------------------------------


@pytest.mark.parametrize(
    ("files", "expected_mode", "devices", "unified"),
    [
        (["devices/devices.list", "cpu/cpu.shares"], CgroupMode.V1, "devices", None),
        (["devices/devices.list", "unified/cgroup.controllers"], CgroupMode.HYBRID, "devices", "unified"),
        (["cgroup.controllers", "system.slice/cgroup.procs"], CgroupMode.V2, None, "."),
        ([], CgroupMode.NONE, None, None),
    ],
    ids=["v1", "hybrid", "v2", "none"],
)
def test_probe_fixture_tree(
    tmp_path: Path, files: list[str], expected_mode: CgroupMode, devices: str | None, unified: str | None
) -> None:
    root = _tree(tmp_path / "cg", *files)
    root.mkdir(exist_ok=True)
    proc = _proc(tmp_path, None)
    before = _snapshot(tmp_path)
    layout = detect_layout(root, proc)
    assert layout == CgroupLayout(
        expected_mode,
        None if devices is None else root / devices,
        None if unified is None else (root / unified if unified != "." else root),
    )
    assert _snapshot(tmp_path) == before


def test_missing_root_is_none_and_not_created(tmp_path: Path) -> None:
    root = tmp_path / "absent"
    assert detect_layout(root, tmp_path / "no-proc") == CgroupLayout(CgroupMode.NONE, None, None)
    assert not root.exists()


def test_real_mountinfo_does_not_override_fixture_tree(tmp_path: Path) -> None:
    """The host's mounts mapped onto a fixture root do not exist there: the fixture's files decide."""
    root = _tree(tmp_path, "cgroup.controllers")
    assert detect_layout(root) == CgroupLayout(CgroupMode.V2, None, root)


# ---- mountinfo decides ---------------------------------------------------------------------------


def test_host_tree_mounted_elsewhere_is_mapped(tmp_path: Path) -> None:
    """Exporter in a container: mountinfo names /sys/fs/cgroup/…; the host tree is at /host/…."""
    root = _tree(tmp_path / "host/sys/fs/cgroup", "devices/devices.list", "unified/cgroup.controllers")
    layout = detect_layout(root, _proc(tmp_path, HYBRID_MOUNTINFO))
    assert layout == CgroupLayout(CgroupMode.HYBRID, root / "devices", root / "unified")


def test_mounts_under_the_configured_root_are_trusted(tmp_path: Path) -> None:
    root = tmp_path / "host/sys/fs/cgroup"
    mountinfo = HYBRID_MOUNTINFO.replace("/sys/fs/cgroup", str(root))
    assert detect_layout(root, _proc(tmp_path, mountinfo)) == CgroupLayout(
        CgroupMode.HYBRID, root / "devices", root / "unified"
    )
    assert not root.exists()


def test_v2_from_mountinfo(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    mountinfo = V2_MOUNTINFO.replace("/sys/fs/cgroup", str(root))
    assert detect_layout(root, _proc(tmp_path, mountinfo)) == CgroupLayout(CgroupMode.V2, None, root)


def test_v1_without_devices_controller(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    mountinfo = f"32 31 0:29 / {root}/cpu rw - cgroup cgroup rw,cpu\n"
    assert detect_layout(root, _proc(tmp_path, mountinfo)) == CgroupLayout(CgroupMode.V1, None, None)


def test_v1_only_from_mountinfo(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    mountinfo = "\n".join(line for line in HYBRID_MOUNTINFO.splitlines() if "cgroup2" not in line)
    mountinfo = mountinfo.replace("/sys/fs/cgroup", str(root))
    assert detect_layout(root, _proc(tmp_path, mountinfo)) == CgroupLayout(CgroupMode.V1, root / "devices", None)


def test_cgroup_mounts_elsewhere_are_ignored(tmp_path: Path) -> None:
    root = _tree(tmp_path / "cg", "cgroup.controllers")
    mountinfo = "60 1 0:50 / /run/other/devices rw - cgroup cgroup rw,devices\n"
    assert detect_layout(root, _proc(tmp_path, mountinfo)) == CgroupLayout(CgroupMode.V2, None, root)


# ---- the real host -------------------------------------------------------------------------------


def test_real_host_is_hybrid() -> None:
    """spec §1: the development and CI machines are hybrid (v1 controllers + cgroup2 at unified)."""
    assert detect_layout() == CgroupLayout(
        CgroupMode.HYBRID, Path("/sys/fs/cgroup/devices"), Path("/sys/fs/cgroup/unified")
    )


def test_real_host_probe_agrees_with_mountinfo(tmp_path: Path) -> None:
    real = Path("/sys/fs/cgroup")
    assert detect_layout(real, tmp_path / "no-proc") == detect_layout(real)
