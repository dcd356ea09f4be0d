"""``benchmarks/attack.py --undecidable-programs N``: device programs a privileged container attaches
that the evaluator cannot decide (issue 24 rows 2 and 8), against a real exporter on a real kernel.

Builds, under ``<cgroup2 mount>/accelstats-attack-<pid>`` (root; a cgroup2 mount where device programs
load and attach: ``tests/support/bpf_util.py``):

* N containers (``docker-<64 hex>.scope``), each with its own program that calls a helper
  (``bpf_ktime_get_ns``): undecidable at once, cheap;
* ``--looping-programs`` K (20) more, each with a distinct bounded loop of 250 000 + i rounds (the
  verifier accepts it: kernel 5.3 or later): undecidable once the evaluator's budget is spent.

Then runs ``python3 -m accelstats serve`` from ``--repo`` (plain HTTP, all collectors, the replayed
H200) with that subtree as its cgroup root (a v2 host), scrapes it once, adds the K looping
containers, and scrapes it ``--program-scrapes`` - 1 more times (300 in all) one after another.
Printed: the exporter's RSS (``VmRSS``) after the first scrape and after every further fifth; the
time and the exporter's CPU of the first scrape that meets the looping programs and of the later
ones (p50, max); then of the next scrape after the K looping containers are replaced by K with the
same programs (new IDs, same code: the same containers restarted); of the next two after K more with
programs never seen (260 000 + i rounds); of the next three after K more whose loops run just under
the evaluator's 10 000 instructions a question and deny (the most one program can make it run).
Exit status 1 when a scrape failed or RSS grew by 5 MiB or more after the first scrape.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path

from attack import cpu_seconds, exporter, scrape_once, vm_rss_mib  # benchmarks/ is sys.path[0]
from scrape import loadavg, percentile
from support import bpf_util

ROUNDS = 250_000


def _container(stack: contextlib.ExitStack, top: str, code: bytes) -> None:
    stack.enter_context(bpf_util.cgroup_with_programs(f"{top}/docker-{secrets.token_hex(32)}.scope", [code]))


def _timed(port: int, pid: int) -> tuple[float, float, bool]:
    """One scrape: (seconds, exporter CPU seconds, failed)."""
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    try:
        status, _ = scrape_once(port, None, timeout=30.0)
        failed = status != 200
    except (OSError, http.client.HTTPException):
        failed = True
    return time.monotonic() - t0, cpu_seconds(pid) - cpu0, failed


def programs_run(args: argparse.Namespace, capture: Path) -> int:
    """Print the figures above; 1 when a scrape failed or RSS grew by 5 MiB or more."""
    unified = bpf_util.unified_root()
    if os.geteuid() != 0 or unified is None:
        sys.exit("--undecidable-programs needs root and a cgroup2 mount")
    n, k, scrapes = args.undecidable_programs, args.looping_programs, args.program_scrapes
    print(f"# {args.repo}: {n} containers with a helper-calling device program, {k} with distinct loops of "
          f"{ROUNDS}+ rounds; {scrapes} scrapes one after another, plain HTTP, all collectors")
    top = f"accelstats-attack-{os.getpid()}"
    failed = 0
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        root = stack.enter_context(bpf_util.cgroup_with_programs(top, []))
        for i in range(n):
            _container(stack, top, bpf_util.calls_helper(i))
        folder = Path(tmp)
        (folder / "cgroup").symlink_to(root)
        with exporter(args.repo, folder, None, args.nofile, capture, collectors=()) as (proc, port):
            failed += _timed(port, proc.pid)[2]  # the exporter's own first collections are done
            rss = [(1, vm_rss_mib(proc.pid))]
            loops = contextlib.ExitStack()
            stack.enter_context(loops)
            for i in range(k):  # the looping ones arrive now: the next scrape meets them first
                _container(loops, top, bpf_util.looping(ROUNDS + i))
            first, first_cpu, bad = _timed(port, proc.pid)
            failed += bad
            marks = {scrapes * j // 5 for j in range(1, 6)}
            later: list[tuple[float, float]] = []
            for s in range(3, scrapes + 1):
                took, cpu, bad = _timed(port, proc.pid)
                failed += bad
                later.append((took, cpu))
                if s in marks:
                    rss.append((s, vm_rss_mib(proc.pid)))
            loops.close()  # the K looping containers go; K new ones run the same code under new IDs
            for i in range(k):
                _container(stack, top, bpf_util.looping(ROUNDS + i))
            same, same_cpu, bad = _timed(port, proc.pid)
            failed += bad
            for i in range(k):  # and K with code never seen
                _container(stack, top, bpf_util.looping(ROUNDS + 10_000 + i))
            new = [_timed(port, proc.pid) for _ in range(2)]
            for i in range(k):  # and K that run just under the question limit and deny: the most per program
                _container(stack, top, bpf_util.looping(4_990 - i, allow=False))
            worst = [_timed(port, proc.pid) for _ in range(3)]
            failed += sum(bad for _, _, bad in (*new, *worst))
    ms = sorted(t * 1000 for t, _ in later)
    cpu_ms = sorted(c * 1000 for _, c in later)
    print("RSS MiB after scrape " + ", ".join(f"{s}: {mib:.1f}" for s, mib in rss))
    growth = rss[-1][1] - rss[0][1]
    print(f"RSS growth after the first scrape: {growth:+.1f} MiB (target: flat, < 5 MiB)")
    print(f"first scrape with the {k} looping programs (scrape 2): {first * 1000:.0f} ms, exporter CPU "
          f"{first_cpu * 1000:.0f} ms")
    print(f"scrapes 3-{scrapes}: ms p50 {percentile(ms, 50):.1f}, max {ms[-1]:.1f}; exporter CPU ms p50 "
          f"{percentile(cpu_ms, 50):.0f}, max {cpu_ms[-1]:.0f}")
    print(f"{k} looping containers replaced by {k} with the same programs (new IDs): next scrape "
          f"{same * 1000:.0f} ms, CPU {same_cpu * 1000:.0f} ms")
    print(f"{k} more with programs never seen: next scrapes " + ", ".join(
        f"{t * 1000:.0f} ms (CPU {c * 1000:.0f} ms)" for t, c, _ in new))
    print(f"{k} more that loop about 10 000 instructions a question and deny: next scrapes " + ", ".join(
        f"{t * 1000:.0f} ms (CPU {c * 1000:.0f} ms)" for t, c, _ in worst))
    print(f"scrapes failed: {failed}")
    print(f"# end {loadavg()}")
    return 1 if failed or growth >= 5 else 0
