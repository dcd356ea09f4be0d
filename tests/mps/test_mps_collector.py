"""The ``mps`` collector (accelstats/mps/host.py ``MpsCollector``) against the control-daemon test double.

| situation | accelstats_mps_daemon_up |
|---|---|
| daemon answers | 1, with servers, clients and limits |
| another resource's device is not a GPU of this host | 0 for that one only; the others still read |
| daemon accepts and never answers | 0 after the collector's deadline (not the control timeout); others read |
| NVML not answering | daemons still read (no pinned limits: devices not resolved) |
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.mps_util import DOUBLE, GPUS, UUID0, serving

from accelstats.manager import AcceleratorManager
from accelstats.mps.daemon import Daemon
from accelstats.mps.host import MpsCollector
from accelstats.mps.rules import MpsResource, Root
from accelstats.settings import MpsResourceSettings, MpsSettings, Settings
from collectors.model import DeviceSnapshot, MpsDaemonReading
from collectors.replay.lib import open_replay


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "mps"
    yield path
    for pid in serving(path):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture
def snapshot(tmp_path: Path, fixtures_dir: Path) -> Iterator[DeviceSnapshot]:
    """One collection of the replayed H200 (GPU index 0, the UUID of test_mps.UUID0)."""
    manager = AcceleratorManager(Settings(cgroup_root=tmp_path, proc_root=tmp_path, collectors=("nvidia",)),
                                 open_replay(fixtures_dir / "h200" / "nvidia-smi-q.xml"))
    manager.setup()
    try:
        yield manager.collect().snapshot
    finally:
        manager.destroy(timeout=0.5)
        manager.close()


def read(collector: MpsCollector, snapshot: DeviceSnapshot) -> dict[str, MpsDaemonReading]:
    snapshot.mps.clear()
    collector.update(snapshot)
    return {r.resource: r for r in snapshot.mps}


def started(root: Path, name: str, timeout: float = 3.0) -> Daemon:
    daemon = Daemon(MpsResource(name, 2, (UUID0,)), GPUS, Root(root), binary=str(DOUBLE), timeout=timeout)
    daemon.start()
    return daemon


def test_one_bad_resource_does_not_mark_the_others_down(root: Path, snapshot: DeviceSnapshot) -> None:
    good = started(root, "good")
    settings = MpsSettings(root=root, resources=(MpsResourceSettings("good", 2, (0,)),
                                                 MpsResourceSettings("gone", 2, (1,))))
    collector = MpsCollector(settings, binary=str(DOUBLE))
    try:
        readings = read(collector, snapshot)
        assert readings["good"].up and readings["good"].active_thread_ratio == 0.5
        assert dict(readings["good"].pinned_memory_limit_bytes) == {UUID0: 143771 // 2 * 2**20}
        assert not readings["gone"].up and "not a GPU of this host" in readings["gone"].reason
    finally:
        collector.close()
        good.stop()


def test_a_wedged_daemon_costs_the_deadline_not_the_control_timeout(root: Path, snapshot: DeviceSnapshot) -> None:
    wedged, fine = started(root, "wedged"), started(root, "fine")
    (wedged.pipe_dir / "double.hang").touch()
    settings = MpsSettings(root=root, timeout=5.0, resources=(MpsResourceSettings("wedged", 2, (0,)),
                                                              MpsResourceSettings("fine", 2, "all")))
    # a deadline of 1 s: the double is a Python script, whose start alone took over half a second on a
    # loaded 2-core CI machine (the healthy daemon's answer came late); the control timeout is 5 x it
    collector = MpsCollector(settings, binary=str(DOUBLE), deadline=1.0)
    try:
        t0 = time.monotonic()
        readings = read(collector, snapshot)
        elapsed = time.monotonic() - t0
        assert not readings["wedged"].up and "no answer within 1 s" in readings["wedged"].reason
        assert readings["fine"].up  # asked in parallel: not held up by the wedged one
        assert elapsed < 5.0, elapsed  # the control timeout is 5 s; the collector waited its 1 s deadline
        again = read(collector, snapshot)  # the stuck query is still running: not started twice
        assert not again["wedged"].up and again["fine"].up
        (wedged.pipe_dir / "double.hang").unlink()
        deadline = time.monotonic() + 10
        while not read(collector, snapshot)["wedged"].up:  # answers again once the old query ended
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        collector.close()
        for d in (wedged, fine):
            (d.pipe_dir / "double.hang").unlink(missing_ok=True)
            d.stop()


def test_daemons_are_watched_while_nvml_is_down(root: Path) -> None:
    good = started(root, "good")
    collector = MpsCollector(MpsSettings(root=root, resources=(MpsResourceSettings("good", 2, "all"),)),
                             binary=str(DOUBLE))
    try:
        readings = read(collector, DeviceSnapshot(nvml_status="nvmlInit failed: DRIVER_NOT_LOADED"))
        assert readings["good"].up and readings["good"].pinned_memory_limit_bytes == ()
    finally:
        collector.close()
        good.stop()
