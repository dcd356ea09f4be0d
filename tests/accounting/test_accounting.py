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
| 104 | container D (/docker/f…)  | 60 - 75  | 60                      | 256 MiB                   |

Containers: A's cgroup exists from -5 s, B's from 19.5 s to 80 s, C's (granted, never runs
anything) always, D's from 59.5 s to 76 s (gone 1 s after its work, before its energy window
closes); each is granted the GPU by its devices cgroup.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from accelstats import catalog
from accelstats.accounting import AccountingView, Ledger, Published
from accelstats.accounting.records import merge_spans
from accelstats.attribution.containers import AcceleratorStats, ContainerStats
from accelstats.config import load_config
from accelstats.manager import AcceleratorManager, Collection
from accelstats.settings import ConfigError, Settings
from accelstats.web.exposition import exposition
from collectors.model import Device, DeviceSnapshot
from collectors.nvidia import NvidiaBackend
from collectors.nvml_call import NvmlCaller
from collectors.procsampler import ProcessRound, ProcessSampler
from collectors.replay.lib import open_replay
from collectors.replay.state import SAMPLE_PERIOD_US
from collectors.smsamples import CURSOR_WINDOW, DRIVER_PERIOD_DEFAULT, DRIVER_PERIOD_MAX, SmSamples

UUID = "GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c10"
T0 = 5_000.0  # fake clock at nvmlInit
END = 120  # seconds simulated
GIB = 1 << 30
A, B, C, D = ("/docker/" + ch * 64 for ch in "abcf")
HOST = "/user.slice/user-0.slice/session-1.scope"
CGROUP_OF_PID = {101: A, 102: B, 103: HOST, 104: D}
LIFE = {A: (-5.0, 1e9), B: (19.5, 80.0), C: (-100.0, 1e9), D: (59.5, 76.0)}  # container cgroups: (created, removed)

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
[[gpu.process]]
pid = 104
start_s = 60
end_s = 75
sm_utilization_percent = 60
used_memory_bytes = 268435456
"""


def sm_percent(pid: int, t: float) -> float | None:
    """The scenario's SM % of ``pid`` at ``t`` s (None: not running): the table above."""
    if pid == 101:
        return None if t >= 90 else (100.0 if t >= 30 else 50.0)
    if pid == 102:
        return 25.0 if 20 <= t < 50 else None
    if pid == 104:
        return 60.0 if 60 <= t < 75 else None
    return 10.0


def memory(pid: int, t: float) -> float:
    if pid == 101:
        return 0.0 if t >= 90 else (2.0 * GIB if t >= 30 else 1.0 * GIB)
    if pid == 102:
        return 512.0 * (1 << 20) if 20 <= t < 50 else 0.0
    if pid == 104:
        return 256.0 * (1 << 20) if 60 <= t < 75 else 0.0
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


@dataclass(frozen=True)
class Lookup:
    """The ledger's host lookups (:class:`accelstats.accounting.HostLookup`) from the scenario's tables."""

    cgroup_of: Callable[[int], str | None]
    started_at: Callable[[str], float | None]
    alive: Callable[[str], bool]


def granted(*cgroups: str, uuid: str = UUID) -> list[ContainerStats]:
    return [ContainerStats(cgroup=c, identity=None, accelerators=[AcceleratorStats(
        make="nvidia", model="", id=uuid, minor=0, index=0, attribution="devices_cgroup", memory_total_bytes=None,
        memory_used_bytes=None, duty_cycle=None, container_memory_used_bytes=None, container_sm_utilization_ratio=None,
        container_processes=None)]) for c in cgroups]


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
        self.ledger = Ledger(Lookup(CGROUP_OF_PID.get, self.started_at, self.alive))
        self.sampler = ProcessSampler(NvmlCaller(nvml), 1.0, self.ledger.add_rounds, clock=self.clock, wall=self.clock)
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
        return granted(*(c for c in LIFE if self.alive(c)))

    def collect(self) -> AccountingView:
        return self.ledger.settle(self.containers(), lambda uuid: "0")

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


class Sample:
    """An ``nvmlProcessUtilizationSample_t`` as the sampler reads it."""

    def __init__(self, pid: int, ts: int, sm: int) -> None:
        self.pid, self.timeStamp, self.smUtil = pid, ts, sm


NOW = 10_000_000  # µs: the read's wall clock in the table below


@pytest.mark.parametrize(
    ("shape", "cursor", "idle_read", "samples", "busy", "spans"),
    [
        # (pid, timeStamp µs, smUtil %). Mean shape: a sample covers (cursor, timeStamp]
        ("mean", 9_000_000, None, [(7, 10_000_000, 50)], {7: 0.5}, {7: [(9.0, 10.0)]}),
        ("mean", 9_000_000, None, [(7, 9_500_000, 40), (8, 10_000_000, 100)], {7: 0.2, 8: 1.0},
         {7: [(9.0, 9.5)], 8: [(9.0, 10.0)]}),
        # after reads that proved 4 s idle (NOT_FOUND at 8 s): the mean over the window holds the idle
        # samples (20 % of 5 s = 1 SM-second); its busy part waits for the next window's level
        ("mean", 5_000_000, 8_000_000, [(7, 10_000_000, 20)], {7: 1.0}, {}),  # placed by the next window
        # a NOT_FOUND read within a driver period of the cursor proves nothing: the window is busy
        ("mean", 9_000_000, 9_100_000, [(7, 10_000_000, 50)], {7: 0.5}, {7: [(9.0, 10.0)]}),
        ("mean", 9_000_000, None, [(7, 10_000_000, 250)], {7: 1.0}, {7: [(9.0, 10.0)]}),  # > 100 % (zombies)
        ("mean", 9_000_000, None, [(7, 8_900_000, 50)], {}, {}),  # not newer than the cursor: nothing
        # every shape: each sample covers the time since the PID's previous one, at most the driver period
        ("every", 9_000_000, None, [(7, 9_000_000 + k * 166_667, 100) for k in range(1, 7)],
         {7: 5 * 0.166667 + 0.166667},
         {7: [(9.0, 10.000002)]}),
        ("every", 5_000_000, 8_000_000, [(7, 9_833_333, 100), (7, 10_000_000, 100)], {7: 0.333334},
         {7: [(9.666666, 10.0)]}),
    ],
)
def test_a_sample_covers(shape: str, cursor: int, idle_read: int | None, samples: list[tuple[int, int, int]],
                         busy: dict[int, float], spans: dict[int, list[tuple[float, float]]]) -> None:
    state = SmSamples()
    state.shape, state.cursor_us, state.idle_read_us = shape, cursor, idle_read
    state.sampled_before = {7, 8}
    got = state.answer([Sample(*x) for x in samples], NOW)
    assert got.seconds == pytest.approx(busy, abs=1e-6)
    assert {pid: merge_spans(v) for pid, v in got.spans.items()} == {
        pid: [pytest.approx(x, abs=1e-6) for x in v] for pid, v in spans.items()}
    assert state.cursor_us == max([cursor] + [ts for _, ts, _ in samples])


def test_the_cursor_never_lags_the_read_by_more_than_the_window() -> None:
    state = SmSamples()
    assert state.ask(3_600_000_000) == 3_600_000_000 - int(CURSOR_WINDOW * 1e6)
    state.cursor_us = 3_599_999_000
    assert state.ask(3_600_000_000) == 3_599_999_000


@pytest.mark.parametrize(("again", "shape"), [
    ([(7, 10_000_000, 20)], "every"),  # the same sample answered again: every driver sample
    ([(7, 10_000_000, 20), (7, 10_166_667, 20)], "every"),
    ([(7, 10_000_000, 100)], "mean"),  # a mean that the idle stretch no longer dilutes
    ([(7, 10_166_667, 20)], "mean"),
])
def test_the_answer_shape_is_learnt_after_a_proven_idle_stretch(again: list[tuple[int, int, int]],
                                                                shape: str) -> None:
    """20 % over the 5 s since the cursor (1 SM-second) could be a mean holding the 4 s proven idle: the
    sample is asked again from just before it, once per GPU."""
    state = SmSamples()
    state.cursor_us, state.idle_read_us = 5_000_000, 9_000_000
    asked: list[int] = []

    def query(since: int) -> list[Sample]:
        asked.append(since)
        return [Sample(*x) for x in again]

    state.answer([Sample(7, 10_000_000, 20)], NOW, query=query)
    assert (state.shape, asked) == (shape, [9_999_999])
    state.answer([Sample(7, 11_000_000, 100)], 11_000_000, query=query)
    assert len(asked) == 1  # learnt once


def test_a_sample_no_mean_could_be_is_the_every_shape() -> None:
    """100 % over the 5 s since the cursor would be 5 busy seconds, but NOT_FOUND at 9 s proved the GPU
    idle until then: at most 1 s (plus a driver period and a late sample's margin) can be busy. So the
    answer is not a mean: the every shape, learnt without asking again."""
    state = SmSamples()
    state.cursor_us, state.idle_read_us = 5_000_000, 9_000_000

    def query(since: int) -> list[Sample]:
        raise AssertionError("not asked again")

    got = state.answer([Sample(7, 10_000_000, 100)], NOW, query=query)
    assert state.shape == "every" and got.seconds == {7: pytest.approx(DRIVER_PERIOD_DEFAULT, abs=1e-6)}


def test_a_pid_listed_twice_is_the_every_shape_and_shows_the_driver_period() -> None:
    state = SmSamples()
    state.cursor_us = 9_000_000
    state.answer([Sample(7, 9_500_000, 100), Sample(7, 9_750_000, 100), Sample(7, 10_000_000, 100)], NOW)
    assert (state.shape, state.period_us) == ("every", 250_000)


def test_a_sample_from_the_future_is_left_out_and_does_not_stall_later_reads() -> None:
    state = SmSamples()
    state.cursor_us, state.sampled_before = 1_000_000, {8}
    got = state.answer([Sample(7, 2**63, 100), Sample(8, 2_000_000, 100)], NOW)
    assert (got.seconds, state.cursor_us, got.future) == ({8: 1.0}, 2_000_000, 1)


def test_sm_seconds_integrate_every_driver_sample_once(scenario: Path) -> None:
    totals = Host(scenario).run(scrape_every=1)
    assert totals[A].sm_seconds == pytest.approx(expected_sm_seconds(101), rel=1e-12)
    assert totals[B].sm_seconds == pytest.approx(expected_sm_seconds(102), rel=1e-12)
    assert totals[D].sm_seconds == pytest.approx(expected_sm_seconds(104), rel=1e-12)
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
    host = Host(scenario)
    totals = host.run(scrape_every=1)
    horizon = END - host.ledger.span_lag()  # idle seconds trail the last round (rounds 1 s apart: 3.5 s)
    assert horizon == END - 3.5
    assert totals[A].allocated_seconds == END  # granted before accounting started: from the start
    assert totals[C].allocated_seconds == END
    assert totals[C].idle_seconds == horizon  # granted, never busy: all idle, up to the horizon
    assert totals[B].allocated_seconds == 80.0 - 19.5  # from its oldest process to the removal of its cgroup
    # busy while its samples say so (the replay's 1/6 s grid drifts 4 µs a second from whole seconds)
    assert totals[B].busy_seconds == pytest.approx(30.0, abs=1e-3)
    assert totals[B].idle_seconds == pytest.approx(80.0 - 19.5 - 30.0, abs=1e-3)  # ended: counted to its end
    assert totals[A].busy_seconds == pytest.approx(90.0, abs=1e-3)
    assert totals[A].idle_seconds == pytest.approx(horizon - 90.0, abs=1e-3)
    assert totals[D].allocated_seconds == 76.0 - 59.5
    assert totals[D].busy_seconds == pytest.approx(15.0, abs=1e-3)
    assert totals[D].ended and totals[D].energy_joules > 0


@pytest.mark.parametrize("scrape_every", [7, 60])
def test_the_scrape_interval_does_not_change_the_totals(scenario: Path, scrape_every: int) -> None:
    every_second = Host(scenario).run(scrape_every=1)
    sparse = Host(scenario).run(scrape_every=scrape_every)
    assert set(sparse) == set(every_second) == {A, B, C, D}
    for cgroup, want in every_second.items():
        got = sparse[cgroup]
        assert (got.sm_seconds, got.memory_byte_seconds, got.allocated_seconds, got.busy_seconds) == pytest.approx(
            (want.sm_seconds, want.memory_byte_seconds, want.allocated_seconds, want.busy_seconds), rel=1e-12), cgroup
        assert got.energy_joules == pytest.approx(want.energy_joules, rel=1e-12), cgroup


def test_two_concurrent_scrapers_do_not_change_the_totals(scenario: Path) -> None:
    """Two threads collect as fast as they can while the rounds go on (and a third collects every 5 s):
    every counter only grows in every thread's views, and the final totals are those of one scraper.
    A collection's attribution and settlement go together, as under the manager's collection lock."""
    alone = Host(scenario).run(scrape_every=1)
    host = Host(scenario)
    stop = threading.Event()
    views: dict[int, list[AccountingView]] = {0: [], 1: []}
    collecting = threading.Lock()  # AcceleratorManager.collect: one collection at a time
    plain = host.collect

    def collect() -> AccountingView:
        with collecting:
            return plain()

    host.collect = collect  # type: ignore[method-assign]

    def scraper(n: int) -> None:
        while not stop.is_set():
            views[n].append(host.collect())

    threads = [threading.Thread(target=scraper, args=(n,)) for n in views]
    for t in threads:
        t.start()
    try:
        third = host.run(scrape_every=5)  # its last view of each container
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert all(len(v) > 10 for v in views.values())
    final: dict[str, Published] = dict(third)
    for mine in views.values():
        for value in COUNTERS:
            assert monotonic(mine, value)
        for view in mine:
            for a in view.accounts:
                final[a.labels[0]] = max(final.get(a.labels[0], a), a, key=lambda x: (  # counters only grow
                    x.sm_seconds, x.memory_byte_seconds, x.energy_joules, x.allocated_seconds, x.busy_seconds))
    for cgroup, want in alone.items():
        got = final[cgroup]
        assert (got.sm_seconds, got.memory_byte_seconds, got.energy_joules, got.allocated_seconds,
                got.busy_seconds) == pytest.approx((want.sm_seconds, want.memory_byte_seconds, want.energy_joules,
                                                    want.allocated_seconds, want.busy_seconds), rel=1e-12), cgroup


def monotonic(views: list[AccountingView], value: Callable[[Published], float]) -> bool:
    last: dict[str, float] = {}
    for view in views:
        for a in view.accounts:
            if value(a) < last.get(a.labels[0], 0.0) - 1e-9:
                return False
            last[a.labels[0]] = value(a)
    return True


COUNTERS: tuple[Callable[[Published], float], ...] = (
    lambda a: a.sm_seconds, lambda a: a.memory_byte_seconds, lambda a: a.energy_joules,
    lambda a: a.allocated_seconds, lambda a: a.idle_seconds)


def test_counters_only_grow_and_an_ended_container_is_published_once_more(scenario: Path) -> None:
    host = Host(scenario)
    views = []
    for _ in range(END + 1):
        host.round()
        views.append((host.t, host.collect()))
        host.clock.now += 1.0
    for value in COUNTERS:
        assert monotonic([v for _, v in views], value)
    with_b = [t for t, v in views if any(a.labels[0] == B for a in v.accounts)]
    assert (with_b[0], with_b[-1]) == (20.0, 80.0)  # seen at 20 s; at 80 s its cgroup is gone: final totals
    final_b = next(a for a in views[80][1].accounts if a.labels[0] == B)
    assert final_b.ended and final_b.allocated_seconds == 60.5


def test_mig_instances_are_devices_of_their_own_without_sm_or_energy(tmp_path: Path, fixtures_dir: Path) -> None:
    """NVML gives no per-process utilisation for MIG instances: memory and allocation are counted per
    instance, once (the parent GPU lists the instance's process too: it is left to the instance);
    SM-seconds, energy and idle seconds are absent (never 0); the parent's energy is unattributed."""
    path = tmp_path / "mig.toml"
    path.write_text(f'[[gpu]]\ncapture = "{fixtures_dir / "public" / "a100-sxm4-v12.xml"}"\n'
                    'uuid = "GPU-00000000-0000-4000-8000-0000000000a1"\n[gpu.override]\npower_usage_mw = 100000\n'
                    '[[gpu.mig]]\ngpu_instance_id = 7\nprofile = "1g.10gb"\nmemory_total_bytes = 10737418240\n'
                    'uuid = "MIG-00000000-0000-4000-8000-000000000007"\n[[gpu.mig.process]]\npid = 101\n'
                    f'used_memory_bytes = {GIB}\nsm_utilization_percent = 30\n')
    clock = Clock()
    nvml = open_replay(path, clock=clock)
    nvml.nvmlInit()
    parent = nvml.nvmlDeviceGetHandleByIndex(0)
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0)
    gpu, uuid = "GPU-00000000-0000-4000-8000-0000000000a1", "MIG-00000000-0000-4000-8000-000000000007"
    ledger = Ledger(Lookup(CGROUP_OF_PID.get, lambda cgroup: T0, lambda cgroup: True))
    sampler = ProcessSampler(NvmlCaller(nvml), 1.0, ledger.add_rounds, clock=clock, wall=clock)
    sampler.set_devices([(Device(uuid=gpu, index=0, minor=0, name="A100", mig_mode="enabled"), parent),
                         (Device(uuid=uuid, index=0, minor=None, name="A100 MIG 1g.10gb", kind="mig"), mig)])
    for _ in range(11):
        whole, instance = sampler.read_round()
        assert whole.sm is None and whole.memory == ()  # its instance's process is the instance's
        assert instance.sm is None and instance.memory == ((101, GIB),)
        clock.now += 1.0
    view = ledger.settle(granted(A, uuid=uuid), lambda u: "0")
    collection = Collection(snapshot=DeviceSnapshot(devices=[Device(uuid=gpu, index=0, minor=0, name="A100")]),
                            accounting=view)
    published = {f.name: [v for _, v in f.read(collection)] for f in catalog.ACCOUNTING if f.read is not None}
    assert published == {
        "accelstats_container_gpu_sm_seconds_total": [],
        "accelstats_container_gpu_memory_byte_seconds_total": [10.0 * GIB],  # once: on the instance
        "accelstats_container_gpu_energy_joules_total": [],
        "accelstats_container_gpu_allocated_seconds_total": [10.0],
        "accelstats_container_gpu_idle_seconds_total": [],
        "accelstats_gpu_idle_energy_joules_total": [0.0],
        "accelstats_gpu_unattributed_energy_joules_total": [pytest.approx(100.0 * 10)],  # 100 W, 10 s
        "accelstats_accounting_discarded_total": [0.0] * 6,
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
    began = time.monotonic()
    with AcceleratorManager(settings, open_replay(scenario)) as manager:
        manager.collect()
        ledger = manager.ledger
        assert ledger is not None
        sampler = next(c.accounting for c in manager.collectors if isinstance(c, NvidiaBackend))
        assert sampler is not None
        deadline = time.monotonic() + 30
        while ledger.split_energy(UUID) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        earlier = {f.name: f for f in text_string_to_metric_families(exposition(manager).decode())}
        split = ledger.split_energy(UUID)
        while ledger.split_energy(UUID) == split and time.monotonic() < deadline:
            time.sleep(0.02)  # one more split at least
        sampler.stop()  # what /metrics says next is then what the ledger holds
        assert sampler.wait_idle(5)
        families = {f.name: f for f in text_string_to_metric_families(exposition(manager).decode())}
        ledger_split = ledger.split_energy(UUID)
        lag = ledger.span_lag()

    def values(name: str) -> dict[str, float]:
        return {s.labels.get("id", s.labels.get("uuid", "")): s.value for s in families[name].samples
                if s.name.endswith("_total")}

    sm = values("accelstats_container_gpu_sm_seconds")
    allocated = values("accelstats_container_gpu_allocated_seconds")
    idle = values("accelstats_container_gpu_idle_seconds")
    assert 0 < sm[A] <= 0.4 * (time.monotonic() - began + DRIVER_PERIOD_MAX)  # 40 % busy since accounting began
    assert allocated[C] > 0  # granted, never busy: idle up to the horizon, which trails the last round
    assert idle[C] == pytest.approx(max(0.0, allocated[C] - lag), abs=1e-6)
    assert values("accelstats_container_gpu_memory_byte_seconds")[A] > 0
    energy = values("accelstats_container_gpu_energy_joules")
    gpu_idle = values("accelstats_gpu_idle_energy_joules")[UUID]
    unattributed = values("accelstats_gpu_unattributed_energy_joules")[UUID]
    assert sum(energy.values()) + gpu_idle + unattributed == pytest.approx(ledger_split, rel=1e-9)
    # the GPU's energy counter on /metrics is the reading the split used: their growth agrees on every scrape
    def split_total(fams: dict[str, Any]) -> float:
        return sum(s.value for name in ("accelstats_container_gpu_energy_joules", "accelstats_gpu_idle_energy_joules",
                                        "accelstats_gpu_unattributed_energy_joules")
                   for s in fams[name].samples if s.name.endswith("_total"))

    def counter(fams: dict[str, Any]) -> float:
        return next(s.value for s in fams["accelstats_gpu_energy_joules"].samples if s.name.endswith("_total"))

    assert counter(families) > counter(earlier)
    assert counter(families) - counter(earlier) == pytest.approx(split_total(families) - split_total(earlier),
                                                                 rel=1e-9)
    assert energy[A] > 0 and energy.get(C, 0.0) == 0.0


# --- the ledger against odd input (each a finding of an attack on it) --------------------------------

X, Y = "/docker/" + "d" * 64, "/docker/" + "e" * 64


class Feed:
    """A ledger fed rounds by hand: one device, one round per second."""

    def __init__(self, cgroups: dict[int, str | None], alive: Callable[[str], bool] = lambda c: True) -> None:
        self.t = 0.0
        self.cgroups = cgroups
        self.ledger = Ledger(Lookup(lambda pid: self.cgroups.get(pid), lambda c: None, alive), lag=0.0)

    def round(self, memory: dict[int, int | None] | None, sm: dict[int, float] | None,
              energy: float | None = None, uuid: str = UUID, also: tuple[ProcessRound, ...] = ()) -> None:
        elapsed = 1.0 if self.t > 0 else 0.0
        busy = tuple((pid, self.t - elapsed, self.t) for pid, seconds in (sm or {}).items() if seconds > 0)
        self.ledger.add_rounds([ProcessRound(uuid, self.t, elapsed, None if memory is None else tuple(memory.items()),
                                             None if sm is None else tuple(sm.items()), energy, busy=busy), *also])
        self.t += 1.0

    def settle(self, containers: list[ContainerStats] | None) -> dict[str, Published]:
        return {a.labels[0]: a for a in self.ledger.settle(containers, lambda u: "0").accounts}


def test_a_container_that_ends_right_after_its_work_is_published_once_with_its_final_energy() -> None:
    """Its last PID exits and its cgroup goes in the same second, before the energy window closes: it
    stays published until its energy share is split, then once more with the final totals, then never
    again (no series coming back at 0)."""
    feed = Feed({7: X}, alive=lambda c: feed.t <= 5)
    history = []
    for t in range(21):
        running = 1 <= t <= 4
        feed.round({7: GIB} if running else {}, {7: 1.0} if 2 <= t <= 5 else {}, energy=100.0 * t if t % 10 == 0
                   else None)
        history.append(feed.settle(granted(X) if t <= 4 else []))
    with_x = [t for t, seen in enumerate(history) if X in seen]
    assert with_x == list(range(11))  # until the energy read at 10 s split its share, then gone
    final = history[10][X]
    assert final.ended and final.sm_seconds == 4.0 and final.memory_byte_seconds == 4.0 * GIB
    assert final.energy_joules == pytest.approx(1000.0 * 4.0 / 10.0)


def test_without_an_energy_counter_or_collections_the_pid_table_stays_small() -> None:
    feed = Feed({})
    for n in range(5000):  # a one-second job every second, in the same cgroup, nobody scrapes
        feed.cgroups[10_000 + n] = X
        feed.round({10_000 + n: GIB}, {10_000 + n: 0.5})
    assert feed.ledger.pids_held <= 3  # the running PID and its cgroup's exited sums
    seen = feed.settle(granted(X))
    assert seen[X].sm_seconds == pytest.approx(0.5 * 5000) and seen[X].memory_byte_seconds == 4999 * GIB


def test_a_host_process_busy_for_ever_holds_no_growing_history() -> None:
    feed = Feed({7: HOST})
    for _ in range(2000):
        feed.round({7: GIB}, {7: 1.0})
        if int(feed.t) % 100 == 0:
            feed.settle([])
    (entry,) = feed.ledger._pids[UUID].values()
    assert len(entry.busy) <= 1  # one span: busy round after round


def test_allocated_seconds_never_decrease_when_a_grant_comes_and_goes() -> None:
    feed = Feed({})
    values = []
    for t in range(100):
        feed.round({}, {})
        values.append(feed.settle(granted(X) if t % 2 == 0 else [ContainerStats(cgroup=X, identity=None)])
                      [X].allocated_seconds)
    assert values == sorted(values) and values[-1] == pytest.approx(50.0)


def test_a_reused_pid_is_charged_to_its_new_container() -> None:
    feed = Feed({7: X})
    for _ in range(5):
        feed.round({7: GIB}, {7: 1.0})
    feed.round({}, {})  # PID 7 exits ...
    feed.cgroups[7] = Y  # ... and the kernel gives its number to a process of another container
    for _ in range(5):
        feed.round({7: GIB}, {7: 1.0})
    seen = feed.settle(granted(X, Y))
    assert (seen[X].sm_seconds, seen[Y].sm_seconds) == (5.0, 5.0)


def test_a_short_job_in_a_systemd_docker_scope_counts_as_that_container() -> None:
    scope = "/system.slice/docker-" + "f" * 64 + ".scope"
    feed = Feed({7: scope}, alive=lambda c: feed.t < 21)
    for t in range(25):
        feed.round({7: GIB} if t < 20 else {}, {7: 1.0} if 1 <= t < 20 else {})
    seen = feed.settle([])  # the collection never saw the container: it ran between two scrapes
    assert seen[scope].sm_seconds == 19.0 and seen[scope].ended


def test_a_device_no_longer_read_ends_the_containers_on_it() -> None:
    feed = Feed({7: X}, alive=lambda c: False)
    for _ in range(3):
        feed.round({7: GIB}, {7: 1.0})
    assert X in feed.settle([])
    other = "GPU-00000000-0000-4000-8000-00000000000b"
    feed.round({}, {}, uuid=other)  # re-enumerated: the old device is no longer read
    assert feed.settle([])[X].ended
    assert X not in feed.settle([])


def test_an_energy_jump_is_left_out_and_counted() -> None:
    feed = Feed({7: X})
    for joules in (0.0, 700.0, 2.0**40, 2.0**40 + 700.0):
        feed.round({7: GIB}, {7: 1.0}, energy=joules)
    view = feed.ledger.settle(granted(X), lambda u: "0")
    (account,) = view.accounts
    assert account.energy_joules == pytest.approx(1400.0)  # the two plausible seconds; the jump left out
    assert dict(view.discarded)["energy_jump"] == 1


def test_a_failed_attribution_changes_no_allocation() -> None:
    feed = Feed({})
    for t in range(10):
        feed.round({}, {})
        seen = feed.settle(None if 3 <= t <= 5 else granted(X))  # the attribution failed at 3-5 s
    assert seen[X].allocated_seconds == 9.0 and not seen[X].ended


def test_the_wall_clock_stepping_back_restarts_the_reads(scenario: Path) -> None:
    host = Host(scenario)
    wall = {"offset": 0.0}
    host.sampler.wall = lambda: host.clock.now + wall["offset"]
    for _ in range(3):
        host.round()
        host.clock.now += 1.0
    wall["offset"] = -3600.0  # NTP steps the clock back an hour
    (r,) = host.sampler.read_round()
    assert r.elapsed == 0.0 and dict(r.discarded)["clock_stepped_back"] == 1


def test_an_energy_counter_that_stops_answering_releases_exited_pids_and_ends_containers() -> None:
    feed = Feed({}, alive=lambda c: c != X or feed.t < 3)
    feed.round({}, {}, energy=0.0)  # answered once, then never again
    for n in range(300):
        feed.cgroups[100 + n] = X if n < 3 else Y
        feed.round({100 + n: GIB}, {100 + n: 1.0})
        feed.settle(granted(X, Y) if n < 3 else granted(Y))
    assert feed.ledger.pids_held < 5
    assert X not in feed.settle(granted(Y))  # ended and published once: gone


def test_a_process_list_that_fails_once_keeps_the_energy_window() -> None:
    whole, blip = Feed({7: X}), Feed({7: X})
    for feed in (whole, blip):
        for t in range(11):
            memory = None if (feed is blip and t == 5) else {7: GIB}  # NVML answered no list at 5 s
            feed.round(memory, {7: 1.0}, energy=100.0 * t if t % 10 == 0 else None)
    assert blip.settle(granted(X))[X].energy_joules == whole.settle(granted(X))[X].energy_joules == 1000.0


def test_a_reused_pid_keeps_its_predecessors_energy_share() -> None:
    feed = Feed({7: X})
    for t in range(11):
        if t == 4:
            feed.round({}, {7: 1.0})  # PID 7 exits ...
            feed.cgroups[7] = Y  # ... and its number goes to a process of another container
            continue
        feed.round({7: GIB}, {7: 1.0}, energy=100.0 * t if t % 10 == 0 else None)
    seen = feed.settle(granted(X, Y))
    assert seen[X].energy_joules + seen[Y].energy_joules == pytest.approx(1000.0)
    assert seen[X].energy_joules == pytest.approx(400.0)  # 4 of the window's 10 SM-seconds (1-4 s)


def test_a_grant_removed_and_given_back_counts_each_second_once() -> None:
    feed = Feed({})
    seen = {}
    for t in range(30):
        feed.round({}, {})
        seen = feed.settle(granted(X) if not 10 <= t < 20 else [ContainerStats(cgroup=X, identity=None)])
        assert X in seen  # the container is there all along: its series too
    assert seen[X].allocated_seconds == 29.0 - 10.0  # 0-9 s and 20-29 s (the first round primes)


def test_a_container_between_jobs_keeps_its_series() -> None:
    feed = Feed({7: X})
    for t in range(20):
        running = t < 5 or t >= 15
        feed.round({7: GIB} if running else {}, {7: 1.0} if running else {})
        feed.cgroups[7] = X
        seen = feed.settle([ContainerStats(cgroup=X, identity=None)] if running else [])  # no GPU between jobs
        assert X in seen and not seen[X].ended
    assert seen[X].sm_seconds == 10.0


def test_an_idle_granted_container_learns_that_its_gpu_reports_utilisation() -> None:
    feed = Feed({})
    feed.round({}, None)  # the first utilisation read failed
    feed.settle(granted(X))
    for _ in range(10):
        feed.round({}, {})
    seen = feed.settle(granted(X))
    assert seen[X].has_sm and seen[X].idle_seconds == 10.0


def test_busy_time_before_the_first_collection_that_sees_the_grant_counts_as_busy() -> None:
    started = {X: 0.0}
    feed = Feed({7: X})
    feed.ledger.host = dataclasses.replace(feed.ledger.host, started_at=started.get)
    for _ in range(10):
        feed.round({7: GIB}, {7: 1.0})
        feed.settle([])  # the attribution has not found the container yet
    seen = feed.settle(granted(X))
    assert seen[X].allocated_seconds == 9.0 and seen[X].busy_seconds == 9.0


def test_many_short_containers_and_no_scrape_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("accelstats.accounting.ledger.EXITED_KEPT", 50)
    feed = Feed({})
    for n in range(500):
        feed.cgroups[100 + n] = f"/docker/{n:064x}"
        feed.round({100 + n: GIB}, {100 + n: 1.0})
    assert feed.ledger.pids_held <= 52 and feed.ledger.discarded["ledger_full"] > 0


@pytest.mark.parametrize("interval", [0.1, 0.25, 1.0, 2.0])
def test_the_accounting_interval_does_not_change_the_totals(scenario: Path, interval: float) -> None:
    """Reads faster or slower than the driver samples (1/6 s) integrate the same SM-seconds: the
    replay's whole-percent averages are exact here (constant within each read), so to the sample."""
    host = Host(scenario)
    host.sampler.interval = interval
    steps = round(END / interval)
    for _ in range(steps + 1):
        host.round()
        host.clock.now += interval
    seen = {a.labels[0]: a for a in host.collect().accounts}
    until = steps * interval
    assert seen[A].sm_seconds == pytest.approx(expected_sm_seconds(101, until), abs=2 * SAMPLE_PERIOD_US / 1e6)
    assert seen[B].sm_seconds == pytest.approx(expected_sm_seconds(102, until), abs=2 * SAMPLE_PERIOD_US / 1e6)


@pytest.mark.parametrize(("value", "expected"), [("0", 0.0), ("0.1", 0.1), ("1", 1.0), ("15.5", 15.5)])
def test_config_accounting_interval(tmp_path: Path, value: str, expected: float) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(f"accounting_interval = {value}\n")
    assert load_config(cfg).accounting_interval == expected


@pytest.mark.parametrize(("value", "message"), [
    ("-1", "must be a finite number >= 0 .0 = off. and at least 0.1 when on, got -1"),
    ("1e-9", "must be .* and at least 0.1 when on, got 1e-09"),  # faster than any driver samples: a core for nothing
    ("inf", "must be a finite number"),
    ('"1"', "expected int or float, got str '1'"),
])
def test_config_accounting_interval_rejects(tmp_path: Path, value: str, message: str) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(f"accounting_interval = {value}\n")
    with pytest.raises(ConfigError, match=f"config.toml: key 'accounting_interval': {message}"):
        load_config(cfg)


def test_accounting_interval_zero_publishes_no_accounting_family(tmp_path: Path, fixtures_dir: Path) -> None:
    capture = fixtures_dir / "h200" / "nvidia-smi-q.xml"
    settings = Settings(nvml_replay=capture, cgroup_root=tmp_path, proc_root=tmp_path, accounting_interval=0)
    with AcceleratorManager(settings, open_replay(capture)) as manager:
        body = exposition(manager).decode()
        assert manager.ledger is None
    assert "accounting" not in body and "idle_energy" not in body and "_seconds_total" not in body


def test_a_job_shorter_than_a_window_keeps_its_busy_time_when_its_pid_goes() -> None:
    """A PID sampled once after an idle stretch (its busy span waits for its next window's level) and
    gone from the process lists before that: its span is placed at full use before the PID retires."""
    state = SmSamples()
    state.cursor_us, state.idle_read_us = 5_000_000, 8_000_000
    got = state.answer([Sample(7, 10_000_000, 10)], NOW)  # 10 % of 5 s: 0.5 s of work before 10 s
    assert got.seconds == {7: pytest.approx(0.5)} and got.spans == {}
    state.exited([8], got)
    assert got.spans == {7: [(pytest.approx(9.5), pytest.approx(10.0))]} and state.pending == {}
