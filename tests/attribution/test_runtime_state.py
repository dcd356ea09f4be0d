"""RuntimeState: which container IDs the runtimes' state directories hold (accelstats/attribution/runtimes.py), and
the identity rules that use it (docs/containers.md, "How a container is found").

State trees are built under tmp_path as the runtimes lay them out (the real runtimes are exercised in
tests/attribution/test_runtimes_attribution.py); the table is (candidate, parent cgroup name) -> (runtime, id).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from accelstats.attribution.runtimes import RuntimeState
from accelstats.cgroups.identity import identify_with_root
from accelstats.settings import RuntimeRoots

D1, D2, P1, P2, C1 = "d1" * 32, "d2" * 32, "a1" * 32, "a2" * 32, "c1" * 32
ALLOC = "0b9f4a1e-1c7b-4a53-a7a4-3d1f4cfc3b61"


def index(path: Path, entries: list[dict[str, object]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entries))


def entry(cid: str, name: str, **meta: str) -> dict[str, object]:
    return {"id": cid, "names": [name], "metadata": json.dumps({"image-name": "img:" + name, **meta})}


@pytest.fixture
def state(tmp_path: Path) -> RuntimeState:
    (tmp_path / "var/lib/docker/containers" / D1).mkdir(parents=True)
    tasks = tmp_path / "run/containerd/io.containerd.runtime.v2.task"
    (tasks / "gpus" / "job1").mkdir(parents=True)
    (tasks / "k8s.io" / C1).mkdir(parents=True)
    (tasks / "moby" / D2).mkdir(parents=True)  # dockerd's own containerd namespace
    index(tmp_path / "var/lib/containers/storage/overlay-containers/containers.json", [entry(P1, "web")])
    index(tmp_path / "var/lib/containers/storage/vfs-containers/containers.json",
          [entry(P2, "k8s_x", **{"pod-name": "p", "pod-id": "1"})])
    (tmp_path / "opt/nomad/data/alloc" / ALLOC).mkdir(parents=True)
    s = RuntimeState(tmp_path, RuntimeRoots())
    s.refresh()
    return s


@pytest.mark.parametrize(("candidate", "parent", "expected"), [
    (D1, "anything", ("docker", D1)),                  # docker's data-root: any path
    (D2, "docker", ("docker", D2)),                    # a task in containerd's "moby" namespace is docker's
    ("job1", "gpus", ("containerd", "job1")),          # ctr -n gpus: /gpus/job1
    ("job1", "other", None),                           # a non-hex ID only under its namespace
    (C1, "pod1234", ("containerd", C1)),               # 64 hex: any namespace, any path
    (P1, "mlpods", ("podman", P1)),                    # containers/storage, overlay
    (P2, "kubepods", ("cri-o", P2)),                   # vfs; CRI-O's entries carry pod-name/pod-id
    (ALLOC, "share.slice", ("nomad", ALLOC)),
    ("f" * 64, "docker", None),
])
def test_known(state: RuntimeState, candidate: str, parent: str, expected: tuple[str, str] | None) -> None:
    found = state.known(candidate, parent)
    assert (found[:2] if found else None) == expected


@pytest.mark.parametrize(("path", "expected"), [
    (f"/gpujobs/team/{D1}", ("docker", D1, "runtime state")),
    (f"/system.slice/docker-{D2}.scope", ("docker", D2, "runtime state")),
    ("/gpus/job1", ("containerd", "job1", "runtime state")),
    (f"/libpod_parent/{'e' * 64}/libpod-{P1}", ("podman", P1, "runtime state")),
    (f"/nomad.slice/share.slice/{ALLOC}.train.scope", ("nomad", f"{ALLOC}.train", "runtime state")),
    (f"/docker/{'f' * 64}", ("docker", "f" * 64, "path rule")),  # not in the state: the path rule still says docker
    ("/gpus/job2", None),
])
def test_identify_with_the_state(state: RuntimeState, path: str, expected: tuple[str, str, str] | None) -> None:
    found = identify_with_root(path, state.known)
    got = (found[1].runtime, found[1].id, found[1].how.split(":")[0]) if found else None
    assert got == expected


def test_podman_pod_id_is_the_pod_uid(state: RuntimeState) -> None:
    found = identify_with_root(f"/libpod_parent/{'e' * 64}/libpod-{P1}", state.known)
    assert found is not None and found[1].pod_uid == "e" * 64


def test_a_new_container_directory_changes_the_link_count(tmp_path: Path) -> None:
    """Long after the last change (no racy window), a new container directory is still seen when its
    parent's modification time is unchanged: the link count moved."""
    containers = tmp_path / "var/lib/docker/containers"
    containers.mkdir(parents=True)
    s = RuntimeState(tmp_path, RuntimeRoots(), clock=lambda: time.time() + 3600)
    s.refresh()
    stamp = containers.stat().st_mtime_ns
    (containers / D1).mkdir()
    os.utime(containers, ns=(stamp, stamp))
    s.refresh()
    assert s.known(D1, "x") is not None


def test_a_file_changed_within_the_racy_window_is_read_again(tmp_path: Path) -> None:
    """An index rewritten in place with the same size, inode and modification time (a change in the
    same clock tick) is parsed again while its modification time is within RACY_SECONDS of now."""
    path = tmp_path / "var/lib/containers/storage/overlay-containers/containers.json"
    index(path, [entry(P1, "web")])
    stamp = path.stat().st_mtime_ns
    now = [stamp / 1e9 + 0.5]
    s = RuntimeState(tmp_path, RuntimeRoots(), clock=lambda: now[0])
    s.refresh()
    with path.open("r+") as f:  # same length, same inode
        f.write(path.read_text().replace(P1, P2))
    os.utime(path, ns=(stamp, stamp))
    s.refresh()
    assert s.storage_entry(P2) is not None
    now[0] += 3600  # long after: read once more (the last read was in the window), then trusted
    s.refresh()
    path.write_text(path.read_text().replace(P2, P1))
    os.utime(path, ns=(stamp, stamp))
    s.refresh()
    assert s.known(P1, "x") is None and s.known(P2, "x") is not None


def test_missing_roots_and_bad_indexes(tmp_path: Path) -> None:
    index_path = tmp_path / "var/lib/containers/storage/overlay-containers/containers.json"
    index_path.parent.mkdir(parents=True)
    index_path.write_text("[{")
    s = RuntimeState(tmp_path, RuntimeRoots(docker_data_root=Path("/elsewhere/docker")))
    s.refresh()
    s.refresh()
    assert s.errors == 1  # the same bad file once, however often it is looked at
    missing = dict(s.missing_roots())
    assert missing["docker_data_root"] == Path("/elsewhere/docker")
    assert "storage_graphroot" not in missing
    index_path.write_text(json.dumps([entry(P1, "web"), "junk", {"id": "../etc"}, {"id": P2, "names": 5}]))
    s.refresh()
    assert s.storage_entry(P1) is not None and s.storage_entry(P2) is not None and s.storage_entry("../etc") is None


def test_one_containerd_id_in_two_namespaces_keeps_each_ones_labels(tmp_path: Path) -> None:
    """``ctr -n alpha run … train`` and ``ctr -n beta run … train``: each cgroup gets its own
    namespace's bundle (the metadata cache is keyed by namespace too); a v1-runtime bundle is read."""
    from accelstats.attribution.metadata import MetadataReader
    tasks = tmp_path / "run/containerd/io.containerd.runtime.v2.task"
    for ns in ("alpha", "beta"):
        bundle = tasks / ns / "train"
        bundle.mkdir(parents=True)
        (bundle / "config.json").write_text(json.dumps({"annotations": {
            "io.kubernetes.cri.image-name": f"img-{ns}", "io.kubernetes.cri.sandbox-name": f"pod-{ns}"}}))
    v1 = tmp_path / "run/containerd/io.containerd.runtime.v1.linux/k8s.io/old"
    v1.mkdir(parents=True)
    (v1 / "config.json").write_text(json.dumps({"annotations": {"io.kubernetes.cri.image-name": "img-v1"}}))
    state = RuntimeState(tmp_path, RuntimeRoots())
    state.refresh()
    reader = MetadataReader(tmp_path, runtimes=state)
    for ns in ("alpha", "beta", "alpha"):
        found = identify_with_root(f"/{ns}/train", state.known)
        assert found is not None
        meta = reader.lookup(found[1])
        assert (meta.image, meta.pod) == (f"img-{ns}", f"pod-{ns}")
    found = identify_with_root("/k8s.io/old", state.known)
    assert found is not None and reader.lookup(found[1]).image == "img-v1"


def test_many_containerd_namespaces_are_capped_with_one_warning(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    from accelstats.attribution import runtimes
    tasks = tmp_path / "run/containerd/io.containerd.runtime.v2.task"
    for i in range(runtimes.MAX_NAMESPACES + 5):
        (tasks / f"ns{i:05d}").mkdir(parents=True)
    (tasks / "zzz" / "train").mkdir(parents=True)
    state = RuntimeState(tmp_path, RuntimeRoots())
    state.refresh()
    state.refresh()
    assert state.known("train", "zzz") is None
    assert len([r for r in caplog.records if "containerd namespaces" in r.getMessage()]) == 1
    assert f"only the first {runtimes.MAX_NAMESPACES}" in caplog.text


def test_a_modification_time_in_the_future_is_not_read_again_forever(tmp_path: Path) -> None:
    path = tmp_path / "var/lib/containers/storage/overlay-containers/containers.json"
    index(path, [entry(P1, "web")])
    future = time.time() + 86400
    os.utime(path, (future, future))
    s = RuntimeState(tmp_path, RuntimeRoots())
    s.refresh()
    path.write_text(path.read_text().replace(P1, P2))
    os.utime(path, (future, future))
    s.refresh()  # same size, inode and mtime, far from now: trusted (not re-parsed every scrape)
    assert s.known(P1, "x") is not None


@pytest.mark.parametrize(("value", "expected"), [
    ("//var/lib/docker", "/var/lib/docker"), ("/srv/../var/lib/docker/", "/var/lib/docker"),
    ("/../../etc", "/etc"),  # never above the host root: read under rootfs all the same
])
def test_runtime_roots_are_normalised(tmp_path: Path, value: str, expected: str) -> None:
    from accelstats.config import load_config
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[runtimes]\ndocker_data_root = "{value}"\n')
    roots = load_config(cfg).runtimes
    assert roots.docker_data_root == Path(expected)
    assert RuntimeState(tmp_path, roots).docker_containers() == tmp_path / expected.lstrip("/") / "containers"


def test_mps_clients_are_named_by_the_runtime_state_too(state: RuntimeState, tmp_path: Path) -> None:
    """``accelstats mps status``: a client in ``ctr -n gpus`` container job1 (a path no rule knows)."""
    from accelstats.mps.host import client_containers
    proc = tmp_path / "proc"
    for pid, path in ((41, "/gpus/job1"), (42, "/gpus/other")):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(f"0::{path}\n")
    assert client_containers([41, 42], proc, state.known) == {41: "/gpus/job1"}
    assert client_containers([41, 42], proc) == {}
