"""Attribution on fixture trees: cgroup v2 process evidence, open device nodes, unknown runtimes,
MIG on v1 and v2, runtime metadata, and what is skipped and counted (spec/cgroups.md §2-§4)."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from accelstats.attribution.attributor import Attributor
from accelstats.attribution.containers import ContainerMetadata, ContainerStats, container_of
from accelstats.cgroups import CgroupLayout, CgroupMode
from accelstats.manager import AcceleratorManager, Collection
from accelstats.settings import Settings
from accelstats.web.exposition import render
from collectors.replay.lib import open_replay

GIB = 1 << 30
C1, C2, C3 = "1" * 64, "2" * 64, "3" * 64
DOCKER = "/system.slice/docker-{}.scope"
GPU0 = "GPU-00000000-0000-4000-8000-000000000000"
GPU1 = "GPU-00000000-0000-4000-8000-000000000001"


@dataclass
class Host:
    """A fake host: cgroup tree (v1 devices or v2 unified), proc root, rootfs, replay scenario."""

    root: Path
    capture: Path
    v2: bool = True
    gpus: list[str] = field(default_factory=lambda: [GPU0, GPU1])
    processes: dict[int, list[str]] = field(default_factory=dict)  # gpu index -> scenario lines

    def __post_init__(self) -> None:
        self.cgroup = self.root / "cgroup"
        self.proc = self.root / "proc"
        self.rootfs = self.root / "rootfs"
        for d in (self.cgroup, self.proc, self.rootfs):
            d.mkdir()
        if self.v2:
            (self.cgroup / "cgroup.controllers").write_text("cpu memory pids\n")
        else:
            (self.cgroup / "devices").mkdir()
            (self.cgroup / "devices" / "devices.list").write_text("a *:* rwm\n")

    def container(self, path: str, pids: list[int] = (), devices_list: str = "") -> Path:  # type: ignore[assignment]
        base = self.cgroup if self.v2 else self.cgroup / "devices"
        d = base / path.lstrip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
        if not self.v2:
            (d / "devices.list").write_text(devices_list)
        return d

    def process(self, pid: int, cgroup: str, *, gpu: int | None = None, used: int = GIB, sm: int | None = None,
                fds: list[Path] = ()) -> None:  # type: ignore[assignment]
        d = self.proc / str(pid)
        (d / "fd").mkdir(parents=True)
        line = f"0::{cgroup}\n" if self.v2 else f"5:devices:{cgroup}\n0::/\n"
        (d / "cgroup").write_text(line, errors="surrogateescape")
        (d / "stat").write_text(f"{pid} (python3) S 1 " + " ".join(["0"] * 17) + f" {pid * 7} 0 0\n")
        for n, node in enumerate(fds, start=3):
            (d / "fd" / str(n)).symlink_to(node)
        if gpu is not None:
            self.nvml_process(gpu, pid, used, sm)

    def nvml_process(self, gpu: int, pid: int, used: int = GIB, sm: int | None = None) -> None:
        lines = ["[[gpu.process]]", f"pid = {pid}", f"used_memory_bytes = {used}"]
        if sm is not None:
            lines.append(f"sm_utilization_percent = {sm}")
        self.processes.setdefault(gpu, []).extend(lines)

    def collect(self, extra_gpu_toml: str = "") -> Collection:
        text = ""
        for i, uuid in enumerate(self.gpus):
            text += f'[[gpu]]\ncapture = "{self.capture}"\nminor = {i}\nuuid = "{uuid}"\n'
            text += "\n".join(self.processes.get(i, [])) + "\n"
        text += extra_gpu_toml
        scenario = self.root / "scenario.toml"
        scenario.write_text(text)
        settings = Settings(nvml_replay=scenario, cgroup_root=self.cgroup, proc_root=self.proc, rootfs=self.rootfs,
                            collectors=("nvidia",))  # as before the kubernetes collector: hermetic on a node
        with AcceleratorManager(settings, open_replay(scenario)) as m:
            return m.collect()


def rows(collection: Collection) -> dict[str, ContainerStats]:
    return {c.cgroup: c for c in collection.containers}


def table(stats: ContainerStats) -> list[tuple[str, str, int | None, int | None]]:
    """(uuid, attribution, container memory, container processes) per device, as the spec's table reads."""
    return [(a.id, a.attribution, a.container_memory_used_bytes, a.container_processes) for a in stats.accelerators]


@pytest.fixture
def h200(fixtures_dir: Path) -> Path:
    return fixtures_dir / "h200" / "nvidia-smi-q.xml"


def test_v2_process_evidence_two_containers_sharing_a_gpu(tmp_path: Path, h200: Path) -> None:
    host = Host(tmp_path, h200)
    host.container(DOCKER.format(C1), [101])
    host.container(DOCKER.format(C1) + "/worker", [103])  # a sub-cgroup belongs to its container
    host.container(DOCKER.format(C2), [102])
    host.process(101, DOCKER.format(C1), gpu=0, used=1 * GIB, sm=35)
    host.process(103, DOCKER.format(C1) + "/worker", gpu=1, used=3 * GIB)
    host.process(102, DOCKER.format(C2), gpu=0, used=2 * GIB, sm=10)
    host.process(104, "/system.slice/sshd.service", gpu=1)  # a host process: nobody's container
    host.nvml_process(1, 105)  # exited before /proc was read: skipped and counted
    c = host.collect()
    r = rows(c)
    assert table(r[DOCKER.format(C1)]) == [(GPU0, "process", 1 * GIB, 1), (GPU1, "process", 3 * GIB, 1)]
    assert table(r[DOCKER.format(C2)]) == [(GPU0, "process", 2 * GIB, 1)]
    sm = {(a.id, s.cgroup): a.container_sm_utilization_ratio for s in c.containers for a in s.accelerators}
    assert sm[(GPU0, DOCKER.format(C1))] == pytest.approx(0.35)
    assert sm[(GPU0, DOCKER.format(C2))] == pytest.approx(0.10)
    # GPU 1: no process has a utilisation sample, NVML answers NOT_FOUND: "0 for this period"
    assert sm[(GPU1, DOCKER.format(C1))] == 0.0
    assert "/system.slice/sshd.service" not in r
    assert c.attribution_skipped["pid_vanished"] == 1


def test_v2_unrecognised_cgroup_holding_a_gpu_is_listed_as_unknown(tmp_path: Path, h200: Path) -> None:
    host = Host(tmp_path, h200)
    host.container("/mystery/box1", [201])
    host.process(201, "/mystery/box1", gpu=1, used=GIB)
    r = rows(host.collect())
    box = r["/mystery/box1"]
    assert box.identity is not None and (box.identity.runtime, box.identity.id) == ("unknown", "box1")
    assert table(box) == [(GPU1, "process", GIB, 1)]


@pytest.mark.root  # chown needs CAP_CHOWN
def test_who_could_have_made_a_cgroup_decides_whether_its_identity_is_trusted(tmp_path: Path, h200: Path) -> None:
    """A cgroup in a parent a user may write to (owned by the user, or group/other-writable) or under
    user@<uid>.service is never a runtime's container; a container whose own cgroup its runtime chowned
    to the container's root (unprivileged LXC, runc with a user namespace) under a root-owned parent
    keeps its identity.  The untrusted ones get their whole cgroup path as id, so not even an unknown
    row carries another container's ID."""
    host = Host(tmp_path, h200, v2=False)
    rule = "c 195:1 rw\n"
    lxc = host.container("/lxc.payload.train", [], devices_list=rule)
    os.chown(lxc, 100000, 100000)
    host.container("/deleg", [], devices_list="a *:* rwm\n")
    os.chown(host.cgroup / "devices" / "deleg", 1000, 1000)
    host.container(f"/deleg/docker-{C1}.scope", [], devices_list=rule)
    host.container(f"/deleg/{C2}", [], devices_list=rule)  # unrecognised leaf named like a container ID
    host.container("/deleg/lxc.payload.victim", [], devices_list=rule)  # its path spells a name: not kept
    host.container("/open", [], devices_list="a *:* rwm\n")
    (host.cgroup / "devices" / "open").chmod(0o777)
    host.container(f"/open/docker-{C3}.scope", [], devices_list=rule)
    userd = f"/user.slice/user-1000.slice/user@1000.service/docker-{C3}.scope"
    host.container(userd, [901], devices_list=rule)  # not walked (a user's subtree): found by its process
    host.process(901, userd, gpu=1)
    r = rows(host.collect())
    assert (r["/lxc.payload.train"].identity.runtime, r["/lxc.payload.train"].metadata.name) == ("lxc", "train")
    for path, why in ((f"/deleg/docker-{C1}.scope", "owned by uid 1000"), (f"/deleg/{C2}", "owned by uid 1000"),
                      ("/deleg/lxc.payload.victim", "owned by uid 1000"),
                      (f"/open/docker-{C3}.scope", "writable by group or others"),
                      (f"/user.slice/user-1000.slice/user@1000.service/docker-{C3}.scope", "user@1000.service")):
        row = r[path]
        assert row.identity is not None and (row.identity.runtime, row.identity.id) == ("unknown", path), path
        used = (GIB, 1) if path == userd else (0, 0)
        assert why in row.reason and table(row) == [(GPU1, "devices_cgroup", *used)], (path, row.reason)
        assert row.metadata.name == "", path
    # gone before its parent could be looked at (removed mid-collection, or pulled away on purpose):
    # not trusted, not listed
    attributor = Attributor(CgroupLayout(CgroupMode.V1, host.cgroup / "devices", None), host.proc, host.rootfs)
    assert attributor._delegated(f"/gone/docker-{C1}.scope") is None
    assert attributor._delegated("/lxc.payload.train") == ""  # the root's child: only root made it
    # a parent that cannot be looked at (here its name is longer than NAME_MAX: ENAMETOOLONG) is an
    # untrusted answer, never a trusted one
    why = attributor._delegated("/" + "p" * 300 + f"/docker-{C1}.scope")
    assert why is not None and "cannot be checked" in why


@pytest.mark.root  # chown needs CAP_CHOWN
def test_a_parents_owner_is_looked_at_again_at_each_collection(tmp_path: Path, h200: Path) -> None:
    """Trust is decided once per parent cgroup in a collection (issue 29: the containers of a host share a
    few parents), never kept across collections: a parent handed to a user between two scrapes makes its
    containers untrusted at the next one, and handed back, trusted again.

    | collection | ``/team`` owned by | ``/team/docker-<C1>.scope`` and ``…-<C2>.scope`` |
    |---|---|---|
    | 1 | root | docker containers |
    | 2 | uid 1000 | unknown, "owned by uid 1000" |
    | 3 | root | docker containers |
    """
    host = Host(tmp_path, h200, v2=False)
    rule = "c 195:1 rw\n"
    host.container("/team", [], devices_list="a *:* rwm\n")
    paths = [f"/team/docker-{c}.scope" for c in (C1, C2)]
    for path in paths:
        host.container(path, [], devices_list=rule)
    team = host.cgroup / "devices" / "team"
    attributor = Attributor(CgroupLayout(CgroupMode.V1, host.cgroup / "devices", None), host.proc, host.rootfs)
    snapshot = host.collect().snapshot

    def runtimes() -> list[tuple[str, str]]:
        found = {s.cgroup: s for s in attributor.attribute(snapshot)[0]}
        return [(found[p].identity.runtime if found[p].identity else "", found[p].reason) for p in paths]

    assert [r for r, _ in runtimes()] == ["docker", "docker"]
    os.chown(team, 1000, 1000)
    second = runtimes()
    assert [r for r, _ in second] == ["unknown", "unknown"]
    assert all("owned by uid 1000" in why for _, why in second)
    os.chown(team, 0, 0)
    assert [r for r, _ in runtimes()] == ["docker", "docker"]


@pytest.mark.root  # mknod of a 195:N node in tmp_path needs CAP_MKNOD
def test_open_device_node_attributes_by_open_fd_and_is_scanned_once(tmp_path: Path, h200: Path) -> None:
    (tmp_path / "dev").mkdir()  # device nodes are looked at only in a dev directory (accelstats/attribution/openfds.py)
    node = tmp_path / "dev" / "nvidia1"
    os.mknod(node, stat.S_IFCHR | 0o600, os.makedev(195, 1))
    ctl = tmp_path / "dev" / "nvidiactl"
    os.mknod(ctl, stat.S_IFCHR | 0o600, os.makedev(195, 255))
    host = Host(tmp_path, h200)
    host.container(DOCKER.format(C3), [301])
    host.process(301, DOCKER.format(C3), fds=[node, ctl])  # no NVML process: only the open node says so
    settings = Settings(cgroup_root=host.cgroup, proc_root=host.proc, rootfs=host.rootfs,
                        nvml_replay=tmp_path / "scenario.toml")
    host.collect()  # writes the scenario
    with AcceleratorManager(settings, open_replay(tmp_path / "scenario.toml")) as m:
        first = m.collect()
        attributor = m._attributor
        assert attributor is not None and attributor.scanner is not None
        scans = attributor.scanner.scans
        m.collect()
        assert attributor.scanner.scans == scans  # no process started: the fd scan is a cache hit
    assert table(rows(first)[DOCKER.format(C3)]) == [(GPU1, "open_fd", 0, 0)]  # 255 (nvidiactl) is no GPU


def test_v1_unrestricted_uses_process_evidence_and_restricted_uses_devices_list(tmp_path: Path, h200: Path) -> None:
    host = Host(tmp_path, h200, v2=False)
    host.container(f"/docker/{C1}", [401], devices_list="a *:* rwm\n")
    host.container(f"/docker/{C2}", [402], devices_list="c 195:0 rw\nc 195:255 rw\n")
    host.process(401, f"/docker/{C1}", gpu=1, used=GIB)
    host.process(402, f"/docker/{C2}", gpu=0, used=2 * GIB)
    r = rows(host.collect())
    assert table(r[f"/docker/{C1}"]) == [(GPU1, "process", GIB, 1)]
    assert table(r[f"/docker/{C2}"]) == [(GPU0, "devices_cgroup", 2 * GIB, 1)]


def test_v1_mig_capability_minors_name_the_instance(tmp_path: Path, fixtures_dir: Path) -> None:
    """spec §2 MIG row: /dev/nvidia1 plus the gi and ci access capabilities -> that MIG instance."""
    a100 = fixtures_dir / "public" / "a100-sxm4-v12.xml"  # GPU minor 1; instances gi 3..6, ci 0
    host = Host(tmp_path, a100, v2=False, gpus=[])
    (host.proc / "devices").write_text("Character devices:\n195 nvidia\n241 nvidia-caps\n\nBlock devices:\n")
    caps = host.proc / "driver" / "nvidia-caps"
    caps.mkdir(parents=True)
    (caps / "mig-minors").write_text(
        "config 1\nmonitor 2\ngpu1/gi3/access 30\ngpu1/gi3/ci0/access 31\ngpu1/gi4/access 40\n"
        "gpu1/gi4/ci0/access 41\nsomething odd\n")
    host.container(f"/docker/{C1}", [], devices_list="c 195:1 rw\nc 241:40 r\nc 241:41 r\n")
    host.container(f"/docker/{C2}", [], devices_list="c 195:1 rw\n")
    c = host.collect(f'[[gpu]]\ncapture = "{a100}"\n')
    devices = {d.uuid: d for d in c.snapshot.devices}
    (inst,) = rows(c)[f"/docker/{C1}"].accelerators
    assert (devices[inst.id].kind, devices[inst.id].gpu_instance_id, inst.attribution) == ("mig", 4, "devices_cgroup")
    (whole,) = rows(c)[f"/docker/{C2}"].accelerators
    assert devices[whole.id].kind == "gpu"  # no capability granted: the GPU node alone


def test_v2_mig_processes_map_to_their_instance(tmp_path: Path, fixtures_dir: Path) -> None:
    a100 = fixtures_dir / "public" / "a100-sxm4-v12.xml"
    host = Host(tmp_path, a100, gpus=[])
    host.container(DOCKER.format(C1), [501])
    host.process(501, DOCKER.format(C1))
    c = host.collect(f'[[gpu]]\ncapture = "{a100}"\n[[gpu.mig]]\ngpu_instance_id = 7\nprofile = "1g.10gb"\n'
                     f'memory_total_bytes = 10737418240\n[[gpu.mig.process]]\npid = 501\nused_memory_bytes = {GIB}\n')
    (acc,) = rows(c)[DOCKER.format(C1)].accelerators
    mig = next(d for d in c.snapshot.devices if d.uuid == acc.id)
    got = (mig.kind, mig.gpu_instance_id, acc.attribution, acc.container_memory_used_bytes)
    assert got == ("mig", 7, "process", GIB)
    assert acc.container_sm_utilization_ratio is None  # NOT_SUPPORTED under MIG: absent


def test_docker_metadata_names_the_container(tmp_path: Path, h200: Path) -> None:
    host = Host(tmp_path, h200)
    host.container(DOCKER.format(C1), [601])
    host.process(601, DOCKER.format(C1), gpu=0)
    cfg = host.rootfs / "var" / "lib" / "docker" / "containers" / C1
    cfg.mkdir(parents=True)
    (cfg / "config.v2.json").write_text(json.dumps({"ID": C1, "Name": "/trainer-1",
                                                    "Config": {"Image": "pytorch/pytorch:2.5", "Labels": {}}}))
    m = rows(host.collect())[DOCKER.format(C1)].metadata
    assert (m.name, m.image) == ("trainer-1", "pytorch/pytorch:2.5")


def test_cgroup_removed_mid_walk_and_unreadable_fd_dirs_are_counted_not_fatal(
        tmp_path: Path, h200: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = Host(tmp_path, h200)
    host.container(DOCKER.format(C1), [701])
    host.process(701, DOCKER.format(C1), gpu=0)
    (host.proc / "701" / "fd").rmdir()
    (host.proc / "701" / "fd").write_text("")  # fd is not a directory: unreadable, skipped
    pod = "/kubepods.slice/kubepods-pod0a1b2c3d_0000_4000_8000_000000000000.slice"
    host.container(pod + "/cri-containerd-" + C2 + ".scope", [702])
    gone = host.cgroup / pod.lstrip("/")
    real_scandir = os.scandir

    def vanishing_scandir(path: object) -> object:
        if str(path) == str(gone):  # the pod's cgroup is removed while the walk lists it
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_scandir(path)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "scandir", vanishing_scandir)
    c = host.collect()
    assert table(rows(c)[DOCKER.format(C1)]) == [(GPU0, "process", GIB, 1)]
    assert not any(path.startswith(pod) for path in rows(c))
    assert c.attribution_skipped["fd_unreadable"] == 1
    assert c.attribution_skipped["cgroup_vanished"] == 1


def test_processes_in_several_lists_count_once_per_container(tmp_path: Path, h200: Path) -> None:
    """A compute+MPS (or C+G) PID is one process: its memory is counted once."""
    host = Host(tmp_path, h200)
    host.container(DOCKER.format(C1), [801, 802])
    host.process(801, DOCKER.format(C1), gpu=0, used=GIB)
    host.processes[0] += ["[[gpu.process]]", "pid = 801", f"used_memory_bytes = {GIB}", 'type = "mps"']
    host.process(802, DOCKER.format(C1))
    host.processes[0] += ["[[gpu.process]]", "pid = 802", f"used_memory_bytes = {2 * GIB}", 'type = "mps"']
    assert table(rows(host.collect())[DOCKER.format(C1)]) == [(GPU0, "process", 3 * GIB, 2)]


def test_nomad_v1_process_is_found_through_its_devices_controller_line(tmp_path: Path, h200: Path) -> None:
    """Nomad <= 1.6 on v1: cpuset says /nomad/..., the devices controller says /docker/<id>."""
    host = Host(tmp_path, h200, v2=False)
    host.container(f"/docker/{C1}", [901], devices_list="a *:* rwm\n")
    host.process(901, f"/docker/{C1}", gpu=1, used=GIB)
    (host.proc / "901" / "cgroup").write_text(
        f"7:cpuset:/nomad/reserved/0b9f4a1e-1c7b-4a53-a7a4-3d1f4cfc3b61.web\n5:devices:/docker/{C1}\n"
        f"4:memory:/docker/{C1}\n0::/\n")
    assert table(rows(host.collect())[f"/docker/{C1}"]) == [(GPU1, "process", GIB, 1)]


@pytest.mark.parametrize("path", ["/system.slice/gpu-probe.scope", "/system.slice/run-r3f1.scope",
                                  "/user.slice/user-1000.slice/user@1000.service/app.slice/app-x.scope",
                                  "/user.slice/user-1000.slice/session-3.scope", "/system.slice/sshd.service", "/"])
def test_host_processes_are_not_containers(tmp_path: Path, h200: Path, path: str) -> None:
    host = Host(tmp_path, h200)
    host.process(1001, path, gpu=0)
    assert rows(host.collect()) == {}


def test_podman_process_in_the_parent_of_the_container_child_is_one_container(tmp_path: Path, h200: Path) -> None:
    scope = f"/machine.slice/libpod-{C1}.scope"
    host = Host(tmp_path, h200)
    host.container(scope, [])
    host.container(scope + "/container", [1101])
    host.process(1101, scope + "/container", gpu=0, used=GIB)
    host.process(1102, scope, gpu=0, used=2 * GIB)  # conmon-side helper in the parent
    r = rows(host.collect())
    assert list(r) == [scope + "/container"]
    assert table(r[scope + "/container"]) == [(GPU0, "process", 3 * GIB, 2)]


def test_paths_from_another_cgroup_namespace_are_skipped_and_counted(tmp_path: Path, h200: Path) -> None:
    host = Host(tmp_path, h200)
    host.container(DOCKER.format(C1), [1201])
    host.process(1201, "/../../system.slice/docker-" + C1 + ".scope", gpu=0)
    c = host.collect()
    assert DOCKER.format(C1) not in rows(c)  # its process could not be placed: no GPU is attributed, not listed
    assert c.attribution_skipped["foreign_cgroupns"] == 1


@pytest.mark.parametrize("own", ["/", "/init"])  # the exporter at its namespace root, or in a child of it
def test_paths_from_our_own_private_cgroup_namespace_are_resolved(tmp_path: Path, h200: Path, own: str) -> None:
    """A DaemonSet exporter in a private cgroup namespace (cgroup v2 default) reads other pods' paths as
    ``/../../…``; its own cgroup, found in the mounted host tree by its PID, places them
    (accelstats/attribution/cgroupns.py)."""
    ours = "/kubepods.slice/kubepods-pod0.slice/cri-containerd-" + C2 + ".scope"
    theirs = "/kubepods.slice/kubepods-pod1.slice/cri-containerd-" + C1 + ".scope"
    host = Host(tmp_path, h200)
    host.container(ours + (own if own != "/" else ""), [4242])
    host.container(theirs, [1201])
    (host.proc / "4242").mkdir(parents=True, exist_ok=True)
    (host.proc / "4242" / "cgroup").write_text(f"0::{own}\n")
    (host.proc / "self").symlink_to("4242")
    host.process(1201, "/../../kubepods-pod1.slice/cri-containerd-" + C1 + ".scope", gpu=0)
    host.process(1202, "/../../../../system.slice/x.scope/../../..", gpu=1)  # climbs above the host's root
    c = host.collect()
    assert table(rows(c)[theirs]) == [(GPU0, "process", GIB, 1)]
    assert c.attribution_skipped["foreign_cgroupns"] == 1  # only the path that climbs out


def test_unknown_mig_minors_lines_are_counted_once(tmp_path: Path, fixtures_dir: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """... and never logged: under --proc-root the file may be anyone's (issue 24, row 12)."""
    a100 = fixtures_dir / "public" / "a100-sxm4-v12.xml"
    host = Host(tmp_path, a100, v2=False, gpus=[])
    (host.proc / "devices").write_text("Character devices:\n195 nvidia\n241 nvidia-caps\n")
    (host.proc / "driver" / "nvidia-caps").mkdir(parents=True)
    (host.proc / "driver" / "nvidia-caps" / "mig-minors").write_text("gpu1/gi3/access 30\nsomething odd\nx y z\n")
    scenario_tail = f'[[gpu]]\ncapture = "{a100}"\n'
    assert host.collect(scenario_tail).attribution_skipped["mig_minors_line"] == 2
    assert "mig-minors: skipped a line of 13 characters" in caplog.text
    assert "something odd" not in caplog.text and "x y z" not in caplog.text


@pytest.mark.parametrize(("path", "containers", "owner"), [
    ("/docker/a", {"/docker/a"}, "/docker/a"),
    ("/docker/a/init.scope", {"/docker/a"}, "/docker/a"),
    ("/docker/ab", {"/docker/a"}, None),  # a prefix of the name is not an ancestor
    ("/k/pod/c1/sub", {"/k/pod", "/k/pod/c1"}, "/k/pod/c1"),  # the nearest ancestor
    ("/", {"/docker/a"}, None),
    ("", {"/docker/a"}, None),
])
def test_container_of_is_the_nearest_ancestor(path: str, containers: set[str], owner: str | None) -> None:
    assert container_of(path, containers) == owner


@pytest.mark.parametrize(("content", "reason"), [
    (b"0::/x\xff\n", "pid_unreadable"),  # not UTF-8: kept as the walk would name it
    (b"0::/foo\x00bar\n", "bad_cgroup_path"),
    (b"0::/../outside/x\n", "foreign_cgroupns"),
    (b"0::/a/../../outside\n", "bad_cgroup_path"),
    (b"0::" + b"/a" * 200_000 + b"\n", "bad_cgroup_path"),  # absurd depth, and more than 64 KiB read
    (b"", "pid_unreadable"),
    (b"\x00\x01binary\n", "pid_unreadable"),
])
def test_hostile_proc_cgroup_files_are_skipped_and_counted(
        tmp_path: Path, h200: Path, content: bytes, reason: str) -> None:
    host = Host(tmp_path, h200)
    host.container(DOCKER.format(C1), [1301])
    host.process(1301, DOCKER.format(C1), gpu=0)
    host.process(1302, "/placeholder", gpu=1)
    (host.proc / "1302" / "cgroup").write_bytes(content)
    c = host.collect()
    assert table(rows(c)[DOCKER.format(C1)]) == [(GPU0, "process", GIB, 1)]
    if reason == "pid_unreadable" and content.startswith(b"0::/x"):
        assert "/x\udcff" in rows(c)  # the byte kept as os.fsdecode would: an unknown container, no crash
        return
    assert c.attribution_skipped[reason] >= 1
    assert all(not path.startswith("/..") and "\x00" not in path for path in rows(c))


@pytest.mark.parametrize("victim", ["cgroup.procs", "proc-cgroup", "stat"])
def test_fifos_never_hang_attribution(tmp_path: Path, h200: Path, victim: str) -> None:
    host = Host(tmp_path, h200)
    d = host.container(DOCKER.format(C1), [1401])
    host.process(1401, DOCKER.format(C1), gpu=0)
    target = {"cgroup.procs": d / "cgroup.procs", "proc-cgroup": host.proc / "1401" / "cgroup",
              "stat": host.proc / "1401" / "stat"}[victim]
    target.unlink()
    os.mkfifo(target)
    c = host.collect()  # returns: a FIFO is not read
    assert c.snapshot.devices


def test_huge_numbers_and_odd_digits_are_not_pids_or_majors(tmp_path: Path, fixtures_dir: Path) -> None:
    a100 = fixtures_dir / "public" / "a100-sxm4-v12.xml"
    host = Host(tmp_path, a100, v2=False, gpus=[])
    (host.proc / "devices").write_text("Character devices:\n" + "9" * 5000 + " nvidia-caps\n²³ nvidia-caps\n")
    (host.proc / "driver" / "nvidia-caps").mkdir(parents=True)
    (host.proc / "driver" / "nvidia-caps" / "mig-minors").write_text("gpu1/gi3/access 30\n")
    d = host.container(f"/docker/{C1}", [], devices_list="c 195:1 rw\n")
    (d / "cgroup.procs").write_text("9" * 5000 + "\n²³\n-5\n")
    c = host.collect(f'[[gpu]]\ncapture = "{a100}"\n')
    assert [a.attribution for a in rows(c)[f"/docker/{C1}"].accelerators] == ["devices_cgroup"]
    assert all(r.success for r in c.snapshot.collector_results)


def test_an_attribution_bug_fails_only_the_attribution(tmp_path: Path, h200: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    host = Host(tmp_path, h200)
    host.container(DOCKER.format(C1), [1501])
    host.process(1501, DOCKER.format(C1), gpu=0)
    monkeypatch.setattr("accelstats.attribution.attributor.cgroup_of_pids", lambda *a: 1 / 0)
    c = host.collect()
    results = {r.name: r.success for r in c.snapshot.collector_results}
    assert results == {"nvidia": True, "attribution": False}
    assert c.containers == [] and len(c.snapshot.devices) == 2


def test_undecodable_names_never_break_the_exposition(tmp_path: Path, h200: Path) -> None:
    """Names that are not UTF-8 are exported with each undecodable byte as \\xNN: two cgroups whose
    names differ only there stay two series (one replacement character for every byte made them one)."""
    host = Host(tmp_path, h200)
    for pid, name in ((1601, "/lxc.payload.box\udcff"), (1602, "/lxc.payload.box\udcfe")):
        host.container(name, [pid])
        host.process(pid, name, gpu=0)
    c = host.collect()
    assert [s.cgroup for s in c.containers] == ["/lxc.payload.box\udcfe", "/lxc.payload.box\udcff"]
    c.containers[0].metadata = ContainerMetadata(name="/\ud800bad", image="img\udcfe")
    text = generate_latest(_Fixed(list(render(c)))).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    infos = families["accelstats_container_info"].samples
    assert sorted(s.labels["id"] for s in infos) == ["/lxc.payload.box\\xfe", "/lxc.payload.box\\xff"]
    first = next(s for s in infos if s.labels["id"].endswith("xfe"))
    assert first.labels["name"] == "/\\xed\\xa0\\x80bad" and first.labels["image"] == "img\\xfe"
    assert len({tuple(sorted(s.labels.items())) for s in families["accelstats_container_gpu_processes"].samples}) == 2


class _Fixed:
    def __init__(self, families: list[object]) -> None:
        self.families = families

    def collect(self) -> list[object]:
        return self.families
