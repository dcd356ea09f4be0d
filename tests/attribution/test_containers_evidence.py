"""Real runc containers attributed by evidence: NVML process lists and open device nodes.

A container's real host PID is given to the replay scenario as a compute process; accelstats must
find the container through ``/proc/<pid>/cgroup`` on this host's unified hierarchy
(``--cgroup-root /sys/fs/cgroup/unified``, as a cgroup v2 host) and on the v1 hierarchy. An open
``/dev/nvidia<N>``-like node (made with mknod in the test's temp dir, opened with O_PATH because no
driver is loaded) held by a process of a container is attributed by ``open_fd``.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.runc_harness import ContainerSpec, RuncContainer, RuncFactory, docker_cgroupfs_path, docker_systemd_path
from support.scenarios_util import two_gpu_scenario

pytestmark = pytest.mark.root

GPU0 = "GPU-00000000-2222-4000-8000-000000000000"
GPU1 = "GPU-00000001-2222-4000-8000-000000000001"
GIB = 1 << 30
UNIFIED = "/sys/fs/cgroup/unified"


def scenario(tmp_path: Path, fixtures_dir: Path, processes: dict[str, list[tuple[int, int]]]) -> Path:
    return two_gpu_scenario(tmp_path, fixtures_dir, (GPU0, GPU1), processes)


def containers_json(replay: Path, *extra: str) -> dict[str, dict[str, object]]:
    proc = subprocess.run([sys.executable, "-m", "accelstats", "containers", "--json", "--nvml-replay", str(replay),
                           *extra], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return {str(r["cgroup"]): r for r in json.loads(proc.stdout)}


def devices(row: dict[str, object]) -> list[tuple[object, object, object]]:
    return [(d["uuid"], d["attribution"], d["memory_used_bytes"]) for d in row["devices"]]  # type: ignore[attr-defined]


def test_process_evidence_on_the_unified_and_the_v1_hierarchy(
        runc_container: RuncFactory, tmp_path: Path, fixtures_dir: Path) -> None:
    a = runc_container(ContainerSpec("a", docker_systemd_path(), devices=[("c", 195, 0, "rw")]))
    b = runc_container(ContainerSpec("b", docker_cgroupfs_path(), devices=[("c", 195, 0, "rw")]))
    priv = runc_container(ContainerSpec("priv", docker_systemd_path(), privileged=True))
    replay = scenario(tmp_path, fixtures_dir, {GPU0: [(a.pid, 1 * GIB), (b.pid, 3 * GIB)], GPU1: [(priv.pid, 2 * GIB)]})

    v2 = containers_json(replay, "--cgroup-root", UNIFIED)  # this host's cgroup2 mount, as a v2 host
    assert devices(v2[a.cgroups_path]) == [(GPU0, "process", 1 * GIB)]
    assert devices(v2[b.cgroups_path]) == [(GPU0, "process", 3 * GIB)]  # one GPU, each its own share
    assert devices(v2[priv.cgroups_path]) == [(GPU1, "process", 2 * GIB)]

    v1 = containers_json(replay)  # the v1 devices hierarchy
    assert devices(v1[a.cgroups_path]) == [(GPU0, "devices_cgroup", 1 * GIB)]
    assert devices(v1[b.cgroups_path]) == [(GPU0, "devices_cgroup", 3 * GIB)]
    assert devices(v1[priv.cgroups_path]) == [(GPU1, "process", 2 * GIB)]  # a *:* rwm: only the process says


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[Path, list[subprocess.Popen[str]]]]:
    """A 195:1 node in tmp_path/dev, and the processes started to hold it (killed at teardown, before the
    containers' cgroups are removed)."""
    (tmp_path / "dev").mkdir()
    node = tmp_path / "dev" / "nvidia1"
    os.mknod(node, stat.S_IFCHR | 0o600, os.makedev(195, 1))
    started: list[subprocess.Popen[str]] = []
    yield node, started
    for p in started:
        p.kill()
        p.wait(timeout=10)


def hold_open_in(ctr: RuncContainer, node: Path, started: list[subprocess.Popen[str]]) -> int:
    """Start a process that holds ``node`` open (O_PATH) and move it into ``ctr``'s devices and unified cgroups."""
    code = f"import os,sys,time; fd=os.open({str(node)!r}, os.O_PATH); print('ok', flush=True); time.sleep(600)"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    started.append(p)
    assert p.stdout is not None and p.stdout.readline().strip() == "ok"
    (ctr.devices_cgroup_dir / "cgroup.procs").write_text(f"{p.pid}\n")
    assert ctr.unified_cgroup_dir is not None
    (ctr.unified_cgroup_dir / "cgroup.procs").write_text(f"{p.pid}\n")
    cgroup = Path(f"/proc/{p.pid}/cgroup").read_text()
    assert f"devices:{ctr.cgroups_path}" in cgroup and f"0::{ctr.cgroups_path}" in cgroup
    return p.pid


def test_open_device_node_is_attributed_by_open_fd(
        runc_container: RuncFactory, holder: tuple[Path, list[subprocess.Popen[str]]],
        tmp_path: Path, fixtures_dir: Path) -> None:
    node, started = holder
    ctr = runc_container(ContainerSpec("fd", docker_systemd_path(), devices=[("c", 195, 0, "rw")]))
    hold_open_in(ctr, node, started)
    replay = scenario(tmp_path, fixtures_dir, {})  # NVML lists no process: only the open node says so
    time.sleep(0.05)
    v2 = containers_json(replay, "--cgroup-root", UNIFIED)
    assert devices(v2[ctr.cgroups_path]) == [(GPU1, "open_fd", 0)]
    # On v1 the devices cgroup grants GPU 0 only, yet a process of the container holds GPU 1's node:
    # both are reported, each with how it was found.
    v1 = containers_json(replay)
    assert devices(v1[ctr.cgroups_path]) == [(GPU0, "devices_cgroup", 0), (GPU1, "open_fd", 0)]


def test_an_exporter_in_a_private_cgroup_namespace_resolves_host_paths(
        runc_container: RuncFactory, tmp_path: Path, fixtures_dir: Path) -> None:
    """The exporter runs in a cgroup namespace of its own (``unshare --cgroup``, as a cgroup v2 container
    gets by default): the container's process reads as ``/../…``; accelstats/attribution/cgroupns.py places it."""
    a = runc_container(ContainerSpec("a", docker_systemd_path(), devices=[("c", 195, 0, "rw")]))
    replay = scenario(tmp_path, fixtures_dir, {GPU0: [(a.pid, 1 * GIB)]})
    own = Path(UNIFIED) / f"accelstats-test-ns-{os.getpid()}"
    own.mkdir()
    try:
        code = ("import os, sys, subprocess; "
                "open(sys.argv[1] + '/cgroup.procs', 'w').write(str(os.getpid())); "
                "os.execvp('unshare', ['unshare', '--cgroup', *sys.argv[2:]])")
        proc = subprocess.run([sys.executable, "-c", code, str(own), sys.executable, "-c",
                               "import sys; print(open(f'/proc/{sys.argv[1]}/cgroup').read()); "
                               "from accelstats.cli import main; sys.argv = ['accelstats', *sys.argv[2:]]; main()",
                               str(a.pid), "containers", "--json", "--nvml-replay", str(replay),
                               "--cgroup-root", UNIFIED],
                              capture_output=True, text=True, timeout=60, check=False, cwd=Path(__file__).parents[2])
        assert proc.returncode == 0, proc.stderr
        seen, _, rows = proc.stdout.partition("\n\n")
        assert "0::/../" in seen  # the container's process, as the exporter's namespace shows it
        found = {str(r["cgroup"]): r for r in json.loads(rows)}
        assert devices(found[a.cgroups_path]) == [(GPU0, "process", 1 * GIB)]
    finally:
        for _ in range(50):
            try:
                own.rmdir()
                break
            except OSError:
                time.sleep(0.1)
