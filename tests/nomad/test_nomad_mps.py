"""The Nomad plugin's MPS lifecycle (accelstats/nomad/mpsshares.py) and Reserve's MPS rules, in-process,
against the ``nvidia-cuda-mps-control`` test double (tests/support/mps_double).

| situation | what the plugin offers | what it does to the daemon |
|---|---|---|
| first Fingerprint, no daemon | healthy replicas | starts it |
| first Fingerprint, a daemon answers (plugin restarted) | healthy replicas | adopts it, re-applies the limits |
| daemon process gone | unhealthy, then healthy | starts it again, at most once per retry interval |
| daemon running but not answering | unhealthy "running but not answering" | leaves it (its clients need it) |
| resource fails validation | every replica unhealthy with the rule; never the whole GPU | nothing started |
| configuration changed | replicas of the new configuration | stops removed/changed daemons, keeps the others |
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from support.mps_util import DOUBLE, GPU0, GPUS, UUID0, UUID1, gone, serving

from accelstats.mps.daemon import Daemon
from accelstats.mps.rules import MpsResource, Root
from accelstats.nomad import devices
from accelstats.nomad.config import decode
from accelstats.nomad.mpsshares import PluginMps
from accelstats.nomad.proto import device_pb2
from accelstats.settings import ConfigError, MpsResourceSettings, MpsSettings
from collectors.model import Device


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "mps"
    yield path
    for pid in serving(path):  # the plugin never stops daemons on exit: the test does
        os.kill(pid, signal.SIGKILL)


def settings(root: Path, *resources: MpsResourceSettings, timeout: float = 2.0) -> MpsSettings:
    return MpsSettings(root=root, timeout=timeout, resources=resources)


def plugin_mps(s: MpsSettings, retry: float = 30.0) -> PluginMps:
    return PluginMps(s, binary=str(DOUBLE), retry_interval=retry)


def daemon_of(root: Path, name: str, replicas: int, uuids: tuple[str, ...]) -> Daemon:
    return Daemon(MpsResource(name, replicas, uuids), GPUS, Root(root), binary=str(DOUBLE), timeout=2.0)


def test_first_fingerprint_starts_the_daemon_and_offers_healthy_replicas(root: Path) -> None:
    mps = plugin_mps(settings(root, MpsResourceSettings("shared", 4, (0,))))
    shares = mps.shares(GPUS)
    assert list(shares) == [UUID0]
    share = shares[UUID0]
    assert (share.resource, share.replicas, share.healthy, share.reason) == ("shared", 4, True, "")
    assert share.pipe_dir == str(root / "shared" / "pipe") and share.shm_dir == "/dev/shm"
    assert share.pinned_limit_bytes == GPU0.memory_total_bytes // 4 // 2**20 * 2**20
    assert daemon_of(root, "shared", 4, (UUID0,)).running()
    daemon_of(root, "shared", 4, (UUID0,)).stop()


def test_a_restarted_plugin_adopts_the_running_daemon_and_reapplies_the_limits(root: Path) -> None:
    earlier = daemon_of(root, "shared", 2, (UUID0,))  # e.g. `accelstats mps start` with replicas = 2
    earlier.start()
    pid = earlier.pid()
    mps = plugin_mps(settings(root, MpsResourceSettings("shared", 4, (0,))))
    assert mps.shares(GPUS)[UUID0].healthy
    assert earlier.pid() == pid  # adopted, not restarted
    assert earlier.echo_pipe_to_control("get_default_active_thread_percentage") == "25.0"  # 100 // 4
    earlier.stop()


def test_a_running_daemon_for_other_gpus_is_not_adopted(root: Path) -> None:
    earlier = daemon_of(root, "shared", 2, (UUID1, UUID0))  # started for two GPUs
    earlier.start()
    share = plugin_mps(settings(root, MpsResourceSettings("shared", 2, (0,)))).shares(GPUS)[UUID0]
    assert not share.healthy and f"runs for GPUs {UUID1},{UUID0}, not {UUID0}" in share.reason
    assert earlier.running()  # left alone: tasks may use it
    earlier.stop()


def test_a_daemon_that_died_is_started_again_after_the_retry_interval(root: Path) -> None:
    mps = plugin_mps(settings(root, MpsResourceSettings("shared", 2, (0,))), retry=0.5)
    assert mps.shares(GPUS)[UUID0].healthy
    daemon = daemon_of(root, "shared", 2, (UUID0,))
    pid = daemon.pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    assert gone(pid)
    # the pid file is left behind by SIGKILL, the process is gone: started again at once ...
    assert mps.shares(GPUS)[UUID0].healthy and daemon.pid() not in (None, pid)
    # ... and a start that fails waits for the retry interval before the next try
    daemon.stop()
    blocker = root / "shared"
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("not a directory")  # the pipe dir cannot be created
    failed = mps.shares(GPUS)[UUID0]
    assert not failed.healthy and "next try in 0.5 s" in failed.reason
    assert mps.shares(GPUS)[UUID0].reason == failed.reason  # within the interval: not tried again
    blocker.unlink()
    time.sleep(0.6)
    assert mps.shares(GPUS)[UUID0].healthy
    daemon.stop()


def test_a_wedged_daemon_is_unhealthy_and_left_running(root: Path) -> None:
    mps = plugin_mps(settings(root, MpsResourceSettings("shared", 2, (0,)), timeout=0.5), retry=0.0)
    assert mps.shares(GPUS)[UUID0].healthy
    daemon = daemon_of(root, "shared", 2, (UUID0,))
    pid = daemon.pid()
    (daemon.pipe_dir / "double.hang").touch()
    share = mps.shares(GPUS)[UUID0]
    assert not share.healthy and "running but not answering" in share.reason
    assert daemon.pid() == pid and daemon.running()  # not restarted: its clients would lose their server
    (daemon.pipe_dir / "double.hang").unlink()
    assert mps.shares(GPUS)[UUID0].healthy
    daemon.stop()


@pytest.mark.parametrize(("resource", "rule"), [
    (MpsResourceSettings("big", 49, (0,)), "48"),
    (MpsResourceSettings("ghost", 2, ("GPU-00000000-0000-0000-0000-000000000000", 0)), "not a GPU of this host"),
])
def test_a_resource_failing_validation_offers_unhealthy_replicas_naming_the_rule(
        root: Path, resource: MpsResourceSettings, rule: str) -> None:
    shares = plugin_mps(settings(root, resource)).shares(GPUS)
    assert list(shares) == [UUID0]  # still offered as replicas (never whole), unhealthy
    assert not shares[UUID0].healthy and rule in shares[UUID0].reason
    assert serving(root) == []  # nothing started


def test_a_gpu_listed_by_two_resources_is_refused_for_the_second(root: Path) -> None:
    shares = plugin_mps(settings(root, MpsResourceSettings("a", 2, (0,)), MpsResourceSettings("b", 2, (0, 1)))
                        ).shares(GPUS)
    assert shares[UUID0].resource == "a" and shares[UUID0].healthy
    assert shares[UUID1].resource == "b" and not shares[UUID1].healthy
    assert "both list GPU" in shares[UUID1].reason
    daemon_of(root, "a", 2, (UUID0,)).stop()


def test_a_changed_configuration_stops_only_removed_or_changed_daemons(root: Path) -> None:
    mps = plugin_mps(settings(root, MpsResourceSettings("keep", 2, (0,)), MpsResourceSettings("drop", 2, (1,))))
    assert all(s.healthy for s in mps.shares(GPUS).values())
    keep, drop = daemon_of(root, "keep", 2, (UUID0,)), daemon_of(root, "drop", 2, (UUID1,))
    keep_pid, drop_pid = keep.pid(), drop.pid()
    assert keep_pid is not None and drop_pid is not None
    mps.reconfigure(settings(root, MpsResourceSettings("keep", 2, (0,))))
    assert gone(drop_pid) and not drop.pipe_dir.exists()
    assert list(mps.shares(GPUS)) == [UUID0] and keep.pid() == keep_pid
    keep.stop()


# --------------------------------------------------------------------------------------------
# Reserve


def _snapshot() -> devices.Snapshot:
    gpu0 = Device(index=0, minor=0, uuid=UUID0, name="NVIDIA H200", kind="gpu")
    gpu1 = Device(index=1, minor=1, uuid=UUID1, name="NVIDIA H200", kind="gpu")
    a0 = devices.MpsShare("a", 2, True, "", "/run/a/pipe", "/run/shm", 1 << 30)
    a1 = devices.MpsShare("a", 2, True, "", "/run/a/pipe", "/run/shm", 2 << 30)  # another GPU of resource a
    b = devices.MpsShare("b", 2, True, "", "/run/b/pipe", "/run/shm", 1 << 30)
    return devices.Snapshot(devices={
        f"{UUID0}::0": devices.Reservable("mps", device=gpu0, parent_minor=0, mps=a0),
        f"{UUID0}::1": devices.Reservable("mps", device=gpu0, parent_minor=0, mps=a0),
        f"{UUID1}::0": devices.Reservable("mps", device=gpu1, parent_minor=1, mps=a1),
        f"{UUID1}::1": devices.Reservable("mps", device=gpu1, parent_minor=1, mps=b),
        UUID1: devices.Reservable("gpu", device=gpu1, parent_minor=1),
    })


def _reserve(ids: list[str], **kw: bool) -> device_pb2.ContainerReservation:
    return devices.reserve(device_pb2, _snapshot(), ids, {}, dev_root="/nonexistent", **kw)


def test_reserve_one_replica() -> None:
    res = _reserve([f"{UUID0}::1"])
    assert dict(res.envs) == {"CUDA_VISIBLE_DEVICES": UUID0, "CUDA_MPS_PIPE_DIRECTORY": "/run/a/pipe"}
    assert [(m.task_path, m.host_path) for m in res.mounts] == [("/run/a/pipe", "/run/a/pipe"),
                                                               ("/dev/shm", "/run/shm")]


# One replica per request (docs/nomad.md, "One replica per task"), as k8s-device-plugin's default
# failRequestsGreaterThanOne (api/config/v1/config.go:72-76, internal/rm/rm.go:101-104):
#
# | request | default | fail_requests_greater_than_one = false |
# |---|---|---|
# | two replicas of one GPU | refused, naming the GPU | the one-replica reservation of that GPU (one MPS client) |
# | one replica on each of two GPUs | refused, naming both | both GPUs visible to one MPS client |
@pytest.mark.parametrize(("ids", "refused", "opt_in_visible"), [
    ([f"{UUID0}::0", f"{UUID0}::1"], f"2 MPS replicas in one request (2 of GPU {UUID0}), at most 1", UUID0),
    ([f"{UUID0}::0", f"{UUID1}::0"], f"2 MPS replicas in one request (1 of GPU {UUID0}, 1 of GPU {UUID1})",
     f"{UUID0},{UUID1}"),
])
def test_reserve_refuses_more_than_one_replica_unless_opted_in(ids: list[str], refused: str,
                                                               opt_in_visible: str) -> None:
    with pytest.raises(devices.ReserveError) as err:
        _reserve(ids)
    assert refused in str(err.value) and "fail_requests_greater_than_one = false" in str(err.value)
    assert "\n" not in str(err.value)
    res = _reserve(ids, fail_requests_greater_than_one=False)
    assert dict(res.envs) == {"CUDA_VISIBLE_DEVICES": opt_in_visible, "CUDA_MPS_PIPE_DIRECTORY": "/run/a/pipe"}


def test_opted_in_two_replicas_of_one_gpu_reserve_what_one_does() -> None:
    """What the opt-in gives: exactly one replica's reservation — one MPS client, with the daemon's
    one-replica limits; the second replica is held by the task and used by no one."""
    two = _reserve([f"{UUID0}::0", f"{UUID0}::1"], fail_requests_greater_than_one=False)
    assert two == _reserve([f"{UUID0}::1"])


@pytest.mark.parametrize(("block", "fail"), [
    (None, True),  # no mps block: the default
    ({}, True),
    ({"fail_requests_greater_than_one": True}, True),
    ({"fail_requests_greater_than_one": False}, False),
    ({"fail_requests_greater_than_one": "false"}, False),  # go-cty's bool as text
])
def test_fail_requests_greater_than_one_is_read_from_the_mps_block(block: dict[str, Any] | None,
                                                                   fail: bool) -> None:
    data = msgpack.packb({} if block is None else {"mps": block})
    assert decode(data).nomad.fail_mps_requests_greater_than_one is fail


def test_fail_requests_greater_than_one_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match=r"^config: mps\.fail_requests_greater_than_one: expected true or false, "
                                          r"got 'yes'$"):
        decode(msgpack.packb({"mps": {"fail_requests_greater_than_one": "yes"}}))


@pytest.mark.parametrize(("ids", "message"), [
    ([f"{UUID0}::0", f"{UUID1}::1"], "different resources cannot be reserved together: 'a', 'b'"),
    ([f"{UUID0}::0", UUID1], "whole GPUs (or MIG instances) and MPS replicas cannot be reserved together"),
])
def test_reserve_refuses_mixes_that_cannot_work(ids: list[str], message: str) -> None:
    with pytest.raises(devices.ReserveError) as err:
        devices.reserve(device_pb2, _snapshot(), ids, {}, dev_root="/nonexistent")
    assert message in str(err.value)


# --------------------------------------------------------------------------------------------
# the cgroup walk is for /metrics only


@pytest.mark.parametrize("walks", [False, True])
def test_the_plugin_walks_cgroups_only_when_it_serves_metrics(fixtures_dir: Path, walks: bool) -> None:
    """Fingerprint, Stats and Reserve use no container data; a plugin over 10 000 containers spent a third
    of a core on the walk. Counted by the collector results, not timed."""
    from support.faultmatrix_util import Plugin
    from support.ports import free_port

    metrics_listen = f"127.0.0.1:{free_port()}" if walks else ""
    cfg = {"nvml_replay": str(fixtures_dir / "h200" / "nvidia-smi-q.xml"), "metrics_listen": metrics_listen}
    with Plugin(cfg) as plugin:
        collection = plugin.state.collect()
        assert collection is not None
        ran = [r.name for r in collection.snapshot.collector_results]
        assert ("attribution" in ran) is walks, ran
        assert plugin.fingerprint()  # the GPUs are offered either way
