"""What GPU accounting costs: a scrape with and without it, and the background sampler's rounds.

Builds the 8 GPU x 1000 container host of ``benchmarks/scrape.py`` (cgroup v1, each container granted
one GPU) and gives every container one GPU process (replayed: SM 30 %, 1 GiB; ``/proc/<pid>/cgroup``
names the container), so every (container, GPU) pair has all five accounting counters. Then, in one
run, alternating the two exporters scrape by scrape, the CPU time of one ``/metrics`` body as the server
makes it for Prometheus (``SharedExposition`` with the fast encoder, OpenMetrics, gzip: collection +
rendering + encoding):

* ``off``: ``accounting_interval = 0`` (no sampler, no ledger, no accounting families);
* ``on``: ``accounting_interval = 1``, with ``--between`` sampler rounds (untimed, on this thread)
  before each scrape, so each settlement hands over what a 15 s scrape interval would.

and prints the medians, their ratio and the median of the scrape-by-scrape ratios (steadier on a
noisy machine), the samples added, and the median of one sampler round (every
device: process lists, process utilisation, energy every tenth round) over ``--rounds`` rounds.

Usage: ``python3 benchmarks/accounting.py [--scrapes 60] [--rounds 30]``. Figures are recorded in
docs/performance.md; no pass/fail here (compare within one run).

``--short-jobs JOBS:PER_SECOND`` measures instead what short jobs in cgroups that stay (nothing removes
a user's empty job cgroups) leave published: a :class:`~accelstats.accounting.Ledger` with its default
limits (``IDLE_KEPT_S``, ``ACCOUNTS_KEPT``) is fed directly, one round (one GPU) and one collection a
second; ``PER_SECOND`` one-second jobs start each second, each in a cgroup of its own that stays, listed
by the attribution while it runs, until ``JOBS`` have run; then ``IDLE_KEPT_S`` + 30 s with none. It
prints the peak of accounts published in one collection (and of those not ended), when it came, when
the last job ran, when the last account was published and how many the last collection published.
``--no-limits``: the same with a ledger that never ends an idle account and keeps any number (what it
did before the limits).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import platform
import secrets
import statistics
import tempfile
import time
from pathlib import Path

from exposition import PROMETHEUS_ACCEPT, cpu_ms
from scrape import build_host, default_shared

from accelstats.manager import AcceleratorManager
from accelstats.settings import Settings
from accelstats.web.app import ServerCounters, SharedExposition
from collectors.nvidia import NvidiaBackend
from collectors.replay.lib import open_replay

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class StaysLookup:
    """:class:`~accelstats.accounting.HostLookup` of ``--short-jobs``: PID 100 000 + n runs in job n's
    cgroup, which stays (alive); no start time."""

    def cgroup_of(self, pid: int) -> str | None:
        return f"/user.slice/user-1000.slice/user@1000.service/jobs/job-{pid - 100_000}"

    def started_at(self, cgroup: str) -> float | None:
        return None

    def alive(self, cgroup: str) -> bool:
        return True


def short_jobs(jobs: int, per_second: int, unlimited: bool) -> None:
    """Run ``--short-jobs`` (see the module's docstring) and print its figures; ``unlimited``: a ledger
    that never ends an idle account and keeps any number (as it was before the limits)."""
    from accelstats.accounting import Ledger
    from accelstats.accounting.ledger import ACCOUNTS_KEPT, IDLE_KEPT_S
    from accelstats.attribution.containers import ContainerStats
    from collectors.procsampler import ProcessRound

    lookup, uuid, t0 = StaysLookup(), "GPU-00000000-0000-4000-8000-000000000000", 1_000.0
    ledger = Ledger(lookup, idle_kept=math.inf, max_accounts=1 << 62) if unlimited else Ledger(lookup)
    busy_s = -(-jobs // per_second)
    peak = peak_kept = peak_at = last_published = final = 0
    started = time.perf_counter()
    for t in range(busy_s + int(IDLE_KEPT_S) + 30):
        pids = [100_000 + n for n in range(t * per_second, min(jobs, (t + 1) * per_second))]
        ledger.add_rounds([ProcessRound(uuid, t0 + t, 1.0 if t else 0.0, tuple((p, GIB) for p in pids),
                                        tuple((p, 0.5) for p in pids), energy_joules=400.0 * t)])
        listed = [ContainerStats(cgroup=lookup.cgroup_of(p) or "", identity=None) for p in pids]
        view = ledger.settle(listed, lambda _: "0")
        if len(view.accounts) > peak:
            peak, peak_at = len(view.accounts), t
        peak_kept = max(peak_kept, sum(not a.ended for a in view.accounts))
        if view.accounts:
            last_published = t
        final = len(view.accounts)
    print(f"# {time.strftime('%Y-%m-%d')} {platform.node()} python={platform.python_version()} --short-jobs "
          f"{jobs}:{per_second} " + ("(no limits)" if unlimited else
                                     f"(IDLE_KEPT_S {IDLE_KEPT_S:g} s, ACCOUNTS_KEPT {ACCOUNTS_KEPT})"))
    print(f"accounts published in one collection: peak {peak} (not ended: {peak_kept}) at t={peak_at} s; "
          f"last job at t={busy_s - 1} s; last account published at t={last_published} s "
          f"({last_published - busy_s + 1} s after the last job); at the end (t={t} s): {final}; "
          f"accounts_full {ledger.discarded['accounts_full']}; "
          f"{time.perf_counter() - started:.1f} s")


def add_processes(settings: Settings, capture: Path, gpus: int) -> None:
    """Rewrite the scenario with one GPU process per container (PID 10000 + n on GPU n mod ``gpus``)
    and write each PID's ``/proc/<pid>/cgroup`` naming its container."""
    assert settings.nvml_replay is not None
    containers = sorted((settings.cgroup_root / "devices" / "docker").iterdir())
    per_gpu: dict[int, list[str]] = {i: [] for i in range(gpus)}
    for n, directory in enumerate(containers):
        gpu = int((directory / "devices.list").read_text().split("c 195:")[-1].split()[0])
        pid = 10_000 + n
        per_gpu[gpu].append(f"[[gpu.process]]\npid = {pid}\nused_memory_bytes = {GIB}\nsm_utilization_percent = 30\n")
        proc = settings.proc_root / str(pid)
        proc.mkdir()
        (proc / "cgroup").write_text(f"4:devices:/docker/{directory.name}\n0::/docker/{directory.name}\n")
    lines = []
    for i in range(gpus):
        lines += ["[[gpu]]", f'capture = "{capture}"', f"index = {i}", f"minor = {i}",
                  f'uuid = "GPU-{i:08x}-0000-4000-8000-{secrets.token_hex(6)}"', *per_gpu[i], ""]
    settings.nvml_replay.write_text("\n".join(lines))


def main() -> None:
    """Run the comparison and print it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--between", type=int, default=15,
                        help="sampler rounds before each scrape (15: a 15 s scrape interval at the 1 s default)")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--containers", type=int, default=1000)
    parser.add_argument("--short-jobs", metavar="JOBS:PER_SECOND",
                        help="instead: what short jobs in cgroups that stay leave published (e.g. 1000:1)")
    parser.add_argument("--no-limits", action="store_true",
                        help="with --short-jobs: a ledger that never ends an idle account (as before the limits)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.short_jobs:
        try:
            jobs, per_second = (int(x) for x in args.short_jobs.split(":"))
        except ValueError:
            parser.error(f"--short-jobs wants JOBS:PER_SECOND, two integers, got {args.short_jobs!r}")
        if jobs < 1 or per_second < 1:
            parser.error(f"--short-jobs wants JOBS and PER_SECOND >= 1, got {args.short_jobs!r}")
        short_jobs(jobs, per_second, args.no_limits)
        return
    capture = default_shared() / "fixtures" / "h200" / "nvidia-smi-q.xml"
    print(f"# {time.strftime('%Y-%m-%d')} {platform.node()} cpus={os.cpu_count()} "
          f"python={platform.python_version()} {args.gpus} GPUs x {args.containers} containers, one GPU process each")
    r = overhead(capture, args.gpus, args.containers, args.scrapes, args.between, args.rounds)
    print(f"/metrics CPU ms p50 (OpenMetrics, gzip, fast encoder): off {r.off_ms:.2f}  on {r.on_ms:.2f}  "
          f"added {100 * (r.on_ms / r.off_ms - 1):+.1f} % (median of the scrape-by-scrape ratios: "
          f"{100 * (r.pair_ratio - 1):+.1f} %)")
    print(f"body bytes (uncompressed): off {r.sizes['off']}  on {r.sizes['on']}  ((container, GPU) accounts: "
          f"{r.accounts})")
    print(f"sampler round ms (every GPU once, in the background): median {statistics.median(r.round_ms):.2f}  "
          f"max {max(r.round_ms):.2f}")


@dataclasses.dataclass(frozen=True)
class Overhead:
    """What :func:`overhead` measured: CPU ms p50 of a scrape without and with accounting, the median of
    the scrape-by-scrape ratios (on/off), body sizes, accounts published and sampler round times (ms)."""

    off_ms: float
    on_ms: float
    pair_ratio: float
    sizes: dict[str, int]
    accounts: int
    round_ms: list[float]


def overhead(capture: Path, gpus: int, containers: int, scrapes: int, between: int, rounds: int) -> Overhead:
    """Scrapes with accounting off and on, alternated (module docstring), on a host of ``gpus`` x
    ``containers`` with one GPU process per container."""
    with tempfile.TemporaryDirectory() as tmp:
        base = build_host(Path(tmp), capture, gpus, containers)
        add_processes(base, capture, gpus)
        assert base.nvml_replay is not None
        off = AcceleratorManager(dataclasses.replace(base, accounting_interval=0), open_replay(base.nvml_replay))
        on = AcceleratorManager(dataclasses.replace(base, accounting_interval=1.0), open_replay(base.nvml_replay))
        shared = {}
        for name, manager in (("off", off), ("on", on)):
            manager.setup()
            shared[name] = SharedExposition(manager, extra=[ServerCounters()], fast=True)
            for _ in range(3):  # warm-up: NVML set up, the sampler's first round done, label cache
                shared[name].body(PROMETHEUS_ACCEPT, "gzip")
        backend = next(c for c in on.collectors if isinstance(c, NvidiaBackend))
        sampler = backend.accounting
        assert sampler is not None
        sampler.stop()  # its rounds are timed below, on this thread
        assert sampler.wait_idle(10)
        round_ms = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            sampler.read_round()
            round_ms.append((time.perf_counter() - t0) * 1000)
        times: dict[str, list[float]] = {"off": [], "on": []}
        sizes = {name: len(s.body(PROMETHEUS_ACCEPT, "")[0]) for name, s in shared.items()}
        for _ in range(scrapes):
            for _ in range(between):  # what the sampler integrated since the previous scrape
                sampler.read_round()
            for name in ("off", "on"):
                times[name].append(cpu_ms(lambda s=shared[name]: s.body(PROMETHEUS_ACCEPT, "gzip")))
        collection = on.collect()
        accounts = len(collection.accounting.accounts) if collection.accounting is not None else 0
        for manager in (off, on):
            manager.destroy()
            manager.close()
    med = {name: statistics.median(v) for name, v in times.items()}
    pairs = statistics.median(on / off for off, on in zip(times["off"], times["on"], strict=True))
    return Overhead(med["off"], med["on"], pairs, sizes, accounts, round_ms)

if __name__ == "__main__":
    main()
