"""Fault matrix rows 6-10: the host side (cgroups, processes, files). The table is the docstring of
``test_fault_matrix.py``; the plugin column of rows 6-9 is "n/a" there (the plugin's Fingerprint,
Stats and Reserve carry no container data), so those rows have exporter tests only.

Real things where the row asks for them: rows 6-8 make real cgroups in this host's cgroup v1
``devices`` hierarchy (``/sys/fs/cgroup/devices/accelstats-fm-*``, removed after each test), row 7
a real child process, row 8 a real EACCES (``chmod 000`` on the kernel's ``devices.list`` and an
exporter process whose bounding set lacks CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, via
``setpriv``). A host without that hierarchy (cgroup v2 only, as CI machines may be) skips those
variants with the reason, so rows 6-8 each have a **replayed** variant as well, which runs
everywhere: the cgroupfs replayed as plain directories (``devices.list`` and ``cgroup.procs``
files in a temporary tree); for row 7 also the child's ``/proc/<pid>`` (``cgroup``, ``stat``,
``fd/``), removed as the kernel removes it when the process is reaped; for row 8 a ``chmod 000``
plain file read by the same capability-less exporter process (a real EACCES, from the file system
instead of cgroupfs). Row 9 is replayed only: 10 000 real cgroups would cost the shared CI host more
than they prove. Moments "mid-walk" and "mid-read" are reached by wrapping the step before them
(``monkeypatch``) so that the removal happens exactly there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import in_ci
from support.faultmatrix_util import (
    Exporter,
    Plugin,
    eight_h200,
    replay_exporter,
    scrape,
    serve_subprocess,
    uuid_of,
)

from accelstats.attribution import attributor as attribution
from accelstats.cgroups import discovery
from accelstats.settings import FileDevicesSettings, Settings
from collectors.replay.lib import open_replay

DEVICES_V1 = Path("/sys/fs/cgroup/devices")
A, B = "a" * 63 + "1", "b" * 63 + "2"  # docker container ids


@pytest.fixture
def h200(fixtures_dir: Path) -> Path:
    return fixtures_dir / "h200" / "nvidia-smi-q.xml"


@pytest.fixture
def real_root() -> Iterator[Path]:
    """A cgroup of this test in the host's v1 devices hierarchy; its sub-cgroups are removed after.

    Skips on a host without that hierarchy (cgroup v2 only: there is no devices.list at all); fails
    under CI=true when the hierarchy is there but this is not root (a missing setup, not a host fact).
    """
    if not (DEVICES_V1 / "devices.list").is_file():
        pytest.skip("no cgroup v1 devices hierarchy at /sys/fs/cgroup/devices (a cgroup v2 host)")
    if os.geteuid() != 0:
        if in_ci():
            pytest.fail("cannot run under CI=true: real cgroups need root", pytrace=False)
        pytest.skip("real cgroups need root")
    root = DEVICES_V1 / f"accelstats-fm-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    try:
        yield root
    finally:
        for d in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            d.rmdir()
        root.rmdir()


def cgroup(parent: Path, *parts: str, allow: str | None) -> Path:
    """A real cgroup ``parent/parts…``; with ``allow``, its devices restricted to that rule (kernel
    devices.deny ``a``, then devices.allow), else left unrestricted (``a *:* rwm``)."""
    d = parent.joinpath(*parts)
    d.mkdir(parents=True)
    if allow is not None:
        (d / "devices.deny").write_text("a")
        (d / "devices.allow").write_text(allow)
    return d


def remove(directory: Path, up_to: Path) -> None:
    """rmdir ``directory`` and its parents below ``up_to`` (real cgroups: no processes in them)."""
    while directory != up_to:
        directory.rmdir()
        directory = directory.parent


def confined(tmp_path: Path, root: Path) -> tuple[Path, Path]:
    """(cgroup root, proc root) that make the exporter walk only ``root``: a ``devices`` link to it
    and an empty proc (no mountinfo: the layout is probed from the link)."""
    (tmp_path / "cg").mkdir()
    (tmp_path / "cg" / "devices").symlink_to(root)
    (tmp_path / "proc").mkdir()
    return tmp_path / "cg", tmp_path / "proc"


def wrap(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, after: Callable[..., None]) -> None:
    """Replace ``owner.name`` by a function that calls the original, then ``after(*args)``."""
    real = getattr(owner, name)

    def hooked(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        after(*args)
        return result

    monkeypatch.setattr(owner, name, hooked)


def skipped(got: Any, reason: str) -> float | None:
    return got.value("accelstats_attribution_skipped", reason=reason)


# -- row 6: a cgroup removed mid-walk ---------------------------------------------------------------

MOMENTS_6 = ("while_the_walk_lists_its_parent", "after_the_walk_before_its_pids", "after_its_pids_before_devices_list")


def replayed_cgroup(parent: Path, *parts: str, allow: str | None) -> Path:
    """:func:`cgroup` in a replayed tree: directories with ``devices.list`` and ``cgroup.procs`` files."""
    d = parent.joinpath(*parts)
    d.mkdir(parents=True)
    (d / "devices.list").write_text(allow + "\n" if allow is not None else "a *:* rwm\n")
    (d / "cgroup.procs").write_text("")
    return d


@pytest.mark.parametrize("tree", ["real_cgroupfs", "replayed"])
@pytest.mark.parametrize("moment", MOMENTS_6)
def test_row6_cgroup_removed_mid_walk_exporter(tmp_path: Path, h200: Path, request: pytest.FixtureRequest,
                                               monkeypatch: pytest.MonkeyPatch, moment: str, tree: str) -> None:
    if tree == "real_cgroupfs":
        top: Path = request.getfixturevalue("real_root")
        make = cgroup
    else:
        top = tmp_path / "replayed" / "devices"
        replayed_cgroup(top.parent, "devices", allow=None)
        make = replayed_cgroup
    make(top, "docker", A, allow="c 195:0 rw")
    gone = make(top, "slice", "docker", B, allow="c 195:1 rw")
    cg_root, proc_root = confined(tmp_path, top)
    scenario = eight_h200(tmp_path, h200, count=2)
    removed: list[str] = []

    def rm(*_: Any) -> None:
        if not removed:
            if tree == "replayed":
                shutil.rmtree(top / "slice")
            else:
                remove(gone, top)
            removed.append(moment)

    if moment == MOMENTS_6[0]:  # the root listed: the walk then finds "slice" gone
        wrap(monkeypatch, discovery, "_subdirectories",
             lambda directory: rm() if directory == str(cg_root / "devices") else None)
    elif moment == MOMENTS_6[1]:
        wrap(monkeypatch, attribution, "discover_v1_containers", rm)
    else:
        wrap(monkeypatch, attribution, "pids_in_cgroup",
             lambda directory, **_: rm() if Path(directory).name == B else None)
    settings = Settings(nvml_replay=scenario, cgroup_root=cg_root, proc_root=proc_root)
    with Exporter(settings, open_replay(scenario)) as exporter:
        got = exporter.scrape()
        listed = [c.cgroup for c in exporter.manager.collect().containers]
    assert removed == [moment]
    assert got.value("accelstats_scrape_collector_success", collector="attribution") == 1.0
    assert got.values("container_accelerator_memory_total_bytes", "id") == {f"/docker/{A}": float(143771 << 20)}
    assert got.values("accelstats_gpu_up", "uuid") == {uuid_of(0): 1.0, uuid_of(1): 1.0}
    assert skipped(got, "cgroup_vanished") == 1.0  # one container removed: counted once, as removed
    assert skipped(got, "devices_list_unreadable") == 0.0  # not a permission problem
    assert listed == [f"/docker/{A}"]  # the stopped container is not listed (accelstats containers)


# -- row 7: a PID gone mid-read ----------------------------------------------------------------------

MOMENTS_7 = ("before_its_proc_cgroup_is_read", "after_cgroup_procs_before_its_fds")
REPLAYED_PID = 4242


def replayed_process(proc: Path, pid: int, cgroup_line: str) -> Path:
    """``<proc>/<pid>`` as procfs has it for a running process: ``cgroup``, ``stat`` (proc(5): field 22
    is the start time) and an empty ``fd/``; returns the directory."""
    d = proc / str(pid)
    (d / "fd").mkdir(parents=True)
    (d / "cgroup").write_text(cgroup_line + "\n")
    (d / "stat").write_text(f"{pid} (sleep) S 1 " + " ".join(["0"] * 17) + f" {pid * 10} 0 0\n")
    return d


@pytest.mark.parametrize("tree", ["real_cgroupfs", "replayed"])
@pytest.mark.parametrize("moment", MOMENTS_7)
def test_row7_pid_gone_mid_read_exporter(tmp_path: Path, h200: Path, request: pytest.FixtureRequest,
                                         monkeypatch: pytest.MonkeyPatch, moment: str, tree: str) -> None:
    child: subprocess.Popen[bytes] | None = None
    if tree == "real_cgroupfs":
        real_root: Path = request.getfixturevalue("real_root")
        container = cgroup(real_root, "docker", B, allow=None)  # unrestricted: attributed by its processes
        child = subprocess.Popen(["sleep", "60"])
        pid = child.pid
        (container / "cgroup.procs").write_text(str(pid))
        cg_root, proc_root = Path("/sys/fs/cgroup"), Path("/proc")

        def reap() -> None:
            assert child is not None
            child.kill()
            child.wait()
    else:
        top = tmp_path / "replayed" / "devices"
        replayed_cgroup(top.parent, "devices", allow=None)
        container = replayed_cgroup(top, "docker", B, allow=None)
        pid = REPLAYED_PID
        (container / "cgroup.procs").write_text(f"{pid}\n")
        cg_root, proc_root = confined(tmp_path, top)
        process = replayed_process(proc_root, pid, f"5:devices:/docker/{B}")

        def reap() -> None:  # what the kernel does: out of cgroup.procs, /proc/<pid> gone
            (container / "cgroup.procs").write_text("")
            shutil.rmtree(process)
    try:
        scenario = eight_h200(tmp_path, h200, f"[[gpu.process]]\npid = {pid}\nused_memory_bytes = 1048576\n",
                              count=1)
        killed: list[int] = []

        def kill(*_: Any) -> None:
            if not killed:
                reap()
                killed.append(pid)

        if moment == MOMENTS_7[0]:  # NVML listed it; it exits before /proc/<pid>/cgroup is read
            monkeypatch.setattr(attribution, "cgroup_of_pids", _before(attribution.cgroup_of_pids, kill))
        else:  # cgroup.procs listed it; it exits before /proc/<pid>/stat and fd are read
            wrap(monkeypatch, attribution, "pids_in_cgroup",
                 lambda directory, **_: kill() if Path(directory).name == B else None)
        settings = Settings(nvml_replay=scenario, cgroup_root=cg_root, proc_root=proc_root)
        with Exporter(settings, open_replay(scenario)) as exporter:
            got = exporter.scrape()
    finally:
        if child is not None:
            child.kill()
            child.wait()
    assert killed == [pid]
    assert got.value("accelstats_scrape_collector_success", collector="attribution") == 1.0
    assert got.value("accelstats_gpu_up", uuid=uuid_of(0)) == 1.0
    ids = set(got.values("accelstats_container_gpu_processes", "id"))
    if moment == MOMENTS_7[0]:
        assert skipped(got, "pid_vanished") == 1.0
        assert not any(B in i for i in ids)  # its process left before it could be tied to it
    else:
        assert skipped(got, "pid_vanished") == 0.0
        assert any(B in i for i in ids)  # tied by /proc/<pid>/cgroup, read while it ran


def _before(real: Callable[..., Any], first: Callable[[], None]) -> Callable[..., Any]:
    def hooked(*args: Any, **kwargs: Any) -> Any:
        first()
        return real(*args, **kwargs)
    return hooked


# -- row 8: devices.list unreadable ------------------------------------------------------------------

@pytest.mark.parametrize("tree", ["real_cgroupfs", "replayed"])
def test_row8_devices_list_unreadable_exporter_process(tmp_path: Path, h200: Path, request: pytest.FixtureRequest,
                                                       tree: str) -> None:
    """As root the exporter process runs without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (setpriv),
    so ``chmod 000`` refuses it as it refuses any user; not root, it never had them."""
    prefix: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.fail("setpriv (util-linux) is needed to drop CAP_DAC_OVERRIDE", pytrace=False)
        prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
    if tree == "real_cgroupfs":
        top: Path = request.getfixturevalue("real_root")
        make = cgroup
    else:
        top = tmp_path / "replayed" / "devices"
        replayed_cgroup(top.parent, "devices", allow=None)
        make = replayed_cgroup
    make(top, "docker", A, allow="c 195:0 rw")
    locked = make(top, "docker", B, allow="c 195:1 rw")
    (locked / "devices.list").chmod(0)
    cg_root, proc_root = confined(tmp_path, top)
    scenario = eight_h200(tmp_path, h200, count=2)
    args = ["--nvml-replay", str(scenario), "--cgroup-root", str(cg_root), "--proc-root", str(proc_root)]
    with serve_subprocess(args, tmp_path / "serve.log", prefix=prefix) as (_, url):
        first, second = scrape(url), scrape(url)
    for got in (first, second):
        assert got.value("accelstats_scrape_collector_success", collector="attribution") == 1.0
        assert got.values("accelstats_gpu_up", "uuid") == {uuid_of(0): 1.0, uuid_of(1): 1.0}
        assert got.values("container_accelerator_memory_total_bytes", "id") == {f"/docker/{A}": float(143771 << 20)}
        assert skipped(got, "cgroup_vanished") == 0.0
    before, after = skipped(first, "devices_list_unreadable"), skipped(second, "devices_list_unreadable")
    # re-read, and refused, at each collection (at least one per scrape: a loaded CI run saw another collection
    # between the two scrapes)
    assert before is not None and before >= 1 and after is not None and after >= before + 1


# -- row 9: 10 000 containers --------------------------------------------------------------------------

def test_row9_ten_thousand_containers_exporter(tmp_path: Path, h200: Path) -> None:
    devices = tmp_path / "cgroup" / "devices"
    devices.mkdir(parents=True)
    (devices / "devices.list").write_text("a *:* rwm\n")
    t0 = time.monotonic()
    for i in range(10_000):
        d = devices / "docker" / f"{i:064x}"
        d.mkdir(parents=True)
        (d / "devices.list").write_text(f"c 1:3 rwm\nc 195:{i % 2} rw\n" if i % 100 == 0 else "c 1:3 rwm\n")
        (d / "cgroup.procs").write_text("")
    built = time.monotonic() - t0
    (tmp_path / "proc").mkdir()
    scenario = eight_h200(tmp_path, h200, count=2)
    with replay_exporter(tmp_path, scenario) as exporter:
        got = [exporter.scrape() for _ in range(3)]
    durations = [g.value("accelstats_scrape_collector_duration_seconds", collector="attribution") for g in got]
    print(f"10 000 containers: tree built in {built:.1f} s; /metrics {[round(g.seconds, 3) for g in got]} s; "
          f"attribution {[round(d or 0, 3) for d in durations]} s")
    last = got[-1]
    ids = last.values("container_accelerator_memory_total_bytes", "id")
    assert len(ids) == 100 and f"/docker/{0:064x}" in ids and f"/docker/{100:064x}" in ids
    assert last.value("accelstats_scrape_collector_success", collector="attribution") == 1.0
    assert skipped(last, "cgroup_vanished") == 0.0


# -- row 10: the file-devices directory deleted and recreated -----------------------------------------

def test_row10_file_devices_dir_deleted_and_recreated_exporter(tmp_path: Path, h200: Path) -> None:
    devs = tmp_path / "devs"
    devs.mkdir()
    (devs / "dev0").write_text("x")
    scenario = eight_h200(tmp_path, h200, count=1)
    with replay_exporter(tmp_path, scenario, file_devices=FileDevicesSettings(dir=devs)) as exporter:
        assert exporter.scrape().values("accelstats_file_device_info", "device") == {"dev0": 1.0}
        shutil.rmtree(devs)
        gone = exporter.scrape()
        devs.mkdir()
        (devs / "dev1").write_text("y")
        back = exporter.scrape()
    assert gone.value("accelstats_scrape_collector_success", collector="files") == 0.0
    assert "accelstats_file_device_info" not in gone.families
    assert gone.value("accelstats_gpu_up", uuid=uuid_of(0)) == 1.0  # the other collectors go on
    assert back.value("accelstats_scrape_collector_success", collector="files") == 1.0
    assert back.values("accelstats_file_device_info", "device") == {"dev1": 1.0}


def test_row10_file_devices_dir_deleted_and_recreated_plugin(tmp_path: Path) -> None:
    devs = tmp_path / "devs"
    devs.mkdir()
    (devs / "dev0").write_text("x")
    with Plugin({"enabled": False, "file_devices": {"dir": str(devs), "list_period": "200ms"}}) as plugin:
        assert plugin.fingerprint() == {"dev0": (True, "")}
        shutil.rmtree(devs)
        gone = plugin.fingerprint()
        devs.mkdir()
        (devs / "dev1").write_text("y")
        back = plugin.fingerprint()
    assert gone == {}
    assert back == {"dev1": (True, "")}
