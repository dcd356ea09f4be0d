"""GPU accounting on a replay scenario with known per-process samples and energy readings.

The replayed driver samples each process every 1/6 s (``SAMPLE_PERIOD_US``) and answers
``nvmlDeviceGetProcessUtilization`` as NVML documents it (one averaged sample per busy process since
``lastSeenTimeStamp``); the GPU draws a constant 400 W. The real :class:`ProcessSampler` reads it
through pynvml once per (fake) second and the real :class:`Ledger` integrates; collections
(:meth:`Ledger.settle`) come every 1 s, 7 s or 60 s, or from two threads at once.

Scenario (seconds after ``nvmlInit``):

| PID | cgroup                    | lives    | SM %                    | memory                    |
|-----|---------------------------|----------|-------------------------|---------------------------|
| 101 | container A (/docker/a…)  | 0 - 90   | 50, 100 from 30         | 1 GiB, 2 GiB from 30      |
| 102 | container B (/docker/b…)  | 20 - 50  | 25                      | 512 MiB                   |
| 103 | a login session (host)    | always   | 10                      | 256 MiB                   |

Containers: A's cgroup exists from -5 s, B's from 19.5 s to 80 s, C's (granted, never runs
anything) always; each is granted the GPU by its devices cgroup.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from accelstats import catalog
from accelstats.accounting import AccountingView, Ledger, Published
from accelstats.catalog import identity_labels
from accelstats.config import Settings
from accelstats.containers import AcceleratorStats, ContainerStats
from accelstats.exporter import exposition
from accelstats.manager import AcceleratorManager, Collection
from collectors.model import Device, DeviceSnapshot
from collectors.nvidia import NvidiaBackend
from collectors.nvml_call import NvmlCaller
from collectors.nvml_lib import open_replay
from collectors.nvml_replay import SAMPLE_PERIOD_US
from collectors.procsampler import ProcessSampler, busy_seconds

UUID = "GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c10"
T0 = 5_000.0  # fake clock at nvmlInit
END = 120  # seconds simulated
GIB = 1 << 30
A, B, C = "/docker/" + "a" * 64, "/docker/" + "b" * 64, "/docker/" + "c" * 64
HOST = "/user.slice/user-0.slice/session-1.scope"
CGROUP_OF_PID = {101: A, 102: B, 103: HOST}
LIFE = {A: (-5.0, 1e9), B: (19.5, 80.0), C: (-100.0, 1e9)}  # container cgroups: (created, removed)

SCENARIO = """
[[gpu]]
capture = "{capture}"
[gpu.override]
power_usage_mw = 400000
[[gpu.process]]
pid = 101
sm_utilization_percent = 50
used_memory_bytes = 1073741824
end_s = 90
[[gpu.process.step]]
at_s = 30
sm_utilization_percent = 100
used_memory_bytes = 2147483648
[[gpu.process]]
pid = 102
start_s = 20
end_s = 50
sm_utilization_percent = 25
used_memory_bytes = 536870912
[[gpu.process]]
pid = 103
sm_utilization_percent = 10
used_memory_bytes = 268435456
"""


def sm_percent(pid: int, t: float) -> float | None:
    """The scenario's SM % of ``pid`` at ``t`` s (None: not running): the table above."""
    if pid == 101:
        return None if t >= 90 else (100.0 if t >= 30 else 50.0)
    if pid == 102:
        return 25.0 if 20 <= t < 50 else None
    return 10.0


def memory(pid: int, t: float) -> float:
    if pid == 101:
        return 0.0 if t >= 90 else (2.0 * GIB if t >= 30 else 1.0 * GIB)
    if pid == 102:
        return 512.0 * (1 << 20) if 20 <= t < 50 else 0.0
    return 256.0 * (1 << 20)


def expected_sm_seconds(pid: int, until: float = END) -> float:
    """Every driver sample after the first read (tick 0) up to the last read: value x sample period."""
    period = SAMPLE_PERIOD_US / 1e6
    total = 0.0
    for k in range(1, int(until * 1e6) // SAMPLE_PERIOD_US + 1):
        value = sm_percent(pid, k * SAMPLE_PERIOD_US / 1e6)
        total += (value or 0.0) / 100.0 * period
    return total


def expected_byte_seconds(pid: int, until: int = END) -> float:
    """Memory read at each whole second, held until the next read."""
    return sum(memory(pid, t) for t in range(until))


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


class Host:
    """A scenario, the sampler and the ledger on one fake clock; ``collect`` is one settlement."""

    def __init__(self, scenario: Path) -> None:
        self.clock = Clock()
        nvml = open_replay(scenario, clock=self.clock)
        nvml.nvmlInit()
        self.nvml = nvml
        self.ledger = Ledger(CGROUP_OF_PID.get, self.started_at, self.alive)
        self.sampler = ProcessSampler(NvmlCaller(nvml), 1.0, self.ledger.add_rounds, clock=self.clock)
        self.sampler.set_devices([(Device(uuid=UUID, index=0, minor=0, name="NVIDIA H200"),
                                   nvml.nvmlDeviceGetHandleByIndex(0))])
        self.energy: list[float] = []

    @property
    def t(self) -> float:
        return self.clock.now - T0

    def started_at(self, cgroup: str) -> float | None:
        return T0 + LIFE[cgroup][0]

    def alive(self, cgroup: str) -> bool:
        born, gone = LIFE.get(cgroup, (0.0, 0.0))
        return born <= self.t < gone

    def containers(self) -> list[ContainerStats]:
        """What the attribution finds now: every container whose cgroup exists, granted the GPU."""
        return [ContainerStats(cgroup=c, identity=None, accelerators=[AcceleratorStats(
            make="nvidia", model="NVIDIA H200", id=UUID, minor=0, index=0, attribution="devices_cgroup",
            memory_total_bytes=None, memory_used_bytes=None, duty_cycle=None, container_memory_used_bytes=None,
            container_sm_utilization_ratio=None, container_processes=None)]) for c in LIFE if self.alive(c)]

    def collect(self) -> AccountingView:
        return self.ledger.settle(self.containers(), identity_labels, lambda uuid: "0")

    def round(self) -> None:
        for r in self.sampler.read_round():
            if r.energy_joules is not None:
                self.energy.append(r.energy_joules)

    def run(self, scrape_every: int, until: int = END) -> dict[str, Published]:
        """One round per second from 0 to ``until``, a collection every ``scrape_every`` seconds and
        after the last round; the totals each container had when last published."""
        seen: dict[str, Published] = {}
        while True:
            self.round()
            if int(self.t) % scrape_every == 0 or self.t >= until:
                seen.update({a.labels[0]: a for a in self.collect().accounts})
            if self.t >= until:
                return seen
            self.clock.now += 1.0


@pytest.fixture
def scenario(tmp_path: Path, fixtures_dir: Path) -> Path:
    path = tmp_path / "accounting.toml"
    path.write_text(SCENARIO.format(capture=fixtures_dir / "h200" / "nvidia-smi-q.xml"))
    return path


@pytest.mark.parametrize(
    ("samples", "last_seen_us", "elapsed", "busy", "newest"),
    [
        # (pid, timeStamp µs, smUtil %): one sample covers (lastSeenTimeStamp, timeStamp]
        ([(7, 2_000_000, 50)], 1_000_000, 1.0, {7: 0.5}, 2_000_000),
        ([(7, 2_000_000, 50)], 1_000_000, 0.25, {7: 0.125}, 2_000_000),  # at most the time since the last read
        ([(7, 1_500_000, 40), (8, 2_000_000, 100)], 1_000_000, 1.0, {7: 0.2, 8: 1.0}, 2_000_000),
        ([(7, 2_000_000, 250)], 1_000_000, 1.0, {7: 1.0}, 2_000_000),  # > 100 % (zombies): 100 %
        ([(7, 900_000, 50)], 1_000_000, 1.0, {7: 0.0}, 1_000_000),  # not newer: covers nothing
        ([], 1_000_000, 1.0, {}, 1_000_000),
    ],
)
def test_busy_seconds(samples: list[tuple[int, int, int]], last_seen_us: int, elapsed: float,
                      busy: dict[int, float], newest: int) -> None:
    class S:
        def __init__(self, pid: int, ts: int, sm: int) -> None:
            self.pid, self.timeStamp, self.smUtil = pid, ts, sm

    got, seen = busy_seconds([S(*s) for s in samples], last_seen_us, elapsed)
    assert got == pytest.approx(busy) and seen == newest


def test_sm_seconds_integrate_every_driver_sample_once(scenario: Path) -> None:
    totals = Host(scenario).run(scrape_every=1)
    assert totals[A].sm_seconds == pytest.approx(expected_sm_seconds(101), rel=1e-12)
    assert totals[B].sm_seconds == pytest.approx(expected_sm_seconds(102), rel=1e-12)
    assert totals[C].sm_seconds == 0.0
    # 30 s at 50 % + 60 s at 100 %, less the last sample before each whole second's read boundary drift
    assert totals[A].sm_seconds == pytest.approx(75.0, abs=0.01)
    assert HOST not in totals  # a host process is no container


def test_memory_byte_seconds_hold_each_reading_until_the_next(scenario: Path) -> None:
    totals = Host(scenario).run(scrape_every=1)
    assert totals[A].memory_byte_seconds == expected_byte_seconds(101) == 30 * GIB + 60 * 2 * GIB
    assert totals[B].memory_byte_seconds == expected_byte_seconds(102) == 30 * 512 * (1 << 20)
    assert totals[C].memory_byte_seconds == 0.0


def test_energy_is_conserved_and_split_by_sm_share(scenario: Path) -> None:
    host = Host(scenario)
    totals = host.run(scrape_every=1)
    view = host.collect()
    (uuid, idle, unattributed), = view.devices
    assert uuid == UUID
    delta = host.energy[-1] - host.energy[0]
    assert delta == pytest.approx(400.0 * END)  # the replayed counter: 400 W for 120 s
    containers = sum(a.energy_joules for a in totals.values())
    assert containers + idle + unattributed == pytest.approx(delta, rel=1e-12)
    # the first window (0, 10]: A at 50 % and the host process at 10 %, each read covering 6 samples
    covered = 10 * 6 * SAMPLE_PERIOD_US / 1e6
    first = Host(scenario)
    first.run(scrape_every=1, until=10)
    a, = (x for x in first.collect().accounts if x.labels[0] == A)
    assert a.energy_joules == pytest.approx(4000.0 * 0.5 * covered / 10.0, rel=1e-9)
    (_, idle10, host10), = first.collect().devices
    assert host10 == pytest.approx(4000.0 * 0.1 * covered / 10.0, rel=1e-9)  # the host process's share
    assert idle10 == pytest.approx(4000.0 * (1 - 0.6 * covered / 10.0), rel=1e-9)


def test_allocated_and_idle_seconds(scenario: Path) -> None:
    totals = Host(scenario).run(scrape_every=1)
    assert totals[A].allocated_seconds == END  # granted before accounting started: from the start
    assert totals[C].allocated_seconds == END
    assert totals[C].allocated_seconds - totals[C].busy_seconds == END  # granted, never busy: all idle
    assert totals[B].allocated_seconds == 80.0 - 19.5  # from its oldest process to the removal of its cgroup
    assert totals[B].busy_seconds == 30.0  # reads at 21 … 50 s saw it busy
    assert totals[A].busy_seconds == 90.0


@pytest.mark.parametrize("scrape_every", [7, 60])
def test_the_scrape_interval_does_not_change_the_totals(scenario: Path, scrape_every: int) -> None:
    every_second = Host(scenario).run(scrape_every=1)
    sparse = Host(scenario).run(scrape_every=scrape_every)
    assert set(sparse) == set(every_second) == {A, B, C}
    for cgroup, want in every_second.items():
        got = sparse[cgroup]
        assert (got.sm_seconds, got.memory_byte_seconds, got.allocated_seconds, got.busy_seconds) == pytest.approx(
            (want.sm_seconds, want.memory_byte_seconds, want.allocated_seconds, want.busy_seconds), rel=1e-12), cgroup
        assert got.energy_joules == pytest.approx(want.energy_joules, rel=1e-12), cgroup


def test_two_concurrent_scrapers_do_not_change_the_totals(scenario: Path) -> None:
    alone = Host(scenario).run(scrape_every=1)
    host = Host(scenario)
    stop = threading.Event()
    seen: list[AccountingView] = []

    def scraper() -> None:
        while not stop.is_set():
            seen.append(host.collect())

    threads = [threading.Thread(target=scraper) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        totals = host.run(scrape_every=5)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert len(seen) > 10
    for cgroup, want in alone.items():
        got = totals[cgroup]
        assert (got.sm_seconds, got.memory_byte_seconds, got.energy_joules) == pytest.approx(
            (want.sm_seconds, want.memory_byte_seconds, want.energy_joules), rel=1e-12), cgroup


def monotonic(views: list[AccountingView], value: Callable[[Published], float]) -> bool:
    last: dict[str, float] = {}
    for view in views:
        for a in view.accounts:
            if value(a) < last.get(a.labels[0], 0.0):
                return False
            last[a.labels[0]] = value(a)
    return True


def test_counters_only_grow_and_an_ended_container_is_published_once_more(scenario: Path) -> None:
    host = Host(scenario)
    views = []
    for _ in range(END + 1):
        host.round()
        views.append((host.t, host.collect()))
        host.clock.now += 1.0
    for value in (lambda a: a.sm_seconds, lambda a: a.memory_byte_seconds, lambda a: a.energy_joules,
                  lambda a: a.allocated_seconds, lambda a: a.allocated_seconds - a.busy_seconds):
        assert monotonic([v for _, v in views], value)
    with_b = [t for t, v in views if any(a.labels[0] == B for a in v.accounts)]
    assert (with_b[0], with_b[-1]) == (20.0, 80.0)  # seen at 20 s; at 80 s its cgroup is gone: final totals
    final_b = next(a for a in views[80][1].accounts if a.labels[0] == B)
    assert final_b.ended and final_b.allocated_seconds == 60.5


def test_mig_instances_are_devices_of_their_own_without_sm_or_energy(tmp_path: Path, fixtures_dir: Path) -> None:
    """NVML gives no per-process utilisation for MIG instances: memory and allocation are counted per
    instance; SM-seconds, energy and idle seconds are absent (never 0)."""
    path = tmp_path / "mig.toml"
    path.write_text(f'[[gpu]]\ncapture = "{fixtures_dir / "public" / "a100-sxm4-v12.xml"}"\n[[gpu.mig]]\n'
                    'gpu_instance_id = 7\nprofile = "1g.10gb"\nmemory_total_bytes = 10737418240\n'
                    f'uuid = "MIG-00000000-0000-4000-8000-000000000007"\n[[gpu.mig.process]]\npid = 101\n'
                    f'used_memory_bytes = {GIB}\nsm_utilization_percent = 30\n')
    clock = Clock()
    nvml = open_replay(path, clock=clock)
    nvml.nvmlInit()
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(nvml.nvmlDeviceGetHandleByIndex(0), 0)
    uuid = "MIG-00000000-0000-4000-8000-000000000007"
    ledger = Ledger(CGROUP_OF_PID.get, lambda cgroup: T0, lambda cgroup: True)
    sampler = ProcessSampler(NvmlCaller(nvml), 1.0, ledger.add_rounds, clock=clock)
    sampler.set_devices([(Device(uuid=uuid, index=0, minor=None, name="A100 MIG 1g.10gb", kind="mig"), mig)])
    for _ in range(11):
        (r,) = sampler.read_round()
        assert r.sm is None and r.memory == ((101, GIB),)
        clock.now += 1.0
    container = ContainerStats(cgroup=A, identity=None, accelerators=[AcceleratorStats(
        make="nvidia", model="A100 MIG", id=uuid, minor=None, index=0, attribution="devices_cgroup",
        memory_total_bytes=None, memory_used_bytes=None, duty_cycle=None, container_memory_used_bytes=None,
        container_sm_utilization_ratio=None, container_processes=None)])
    view = ledger.settle([container], identity_labels, lambda u: "0")
    collection = Collection(snapshot=DeviceSnapshot(), accounting=view)
    published = {f.name: [v for _, v in f.read(collection)] for f in catalog.ACCOUNTING if f.read is not None}
    assert published == {
        "accelstats_container_gpu_sm_seconds_total": [],
        "accelstats_container_gpu_memory_byte_seconds_total": [10.0 * GIB],
        "accelstats_container_gpu_energy_joules_total": [],
        "accelstats_container_gpu_allocated_seconds_total": [10.0],
        "accelstats_container_gpu_idle_seconds_total": [],
        "accelstats_gpu_idle_energy_joules_total": [],  # no energy counter read for an instance
        "accelstats_gpu_unattributed_energy_joules_total": [],
    }


def test_the_exporter_publishes_the_counters_from_its_own_sampler(tmp_path: Path, fixtures_dir: Path) -> None:
    """The manager's real sampler thread, the attribution on a v1 devices tree, the exposition: a busy
    container, an idle one, and energy conserved on what /metrics says."""
    scenario = tmp_path / "host.toml"
    scenario.write_text(f'[[gpu]]\ncapture = "{fixtures_dir / "h200" / "nvidia-smi-q.xml"}"\n'
                        f'[[gpu.process]]\npid = 4242\nused_memory_bytes = {GIB}\nsm_utilization_percent = 40\n')
    devices = tmp_path / "cgroup" / "devices"
    for cid in ("a" * 64, "c" * 64):
        (devices / "docker" / cid).mkdir(parents=True)
        (devices / "docker" / cid / "devices.list").write_text("c 195:0 rw\n")
    (devices / "devices.list").write_text("a *:* rwm\n")
    (tmp_path / "proc" / "4242").mkdir(parents=True)
    (tmp_path / "proc" / "4242" / "cgroup").write_text(f"5:devices:{A}\n0::{A}\n")
    settings = Settings(nvml_replay=scenario, cgroup_root=tmp_path / "cgroup", proc_root=tmp_path / "proc",
                        accounting_interval=0.02)
    with AcceleratorManager(settings, open_replay(scenario)) as manager:
        manager.collect()
        ledger = manager.ledger
        assert ledger is not None
        sampler = next(c.accounting for c in manager.collectors if isinstance(c, NvidiaBackend))
        assert sampler is not None
        deadline = time.monotonic() + 30
        while ledger.split_energy(UUID) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        sampler.stop()  # what /metrics says next is then what the ledger holds
        assert sampler.wait_idle(5)
        families = {f.name: f for f in text_string_to_metric_families(exposition(manager).decode())}
        ledger_split = ledger.split_energy(UUID)

    def values(name: str) -> dict[str, float]:
        return {s.labels.get("id", s.labels.get("uuid", "")): s.value for s in families[name].samples
                if s.name.endswith("_total")}

    sm = values("accelstats_container_gpu_sm_seconds")
    allocated = values("accelstats_container_gpu_allocated_seconds")
    idle = values("accelstats_container_gpu_idle_seconds")
    assert 0 < sm[A] <= 0.4 * allocated[A] + 1e-9
    assert idle[C] == allocated[C] > 0  # granted, never busy
    assert values("accelstats_container_gpu_memory_byte_seconds")[A] > 0
    energy = values("accelstats_container_gpu_energy_joules")
    gpu_idle = values("accelstats_gpu_idle_energy_joules")[UUID]
    unattributed = values("accelstats_gpu_unattributed_energy_joules")[UUID]
    assert sum(energy.values()) + gpu_idle + unattributed == pytest.approx(ledger_split, rel=1e-9)
    assert energy[A] > 0 and energy.get(C, 0.0) == 0.0
