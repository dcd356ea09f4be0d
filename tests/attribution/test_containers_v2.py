"""Real runc containers on cgroup v2: the devices cgroup is the BPF program runc attached.

runc runs in unified mode (a private mount namespace with cgroup2 at ``/sys/fs/cgroup``, see
``runc_harness``), so each container's cgroup exists only in the cgroup2 hierarchy, as on a v2 host,
with a real ``BPF_CGROUP_DEVICE`` program built by runc from the OCI device rules.  The exporter reads
that hierarchy (``--cgroup-root /sys/fs/cgroup/unified``: a cgroup2 mount and nothing else, so the
layout is v2) and must attribute the GPUs each program grants as ``devices_cgroup`` — with no
process on them too: the GPU allocated and idle.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import in_ci
from prometheus_client.parser import text_string_to_metric_families
from support import bpf_util
from support.bpf_util import unified_root
from support.runc_harness import ContainerSpec, RuncContainer, RuncFactory, docker_cgroupfs_path
from support.scenarios_util import two_gpu_scenario

from accelstats.manager import AcceleratorManager
from accelstats.settings import Settings
from collectors.replay.lib import open_replay

pytestmark = pytest.mark.root

GPU0 = "GPU-00000000-2222-4000-8000-000000000000"
GPU1 = "GPU-00000001-2222-4000-8000-000000000001"
GIB = 1 << 30
DROP = "-sys_admin,-net_admin,-bpf,-perfmon"


def cli(*args: str, drop_caps: bool = False) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "accelstats", *args]
    if drop_caps:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.fail("setpriv (util-linux) missing") if in_ci() else pytest.skip("setpriv missing")
        cmd = [setpriv, f"--bounding-set={DROP}", f"--inh-caps={DROP}", "--", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture
def v2_root() -> Path:
    root = unified_root()
    if root is None:
        pytest.fail("no cgroup2 mount") if in_ci() else pytest.skip("no cgroup2 mount")
    assert root is not None
    return root


@pytest.fixture
def containers(runc_container: RuncFactory, v2_root: Path) -> dict[str, RuncContainer]:
    def start(name: str, **kw: object) -> RuncContainer:
        return runc_container(ContainerSpec(name, docker_cgroupfs_path(), unified=True, **kw))  # type: ignore[arg-type]

    return {
        "gpu1_idle": start("gpu1_idle", devices=[("c", 195, 1, "rw"), ("c", 195, 255, "rw")]),
        "both_busy": start("both_busy", devices=[("c", 195, 0, "rw"), ("c", 195, 1, "rw")]),
        "denied": start("denied"),
        "unrestricted": start("unrestricted", privileged=True),
    }


def test_runc_attaches_a_device_program_in_unified_mode(containers: dict[str, RuncContainer], v2_root: Path) -> None:
    """The premise: the container lives only in the cgroup2 hierarchy, with a device program."""
    from accelstats.cgroups.devices_bpf import BpfReader
    ctr = containers["gpu1_idle"]
    assert ctr.unified_cgroup_dir is not None and ctr.unified_cgroup_dir.is_dir()
    assert not ctr.devices_cgroup_dir.exists()  # no v1 devices cgroup: runc ran as on a v2 host
    assert len(BpfReader().query(str(ctr.unified_cgroup_dir))) >= 1


def test_device_programs_attribute_granted_gpus_busy_or_idle(
        containers: dict[str, RuncContainer], tmp_path: Path, fixtures_dir: Path, v2_root: Path) -> None:
    c = containers
    replay = two_gpu_scenario(tmp_path, fixtures_dir, (GPU0, GPU1), {GPU0: [(c["both_busy"].pid, 3 * GIB)]})
    out = cli("containers", "--json", "--cgroup-root", str(v2_root), "--nvml-replay", str(replay))
    rows = {r["cgroup"]: r for r in json.loads(out.stdout)}

    def devices(name: str) -> list[tuple[str, str, int | None]]:
        return [(d["uuid"], d["attribution"], d["memory_used_bytes"]) for d in rows[c[name].cgroups_path]["devices"]]

    # granted GPU 1, nothing running on it: listed with the GPU, its own memory 0 (allocated and idle)
    assert devices("gpu1_idle") == [(GPU1, "devices_cgroup", 0)]
    assert rows[c["gpu1_idle"].cgroups_path]["devices_cgroup"] == "restricted"
    # granted both, a process on GPU 0: both by the devices cgroup, its memory where its process is
    assert devices("both_busy") == [(GPU0, "devices_cgroup", 3 * GIB), (GPU1, "devices_cgroup", 0)]
    # granted no GPU: not a GPU container
    assert c["denied"].cgroups_path not in rows
    # privileged: nothing restricts it, so it may open any GPU; no process on one: listed, reason says so
    unrestricted = rows[c["unrestricted"].cgroups_path]
    assert unrestricted["devices"] == [] and unrestricted["devices_cgroup"] == "unrestricted"
    assert "unrestricted" in unrestricted["reason"]
    for name in ("gpu1_idle", "both_busy"):
        assert rows[c[name].cgroups_path]["runtime"] == "docker" and rows[c[name].cgroups_path]["reason"].startswith(
            "no name or image")  # runc, not docker, made it: docker's state has no file for it


def test_idle_allocation_in_metrics(containers: dict[str, RuncContainer], tmp_path: Path, fixtures_dir: Path,
                                    v2_root: Path) -> None:
    """The allocated-and-idle query of the dashboard and the alert, on what dump publishes."""
    c = containers
    replay = two_gpu_scenario(tmp_path, fixtures_dir, (GPU0, GPU1), {GPU0: [(c["both_busy"].pid, GIB)]})
    text = cli("dump", "--cgroup-root", str(v2_root), "--nvml-replay", str(replay)).stdout
    families = {f.name: f for f in text_string_to_metric_families(text)}
    ours = {ctr.cgroups_path: name for name, ctr in c.items()}
    idle = {(ours[s.labels["id"]], s.labels["uuid"]) for s in families["accelstats_container_gpu_processes"].samples
            if s.labels["id"] in ours and s.labels["attribution"] == "devices_cgroup" and s.value == 0}
    assert idle == {("gpu1_idle", GPU1), ("both_busy", GPU1)}


def test_without_cap_sys_admin_one_reason_and_process_evidence(
        containers: dict[str, RuncContainer], tmp_path: Path, fixtures_dir: Path, v2_root: Path) -> None:
    c = containers
    replay = two_gpu_scenario(tmp_path, fixtures_dir, (GPU0, GPU1), {GPU0: [(c["both_busy"].pid, GIB)]})
    out = cli("containers", "--json", "--cgroup-root", str(v2_root), "--nvml-replay", str(replay), drop_caps=True)
    rows = {r["cgroup"]: r for r in json.loads(out.stdout)}
    busy = rows[c["both_busy"].cgroups_path]
    assert [(d["uuid"], d["attribution"]) for d in busy["devices"]] == [(GPU0, "process")]
    assert "CAP_SYS_ADMIN" in busy["reason"]
    assert c["gpu1_idle"].cgroups_path not in rows  # granted but unused: cannot be seen without the programs
    assert len([x for x in out.stderr.splitlines() if "WARNING" in x and "CAP_SYS_ADMIN" in x]) == 1  # logged once
    assert out.stderr.count("# cgroup v2 device programs not readable") == 1  # and said once to the user
    text = cli("dump", "--cgroup-root", str(v2_root), "--nvml-replay", str(replay), drop_caps=True).stdout
    skipped = {s.labels["reason"]: s.value for f in text_string_to_metric_families(text)
               if f.name == "accelstats_attribution_skipped" for s in f.samples}
    assert skipped["device_programs_denied"] >= 1


def unit_capabilities(*files: Path) -> list[str]:
    """The CapabilityBoundingSet= of the unit and drop-ins (merged, as systemd does), in setpriv's spelling."""
    caps: list[str] = []
    for f in files:
        for line in f.read_text().splitlines():
            if line.startswith("CapabilityBoundingSet="):
                caps += [c.removeprefix("CAP_").lower() for c in line.split("=", 1)[1].split()]
    return caps


@pytest.mark.parametrize("drop_in", [False, True], ids=["unit", "unit+device-programs.conf"])
def test_the_units_capabilities_with_and_without_the_drop_in(
        containers: dict[str, RuncContainer], tmp_path: Path, fixtures_dir: Path, v2_root: Path,
        repo_root: Path, drop_in: bool) -> None:
    """The shipped unit's capability set reads no device program (so a granted, idle GPU is not
    seen); with systemd/device-programs.conf added it does."""
    files = [repo_root / "systemd" / "accelstats.service"]
    if drop_in:
        files.append(repo_root / "systemd" / "device-programs.conf")
    caps = ",".join(["-all", *(f"+{c}" for c in unit_capabilities(*files))])
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.fail("setpriv (util-linux) missing") if in_ci() else pytest.skip("setpriv missing")
    replay = two_gpu_scenario(tmp_path, fixtures_dir, (GPU0, GPU1), {})
    proc = subprocess.run([setpriv, f"--bounding-set={caps}", f"--inh-caps={caps}", "--", sys.executable, "-m",
                           "accelstats", "containers", "--json", "--cgroup-root", str(v2_root), "--nvml-replay",
                           str(replay)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    rows = {r["cgroup"]: r for r in json.loads(proc.stdout)}
    idle = rows.get(containers["gpu1_idle"].cgroups_path)
    if drop_in:
        assert idle is not None and [d["uuid"] for d in idle["devices"]] == [GPU1]
    else:
        assert idle is None and "CAP_SYS_ADMIN" in proc.stderr


def test_mig_capability_minors_in_device_programs_name_the_instance(tmp_path: Path, fixtures_dir: Path,
                                                                    v2_root: Path) -> None:
    """spec §2 MIG row, on v2: a program granting /dev/nvidia1 plus the gi and ci access capabilities
    (read, on the nvidia-caps major of /proc/devices) attributes that MIG instance; the GPU node alone,
    the whole GPU.  Real cgroups and programs; /proc/devices and mig-minors from a fixture /proc."""
    a100 = fixtures_dir / "public" / "a100-sxm4-v12.xml"  # GPU minor 1; MIG instances gi 3..6, ci 0
    proc = tmp_path / "proc"
    (proc / "driver" / "nvidia-caps").mkdir(parents=True)
    (proc / "devices").write_text("Character devices:\n195 nvidia\n241 nvidia-caps\n\nBlock devices:\n")
    (proc / "driver" / "nvidia-caps" / "mig-minors").write_text(
        "config 1\nmonitor 2\ngpu1/gi3/access 30\ngpu1/gi3/ci0/access 31\ngpu1/gi4/access 40\ngpu1/gi4/ci0/access 41\n")
    instance, whole = f"/docker/{secrets.token_hex(32)}", f"/docker/{secrets.token_hex(32)}"
    programs = {instance: [("c", 195, 1, "rw", True), ("c", 241, 40, "r", True), ("c", 241, 41, "r", True)],
                whole: [("c", 195, 1, "rw", True)]}
    scenario = tmp_path / "scenario.toml"
    scenario.write_text(f'[[gpu]]\ncapture = "{a100}"\n')
    made = []
    try:
        for path, rules in programs.items():
            d = v2_root / path.lstrip("/")
            d.mkdir(parents=True)
            made.append(d)
            fd = bpf_util.load_program(bpf_util.runc_style(rules))
            try:
                bpf_util.attach(d, fd)
            finally:
                os.close(fd)
        settings = Settings(nvml_replay=scenario, cgroup_root=v2_root, proc_root=proc, rootfs=tmp_path)
        with AcceleratorManager(settings, open_replay(scenario)) as m:
            c = m.collect()
    finally:
        for d in made:
            d.rmdir()
        with contextlib.suppress(OSError):
            (v2_root / "docker").rmdir()
    devices = {d.uuid: d for d in c.snapshot.devices}
    by_path = {s.cgroup: s for s in c.containers}
    (inst,) = by_path[instance].accelerators
    assert (devices[inst.id].kind, devices[inst.id].gpu_instance_id, inst.attribution) == ("mig", 4, "devices_cgroup")
    (gpu,) = by_path[whole].accelerators
    assert (devices[gpu.id].kind, gpu.attribution) == ("gpu", "devices_cgroup")
