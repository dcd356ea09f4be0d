"""RuntimeState: which container IDs the runtimes' state directories hold (accelstats/attribution/runtimes.py), and
the identity rules that use it (docs/containers.md, "How a container is found").

State trees are built under tmp_path as the runtimes lay them out (the real runtimes are exercised in
tests/attribution/test_runtimes_attribution.py); the table is (candidate, parent cgroup name) -> (runtime, id).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import time
import tracemalloc
from pathlib import Path

import pytest

from accelstats.attribution import runtimes
from accelstats.attribution.attributor import Attributor
from accelstats.attribution.runtimes import RuntimeState
from accelstats.catalog import ATTRIBUTION_SKIPPED
from accelstats.cgroups.identity import identify_with_root
from accelstats.cgroups.mode import CgroupLayout, CgroupMode
from accelstats.manager import Collection
from accelstats.settings import RuntimeRoots
from collectors.model import DeviceSnapshot

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


def test_a_file_changed_within_the_racy_window_is_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An index rewritten in place with the same size, inode and modification time (a change in the
    same clock tick) is parsed again while its modification time is within RACY_SECONDS of now."""
    monkeypatch.setattr(runtimes, "BACKOFF_MIN_SECONDS", float("inf"))  # a preempted parse holds nothing back
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


# -- issue 24, row 7: an index someone else writes ------------------------------------------------

STORAGE_INDEX = "var/lib/containers/storage/overlay-containers/containers.json"


def test_a_fifo_swapped_in_between_the_stat_and_the_read_is_refused(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The index is a regular file when ``stat``-ed and a FIFO with a writer (no data yet) when
    opened: dbbc921 opened it, got ``None`` from a non-blocking read and the collection raised
    ``TypeError``. Now the FIFO is refused unopened, counted once, and the other indexes still count."""
    index(tmp_path / STORAGE_INDEX, [entry(P1, "web")])
    index(tmp_path / "var/lib/containers/storage/vfs-containers/containers.json", [entry(P2, "db")])
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # a writer holds it: a read would find no data, no EOF
    real_stat = os.stat
    swapped: list[Path] = []

    def stat_then_swap(path: object, *args: object, **kw: object) -> os.stat_result:
        result = real_stat(path, *args, **kw)  # type: ignore[arg-type]
        if str(path) == str(tmp_path / STORAGE_INDEX) and not swapped:
            os.rename(fifo, tmp_path / STORAGE_INDEX)  # right after the stat, before any open
            swapped.append(tmp_path / STORAGE_INDEX)
        return result

    monkeypatch.setattr(os, "stat", stat_then_swap)
    try:
        s = RuntimeState(tmp_path, RuntimeRoots())
        s.refresh()
    finally:
        monkeypatch.undo()
        os.close(writer)
    assert swapped and stat.S_ISFIFO(os.lstat(swapped[0]).st_mode)
    assert s.known(P1, "x") is None
    assert s.known(P2, "x") == ("podman", P2, "var/lib/containers/storage/vfs-containers/containers.json", "")
    assert s.errors == 1


def near_cap_index(shape: str) -> bytes:
    """An index of nearly :data:`MAX_INDEX_BYTES`: ``"podman"``, entries as podman 4.3 writes them
    (about 510 bytes each); ``"[]"``, a list of empty lists (24 bytes of Python objects per 3 bytes);
    ``'{"id":0}'``, as many of those as the values-per-byte check lets through, padded by a string
    that holds one non-ASCII character (the whole text is then decoded 4 bytes a character)."""
    cap = runtimes.MAX_INDEX_BYTES - 4096
    if shape == "podman":
        one = json.dumps(entry(P1, "worker-00000") | {"image": "f" * 64, "layer": "9" * 64,
                         "created": "2026-12-05T08:02:40.311551711Z", "flags": {"MountLabel": "", "ProcessLabel": ""}},
                         separators=(",", ":"))
        return ("[" + ",".join(one.replace(P1, f"{i:064x}") for i in range(cap // (len(one) + 1))) + "]").encode()
    if shape == "[]":
        return ("[" + ",".join(["[]"] * (cap // 3)) + "]").encode()
    per_value = runtimes.MIN_BYTES_PER_VALUE
    items = ",".join([shape] * (cap // (3 * per_value)))
    head = f'[[{items}],"\U0001f600'.encode()
    values = sum(head.count(c) for c in b"[{,:")
    return head + b"x" * (values * per_value - len(head) - 2) + b'"]'


@pytest.mark.parametrize(("shape", "parsed"), [("podman", True), ("[]", False), ('{"id":0}', True)])
def test_parsing_a_near_cap_index_costs_a_bounded_multiple_of_its_size(tmp_path: Path, shape: str,
                                                                       parsed: bool) -> None:
    """dbbc921 parsed up to 16 MiB with ``json.loads``: a list of ``[]`` cost 24 times its size (389 MiB
    of RSS for 16 MiB). Now: at most 4 MiB, at most one value per MIN_BYTES_PER_VALUE bytes (counted
    before parsing), only ``id``, ``names`` and ``metadata`` kept: tracemalloc's peak stays under 16
    times the file's size whatever it holds (measured: 6x for podman's entries, 14.2x for the worst
    shape let through)."""
    data = near_cap_index(shape)
    assert runtimes.MAX_INDEX_BYTES - 64 * 1024 < len(data) <= runtimes.MAX_INDEX_BYTES
    path = tmp_path / STORAGE_INDEX
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    s = RuntimeState(tmp_path, RuntimeRoots())
    tracemalloc.start()
    try:
        s.refresh()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 16 * len(data), f"{peak / len(data):.1f} times the index's size"
    assert s.errors == (0 if parsed else 1)
    if shape == "podman":
        assert s.known(f"{7:064x}", "x") is not None and s.storage_entry(f"{7:064x}") == runtimes.StorageEntry(
            "worker-00000", "img:worker-00000", False, path)


def test_an_index_rewritten_at_every_collection_is_parsed_at_most_once_per_back_off(tmp_path: Path) -> None:
    """A near-cap index (its parse takes tens of milliseconds) rewritten before each collection is
    parsed again only BACKOFF_FACTOR times its last parse time later; a small one is never held back
    (test_a_file_changed_within_the_racy_window_is_read_again)."""
    path = tmp_path / STORAGE_INDEX
    path.parent.mkdir(parents=True)
    data = near_cap_index("podman")
    path.write_bytes(data)
    later = [0.0]
    s = RuntimeState(tmp_path, RuntimeRoots(), timer=lambda: time.monotonic() + later[0])
    s.refresh()
    path.write_bytes(data.replace(b'"worker-00000"', b'"worker-11111"'))  # a new version, the same size
    s.refresh()
    first = s.storage_entry(f"{7:064x}")
    assert first is not None and first.name == "worker-00000"  # held back
    later[0] += 3600
    s.refresh()
    again = s.storage_entry(f"{7:064x}")
    assert again is not None and again.name == "worker-11111"


@pytest.mark.root
def test_real_podman_indexes_fit_the_limits_with_room(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """What the limits are measured against: 10 containers made by the real podman in a private
    storage root (vfs driver, nothing started). Each costs about 510 bytes of index (MAX_INDEX_BYTES
    holds 8 000), with one JSON value per 16 bytes or more (MIN_BYTES_PER_VALUE is 10), and they are
    all read back with their names and image."""
    from conftest import require_tool
    run = Path(tempfile.mkdtemp(prefix="acs-", dir="/run"))  # podman wants a runroot of at most 50 characters
    request.addfinalizer(lambda: shutil.rmtree(run, ignore_errors=True))
    podman = [require_tool("podman", "podman"), "--root", str(tmp_path / "root"), "--runroot", str(run),
              "--storage-driver", "vfs", "--events-backend", "none", "--cgroup-manager", "cgroupfs"]
    with tarfile.open(tmp_path / "empty.tar", "w"):
        pass
    subprocess.run([*podman, "import", "-q", str(tmp_path / "empty.tar"), "localhost/empty:1"], check=True,
                   capture_output=True, timeout=60)
    for i in range(10):
        subprocess.run([*podman, "create", "-q", "--name", f"c{i}", "localhost/empty:1", "/x"], check=True,
                       capture_output=True, timeout=60)
    data = (tmp_path / "root/vfs-containers/containers.json").read_bytes()
    values = sum(data.count(c) for c in b"[{,:")
    assert len(data) / 10 < runtimes.MAX_INDEX_BYTES / 7500
    assert len(data) / values > 1.5 * runtimes.MIN_BYTES_PER_VALUE
    s = RuntimeState(Path("/"), RuntimeRoots(storage_graphroot=tmp_path / "root", storage_runroot=run))
    s.refresh()
    assert s.errors == 0
    found = {e.name: e.image for e in (s.storage_entry(d["id"]) for d in json.loads(data)) if e is not None}
    assert found == {f"c{i}": "localhost/empty:1" for i in range(10)}


REFUSED_INDEXES = {
    "over MAX_INDEX_BYTES": b"[" + b" " * runtimes.MAX_INDEX_BYTES + b"]",
    "more than one value per 10 bytes": b"[" + b"[]," * 30_000 + b"[]]",
    "not JSON": b"[{",
}


@pytest.mark.parametrize("why", REFUSED_INDEXES)
def test_a_refused_index_is_counted_in_the_attribution_skipped_metric(tmp_path: Path, why: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Row 7 follow-up: an index that is not used is warned once per path and counted in
    ``accelstats_attribution_skipped_total{reason="runtime_index_refused"}``, once per version of the
    file (before, only in ``MetadataReader.errors``, which nothing exports)."""
    # no back-off after a slow parse: refusing 4 MiB took past BACKOFF_MIN_SECONDS on a loaded CI
    # machine once, and the new version then waited out the back-off (the back-off's own test is apart)
    monkeypatch.setattr(runtimes, "BACKOFF_MIN_SECONDS", float("inf"))
    text = REFUSED_INDEXES[why]
    path = tmp_path / STORAGE_INDEX
    path.parent.mkdir(parents=True)
    path.write_bytes(text)
    (tmp_path / "cgroup").mkdir()
    attributor = Attributor(CgroupLayout(CgroupMode.V2, None, tmp_path / "cgroup"), tmp_path / "proc", tmp_path,
                            open_fds=False)

    def exported() -> float:
        attributor.attribute(DeviceSnapshot())
        collection = Collection(DeviceSnapshot(), attribution_skipped=dict(attributor.skipped))
        assert ATTRIBUTION_SKIPPED.read is not None
        return dict(ATTRIBUTION_SKIPPED.read(collection))[("runtime_index_refused",)]

    assert exported() == 1
    assert exported() == 1  # the same version: not counted again
    path.write_bytes(text + b" ")
    assert exported() == 2  # a new version refused again


def test_at_most_eight_storage_drivers_are_read_per_root(tmp_path: Path) -> None:
    """containers/storage has six drivers; a rootless owner's graphroot may hold any number of
    ``<name>-containers`` directories: the first eight (in name order) are read."""
    graph = tmp_path / "var/lib/containers/storage"
    ids = [f"{n:02x}" * 32 for n in range(10)]
    for n, cid in enumerate(ids):
        index(graph / f"d{n}-containers" / "containers.json", [entry(cid, f"c{n}")])
    s = RuntimeState(tmp_path, RuntimeRoots())
    s.refresh()
    assert [s.known(cid, "") is not None for cid in ids] == [True] * 8 + [False] * 2


def test_roots_left_out_of_read_are_neither_read_nor_missing(state: RuntimeState) -> None:
    state.read = frozenset({"storage_graphroot"})
    state.refresh()
    assert state.known_ids() == {"docker": 0, "containerd": 0, "storage": 2, "nomad": 0}
    assert state.missing_roots() == []  # storage_graphroot exists; the others are not looked at
