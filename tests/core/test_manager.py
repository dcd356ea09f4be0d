"""AcceleratorManager on fixture cgroup trees: devices.list attribution, bad lines, shared collections."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from accelstats.attribution.containers import ContainerCollector, ContainerStats
from accelstats.manager import AcceleratorManager
from accelstats.settings import Settings
from accelstats.web.exposition import exposition
from collectors.replay.lib import open_replay

DOCKER_A = "a" * 64
DOCKER_B = "b" * 64


def host(tmp_path: Path, capture: Path, lists: dict[str, str]) -> Settings:
    """A v1 devices tree with one docker container per entry and a two-GPU replay (minors 0, 1)."""
    scenario = tmp_path / "scenario.toml"
    scenario.write_text(
        f'[[gpu]]\ncapture = "{capture}"\n'
        f'[[gpu]]\ncapture = "{capture}"\nminor = 1\nuuid = "GPU-00000000-0000-4000-8000-000000000001"\n')
    devices = tmp_path / "cgroup" / "devices"
    devices.mkdir(parents=True)
    (devices / "devices.list").write_text("a *:* rwm\n")
    for cid, text in lists.items():
        d = devices / "docker" / cid
        d.mkdir(parents=True)
        (d / "devices.list").write_text(text)
    (tmp_path / "proc").mkdir()
    return Settings(nvml_replay=scenario, cgroup_root=tmp_path / "cgroup", proc_root=tmp_path / "proc")


def manager(settings: Settings) -> AcceleratorManager:
    assert settings.nvml_replay is not None
    m = AcceleratorManager(settings, open_replay(settings.nvml_replay))
    m.setup()
    return m


def test_malformed_lines_are_skipped_counted_and_the_rest_used(tmp_path: Path, fixtures_dir: Path) -> None:
    capture = fixtures_dir / "h200" / "nvidia-smi-q.xml"
    settings = host(tmp_path, capture, {DOCKER_A: "c 1:2 rwm badformat\nc badformat rwm\nc 195:1 rw\n",
                                        DOCKER_B: "c 195:* m\n"})
    m = manager(settings)
    collection = m.collect()
    by_id = {c.identity.id: c for c in collection.containers if c.identity}
    assert [a.minor for a in by_id[DOCKER_A].accelerators] == [1]
    assert by_id[DOCKER_B].accelerators == []  # lost GPU access after daemon-reload: zero GPUs, listed
    assert by_id[DOCKER_B].lost_gpu_access and "lost GPU access" in by_id[DOCKER_B].reason
    assert collection.devices_list_skipped_lines_total == 2
    text = exposition(m).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["accelstats_devices_list_skipped_lines"].samples[0].value == 2  # each line counted once
    cad = families["container_accelerator_memory_total_bytes"].samples
    assert [(s.labels["id"], s.labels["acc_id"]) for s in cad] == [
        (f"/docker/{DOCKER_A}", "GPU-00000000-0000-4000-8000-000000000001")]


def test_get_collector_outside_the_hierarchy_is_a_noop_with_a_reason(tmp_path: Path, fixtures_dir: Path) -> None:
    m = manager(host(tmp_path, fixtures_dir / "h200" / "nvidia-smi-q.xml", {}))
    m.collect()
    stats = ContainerStats(cgroup="/elsewhere", identity=None)
    m.get_collector(tmp_path / "elsewhere").update_stats(stats)
    assert stats.accelerators == [] and "is not under" in stats.reason


def test_a_vanished_devices_list_is_a_reason_not_an_exception(tmp_path: Path, fixtures_dir: Path) -> None:
    settings = host(tmp_path, fixtures_dir / "h200" / "nvidia-smi-q.xml", {DOCKER_A: "c 195:0 rw\n"})
    m = manager(settings)
    m.collect()
    d = settings.cgroup_root / "devices" / "docker" / DOCKER_A
    (d / "devices.list").unlink()
    stats = ContainerStats(cgroup=f"/docker/{DOCKER_A}", identity=None)
    m.get_collector(d).update_stats(stats)
    assert stats.accelerators == [] and "devices.list not readable" in stats.reason


def test_get_collector_reads_a_callers_path_with_the_checked_reads(tmp_path: Path, fixtures_dir: Path) -> None:
    """The collection's plain reads (cgroupfs alone, accelstats/cgroups/plainreads.py) hold for the
    hierarchy it looked at; a path a caller hands in is checked by name only, so it is read checked."""
    settings = host(tmp_path, fixtures_dir / "h200" / "nvidia-smi-q.xml", {DOCKER_A: "c 195:0 rw\n"})
    m = manager(settings)
    latest = m.collect()
    assert latest.view is not None
    latest.view.plain_reads = True  # as on a cgroupfs host
    collector = m.get_collector(settings.cgroup_root / "devices" / "docker" / DOCKER_A)
    assert isinstance(collector, ContainerCollector) and collector.view.plain_reads is False


def test_concurrent_scrapes_share_one_collection(tmp_path: Path, fixtures_dir: Path) -> None:
    """One collection runs (held inside attribution); seven callers arrive meanwhile and queue at the
    manager's lock; released only once all seven are counted there, they share one more collection."""
    m = manager(host(tmp_path, fixtures_dir / "h200" / "nvidia-smi-q.xml", {DOCKER_A: "c 195:0 rw\n"}))
    runs = 0
    attributor = m._attributor
    assert attributor is not None
    real = attributor.attribute
    gate, inside = threading.Event(), threading.Event()

    def slow_attribute(snapshot, on_skipped=None):  # type: ignore[no-untyped-def]
        nonlocal runs
        runs += 1
        inside.set()
        assert gate.wait(60), "never released"
        return real(snapshot, on_skipped)

    class CountingLock:
        """The manager's lock, counting the callers that reached ``with lock:`` (holding or waiting)."""

        def __init__(self, lock: threading.Lock) -> None:
            self.lock, self.arrived = lock, 0
            self._count = threading.Lock()

        def __enter__(self) -> bool:
            with self._count:
                self.arrived += 1
            return self.lock.acquire()

        def __exit__(self, *exc: object) -> None:
            self.lock.release()

        def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
            return self.lock.acquire(blocking, timeout)

        def release(self) -> None:
            self.lock.release()

    attributor.attribute = slow_attribute  # type: ignore[method-assign]
    lock = CountingLock(m._lock)
    m._lock = lock  # type: ignore[assignment]
    results = []
    threads = [threading.Thread(target=lambda: results.append(m.collect())) for _ in range(8)]
    threads[0].start()
    assert inside.wait(60)  # the first collection runs: the seven below arrive after it started
    for t in threads[1:]:
        t.start()
    end = time.monotonic() + 60
    while lock.arrived < 8:  # all seven queued behind the running collection
        assert time.monotonic() < end, f"only {lock.arrived - 1} of 7 callers reached the lock"
        time.sleep(0.01)
    gate.set()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert len(results) == 8
    assert runs == 2  # the one in flight, then one more shared by the seven that waited for it
    assert len({id(r) for r in results}) == 2


def test_unrestricted_cgroup_is_attributed_by_its_processes(tmp_path: Path, fixtures_dir: Path) -> None:
    """a *:* rwm proves nothing: the GPU a process of the container (or of a sub-cgroup) is on counts."""
    capture = fixtures_dir / "h200" / "nvidia-smi-q.xml"
    settings = host(tmp_path, capture, {DOCKER_A: "a *:* rwm\n", DOCKER_B: "a *:* rwm\n"})
    scenario = settings.nvml_replay
    assert scenario is not None
    scenario.write_text(scenario.read_text() + "[[gpu.process]]\npid = 4242\nused_memory_bytes = 1048576\n")
    proc = settings.proc_root / "4242"
    proc.mkdir()
    (proc / "cgroup").write_text(f"5:devices:/docker/{DOCKER_A}/init.scope\n0::/docker/{DOCKER_A}/init.scope\n")
    by_id = {c.identity.id: c for c in manager(settings).collect().containers if c.identity}
    (acc,) = by_id[DOCKER_A].accelerators
    assert (acc.id, acc.attribution, acc.container_memory_used_bytes, acc.container_processes) == (
        "GPU-00000000-0000-4000-8000-000000000001", "process", 1048576, 1)
    assert by_id[DOCKER_B].accelerators == []
    assert "none of its processes is on a GPU" in by_id[DOCKER_B].reason



def test_nvml_pcie_interval_reaches_the_sampler(tmp_path: Path, fixtures_dir: Path) -> None:
    """``nvml_pcie_interval`` (config key) sets the PCIe sampler's period; 0 turns it off."""
    from collectors.nvidia import NvidiaBackend

    def sampler_interval(interval: float) -> float | None:
        settings = Settings(cgroup_root=tmp_path, proc_root=tmp_path, collectors=("nvidia",),
                            nvml_pcie_interval=interval)
        manager = AcceleratorManager(settings, open_replay(fixtures_dir / "h200" / "nvidia-smi-q.xml"))
        manager.setup()
        try:
            (nvidia,) = manager.collectors
            assert isinstance(nvidia, NvidiaBackend)
            return nvidia.pcie.interval if nvidia.pcie is not None else None
        finally:
            manager.destroy(timeout=0.5)
            manager.close()

    assert sampler_interval(0) is None
    assert sampler_interval(2.5) == 2.5


def test_a_second_setup_adds_no_second_set_of_collectors(tmp_path: Path, fixtures_dir: Path) -> None:
    """``with AcceleratorManager(...)`` sets up; a caller's own ``setup()`` inside it once made every
    collection read each GPU twice (benchmarks and the exposition tests did)."""
    settings = Settings(cgroup_root=tmp_path, proc_root=tmp_path, collectors=("nvidia",))
    with AcceleratorManager(settings, open_replay(fixtures_dir / "h200" / "nvidia-smi-q.xml")) as manager:
        manager.setup()
        assert [c.name for c in manager.collectors] == ["nvidia"]
        results = [r.name for r in manager.collect().snapshot.collector_results]
        assert results.count("nvidia") == 1
