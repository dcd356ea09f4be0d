"""``accelstats containers`` as a user runs it, on fake hosts: what it says without NVML, and what the POD
column shows when only the pod's UID is known (docs/containers.md, "`accelstats containers`")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "accelstats"]
C1, C2 = "1" * 64, "2" * 64
POD_UID = "0a1b2c3d-0000-4000-8000-000000000000"
GPU0 = "GPU-00000000-0000-4000-8000-000000000000"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, check=False)


def v1_host(root: Path, containers: dict[str, str]) -> list[str]:
    """A cgroup v1 devices hierarchy holding ``{cgroup path: devices.list}``, an empty /proc and
    rootfs; the source options that point at them."""
    devices = root / "cgroup" / "devices"
    devices.mkdir(parents=True)
    (devices / "devices.list").write_text("a *:* rwm\n")
    for path, rules in containers.items():
        d = devices / path.lstrip("/")
        d.mkdir(parents=True)
        (d / "devices.list").write_text(rules)
        (d / "cgroup.procs").write_text("")
    for d in ("proc", "rootfs"):
        (root / d).mkdir()
    return ["--cgroup-root", str(root / "cgroup"), "--proc-root", str(root / "proc"), "--rootfs", str(root / "rootfs")]


def test_without_nvml_the_command_says_so_once_and_what_it_still_lists(tmp_path: Path) -> None:
    """No NVIDIA GPU (no NVIDIA PCI device under --sysfs-root): a container granted GPU 0 cannot be
    tied to a GPU nobody knows; the one whose rules allow every device is still listed.  One line on
    stderr says both, in the table and with --json."""
    source = v1_host(tmp_path, {f"/docker/{C1}": "c 195:0 rw\nc 195:255 rw\n", f"/docker/{C2}": "a *:* rwm\n"})
    no_gpu = ["--sysfs-root", str(tmp_path / "sys"), *source]
    table = run("containers", *no_gpu)
    assert table.returncode == 0, table.stderr
    said = [line for line in table.stderr.splitlines() if line.startswith("# NVIDIA GPUs not available")]
    assert len(said) == 1, table.stderr
    assert "no NVIDIA PCI device" in said[0] and "no GPU can be attributed" in said[0]
    assert "allow every device or could not be read" in said[0]
    (row,) = table.stdout.splitlines()[1:]
    assert row.startswith("docker     222222222222") and "unrestricted devices cgroup" in row
    as_json = run("containers", "--json", *no_gpu)
    assert [r["id"] for r in json.loads(as_json.stdout)] == [C2]
    assert sum(line.startswith("# NVIDIA GPUs not available") for line in as_json.stderr.splitlines()) == 1


def test_with_nvml_there_is_no_such_line(tmp_path: Path, fixtures_dir: Path) -> None:
    source = v1_host(tmp_path, {f"/docker/{C1}": "c 195:0 rw\n"})
    proc = run("containers", "--nvml-replay", str(fixtures_dir / "h200" / "nvidia-smi-q.xml"), *source)
    assert proc.returncode == 0 and "GPUs not available" not in proc.stderr, proc.stderr
    assert f"docker     {C1[:12]}" in proc.stdout


@pytest.mark.parametrize(("path", "pod_column", "pod_uid"), [
    # Kubernetes, cgroupfs driver: the path names the pod by its UID; its name is in containerd's
    # state, which this host does not have: POD shows the UID, /metrics' pod label stays ""
    (f"/kubepods/burstable/pod{POD_UID}/{C1}", f"uid:{POD_UID}"[:20], POD_UID),
    # podman in a pod: the pod ID is in the path, the pod name only in libpod's database
    (f"/libpod_parent/{C2}/libpod-{C1}", f"id:{C2}"[:20], C2),
], ids=["kubernetes", "podman"])
def test_a_pod_known_by_its_uid_alone_shows_the_uid(tmp_path: Path, fixtures_dir: Path, path: str,
                                                     pod_column: str, pod_uid: str) -> None:
    source = v1_host(tmp_path, {path: "c 195:0 rw\n"})
    replay = ["--nvml-replay", str(fixtures_dir / "h200" / "nvidia-smi-q.xml")]
    table = run("containers", *replay, *source)
    assert table.returncode == 0, table.stderr
    header, row = table.stdout.splitlines()
    pod_at = header.index("POD")
    assert row[pod_at:pod_at + 20] == pod_column
    (found,) = json.loads(run("containers", "--json", *replay, *source).stdout)
    assert (found["pod"], found["pod_uid"]) == ("", pod_uid)  # JSON and /metrics: the name, or ""
