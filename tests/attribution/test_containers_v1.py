"""Real runc containers on this cgroup v1 (hybrid) host, attributed by their devices.list.

Four containers as docker makes them (spec/cgroups.md §3), against a two-GPU replay scenario with
minors 0 and 1: each must be reported with exactly the GPUs its ``devices.list`` grants, in
``accelstats containers --json`` and under the cAdvisor families of ``accelstats dump``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.runc_harness import (
    ContainerSpec,
    RuncContainer,
    RuncFactory,
    docker_cgroupfs_path,
    docker_id,
    docker_systemd_path,
)
from support.scenarios_util import two_gpu_scenario

pytestmark = pytest.mark.root

GPU0 = "GPU-00000000-1111-4000-8000-000000000000"
GPU1 = "GPU-00000001-1111-4000-8000-000000000001"
GIB = 1 << 30


def scenario(tmp_path: Path, fixtures_dir: Path, processes: dict[str, list[tuple[int, int]]]) -> Path:
    return two_gpu_scenario(tmp_path, fixtures_dir, (GPU0, GPU1), processes)


def accelstats(*args: str) -> str:
    """Run the installed CLI as a user would; fail the test with its stderr if it fails."""
    proc = subprocess.run([sys.executable, "-m", "accelstats", *args], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture
def four_containers(runc_container: RuncFactory) -> dict[str, RuncContainer]:
    return {
        "gpu0": runc_container(ContainerSpec("gpu0", docker_cgroupfs_path(), devices=[("c", 195, 0, "rw")])),
        "gpu1": runc_container(ContainerSpec("gpu1", docker_systemd_path(),
                                             devices=[("c", 195, 1, "rw"), ("c", 195, 255, "rw")])),
        "nogpu": runc_container(ContainerSpec("nogpu", docker_cgroupfs_path())),
        "privileged": runc_container(ContainerSpec("privileged", docker_systemd_path(), privileged=True)),
    }


EXPECTED = {  # container -> GPUs its devices.list grants
    "gpu0": [GPU0],
    "gpu1": [GPU1],
    "nogpu": [],
    "privileged": [],  # a *:* rwm: unrestricted, so attribution needs process evidence, not the file
}


def test_containers_json_reports_exactly_the_granted_gpus(
        four_containers: dict[str, RuncContainer], tmp_path: Path, fixtures_dir: Path) -> None:
    c = four_containers
    replay = scenario(tmp_path, fixtures_dir, {GPU0: [(c["gpu0"].pid, GIB)], GPU1: [(999_999_999, 5 * GIB)]})
    rows = {r["cgroup"]: r for r in json.loads(accelstats("containers", "--json", "--nvml-replay", str(replay)))}
    assert c["nogpu"].spec.cgroups_path not in rows  # granted no GPU, holds none: not a GPU container
    for name, ctr in c.items():
        if name == "nogpu":
            continue
        row = rows[ctr.spec.cgroups_path]
        assert row["runtime"] == "docker"
        assert row["id"] == ctr.spec.cgroups_path.rsplit("/", 1)[1].removeprefix("docker-").removesuffix(".scope")
        assert [d["uuid"] for d in row["devices"]] == EXPECTED[name], name
        assert all(d["attribution"] == "devices_cgroup" for d in row["devices"])
        for key in ("name", "image", "pod", "namespace", "pod_uid", "alloc_id", "task"):
            assert row[key] == ""
    # The container's own memory: its process's usedGpuMemory; the other GPU's process is no container's.
    assert c["gpu0"].pid and rows[c["gpu0"].spec.cgroups_path]["devices"][0]["memory_used_bytes"] == GIB
    assert rows[c["gpu1"].spec.cgroups_path]["devices"][0]["memory_used_bytes"] == 0
    assert rows[c["gpu1"].spec.cgroups_path]["devices"][0]["minor"] == 1
    assert "unrestricted" in rows[c["privileged"].spec.cgroups_path]["reason"]


def test_cadvisor_families_per_container(
        four_containers: dict[str, RuncContainer], tmp_path: Path, fixtures_dir: Path) -> None:
    replay = scenario(tmp_path, fixtures_dir, {})
    text = accelstats("dump", "--nvml-replay", str(replay))
    families = {f.name: f for f in text_string_to_metric_families(text)}
    ours = {ctr.spec.cgroups_path: name for name, ctr in four_containers.items()}
    for family in ("container_accelerator_memory_total_bytes", "container_accelerator_memory_used_bytes",
                   "container_accelerator_duty_cycle"):
        seen: dict[str, list[str]] = {}
        for s in families[family].samples:
            if s.labels["id"] in ours:
                seen.setdefault(ours[s.labels["id"]], []).append(s.labels["acc_id"])
                assert s.labels["make"] == "nvidia" and s.labels["model"] == "NVIDIA H200"
        assert seen == {k: v for k, v in EXPECTED.items() if v}, family
    total = [s for s in families["container_accelerator_memory_total_bytes"].samples if s.labels["id"] in ours]
    assert {s.value for s in total} == {143771 * 2**20}
    info = [s for s in families["accelstats_container_info"].samples if s.labels["id"] in ours]
    assert {(s.labels["runtime"], ours[s.labels["id"]]) for s in info} == {("docker", "gpu0"), ("docker", "gpu1")}


def test_devices_list_is_reread_each_collection(
        runc_container: RuncFactory, tmp_path: Path, fixtures_dir: Path) -> None:
    """cAdvisor read devices.list once; a `docker update`-style change must show on the next scrape."""
    ctr = runc_container(ContainerSpec("grow", docker_cgroupfs_path(), devices=[("c", 195, 0, "rw")]))
    replay = scenario(tmp_path, fixtures_dir, {})

    def gpus() -> list[str]:
        rows = json.loads(accelstats("containers", "--json", "--nvml-replay", str(replay)))
        return next([d["uuid"] for d in r["devices"]] for r in rows if r["cgroup"] == ctr.spec.cgroups_path)

    assert gpus() == [GPU0]
    (ctr.devices_cgroup_dir / "devices.allow").write_text("c 195:1 rw")
    assert gpus() == [GPU0, GPU1]
    (ctr.devices_cgroup_dir / "devices.deny").write_text("c 195:0 rwm")
    assert gpus() == [GPU1]


def test_one_manager_sees_a_new_container_a_changed_rule_and_a_removed_one_at_the_next_collection(
        runc_container: RuncFactory, tmp_path: Path, fixtures_dir: Path) -> None:
    """What a cache of the cgroup walk or of devices.list would have to preserve, in one process over
    consecutive collections on real cgroupfs (accelstats caches neither: docs/design.md)."""
    from accelstats.manager import AcceleratorManager
    from accelstats.settings import Settings
    from collectors.replay.lib import open_replay

    replay = scenario(tmp_path, fixtures_dir, {})
    settings = Settings(nvml_replay=replay, collectors=("nvidia",))
    with AcceleratorManager(settings, open_replay(replay)) as manager:
        def gpus(cgroup: str) -> list[str] | None:
            found = [c for c in manager.collect().containers if c.cgroup == cgroup]
            return [a.id for a in found[0].accelerators] if found else None

        manager.collect()
        first = runc_container(ContainerSpec("cache-a", docker_cgroupfs_path(), devices=[("c", 195, 0, "rw")]))
        assert gpus(first.spec.cgroups_path) == [GPU0]  # started after the previous collection
        (first.devices_cgroup_dir / "devices.allow").write_text("c 195:1 rw")
        assert gpus(first.spec.cgroups_path) == [GPU0, GPU1]  # a rule added
        (first.devices_cgroup_dir / "devices.deny").write_text("c 195:0 rwm")
        assert gpus(first.spec.cgroups_path) == [GPU1]  # a rule taken away
        first.cleanup()
        assert gpus(first.spec.cgroups_path) is None  # removed
        second = runc_container(ContainerSpec("cache-b", docker_cgroupfs_path(), devices=[("c", 195, 1, "rw")]))
        assert gpus(second.spec.cgroups_path) == [GPU1]  # a replacement, as many cgroups as before


def test_a_replaced_container_leaves_its_parent_cgroup_looking_the_same(runc_container: RuncFactory) -> None:
    """Why the cgroup walk is not cached by directory metadata: on cgroupfs (kernfs) a container removed
    and another made between two scrapes leaves the parent's link count as it was, and kernfs updates
    a directory's mtime for a child only once the directory has attributes of its own (a chown or
    chmod, as systemd's delegation does), so the mtime cannot be relied on either."""
    ctr = runc_container(ContainerSpec("mtime", docker_cgroupfs_path()))
    parent = ctr.devices_cgroup_dir.parent
    before = parent.stat()
    first = parent / f"accelstats-gone-{docker_id()[:12]}"
    first.mkdir()
    during = parent.stat()
    first.rmdir()
    second = parent / f"accelstats-new-{docker_id()[:12]}"
    second.mkdir()
    try:
        after = parent.stat()
    finally:
        second.rmdir()
    assert during.st_nlink == before.st_nlink + 1
    assert after.st_nlink == during.st_nlink  # another container, the same count
