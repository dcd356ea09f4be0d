"""A short soak (benchmarks/soak.py): 3000 scrapes over HTTP in this process leave no thread, fd or
RSS behind (the 100 000-scrape run and its figures are in docs/performance.md).

Counts, not timing: the connection threads and sockets of 3000 requests must all be gone, and the
process's RSS after them within 5 MiB of where it was after a warm-up of 300.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from support.paths import REPO_ROOT, SHARED

if str(REPO_ROOT / "benchmarks") not in sys.path:  # benchmarks/ is not a package
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import soak


@pytest.mark.slow  # more than ~5 s: real daemons, deadlines or a soak
def test_3000_scrapes_leave_no_thread_fd_or_memory_behind(tmp_path: Path) -> None:
    settings = soak.small_host(tmp_path, SHARED)  # 1 replayed H200 x 10 containers
    result = soak.soak(settings, scrapes=3000, every=500, warmup=300, http=True)
    assert result.errors == 0, result.first_error
    assert result.scrapes == 3000 and len(result.samples) == 7  # the baseline, then every 500
    assert result.end.threads <= result.baseline.threads, [s.threads for s in result.samples]
    assert result.end.fds <= result.baseline.fds, [s.fds for s in result.samples]
    assert result.rss_growth < soak.LIMIT_BYTES, [s.rss for s in result.samples]
    assert result.failures == []


def test_the_verdict_names_what_grew() -> None:
    base = soak.Sample(0, rss=100 * soak.MIB, fds=7, threads=6, seconds=0.0)
    grown = soak.Sample(3000, rss=105 * soak.MIB, fds=8, threads=7, seconds=9.0)
    result = soak.SoakResult(samples=[base, grown], errors=1, first_error="HTTP 500, 0 bytes")
    assert result.failures == ["1 scrapes failed (first: HTTP 500, 0 bytes)", "RSS grew 5.00 MiB (limit < 5 MiB)",
                               "open fds grew from 7 to 8", "threads grew from 6 to 7"]
    kept = soak.SoakResult(samples=[base, soak.Sample(3000, 104 * soak.MIB, 7, 6, 9.0)])
    assert kept.failures == []
