"""Series of accounts whose cgroup stays after the job: retention and the cap (accelstats/accounting/ledger.py).

Users run short GPU jobs in cgroups of their own that nothing removes afterwards. On a replay scenario
(one H200, 400 W) the real sampler reads 24 two-second jobs, one every 3 s, each in its own cgroup
under ``user@1000.service`` that stays; the attribution lists a job's cgroup while its process runs
(found through NVML), as it does. One round and one collection per (fake) second.

| ledger | asserted |
|---|---|
| idle_kept 30 s, max_accounts 8 | at most 8 accounts kept, 10 published in one collection (with those ending) |
| | each job's series: published without a gap, counters never go backwards, the last says ended, then gone |
| | after the last job and 30 s: nothing published |
| | the cap bit: ``accounts_full`` counted, logged once |
| | each job's final totals are those of a ledger without limits (ending a series loses nothing) |

Before, every job's series stayed for ever: 24 accounts at the end, 1000 jobs gave 3000 series.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from accelstats.accounting import AccountingView, Ledger, Published
from accelstats.attribution.containers import ContainerStats
from collectors.model import Device
from collectors.nvml_call import NvmlCaller
from collectors.procsampler import ProcessSampler
from collectors.replay.lib import open_replay

UUID = "GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c10"
T0 = 5_000.0
JOBS = 24
END = 3 * JOBS + 2 + 40  # the last job ends at 3 * 23 + 4 s; 30 s idle and some
IDLE_KEPT = 30.0
MAX_ACCOUNTS = 8
GIB = 1 << 30


def job_cgroup(n: int) -> str:
    return f"/user.slice/user-1000.slice/user@1000.service/jobs/job-{n}"


def job_life(n: int) -> tuple[float, float]:
    return 3.0 * n + 2.0, 3.0 * n + 4.0


@dataclass(frozen=True)
class Lookup:
    cgroup_of: Callable[[int], str | None]
    started_at: Callable[[str], float | None]
    alive: Callable[[str], bool]


def run(scenario: Path, limits: bool) -> tuple[list[AccountingView], Ledger]:
    """Every collection's view, one round and one collection per second from 0 to END."""
    now = [T0]

    def clock() -> float:
        return now[0]

    nvml = open_replay(scenario, clock=clock)
    nvml.nvmlInit()
    cgroups = {1000 + n: job_cgroup(n) for n in range(JOBS)}
    ledger = Ledger(Lookup(cgroups.get, lambda c: None, lambda c: True))  # every job's cgroup stays
    if limits:
        ledger.idle_kept, ledger.max_accounts = IDLE_KEPT, MAX_ACCOUNTS
    sampler = ProcessSampler(NvmlCaller(nvml), 1.0, ledger.add_rounds, clock=clock, wall=clock)
    sampler.set_devices([(Device(uuid=UUID, index=0, minor=0, name="NVIDIA H200"), nvml.nvmlDeviceGetHandleByIndex(0))])
    views = []
    for t in range(END + 1):
        sampler.read_round()
        running = [ContainerStats(cgroup=job_cgroup(n), identity=None) for n in range(JOBS)
                   if job_life(n)[0] <= t < job_life(n)[1]]
        views.append(ledger.settle(running, lambda uuid: "0"))
        now[0] += 1.0
    return views, ledger


@pytest.fixture
def scenario(tmp_path: Path, fixtures_dir: Path) -> Path:
    jobs = "".join(f"[[gpu.process]]\npid = {1000 + n}\nstart_s = {job_life(n)[0]:g}\nend_s = {job_life(n)[1]:g}\n"
                   f"sm_utilization_percent = 50\nused_memory_bytes = {GIB}\n" for n in range(JOBS))
    path = tmp_path / "jobs.toml"
    path.write_text(f'[[gpu]]\ncapture = "{fixtures_dir / "h200" / "nvidia-smi-q.xml"}"\n'
                    f"[gpu.override]\npower_usage_mw = 400000\n{jobs}")
    return path


def totals(a: Published) -> tuple[float, float, float]:
    return a.sm_seconds, a.memory_byte_seconds, a.energy_joules


def test_short_jobs_in_cgroups_that_stay_end_their_series_and_the_accounts_are_capped(
        scenario: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="accelstats.accounting.ledger")
    views, ledger = run(scenario, limits=True)
    sizes = [(len(v.accounts), sum(not a.ended for a in v.accounts)) for v in views]
    print(f"accounts published per collection: max {max(s for s, _ in sizes)}, kept max {max(k for _, k in sizes)}")
    assert all(kept <= MAX_ACCOUNTS and published <= MAX_ACCOUNTS + 2 for published, kept in sizes), sizes
    assert views[-1].accounts == ()  # every job's series ended, and is gone
    unlimited, _ = run(scenario, limits=False)
    final_unlimited = {a.labels[0]: a for a in unlimited[-1].accounts}
    assert len(final_unlimited) == JOBS  # without the limits every job's series is still there
    for n in range(JOBS):
        cgroup = job_cgroup(n)
        seen = [(i, a) for i, v in enumerate(views) for a in v.accounts if a.labels[0] == cgroup]
        first, last = seen[0][0], seen[-1][0]
        assert [i for i, _ in seen] == list(range(first, last + 1)), cgroup  # never comes back
        assert [a.ended for _, a in seen] == [False] * (len(seen) - 1) + [True], cgroup  # ended said once, last
        for (_, earlier), (_, later) in itertools.pairwise(seen):
            assert all(x <= y for x, y in zip(totals(earlier), totals(later), strict=True)), cgroup
        assert totals(seen[-1][1]) == pytest.approx(totals(final_unlimited[cgroup]), rel=1e-9), cgroup
        assert seen[-1][1].sm_seconds > 0.5
    assert ledger.discarded["accounts_full"] > 0
    assert [r.getMessage() for r in caplog.records if "accounts_full" in r.getMessage()] == [
        "GPU accounting: readings left out or not attributed (accounts_full); counted in "
        "accelstats_accounting_discarded_total"]


# | job | cgroup | runs (s) | the attribution lists it |
RERUN_JOBS = (
    (3000, job_cgroup(0), 2.0, 4.0, True),
    (3001, job_cgroup(1), 6.0, 8.0, True),
    (3002, job_cgroup(0), 13.0, 18.0, False),  # job-0 again, in the cgroup that stayed; no collection finds it
    (3003, job_cgroup(2), 12.0, 15.0, True),  # a new job: its first readings come as job-0 runs again (cap 2)
)


def test_at_the_cap_an_account_whose_cgroup_runs_a_job_again_is_not_the_one_ended(
        tmp_path: Path, fixtures_dir: Path) -> None:
    """security.md, short jobs in cgroups that stay (row 5's scenario at the cap): a user re-runs a job
    in job-0's cgroup, which no collection's attribution lists (the ledger attributes its PID through
    the cgroup, as for a container no collection saw), while a new job needs an account past
    ``max_accounts`` = 2. The account ended is job-1's (idle, no PID), not job-0's: job-0's series goes
    on, never said ended while its job runs, its counters never going backwards."""
    processes = "".join(f"[[gpu.process]]\npid = {pid}\nstart_s = {start:g}\nend_s = {end:g}\n"
                        f"sm_utilization_percent = 50\nused_memory_bytes = {GIB}\n"
                        for pid, _, start, end, _ in RERUN_JOBS)
    scenario = tmp_path / "rerun.toml"
    scenario.write_text(f'[[gpu]]\ncapture = "{fixtures_dir / "h200" / "nvidia-smi-q.xml"}"\n'
                        f"[gpu.override]\npower_usage_mw = 400000\n{processes}")
    now = [T0]
    nvml = open_replay(scenario, clock=lambda: now[0])
    nvml.nvmlInit()
    cgroups = {pid: cgroup for pid, cgroup, *_ in RERUN_JOBS}
    ledger = Ledger(Lookup(cgroups.get, lambda c: None, lambda c: True), max_accounts=2)
    sampler = ProcessSampler(NvmlCaller(nvml), 1.0, ledger.add_rounds, clock=lambda: now[0], wall=lambda: now[0])
    sampler.set_devices([(Device(uuid=UUID, index=0, minor=0, name="NVIDIA H200"), nvml.nvmlDeviceGetHandleByIndex(0))])
    job0: list[tuple[int, Published]] = []
    ended: dict[str, int] = {}
    for t in range(22):
        sampler.read_round()
        listed = [ContainerStats(cgroup=cgroup, identity=None) for _, cgroup, start, end, shown in RERUN_JOBS
                  if shown and start <= t < end]
        view = ledger.settle(listed, lambda uuid: "0")
        job0 += [(t, a) for a in view.accounts if a.labels[0] == job_cgroup(0)]
        ended.update({a.labels[0]: t for a in view.accounts if a.ended and a.labels[0] not in ended})
        now[0] += 1.0
    assert ledger.discarded["accounts_full"] > 0  # the cap was reached
    assert ended[job_cgroup(1)] == 13 and ended.get(job_cgroup(0), 99) > 18, ended  # job-1 made room for job-2
    during = [(t, a) for t, a in job0 if 13 <= t <= 18]
    assert [t for t, _ in during] == list(range(13, 19)), job0  # published throughout the re-run
    assert not any(a.ended for _, a in during), [(t, a.ended) for t, a in during]
    for (_, earlier), (_, later) in itertools.pairwise(job0):
        assert all(x <= y for x, y in zip(totals(earlier), totals(later), strict=True)), job0
    assert during[-1][1].sm_seconds - during[0][1].sm_seconds > 2.0  # the re-run's readings are in it
