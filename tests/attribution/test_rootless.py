"""Rootless podman and docker containers (cgroups under ``user@<uid>.service``): named from their owner's
own runtime state and labelled with their owner, never with a system container's identity
(docs/containers.md, "Rootless containers"; accelstats/attribution/rootless.py).

The owner's podman state is written by real podman (``podman --root <home>/.local/share/containers/storage
--runroot /run/user/<uid>/containers create``: the paths rootless podman uses, the files it writes), then
handed to the owner as a rootless podman's are; docker's ``config.v2.json`` is written as dockerd writes it
(``ID``, ``Name`` with its ``/``, ``Config.Image``).  The cgroup tree is built as systemd and the runtimes
make it on cgroup v2 (this host has no systemd to delegate a subtree).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from conftest import in_ci
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support.runtimes_harness import IMAGE, Podman, rootfs_tar
from test_attribution import GIB, GPU0, GPU1, Host, _Fixed, rows, table

from accelstats.web.exposition import render

pytestmark = pytest.mark.root  # chown to the owner needs CAP_CHOWN

ALICE = 1000
USER = f"/user.slice/user-{ALICE}.slice/user@{ALICE}.service"
SYSTEM_ID = "5" * 64
D_ID = "d" * 64


@pytest.fixture
def h200(fixtures_dir: Path) -> Path:
    return fixtures_dir / "h200" / "nvidia-smi-q.xml"


def podman_create(rootfs: Path, uid: int, home: str, name: str) -> str:
    """A container made by real podman in ``uid``'s rootless storage (graphroot under the home, runroot
    under /run/user/<uid>), handed to the owner; its ID."""
    reason = Podman.unavailable()
    if reason is not None:
        if in_ci():
            pytest.fail(f"podman cannot run under CI=true: {reason}", pytrace=False)
        pytest.skip(reason)
    graph = rootfs / home.lstrip("/") / ".local/share/containers/storage"
    # podman refuses a runroot path over 50 characters: it runs with a short one, which then moves to
    # /run/user/<uid>/containers (containers.json, the index read, is in the graphroot)
    run = Path(tempfile.mkdtemp(prefix="accelstats-rr-"))
    base = ["podman", "--root", str(graph), "--runroot", str(run), "--storage-driver", "vfs", "--cgroup-manager",
            "cgroupfs", "--events-backend", "file", "--tmpdir", str(rootfs / "tmp")]
    imported = subprocess.run([*base, "import", "-", IMAGE], input=rootfs_tar(), capture_output=True, timeout=60)
    assert imported.returncode == 0, imported.stderr.decode(errors="replace")
    made = subprocess.run([*base, "create", "--name", name, IMAGE, "sleep", "1"], capture_output=True, text=True,
                          timeout=60)
    assert made.returncode == 0, made.stderr
    cid = made.stdout.strip()
    (rootfs / f"run/user/{uid}").mkdir(parents=True)
    run = Path(shutil.move(run, rootfs / f"run/user/{uid}/containers"))
    for d in (graph, run):
        for where, dirs, files in os.walk(d):
            for n in (*dirs, *files):
                os.lchown(os.path.join(where, n), uid, uid)
        os.chown(d, uid, uid)
    return cid


def docker_state(data_root: Path, cid: str, name: str, image: str, uid: int = 0) -> None:
    d = data_root / "containers" / cid
    d.mkdir(parents=True)
    (d / "config.v2.json").write_text(json.dumps({"ID": cid, "Name": f"/{name}", "Config": {"Image": image}}))
    for p in (data_root, data_root / "containers", d):
        os.chown(p, uid, uid)


def passwd(host: Host, *lines: str) -> None:
    (host.rootfs / "etc").mkdir(exist_ok=True)
    (host.rootfs / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n" + "".join(f"{x}\n" for x in lines))


def info_labels(collection: object) -> dict[str, dict[str, str]]:
    text = generate_latest(_Fixed(list(render(collection)))).decode()  # type: ignore[arg-type]
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return {s.labels["id"]: s.labels for s in families["accelstats_container_info"].samples}


def test_rootless_podman_and_docker_are_named_from_their_owners_state(tmp_path: Path, h200: Path) -> None:
    """| cgroup (under user@1000.service)            | owner's state          | runtime | name    | owner_uid |
       | user.slice/libpod-<P>.scope/container       | podman's containers.json | podman | trainer | 1000      |
       | user.slice/docker-<D>.scope                 | docker's config.v2.json  | docker | infer   | 1000      |
    and a system docker container keeps owner_uid "" beside them."""
    host = Host(tmp_path, h200)
    passwd(host, f"alice:x:{ALICE}:{ALICE}:Alice:/home/alice:/bin/bash")
    pid = podman_create(host.rootfs, ALICE, "/home/alice", "trainer")
    docker_state(host.rootfs / "home/alice/.local/share/docker", D_ID, "infer", "vllm/vllm:0.6", uid=ALICE)
    docker_state(host.rootfs / "var/lib/docker", SYSTEM_ID, "victim", "corp/prod:1")
    podman = f"{USER}/user.slice/libpod-{pid}.scope"
    docker = f"{USER}/user.slice/docker-{D_ID}.scope"
    system = f"/system.slice/docker-{SYSTEM_ID}.scope"
    host.container(podman + "/container", [1301])
    host.container(docker, [1302])
    host.container(system, [1303])
    host.process(1301, podman + "/container", gpu=0, used=GIB)
    host.process(1302, docker, gpu=1, used=2 * GIB)
    host.process(1303, system, gpu=1, used=3 * GIB)
    c = host.collect()
    r = rows(c)
    got = {path: (s.identity.runtime, s.identity.id, s.identity.owner, s.metadata.name, s.metadata.image)
           for path, s in r.items() if s.identity is not None}
    assert got == {
        podman: ("podman", pid, "1000", "trainer", IMAGE),
        docker: ("docker", D_ID, "1000", "infer", "vllm/vllm:0.6"),
        system: ("docker", SYSTEM_ID, "", "victim", "corp/prod:1"),
    }
    assert not any("not trusted" in s.reason or "no name" in s.reason for s in r.values())
    assert table(r[podman]) == [(GPU0, "process", GIB, 1)]
    assert table(r[docker]) == [(GPU1, "process", 2 * GIB, 1)]
    assert "rootless, owner uid 1000" in r[podman].identity.how  # identified_by
    labels = info_labels(c)
    assert {k: (v["runtime"], v["container_id"], v["owner_uid"]) for k, v in labels.items()} == {
        podman: ("podman", pid, "1000"), docker: ("docker", D_ID, "1000"), system: ("docker", SYSTEM_ID, "")}


def test_a_rootless_container_never_takes_a_system_containers_identity(tmp_path: Path, h200: Path) -> None:
    """The owner writes their own state: claiming a system container's ID (and its name) there, in a
    cgroup named after it, still gives ``runtime="unknown"`` with the whole path as id; the system
    container keeps its row.  A container whose owner's state does not know it, and one whose owner's
    state root is a link to state the owner does not own, stay unknown too."""
    host = Host(tmp_path, h200)
    passwd(host, f"alice:x:{ALICE}:{ALICE}::/home/alice:/bin/sh", "bob:x:1001:1001::/home/bob:/bin/sh")
    docker_state(host.rootfs / "var/lib/docker", SYSTEM_ID, "victim", "corp/prod:1")
    docker_state(host.rootfs / "home/alice/.local/share/docker", SYSTEM_ID, "victim", "corp/prod:1", uid=ALICE)
    other = "e" * 64  # a root-owned docker instance [runtimes] does not name
    docker_state(host.rootfs / "srv/docker", other, "secret", "corp/secret:1")
    (host.rootfs / "home/bob/.local/share").mkdir(parents=True)
    (host.rootfs / "home/bob/.local/share/docker").symlink_to(host.rootfs / "srv/docker")
    system = f"/system.slice/docker-{SYSTEM_ID}.scope"
    claim = f"{USER}/user.slice/docker-{SYSTEM_ID}.scope"
    stateless = f"{USER}/user.slice/libpod-{'7' * 64}.scope"
    linked = f"/user.slice/user-1001.slice/user@1001.service/user.slice/docker-{other}.scope"
    for pid, path in enumerate((system, claim, stateless, linked), start=1401):
        host.container(path, [pid])
        host.process(pid, path, gpu=0)
    r = rows(host.collect())
    assert (r[system].identity.runtime, r[system].identity.id, r[system].metadata.name) == ("docker", SYSTEM_ID,
                                                                                           "victim")
    for path, why in ((claim, f"claims docker ID {SYSTEM_ID[:12]}, which a system runtime knows"),
                      (stateless, "the runtime state of its owner uid 1000"),
                      (linked, "the runtime state of its owner uid 1001 (none usable) does not know it")):
        row = r[path]
        assert (row.identity.runtime, row.identity.id, row.identity.owner) == ("unknown", path, ""), path
        assert row.metadata.name == "" and why in row.reason and "under user@" in row.reason, (path, row.reason)


@pytest.mark.parametrize("path", [
    f"/user.slice/user-{ALICE}.slice/user@1001.service/user.slice/docker-{D_ID}.scope",  # uids differ
    f"/system.slice/user@{ALICE}.service/docker-{D_ID}.scope",  # not where systemd makes it
    f"/user.slice/user-{ALICE}.slice/session-3.scope/user@{ALICE}.service/docker-{D_ID}.scope",
], ids=["two-uids", "outside-user-slice", "nested"])
def test_only_systemds_user_manager_path_names_an_owner(tmp_path: Path, h200: Path, path: str) -> None:
    host = Host(tmp_path, h200)
    passwd(host, f"alice:x:{ALICE}:{ALICE}::/home/alice:/bin/sh", "bob:x:1001:1001::/home/bob:/bin/sh")
    for home, uid in (("alice", ALICE), ("bob", 1001)):
        docker_state(host.rootfs / f"home/{home}/.local/share/docker", D_ID, "infer", "vllm/vllm:0.6", uid=uid)
    host.container(path, [1501])
    host.process(1501, path, gpu=0)
    (row,) = rows(host.collect()).values()
    assert row.identity is not None and (row.identity.runtime, row.identity.owner) == ("unknown", "")


def test_a_user_manager_in_a_parent_a_user_may_write_names_no_owner(tmp_path: Path, h200: Path) -> None:
    """user@<uid>.service is trusted to be systemd's only in a root-owned user-<uid>.slice."""
    host = Host(tmp_path, h200)
    passwd(host, f"alice:x:{ALICE}:{ALICE}::/home/alice:/bin/sh")
    docker_state(host.rootfs / "home/alice/.local/share/docker", D_ID, "infer", "vllm/vllm:0.6", uid=ALICE)
    path = f"{USER}/user.slice/docker-{D_ID}.scope"
    host.container(path, [1601])
    host.process(1601, path, gpu=0)
    os.chown(host.cgroup / f"user.slice/user-{ALICE}.slice", ALICE, ALICE)
    (row,) = rows(host.collect()).values()
    assert (row.identity.runtime, row.identity.owner) == ("unknown", "")
    assert "user@1000.service itself is not where systemd makes it" in row.reason
