"""The runc harness starts containers whose cgroups look like docker's, and always cleans up."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import pytest
from support.runc_harness import (
    ContainerSpec,
    HarnessError,
    RuncContainer,
    RuncFactory,
    _elf_is_static,
    cgroup_mounts,
    docker_cgroupfs_path,
    docker_systemd_path,
    pid_alive,
    read_proc_cgroup,
    runc_available,
    runc_list,
)


def _lines(text: str) -> set[str]:
    return {line.strip() for line in text.splitlines() if line.strip()}


def _major_195(lines: set[str]) -> set[str]:
    return {line for line in lines if line.split()[1].startswith("195:")}


def _devices_line(pid: int) -> str:
    return next(path for ctrls, path in read_proc_cgroup(pid).items() if "devices" in ctrls.split(","))


@pytest.mark.root
def test_runc_available_here() -> None:
    assert runc_available() is None


@pytest.mark.root
def test_acceptance_containers(runc_container: RuncFactory, runc_state_root: Path) -> None:
    specs = {
        "gpu0": ContainerSpec("gpu0", docker_cgroupfs_path(), devices=[("c", 195, 0, "rw")]),
        "gpu1ctl": ContainerSpec(
            "gpu1ctl", docker_systemd_path(), devices=[("c", 195, 1, "rw"), ("c", 195, 255, "rw")]
        ),
        "nogpu": ContainerSpec("nogpu", docker_cgroupfs_path()),
        "priv": ContainerSpec("priv", docker_systemd_path(), privileged=True),
    }
    t0 = time.monotonic()
    ctrs = {key: runc_container(spec) for key, spec in specs.items()}
    elapsed = time.monotonic() - t0
    print(f"started {len(ctrs)} containers in {elapsed:.3f}s")

    expected_195 = {
        "gpu0": {"c 195:0 rw"},
        "gpu1ctl": {"c 195:1 rw", "c 195:255 rw"},
        "nogpu": set(),
    }
    for key, ctr in ctrs.items():
        lines = _lines((ctr.devices_cgroup_dir / "devices.list").read_text())
        if key == "priv":
            assert lines == {"a *:* rwm"}, key
        else:
            assert _major_195(lines) == expected_195[key], (key, lines)
            assert not any(line.startswith("a ") for line in lines), (key, lines)
            # runc's own defaults are there, as under docker
            assert "c 1:3 rwm" in lines, (key, lines)

        assert pid_alive(ctr.pid, ctr.start_time)
        cg = read_proc_cgroup(ctr.pid)
        assert _devices_line(ctr.pid) == ctr.cgroups_path, (key, cg)
        assert cg.get("") == ctr.cgroups_path, (key, cg)
        assert ctr.unified_cgroup_dir is not None
        procs = (ctr.unified_cgroup_dir / "cgroup.procs").read_text().split()
        assert str(ctr.pid) in procs, key

    assert {c["id"] for c in runc_list(runc_state_root)} == {c.name for c in ctrs.values()}
    out = ctrs["nogpu"].exec_in(["cat", "/proc/1/cgroup"]).stdout
    assert f":devices:{ctrs['nogpu'].cgroups_path}" in out


def _assert_gone(ctr: RuncContainer, state_root: Path, pid: int, dirs: list[Path]) -> None:
    assert ctr.name not in {c["id"] for c in runc_list(state_root)}
    assert not pid_alive(pid, ctr.start_time)
    for d in dirs:
        assert not d.exists(), d
    assert not ctr.bundle_dir.exists()


@pytest.mark.root
def test_cleanup_after_normal_exit(runc_state_root: Path) -> None:
    ctr = RuncContainer(ContainerSpec("ok", docker_cgroupfs_path()), runc_state_root)
    with ctr:
        pid, dirs = ctr.pid, ctr.cgroup_dirs
        assert all(d.is_dir() for d in dirs)
    _assert_gone(ctr, runc_state_root, pid, dirs)


@pytest.mark.root
def test_cleanup_when_body_raises(runc_state_root: Path) -> None:
    ctr = RuncContainer(ContainerSpec("boom", docker_systemd_path()), runc_state_root)
    with pytest.raises(ZeroDivisionError), ctr:
        pid, dirs = ctr.pid, ctr.cgroup_dirs
        _ = 1 / 0
    _assert_gone(ctr, runc_state_root, pid, dirs)


@pytest.mark.root
def test_cleanup_removes_parents_it_created_only(runc_state_root: Path) -> None:
    token = secrets.token_hex(6)
    new_parent = f"/accelstats-test-{token}.slice"
    old_parent = f"/accelstats-test-{token}-existing"
    mounts = cgroup_mounts()
    existing = [m.dir_for(old_parent) for m in mounts]
    for d in existing:
        d.mkdir()
    try:
        fresh = RuncContainer(ContainerSpec("fresh", f"{new_parent}/docker-{token}.scope"), runc_state_root)
        under_existing = RuncContainer(ContainerSpec("under", f"{old_parent}/{token}"), runc_state_root)
        with fresh, under_existing:
            assert all(d.is_dir() for d in fresh.cgroup_dirs + under_existing.cgroup_dirs)
            assert len(fresh.created_cgroup_dirs) == 2 * len(mounts)
            assert len(under_existing.created_cgroup_dirs) == len(mounts)
        for m in mounts:
            assert not m.dir_for(new_parent).exists()
            assert not m.dir_for(f"{old_parent}/{token}").exists()
        assert all(d.is_dir() for d in existing)
    finally:
        for d in existing:
            d.rmdir()


@pytest.mark.root
def test_failed_start_cleans_up(runc_state_root: Path) -> None:
    path = f"/accelstats-test-{secrets.token_hex(6)}/x"
    ctr = RuncContainer(ContainerSpec("bad", path, args=["/no/such/binary"]), runc_state_root)
    with pytest.raises(HarnessError, match="runc run"), ctr:
        pass
    assert runc_list(runc_state_root) == []
    for m in cgroup_mounts():
        assert not m.dir_for(path).parent.exists()


@pytest.mark.root
def test_harness_moves_pid_into_unified_if_runc_did_not(runc_container: RuncFactory) -> None:
    ctr = runc_container(ContainerSpec("move", docker_cgroupfs_path()))
    assert not ctr.unified_moved_by_harness  # runc 1.1 joins the unified hierarchy itself
    assert ctr.unified_cgroup_dir is not None, "no cgroup2 hierarchy mounted (this project's hosts have one)"
    root = next(m for m in cgroup_mounts() if m.version == 2).mountpoint
    (root / "cgroup.procs").write_text(f"{ctr.pid}\n")  # as if runc had left it in the root
    assert read_proc_cgroup(ctr.pid)[""] == "/"
    ctr._join_unified()
    assert ctr.unified_moved_by_harness
    assert read_proc_cgroup(ctr.pid)[""] == ctr.cgroups_path


def test_privileged_takes_no_device_rules() -> None:
    spec = ContainerSpec("x", docker_cgroupfs_path(), devices=[("c", 195, 0, "rw")], privileged=True)
    with pytest.raises(ValueError, match="privileged"):
        spec.device_cgroup_rules()


def test_static_elf_check() -> None:
    assert not _elf_is_static(Path("/bin/sh"))  # dash: dynamic, has PT_INTERP
    assert not _elf_is_static(Path(__file__))  # not ELF at all
    busybox = Path("/bin/busybox")
    if busybox.exists():
        assert _elf_is_static(busybox) == (b"ld-linux" not in busybox.read_bytes()[:4096])
