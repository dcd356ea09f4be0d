"""Container cgroup discovery over synthetic hierarchies built in tmp_path."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from accelstats.cgroups import discovery
from accelstats.cgroups.devices_list import DeviceRule
from accelstats.cgroups.discovery import (
    ContainerCgroup,
    Discovery,
    WalkStats,
    discover_v1_containers,
    discover_v2_containers,
    read_devices_list,
)
from accelstats.cgroups.identity import ContainerIdentity

ID1 = "1" * 64
ID2 = "2" * 64
ID3 = "3" * 64
ID4 = "4" * 64
POD = "6f1a9d52-0b3c-4e8d-9a7f-2c1b0e4d5f60"
GPU_RULES = "c 195:0 rw\nc 195:255 rw\n"

# cgroup path -> devices.list content (None: directory without the file)
TREE: dict[str, str | None] = {
    "": "a *:* rwm\n",
    f"docker/{ID1}": GPU_RULES,
    f"docker/{ID1}/child": GPU_RULES,  # belongs to the container: not a container of its own
    f"system.slice/docker-{ID2}.scope": "c 195:* m\n",
    f"system.slice/var-lib-docker-overlay2-{ID1}-merged.mount": None,  # the .mount trap
    "system.slice/nginx.service": "a *:* rwm\n",
    f"kubepods/burstable/pod{POD}/{ID3}": GPU_RULES,
    f"machine.slice/libpod-{ID4}.scope/container": GPU_RULES,
    "user.slice/user-1000.slice/session-3.scope": None,
}

EXPECTED = [
    (f"/docker/{ID1}", ContainerIdentity("docker", ID1)),
    (f"/kubepods/burstable/pod{POD}/{ID3}", ContainerIdentity("containerd", ID3, pod_uid=POD)),
    (f"/machine.slice/libpod-{ID4}.scope/container", ContainerIdentity("podman", ID4)),
    (f"/system.slice/docker-{ID2}.scope", ContainerIdentity("docker", ID2)),
]


def build(root: Path, tree: dict[str, str | None]) -> Path:
    for rel, rules in tree.items():
        directory = root / rel
        directory.mkdir(parents=True, exist_ok=True)
        if rules is not None:
            (directory / "devices.list").write_text(rules)
    return root


@pytest.fixture
def devices_root(tmp_path: Path) -> Path:
    return build(tmp_path / "devices", TREE)


def paths(found: Discovery) -> list[tuple[str, ContainerIdentity | None]]:
    return [(c.path, c.identity) for c in found.containers]


def test_finds_every_container_and_nothing_else(devices_root: Path) -> None:
    found = discover_v1_containers(devices_root)
    assert paths(found) == EXPECTED
    assert found.stats == WalkStats()
    for container in found.containers:
        assert container.directory == devices_root / container.path.lstrip("/")


def test_mount_unit_is_not_a_container(devices_root: Path) -> None:
    found = discover_v1_containers(devices_root)
    assert not any(c.path.endswith(".mount") for c in found.containers)


def test_podman_without_container_child(tmp_path: Path) -> None:
    root = build(tmp_path, {f"machine.slice/libpod-{ID4}.scope": GPU_RULES})
    assert paths(discover_v1_containers(root)) == [
        (f"/machine.slice/libpod-{ID4}.scope", ContainerIdentity("podman", ID4))
    ]


def test_symlinks_are_not_followed(tmp_path: Path) -> None:
    root = build(tmp_path / "devices", {f"docker/{ID1}": GPU_RULES, "other": None})
    outside = build(tmp_path / "outside", {f"docker/{ID2}": GPU_RULES})
    (root / "other" / "link").symlink_to(outside, target_is_directory=True)
    assert [c.path for c in discover_v1_containers(root).containers] == [f"/docker/{ID1}"]


def test_never_creates_anything(devices_root: Path) -> None:
    before = sorted(devices_root.rglob("*"))
    discover_v1_containers(devices_root)
    discover_v2_containers(devices_root)
    assert sorted(devices_root.rglob("*")) == before


def _patched_scandir(monkeypatch: pytest.MonkeyPatch, target: Path, action: Callable[[Path], None]) -> None:
    real = os.scandir

    def fake(path: Any) -> Iterator[os.DirEntry[str]]:
        if isinstance(path, (str, os.PathLike)) and Path(path) == target:
            action(target)
        return real(path)

    monkeypatch.setattr(os, "scandir", fake)  # discovery calls os.scandir at run time


def test_directory_removed_mid_walk_is_skipped_and_counted(devices_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _patched_scandir(monkeypatch, devices_root / "kubepods" / "burstable", shutil.rmtree)
    found = discover_v1_containers(devices_root)
    assert paths(found) == [e for e in EXPECTED if "kubepods" not in e[0]]
    assert found.stats == WalkStats(skipped_vanished=1)


def test_unreadable_directory_is_skipped_and_counted(devices_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def deny(path: Path) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    _patched_scandir(monkeypatch, devices_root / "system.slice", deny)
    found = discover_v1_containers(devices_root)
    assert paths(found) == [e for e in EXPECTED if "system.slice" not in e[0]]
    assert found.stats == WalkStats(skipped_unreadable=1)


def test_container_removed_after_listing(devices_root: Path) -> None:
    """The walk reports what it saw; reading the rules of a container that exited gives None."""
    found = discover_v1_containers(devices_root)
    shutil.rmtree(found.containers[0].directory)
    assert read_devices_list(found.containers[0].directory) is None


def test_missing_root(tmp_path: Path) -> None:
    found = discover_v1_containers(tmp_path / "absent")
    assert found == Discovery(containers=(), stats=WalkStats(skipped_vanished=1))
    assert not (tmp_path / "absent").exists()


def test_depth_is_bounded(tmp_path: Path) -> None:
    root = build(tmp_path, {"a/b/c/d/" + f"docker/{ID1}": None, f"docker/{ID2}": None})
    found = discover_v1_containers(root, max_depth=3)
    assert [c.path for c in found.containers] == [f"/docker/{ID2}"]
    assert found.stats.skipped_too_deep == 1
    assert [c.path for c in discover_v1_containers(root).containers] == [
        f"/a/b/c/d/docker/{ID1}",
        f"/docker/{ID2}",
    ]


def test_v2_tree(tmp_path: Path) -> None:
    alloc = "8d0e3b5c-1f2a-4b6c-9d8e-7f6a5b4c3d2e"
    root = build(
        tmp_path,
        {
            "": None,
            f"system.slice/docker-{ID1}.scope": None,
            f"nomad.slice/share.slice/{alloc}.web.scope": None,
            "init.scope": None,
            "user.slice/user-0.slice/session-1.scope": None,
        },
    )
    (root / "cgroup.controllers").write_text("cpu memory\n")
    found = discover_v2_containers(root)
    assert found.containers == (
        ContainerCgroup(
            f"/nomad.slice/share.slice/{alloc}.web.scope",
            root / f"nomad.slice/share.slice/{alloc}.web.scope",
            ContainerIdentity("nomad", f"{alloc}.web", alloc_id=alloc, task="web"),
        ),
        ContainerCgroup(
            f"/system.slice/docker-{ID1}.scope",
            root / f"system.slice/docker-{ID1}.scope",
            ContainerIdentity("docker", ID1),
        ),
    )


def test_read_devices_list(devices_root: Path) -> None:
    parsed = read_devices_list(devices_root / "docker" / ID1)
    assert parsed is not None
    assert parsed.rules == (
        DeviceRule("c", 195, 0, frozenset("rw")),
        DeviceRule("c", 195, 255, frozenset("rw")),
    )
    assert read_devices_list(devices_root / "user.slice") is None


def test_read_devices_list_bad_bytes_are_a_skipped_line(tmp_path: Path) -> None:
    (tmp_path / "devices.list").write_bytes(b"c 195:0 rw\nc \xff\xfe:0 rw\n")
    parsed = read_devices_list(tmp_path)
    assert parsed is not None
    assert len(parsed.rules) == 1
    assert len(parsed.skipped_lines) == 1


def test_real_host_devices_hierarchy() -> None:
    """Walks the host's v1 devices hierarchy without raising and reads its root rules."""
    root = Path("/sys/fs/cgroup/devices")
    found = discover_v1_containers(root)
    assert all(c.identity is not None and c.directory.is_relative_to(root) for c in found.containers)
    assert read_devices_list(root) is not None


def test_a_users_delegated_subtree_is_not_walked(tmp_path: Path) -> None:
    """Under ``user@<uid>.service`` nothing is walked: not a look-alike container, not a leaf. The same
    subtree elsewhere is walked (so the test would see the look-alike if the rule were gone)."""
    lookalike = f"app.slice/docker-{ID1}.scope"
    leaves = {f"app.slice/job-{i}.scope": None for i in range(50)}
    delegated = {f"user.slice/user-1000.slice/user@1000.service/{k}": None for k in (lookalike, *leaves)}
    elsewhere = {f"other.slice/{k}": None for k in (lookalike, *leaves)}
    root = build(tmp_path, {"": None, **delegated, **elsewhere})
    (root / "cgroup.controllers").write_text("cpu memory\n")
    found = discover_v2_containers(root)
    assert [c.path for c in found.containers] == [f"/other.slice/{lookalike}"]
    assert all("user@" not in c.path for c in found.unrecognised)
    assert len(found.unrecognised) == 50


def test_unrecognised_leaves_are_bounded_and_the_rest_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(discovery, "MAX_UNRECOGNISED", 10)
    root = build(tmp_path, {"": None, f"system.slice/docker-{ID1}.scope": None,
                            **{f"chowned.slice/job-{i:02}": None for i in range(25)}})
    (root / "cgroup.controllers").write_text("cpu memory\n")
    found = discover_v2_containers(root)
    assert [c.path for c in found.containers] == [f"/system.slice/docker-{ID1}.scope"]  # still found
    assert len(found.unrecognised) == 10 and found.stats.skipped_unrecognised == 15


def test_devices_list_is_read_to_64_kib_at_most(tmp_path: Path) -> None:
    (tmp_path / "devices.list").write_text("c 195:0 rw\n" * 30000)  # 330 000 bytes
    text = discovery.read_devices_list_text(tmp_path)
    assert text is not None and len(text) == 64 << 10
