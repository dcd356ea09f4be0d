"""Container identity from cgroup paths: one case per row of spec/cgroups.md §3, plus properties."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from accelstats.cgroups.identity import (
    RUNTIMES,
    ContainerIdentity,
    cgroup_path_for,
    identify,
    parse_proc_cgroup,
)

ID = "3f4e9c0b8a1d2e7f6c5b4a3928172635445362718190a0b1c2d3e4f5a6b7c8d9"  # 64 hex
ID2 = "0" * 63 + "1"
POD = "6f1a9d52-0b3c-4e8d-9a7f-2c1b0e4d5f60"
POD_ = POD.replace("-", "_")
ALLOC = "8d0e3b5c-1f2a-4b6c-9d8e-7f6a5b4c3d2e"


def docker(cid: str = ID, pod: str = "") -> ContainerIdentity:
    return ContainerIdentity(runtime="docker", id=cid, pod_uid=pod)


def containerd(cid: str = ID, pod: str = "") -> ContainerIdentity:
    return ContainerIdentity(runtime="containerd", id=cid, pod_uid=pod)


def crio(cid: str = ID, pod: str = "") -> ContainerIdentity:
    return ContainerIdentity(runtime="cri-o", id=cid, pod_uid=pod)


def podman(cid: str = ID) -> ContainerIdentity:
    return ContainerIdentity(runtime="podman", id=cid)


def nomad(task: str, alloc: str = ALLOC) -> ContainerIdentity:
    return ContainerIdentity(runtime="nomad", id=f"{alloc}.{task}", alloc_id=alloc, task=task)


def named(runtime: str, name: str) -> ContainerIdentity:
    return ContainerIdentity(runtime=runtime, id=name, name=name)


NOT_A_CONTAINER = None

# runtime (spec row) -> example path -> identity
SPEC_TABLE: list[tuple[str, str, ContainerIdentity | None]] = [
    ("docker, cgroupfs driver", f"/docker/{ID}", docker()),
    ("docker, systemd driver", f"/system.slice/docker-{ID}.scope", docker()),
    (
        "docker overlay mount unit",
        f"/system.slice/var-lib-docker-overlay2-{ID}-merged.mount",
        NOT_A_CONTAINER,
    ),
    ("kubernetes cgroupfs, burstable", f"/kubepods/burstable/pod{POD}/{ID}", containerd(pod=POD)),
    ("kubernetes cgroupfs, besteffort", f"/kubepods/besteffort/pod{POD}/{ID}", containerd(pod=POD)),
    ("kubernetes cgroupfs, guaranteed", f"/kubepods/pod{POD}/{ID}", containerd(pod=POD)),
    (
        "kubernetes systemd driver, besteffort",
        f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_}.slice/cri-containerd-{ID}.scope",
        containerd(pod=POD),
    ),
    (
        "kubernetes systemd driver, guaranteed",
        f"/kubepods.slice/kubepods-pod{POD_}.slice/cri-containerd-{ID}.scope",
        containerd(pod=POD),
    ),
    (
        "containerd non-kubernetes, systemd",
        f"/system.slice/containerd.service/system.slice:cri-containerd:{ID}",
        containerd(),
    ),
    (
        "cri-o container (.scope)",
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_}.slice/crio-{ID}.scope",
        crio(pod=POD),
    ),
    (
        "cri-o pod sandbox (no .scope)",
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_}.slice/crio-{ID}",
        NOT_A_CONTAINER,
    ),
    (
        "cri-o conmon",
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_}.slice/crio-conmon-{ID}.scope",
        NOT_A_CONTAINER,
    ),
    ("podman rootful", f"/machine.slice/libpod-{ID}.scope", podman()),
    ("podman rootful, trailing container", f"/machine.slice/libpod-{ID}.scope/container", podman()),
    (
        "podman rootless",
        f"/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID}.scope/container",
        podman(),
    ),
    ("nomad >= 1.7, share slice", f"/nomad.slice/share.slice/{ALLOC}.web.scope", nomad("web")),
    ("nomad >= 1.7, reserve slice", f"/nomad.slice/reserve.slice/{ALLOC}.web.scope", nomad("web")),
    ("nomad 1.3-1.6, v2", f"/nomad.slice/{ALLOC}.redis-cache.scope", nomad("redis-cache")),
    ("nomad <= 1.6 v1, cpuset reserved", f"/nomad/reserved/{ALLOC}.web", nomad("web")),
    ("nomad <= 1.6 v1, cpuset shared", "/nomad/shared", NOT_A_CONTAINER),
    ("lxc", "/lxc.payload.web01", named("lxc", "web01")),
    ("lxc, older", "/lxc/web01", named("lxc", "web01")),
    ("systemd-nspawn", "/machine.slice/systemd-nspawn@builder.service", named("systemd-nspawn", "builder")),
    ("host process, session", "/user.slice/user-1000.slice/session-3.scope", NOT_A_CONTAINER),
    ("host process, service", "/system.slice/nginx.service", NOT_A_CONTAINER),
    ("host process, root", "/", NOT_A_CONTAINER),
]

# Variants "where natural", and the traps around the table.
MORE_ROWS: list[tuple[str, str, ContainerIdentity | None]] = [
    (
        "kubernetes cgroupfs, cri-containerd- prefix",
        f"/kubepods/burstable/pod{POD}/cri-containerd-{ID}",
        containerd(pod=POD),
    ),
    ("kubernetes cgroupfs, docker- prefix", f"/kubepods/burstable/pod{POD}/docker-{ID}", docker(pod=POD)),
    ("kubernetes cgroupfs, crio- prefix", f"/kubepods/besteffort/pod{POD}/crio-{ID}", crio(pod=POD)),
    ("kubernetes cgroupfs, crio-conmon", f"/kubepods/besteffort/pod{POD}/crio-conmon-{ID}", NOT_A_CONTAINER),
    (
        "kubernetes systemd driver, dockershim",
        f"/kubepods.slice/kubepods-pod{POD_}.slice/docker-{ID}.scope",
        docker(pod=POD),
    ),
    ("kubernetes pod cgroup itself", f"/kubepods/burstable/pod{POD}", NOT_A_CONTAINER),
    ("kubernetes QoS slice", "/kubepods.slice/kubepods-burstable.slice", NOT_A_CONTAINER),
    (
        "containerd cgroupfs given a kubelet systemd path",
        f"/system.slice/containerd.service/kubepods-burstable-pod{POD_}.slice:cri-containerd:{ID}",
        containerd(pod=POD),
    ),
    ("docker-in-docker: the innermost", f"/docker/{ID}/docker/{ID2}", docker(ID2)),
    (
        "systemd inside a docker container",
        f"/system.slice/docker-{ID}.scope/system.slice/cron.service",
        docker(),
    ),
    (
        "docker shm mount unit",
        f"/system.slice/var-lib-docker-containers-{ID}-mounts-shm.mount",
        NOT_A_CONTAINER,
    ),
    ("docker daemon", "/system.slice/docker.service", NOT_A_CONTAINER),
    ("containerd daemon", "/system.slice/containerd.service", NOT_A_CONTAINER),
    ("docker id too short", f"/docker/{ID[:12]}", NOT_A_CONTAINER),
    ("podman conmon", f"/machine.slice/libpod-conmon-{ID}.scope", NOT_A_CONTAINER),
    ("podman cgroupfs driver", f"/libpod_parent/libpod-{ID}", podman()),
    ("nerdctl, systemd driver", f"/system.slice/nerdctl-{ID}.scope", containerd()),
    ("nomad v1, non-cpuset controller", f"/nomad/{ALLOC}.web", nomad("web")),
    ("nomad task name with dots", f"/nomad.slice/share.slice/{ALLOC}.web.v2.scope", nomad("web.v2")),
    ("lxc monitor", "/lxc.monitor.web01", NOT_A_CONTAINER),
    ("lxc, systemd inside", "/lxc.payload.web01/system.slice/sshd.service", named("lxc", "web01")),
    (
        "systemd-nspawn, escaped name",
        r"/machine.slice/systemd-nspawn@my\x2dbox.service",
        named("systemd-nspawn", "my-box"),
    ),
    ("trailing slash", f"/docker/{ID}/", docker()),
    ("doubled slashes and newline", f"//docker//{ID}\n", docker()),
    ("removed cgroup (deleted)", f"/system.slice/docker-{ID}.scope (deleted)", docker()),
    ("empty string", "", NOT_A_CONTAINER),
    ("relative to another cgroup namespace", f"/../../docker/{ID}", docker()),
]


@pytest.mark.parametrize(("path", "expected"), [(p, e) for _, p, e in SPEC_TABLE], ids=[r for r, _, _ in SPEC_TABLE])
def test_spec_table_row(path: str, expected: ContainerIdentity | None) -> None:
    assert identify(path) == expected


@pytest.mark.parametrize(("path", "expected"), [(p, e) for _, p, e in MORE_ROWS], ids=[r for r, _, _ in MORE_ROWS])
def test_more_rows(path: str, expected: ContainerIdentity | None) -> None:
    assert identify(path) == expected


_path_alphabet = st.sampled_from(
    ["/", ".", "-", "_", ":", "@", "\\", " ", "\n", "a", "f", "0", "9", "docker", "pod", "kubepods", ".slice",
     ".scope", ".mount", "crio-", "libpod-", "nomad", "lxc", "container", ID, ALLOC, POD, POD_, "\x00", "é"]
)  # fmt: skip


@given(st.one_of(st.text(), st.lists(_path_alphabet, max_size=40).map("".join)))
def test_identify_never_raises(path: str) -> None:
    found = identify(path)
    assert found is None or (found.runtime in RUNTIMES and found.id)


def test_identify_deep_path() -> None:
    assert identify("/a" * 60 + f"/docker/{ID}") == docker()
    assert identify("/a" * 10_000 + f"/docker/{ID}") is None  # past 64 components: not followed (bounded cost)
    assert identify("/" * 100_000) is None


# ---- /proc/<pid>/cgroup --------------------------------------------------------------------------

HYBRID_PROC_CGROUP = f"""\
12:cpuset:/nomad/reserved/{ALLOC}.web
11:devices:/docker/{ID}
10:cpu,cpuacct:/docker/{ID}
9:name=systemd:/docker/{ID}
0::/system.slice/containerd.service/system.slice:cri-containerd:{ID2}
"""


def test_parse_proc_cgroup_v1_and_v2_lines() -> None:
    parsed = parse_proc_cgroup(HYBRID_PROC_CGROUP)
    assert parsed == {
        "cpuset": f"/nomad/reserved/{ALLOC}.web",
        "devices": f"/docker/{ID}",
        "cpu": f"/docker/{ID}",
        "cpuacct": f"/docker/{ID}",
        "name=systemd": f"/docker/{ID}",
        "": f"/system.slice/containerd.service/system.slice:cri-containerd:{ID2}",
    }


def test_nomad_v1_one_pid_different_paths_per_controller() -> None:
    parsed = parse_proc_cgroup(HYBRID_PROC_CGROUP)
    assert identify(parsed["cpuset"]) == nomad("web")
    path = cgroup_path_for(parsed)
    assert path == f"/docker/{ID}"
    assert identify(path) == docker()


def test_cgroup_path_for_falls_back_to_v2_line() -> None:
    parsed = parse_proc_cgroup(f"0::/system.slice/docker-{ID}.scope\n")
    assert cgroup_path_for(parsed) == f"/system.slice/docker-{ID}.scope"
    assert cgroup_path_for(parsed, prefer="memory") == f"/system.slice/docker-{ID}.scope"
    assert cgroup_path_for({}) is None
    assert cgroup_path_for(parse_proc_cgroup("4:memory:/m\n"), prefer="memory") == "/m"


def test_parse_proc_cgroup_ignores_malformed_lines() -> None:
    text = "garbage\n\nx:devices:/a\n5:devices\n6:pids:relative\n7:blkio:/b\n"
    assert parse_proc_cgroup(text) == {"blkio": "/b"}


def test_parse_proc_cgroup_real_self() -> None:
    with open("/proc/self/cgroup") as handle:
        parsed = parse_proc_cgroup(handle.read())
    assert parsed
    assert all(path.startswith("/") for path in parsed.values())


@given(st.text())
def test_parse_proc_cgroup_never_raises(text: str) -> None:
    parsed = parse_proc_cgroup(text)
    assert all(path.startswith("/") for path in parsed.values())
    cgroup_path_for(parsed)
