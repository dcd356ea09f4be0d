"""Attribution with the real runtimes: docker, podman and containerd, started by the tests.

Each runtime keeps its state under a temporary directory, so ``[runtimes]`` in the config names those
roots (as an operator with a non-default ``data-root``, ``graphroot`` or containerd ``state`` would).
The containers cover the cgroup paths of docs/containers.md: docker by default and under
``--cgroup-parent`` at one and two levels, a compose-style name with labels, podman by default, in a
pod with an infra container, under ``--cgroup-parent``, with ``--privileged`` and on ``vfs`` storage,
containerd through ``ctr`` in a namespace of its own; one with two GPUs, one with none.  For each the
table below says: listed or not, runtime, name, image, GPUs and how they were attributed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import in_ci
from support.ports import free_port
from support.runtimes_harness import IMAGE, Containerd, Docker, Podman, gpu_nodes, token
from support.scenarios_util import two_gpu_scenario

pytestmark = [pytest.mark.root, pytest.mark.xdist_group("runtimes")]  # one worker starts the runtimes once

GPU0 = "GPU-00000000-3333-4000-8000-000000000000"
GPU1 = "GPU-00000001-3333-4000-8000-000000000001"
GIB = 1 << 30
CTR_IMAGE_REASON = "metadata database"


def require(runtime: type[Docker] | type[Podman] | type[Containerd]) -> None:
    reason = runtime.unavailable()
    if reason is not None:
        if in_ci():
            pytest.fail(f"{runtime.name} cannot run under CI=true: {reason}", pytrace=False)
        pytest.skip(reason)


@dataclass
class Expect:
    """One row of the table: what ``accelstats containers --json`` must say about a container."""

    runtime: str
    name: str
    image: str
    devices: list[tuple[str, str]]  # (GPU UUID, attribution); [] with listed=False: not a GPU container
    listed: bool = True
    reason: str = ""  # a fragment the REASON must hold ("" = no reason)
    pod_uid: str = ""
    by: str = "runtime state"  # how it was identified: "runtime state" or "path rule"
    cgroup: str = ""  # the cgroup path the runtime made, with {id} (and {pod}) for the IDs


@dataclass
class Host:
    """The runtimes and the containers started in them: ``ids[label]`` (full IDs), ``pids``, ``expect``."""

    docker: Docker
    podman: Podman
    vfs: Podman
    containerd: Containerd
    nodes: dict[int, Path]
    ids: dict[str, str]
    cgroups: dict[str, str]
    pids: dict[str, int]
    expect: dict[str, Expect]


def config(tmp_path: Path, docker: Docker, podman: Podman, containerd: Containerd) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(
        "[runtimes]\n"
        f'docker_data_root = "{docker.data_root}"\n'
        f'containerd_root = "{containerd.root}"\n'
        f'containerd_state = "{containerd.state}"\n'
        f'storage_graphroot = "{podman.graphroot}"\n'
        f'storage_runroot = "{podman.runroot}"\n')
    return path


def devices_cgroup_path(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "devices" in controllers.split(","):
            return path
    raise AssertionError(f"no devices line for {pid}")


@pytest.fixture(scope="module")
def host() -> Iterator[Host]:
    for runtime in (Docker, Podman, Containerd):
        require(runtime)
    t = token()
    with gpu_nodes([0, 1]) as nodes, Docker() as docker, Podman() as podman, Podman("vfs") as vfs, \
            Containerd() as containerd:
        dev0, dev1 = f"{nodes[0]}:/dev/nvidia0", f"{nodes[1]}:/dev/nvidia1"
        ctl = f"{nodes[255]}:/dev/nvidiactl"
        ids: dict[str, str] = {}
        pids: dict[str, int] = {}

        def keep(label: str, info: dict[str, Any]) -> None:
            ids[label], pids[label] = info["Id"], info["State"]["Pid"]

        keep("docker_default", docker.run("--device", dev0, "--device", ctl, name=f"plain-{t}"))
        keep("docker_parent", docker.run("--device", dev1, "--cgroup-parent", f"/gpujobs-{t}", name=f"parent-{t}"))
        keep("docker_parent2", docker.run("--device", dev0, "--device", dev1, "--cgroup-parent",
                                          f"/gpujobs-{t}/team", name=f"two-gpus-{t}"))
        keep("docker_compose", docker.run("--device", dev1, "--label", f"com.docker.compose.project=proj{t}",
                                          "--label", "com.docker.compose.service=train",
                                          "--label", "com.docker.compose.container-number=1",
                                          name=f"proj{t}-train-1"))
        keep("docker_nogpu", docker.run(name=f"nogpu-{t}"))
        keep("podman_default", podman.run("--device", dev0, name=f"pm-{t}"))
        pod_id = podman.pod(f"pod-{t}")
        keep("podman_pod", podman.run("--pod", f"pod-{t}", "--device", dev1, name=f"in-pod-{t}"))
        keep("podman_parent", podman.run("--device", dev0, "--cgroup-parent", f"/mlpods-{t}", name=f"ml-{t}"))
        keep("podman_privileged", podman.run("--privileged", name=f"priv-{t}"))
        keep("podman_vfs", vfs.run("--device", dev1, name=f"vfs-{t}"))
        ids["ctr"] = f"job-{t}"
        pids["ctr"] = containerd.run(f"gpus-{t}", ids["ctr"], nodes[1])
        cgroups = {label: devices_cgroup_path(pid) for label, pid in pids.items()}
        expect = {
            "docker_default": Expect("docker", f"plain-{t}", IMAGE, [(GPU0, "devices_cgroup")], cgroup="/docker/{id}"),
            "docker_parent": Expect("docker", f"parent-{t}", IMAGE, [(GPU1, "devices_cgroup")],
                                    cgroup=f"/gpujobs-{t}/{{id}}"),
            "docker_parent2": Expect("docker", f"two-gpus-{t}", IMAGE,
                                     [(GPU0, "devices_cgroup"), (GPU1, "devices_cgroup")],
                                     cgroup=f"/gpujobs-{t}/team/{{id}}"),
            "docker_compose": Expect("docker", f"proj{t}-train-1", IMAGE, [(GPU1, "devices_cgroup")],
                                     cgroup="/docker/{id}"),
            "docker_nogpu": Expect("docker", f"nogpu-{t}", IMAGE, [], listed=False, cgroup="/docker/{id}"),
            "podman_default": Expect("podman", f"pm-{t}", IMAGE, [(GPU0, "devices_cgroup")],
                                     cgroup="/libpod_parent/libpod-{id}"),
            "podman_pod": Expect("podman", f"in-pod-{t}", IMAGE, [(GPU1, "devices_cgroup")],
                                 reason="pod name not read", pod_uid=pod_id, cgroup="/libpod_parent/{pod}/libpod-{id}"),
            "podman_parent": Expect("podman", f"ml-{t}", IMAGE, [(GPU0, "devices_cgroup")],
                                    cgroup=f"/mlpods-{t}/libpod-{{id}}"),
            # privileged: a *:* rwm proves nothing; its process on GPU 0 (the replay lists it) does
            "podman_privileged": Expect("podman", f"priv-{t}", IMAGE, [(GPU0, "process")],
                                        cgroup="/libpod_parent/libpod-{id}"),
            # vfs storage in another graphroot than the one configured here (test_vfs_storage configures
            # it): podman's default path, so podman by the path rule, without a name
            "podman_vfs": Expect("podman", "", "", [(GPU1, "devices_cgroup")], reason="has no file for this container",
                                 by="path rule", cgroup="/libpod_parent/libpod-{id}"),
            "ctr": Expect("containerd", ids["ctr"], "", [(GPU1, "devices_cgroup")], reason=CTR_IMAGE_REASON,
                          cgroup=f"/gpus-{t}/{{id}}"),
        }
        for label, want in expect.items():  # the paths of docs/containers.md, as these runtimes made them
            assert cgroups[label] == want.cgroup.format(id=ids[label], pod=pod_id), (label, cgroups[label])
        yield Host(docker, podman, vfs, containerd, nodes, ids, cgroups, pids, expect)


def accelstats(*args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "accelstats", *args], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    return proc


def rows_of(host: Host, tmp_path: Path, fixtures_dir: Path, cfg: Path, *extra: str) -> dict[str, dict[str, Any]]:
    replay = two_gpu_scenario(tmp_path, fixtures_dir, (GPU0, GPU1),
                              {GPU0: [(host.pids["podman_privileged"], GIB), (host.pids["docker_default"], 2 * GIB)]})
    out = accelstats("containers", "--json", "--config", str(cfg), "--nvml-replay", str(replay), *extra).stdout
    return {r["cgroup"]: r for r in json.loads(out)}


def test_every_runtime_and_path_is_attributed_with_its_identity(host: Host, tmp_path: Path,
                                                                fixtures_dir: Path) -> None:
    rows = rows_of(host, tmp_path, fixtures_dir, config(tmp_path, host.docker, host.podman, host.containerd))
    for label, want in host.expect.items():
        cgroup = host.cgroups[label]
        if not want.listed:
            assert cgroup not in rows, label
            continue
        row = rows[cgroup]
        got = (row["runtime"], row["name"], row["image"], [(d["uuid"], d["attribution"]) for d in row["devices"]])
        assert got == (want.runtime, want.name, want.image, want.devices), label
        assert row["id"] == host.ids[label], label  # the full container ID
        assert row["identified_by"].startswith(want.by), (label, row["identified_by"])
        if want.reason:
            assert want.reason in row["reason"], (label, row["reason"])
        else:
            assert row["reason"] == "", (label, row["reason"])
        assert row["pod_uid"] == want.pod_uid, label
    # the container's own memory: its process's, or 0 on a GPU granted and unused
    assert rows[host.cgroups["docker_default"]]["devices"][0]["memory_used_bytes"] == 2 * GIB
    assert [d["memory_used_bytes"] for d in rows[host.cgroups["docker_parent2"]]["devices"]] == [0, 0]


def test_vfs_storage(host: Host, tmp_path: Path, fixtures_dir: Path) -> None:
    """podman on the vfs driver keeps its index in vfs-containers/: found like overlay's."""
    rows = rows_of(host, tmp_path, fixtures_dir, config(tmp_path, host.docker, host.vfs, host.containerd))
    row = rows[host.cgroups["podman_vfs"]]
    assert (row["runtime"], row["id"], row["image"], row["reason"]) == ("podman", host.ids["podman_vfs"], IMAGE, "")
    assert row["name"].startswith("vfs-")
    assert [(d["uuid"], d["attribution"]) for d in row["devices"]] == [(GPU1, "devices_cgroup")]


def test_state_roots_not_found_are_said(host: Host, tmp_path: Path, fixtures_dir: Path) -> None:
    """With the default roots (none exists in this sandbox) the path rules still find docker's default
    and podman's containers, without names; the reason names the setting, and a warning says it once.
    Containers on paths only the state knows (``--cgroup-parent``, ``ctr``) are then unknown."""
    cfg = tmp_path / "defaults.toml"
    cfg.write_text("[runtimes]\n")
    replay = two_gpu_scenario(tmp_path, fixtures_dir, (GPU0, GPU1), {})
    proc = accelstats("containers", "--json", "--config", str(cfg), "--nvml-replay", str(replay))
    rows = {r["cgroup"]: r for r in json.loads(proc.stdout)}
    plain = rows[host.cgroups["docker_default"]]
    assert (plain["runtime"], plain["name"]) == ("docker", "")
    if not Path("/var/lib/docker").exists():
        assert "setting runtimes.docker_data_root" in plain["reason"]
        assert proc.stderr.count("runtimes.docker_data_root") == 1
    assert rows[host.cgroups["docker_parent"]]["runtime"] == "unknown"
    # a root set explicitly that does not exist: one warning at start, naming the setting
    cfg.write_text('[runtimes]\ndocker_data_root = "/nonexistent/docker"\n')
    proc = accelstats("containers", "--json", "--config", str(cfg), "--nvml-replay", str(replay))
    assert len(re.findall(r"WARNING.*/nonexistent/docker \(setting runtimes\.docker_data_root\)", proc.stderr)) == 1


def test_table_has_name_pod_runtime_and_reason(host: Host, tmp_path: Path, fixtures_dir: Path) -> None:
    replay = two_gpu_scenario(tmp_path, fixtures_dir, (GPU0, GPU1), {})
    cfg = config(tmp_path, host.docker, host.podman, host.containerd)
    lines = accelstats("containers", "--config", str(cfg), "--nvml-replay", str(replay)).stdout.splitlines()
    assert lines[0].split() == ["RUNTIME", "ID", "NAME", "POD", "CGROUP", "DEVICES", "REASON"]
    ctr = next(line for line in lines if host.ids["ctr"] in line)
    assert ctr.startswith("containerd") and CTR_IMAGE_REASON in ctr


def test_debug_log_says_what_identified_each_container(host: Host, tmp_path: Path, fixtures_dir: Path) -> None:
    replay = two_gpu_scenario(tmp_path, fixtures_dir, (GPU0, GPU1), {})
    cfg = config(tmp_path, host.docker, host.podman, host.containerd)
    err = accelstats("containers", "--config", str(cfg), "--nvml-replay", str(replay), "--log-level", "debug").stderr
    line = next(x for x in err.splitlines() if host.cgroups["docker_parent"] in x)
    assert f"docker {host.ids['docker_parent']}, identified by runtime state: {host.docker.data_root}" in line


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return str(r.read().decode())


def wait_for(port: int, predicate: Any, what: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = scrape(port)
        if predicate(text):
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.mark.slow  # more than ~5 s: real daemons, deadlines or a soak
def test_containers_started_and_removed_while_serve_is_scraped(host: Host, tmp_path: Path,
                                                              fixtures_dir: Path) -> None:
    replay = two_gpu_scenario(tmp_path, fixtures_dir, (GPU0, GPU1), {})
    port = free_port()
    cfg = config(tmp_path, host.docker, host.podman, host.containerd)
    serve = subprocess.Popen([sys.executable, "-m", "accelstats", "serve", "--listen", f"127.0.0.1:{port}",
                              "--config", str(cfg), "--nvml-replay", str(replay)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                before = scrape(port)
                break
            except OSError:
                assert serve.poll() is None and time.monotonic() < deadline, "serve did not come up"
                time.sleep(0.05)
        t = token()
        started = {
            "docker": host.docker.run("--device", f"{host.nodes[1]}:/dev/nvidia1", name=f"late-{t}")["Id"],
            "podman": host.podman.run("--device", f"{host.nodes[0]}:/dev/nvidia0", name=f"late-{t}")["Id"],
        }
        ns = f"late-{t}"
        host.containerd.run(ns, f"late-{t}", host.nodes[1])
        started["containerd"] = f"late-{t}"
        gpu = {"docker": GPU1, "podman": GPU0, "containerd": GPU1}
        for runtime, cid in started.items():
            assert f'container_id="{cid}"' not in before
            text = wait_for(port, lambda s, c=cid: f'container_id="{c}"' in s, f"{runtime} container to appear")
            info = next(line for line in text.splitlines()
                        if line.startswith("accelstats_container_info{") and f'container_id="{cid}"' in line)
            assert f'runtime="{runtime}"' in info
            assert f'name="{cid if runtime == "containerd" else f"late-{t}"}"' in info
            assert f'image="{"" if runtime == "containerd" else IMAGE}"' in info
            cgroup = re.search(r'[{,]id="([^"]*)"', info)
            assert cgroup is not None
            procs = [line for line in text.splitlines() if line.startswith("accelstats_container_gpu_processes{")
                     and f',id="{cgroup.group(1)}"' in line.replace("{", ",")]
            assert len(procs) == 1 and f'uuid="{gpu[runtime]}"' in procs[0], procs  # its GPU, and only it
            assert 'attribution="devices_cgroup"' in procs[0] and procs[0].endswith(" 0.0"), procs
        host.docker.remove(started["docker"])
        host.podman.remove(started["podman"])
        host.containerd.remove(ns, started["containerd"])
        for runtime, cid in started.items():
            wait_for(port, lambda s, c=cid: f'container_id="{c}"' not in s, f"{runtime} container to go")
        assert serve.poll() is None
    finally:
        serve.terminate()
        _, err = serve.communicate(timeout=30)
    assert "Traceback" not in err.decode(errors="replace")


def _make_cgroup(path: Path, uid: int, pid: int, rules: list[str]) -> None:
    """A v1 devices cgroup at ``path`` restricted to ``rules`` and holding ``pid``, made as a user with
    a delegated subtree makes it: the parent (root made it, then delegated it) and the cgroup are owned
    by ``uid``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chown(path.parent, uid, uid)
    path.mkdir()
    (path / "devices.deny").write_text("a")
    for rule in rules:
        (path / "devices.allow").write_text(rule)
    (path / "cgroup.procs").write_text(str(pid))
    for entry in (path, *path.iterdir()):
        os.chown(entry, uid, uid)


def test_look_alikes_in_delegated_cgroups_never_get_a_containers_identity(host: Host, tmp_path: Path,
                                                                         fixtures_dir: Path) -> None:
    """A local user names cgroups after a real container (docker's `plain-…`): under
    ``user@1000.service``, and in a cgroup it owns elsewhere.  Both are ``runtime="unknown"`` with
    their real cgroups; the victim keeps its own row."""
    victim = host.ids["docker_default"]
    devices = Path("/sys/fs/cgroup/devices")
    t = token()
    delegated = devices / f"user.slice/user-1000.slice/user@1000.service/app-{t}.slice/docker-{victim}.scope"
    owned = devices / f"jobs-{t}" / victim
    sleepers = [subprocess.Popen(["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "sleep", "600"])
                for _ in range(2)]
    made = [delegated, owned]
    try:
        _make_cgroup(delegated, 1000, sleepers[0].pid, ["c 195:1 rw"])
        _make_cgroup(owned, 1000, sleepers[1].pid, ["c 195:1 rw"])
        replay = two_gpu_scenario(tmp_path, fixtures_dir, (GPU0, GPU1),
                                  {GPU1: [(sleepers[0].pid, GIB), (sleepers[1].pid, GIB)]})
        cfg = config(tmp_path, host.docker, host.podman, host.containerd)
        out = accelstats("containers", "--json", "--config", str(cfg), "--nvml-replay", str(replay)).stdout
        rows = {r["cgroup"]: r for r in json.loads(out)}
        for cgroup, why in ((delegated, "under user@1000.service"), (owned, "owned by uid 1000")):
            row = rows["/" + str(cgroup.relative_to(devices))]
            assert (row["runtime"], row["name"], row["image"], row["pod"]) == ("unknown", "", "", ""), row
            assert row["id"] == row["cgroup"] != victim and why in row["reason"], row
            assert "looks like a docker container" in row["reason"], row
            assert [(d["uuid"], d["attribution"], d["memory_used_bytes"]) for d in row["devices"]] == [
                (GPU1, "devices_cgroup", GIB)]
        real = rows[host.cgroups["docker_default"]]
        assert (real["runtime"], real["id"], real["name"]) == ("docker", victim, host.expect["docker_default"].name)
        assert [r["name"] for r in rows.values()].count(host.expect["docker_default"].name) == 1
    finally:
        for p in sleepers:
            p.kill()
            p.wait()
        for leaf in made:
            for d in [leaf, *leaf.parents]:
                if d == devices:
                    break
                with contextlib.suppress(OSError):
                    d.rmdir()
