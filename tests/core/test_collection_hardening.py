"""The collection path touches only what it must, and nothing on it blocks without bound.

Case: what a user saw, then what happens now.

* A container process holds a file open on a FUSE (or NFS) mount whose server stopped answering:
  the open-fd scan ``stat``-ed it and the scrape never answered again. Now the fd's link is read
  (``readlink``) and only ``/dev/...`` nodes are looked at.
* A runtime's state directory sits on such a mount: the attribution waited for ever. Now the
  collection answers by its deadline with the last complete attribution, marked late; one thread
  waits, however many scrapes come.
* ``devices.list`` is a link to ``/dev/urandom``: 1 MiB of noise read and cached per scrape. Now only
  regular files are read, and the caches keep only small texts.
* A FIFO at ``<proc-root>/self/mountinfo``: start-up blocked for ever. Now it is read non-blocking,
  regular files only.
* ``nvmlShutdown`` hangs: SIGTERM never finished. Now the shutdown waits 2 s for it, then the
  process exits.

The FUSE filesystem is real (tests/support/fuse_util.py: ``/dev/fuse``, mounted, served, then silent).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import in_ci
from support.fuse_util import HangingFuse
from support.ports import free_port

from accelstats.cgroups import detect_layout
from accelstats.manager import AcceleratorManager, Collection
from accelstats.settings import RuntimeRoots, Settings
from collectors.replay.lib import open_replay

pytestmark = pytest.mark.root

DOCKER = "/system.slice/docker-{}.scope"
CID = "c" * 64


def require_fuse() -> None:
    if os.geteuid() != 0 or not Path("/dev/fuse").exists():
        reason = "needs root and /dev/fuse"
        if in_ci():
            pytest.fail(f"cannot run under CI=true: {reason}", pytrace=False)
        pytest.skip(reason)


@pytest.fixture
def fuse() -> Iterator[HangingFuse]:
    require_fuse()
    with HangingFuse() as fs:
        yield fs


def v2_tree(root: Path, pid: int) -> Path:
    """A cgroup v2 tree with one docker container holding ``pid`` (the real process)."""
    cgroup = root / "cgroup"
    (cgroup / DOCKER.format(CID).lstrip("/")).mkdir(parents=True)
    (cgroup / "cgroup.controllers").write_text("cpu memory pids\n")
    (cgroup / DOCKER.format(CID).lstrip("/") / "cgroup.procs").write_text(f"{pid}\n")
    return cgroup


def collect_within(manager: AcceleratorManager, seconds: float) -> Collection:
    """``manager.collect()`` on a thread; fails the test when it has not answered in ``seconds``."""
    out: list[Collection] = []
    thread = threading.Thread(target=lambda: out.append(manager.collect()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert out, f"the collection did not answer within {seconds} s"
    return out[0]


def test_a_file_open_on_a_hung_fuse_mount_never_blocks_the_fd_scan(tmp_path: Path, fixtures_dir: Path,
                                                                    fuse: HangingFuse) -> None:
    holder = subprocess.Popen(["sh", "-c", f"exec 3<{fuse.mountpoint}/f; exec sleep 600"])
    try:
        replay = fixtures_dir / "h200" / "nvidia-smi-q.xml"
        settings = Settings(nvml_replay=replay, cgroup_root=v2_tree(tmp_path, holder.pid), proc_root=Path("/proc"),
                            rootfs=tmp_path, collectors=("nvidia",))
        deadline = time.monotonic() + 10
        while not any(os.readlink(f"/proc/{holder.pid}/fd/{fd}").startswith(str(fuse.mountpoint))
                      for fd in os.listdir(f"/proc/{holder.pid}/fd")):
            assert time.monotonic() < deadline, "the holder never opened the file"
            time.sleep(0.01)
        fuse.hang()  # from now on a stat of that file waits for ever
        with AcceleratorManager(settings, open_replay(replay)) as manager:
            for _ in range(2):
                c = collect_within(manager, 10)
                result = {r.name: r.success for r in c.snapshot.collector_results}
                assert result["attribution"], c.snapshot.collector_results  # answered in time, not late
                assert manager._attributor is not None and manager._attributor.scanner is not None
                assert manager._attributor.scanner.scans >= 1  # the holder's fd directory was listed
    finally:
        fuse.close()  # before waiting for the holder: its exit flushes the file on the mount
        holder.kill()
        holder.wait(timeout=30)


def test_a_state_directory_on_a_hung_mount_costs_one_late_attribution(tmp_path: Path, fixtures_dir: Path,
                                                                      fuse: HangingFuse) -> None:
    """docker's data-root on a dead network filesystem: the first collection waits out the deadline
    and serves no attribution (none completed yet), marked late; the next ones answer at once from
    the same stuck worker (no second thread), and once the filesystem answers (here: is aborted)
    attribution is complete again."""
    replay = fixtures_dir / "h200" / "nvidia-smi-q.xml"
    roots = RuntimeRoots(docker_data_root=fuse.mountpoint / "d")  # read under rootfs "/": the mount itself
    settings = Settings(nvml_replay=replay, cgroup_root=v2_tree(tmp_path, 1), proc_root=tmp_path / "proc",
                        rootfs=Path("/"), collectors=("nvidia",), runtimes=roots, collection_deadline=1.0)
    (tmp_path / "proc").mkdir()
    with AcceleratorManager(settings, open_replay(replay)) as manager:
        first = collect_within(manager, 5)  # complete: the mount still answers
        assert {r.name: r.success for r in first.snapshot.collector_results}["attribution"]
        fuse.hang()
        threads = threading.active_count()
        t0 = time.monotonic()
        late = collect_within(manager, 5)
        took = time.monotonic() - t0
        result = next(r for r in late.snapshot.collector_results if r.name == "attribution")
        assert not result.success and "past the collection deadline" in result.error
        assert late.collector_last_success["attribution"] == first.collector_last_success["attribution"]
        assert 0.9 < took < 3.0  # the deadline (1 s), not for ever
        t0 = time.monotonic()
        again = collect_within(manager, 5)
        assert time.monotonic() - t0 < 0.5  # the worker is still stuck: no wait, no second worker
        assert not next(r for r in again.snapshot.collector_results if r.name == "attribution").success
        assert threading.active_count() <= threads + 1
        fuse.close()  # the stuck stat returns (ENOTCONN): attribution completes again
        deadline = time.monotonic() + 10
        while not {r.name: r.success for r in manager.collect().snapshot.collector_results}["attribution"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_devices_list_that_is_not_a_regular_file_is_not_read(tmp_path: Path, fixtures_dir: Path) -> None:
    from accelstats.attribution import containers
    from accelstats.cgroups import discovery
    devices = tmp_path / "cgroup" / "devices"
    (devices / "docker" / CID).mkdir(parents=True)
    (devices / "devices.list").write_text("a *:* rwm\n")
    (devices / "docker" / CID / "devices.list").symlink_to("/dev/urandom")
    (devices / "docker" / CID / "cgroup.procs").write_text("")
    replay = fixtures_dir / "h200" / "nvidia-smi-q.xml"
    settings = Settings(nvml_replay=replay, cgroup_root=tmp_path / "cgroup", proc_root=tmp_path / "proc",
                        rootfs=tmp_path, collectors=("nvidia",))
    (tmp_path / "proc").mkdir()
    before = (containers._grant_cached.cache_info().currsize, discovery._parse_cached.cache_info().currsize)
    with AcceleratorManager(settings, open_replay(replay)) as manager:
        for _ in range(20):
            c = manager.collect()
    (row,) = [s for s in c.containers if s.cgroup == f"/docker/{CID}"]
    assert row.devices_cgroup == "unreadable" and "not readable" in row.reason
    after = (containers._grant_cached.cache_info().currsize, discovery._parse_cached.cache_info().currsize)
    assert after == before  # nothing of /dev/urandom was read, parsed or kept


def test_a_fifo_for_mountinfo_does_not_block_start_up(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    os.mkfifo(proc / "self" / "mountinfo")
    done: list[object] = []
    thread = threading.Thread(target=lambda: done.append(detect_layout(tmp_path / "cgroup", proc)), daemon=True)
    thread.start()
    thread.join(5)
    assert done, "detect_layout blocked on a FIFO"


@pytest.mark.parametrize("xid_watched", [True, False])
def test_sigterm_ends_serve_while_nvml_shutdown_hangs(tmp_path: Path, fixtures_dir: Path, xid_watched: bool) -> None:
    """nvmlShutdown runs on the XID thread when one watches events (after its current wait; the process
    exits without waiting for it), else on the NVML worker, waited for 2 s."""
    capture = fixtures_dir / "h200" / "nvidia-smi-q.xml"
    scenario = tmp_path / "scenario.toml"
    no_events = "" if xid_watched else 'missing_functions = ["nvmlEventSetWait_v2", "nvmlEventSetWait"]\n'
    scenario.write_text(f'{no_events}[[gpu]]\ncapture = "{capture}"\n[[fault]]\ncall = "nvmlShutdown"\n'
                        'hang_seconds = 3600\n')
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "accelstats", "serve", "--listen", f"127.0.0.1:{port}",
                             "--nvml-replay", str(scenario), "--cgroup-root", str(tmp_path), "--proc-root",
                             str(tmp_path)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        import urllib.request
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()  # NVML initialised
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "serve did not come up"
                time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert took < 10, took  # at most the 2 s shutdown wait, not the hour the call hangs
    assert ("nvmlShutdown did not return" in err) is not xid_watched, err
    assert "Traceback" not in err
