"""``benchmarks/attack.py --variants``: rotating ``Accept`` variants and ``name[]`` filters (issue 24, row 3)
against a Prometheus scraper; :func:`variants_run` (its docstring) says what runs and what is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import re
import tempfile
import time
from collections import Counter
from pathlib import Path

from attack import Watch, cpu_seconds, exporter, scrape_once  # benchmarks/ is sys.path[0]
from scrape import build_host, loadavg, percentile

VARIANT_MEDIA = ("text/plain", "text/plain; version=0.0.4", "text/plain; version=1.0.0",
                 "application/openmetrics-text", "application/openmetrics-text; version=1.0.0")
VARIANT_ESCAPINGS = ("", "; escaping=underscores", "; escaping=allow-utf-8", "; escaping=dots", "; escaping=values")
PROMETHEUS_HEADERS = {"Accept": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                                "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
                      "Accept-Encoding": "gzip"}


def variants_run(args: argparse.Namespace, capture: Path) -> int:
    """Row 3 of issue 24: the exporter (plain HTTP) over ``--gpus`` x ``--containers``; a Prometheus scraper
    (its Accept and gzip, a new connection each) every ``--interval`` s for ``--seconds`` s, three times:
    alone; while one address (127.0.0.2) rotates every ``Accept`` variant (text 0.0.4/1.0.0, OpenMetrics x
    escapings x gzip: 50) on ``--variant-clients`` connections; while ``--variant-clients`` addresses
    (127.0.1.x) each send ``name[]`` filters of their own naming every family. The floods run in their own
    process (tests/support/http_flood.py). Printed per phase: scraper latency, errors, the exporter's RSS
    (max, sampled every 0.5 s) and CPU, the flood's answers by status. Exit 1 when a scrape failed."""
    from support.http_flood import flooding

    variants = [{"Accept": m + e} | ({"Accept-Encoding": "gzip"} if z else {})
                for m in VARIANT_MEDIA for e in VARIANT_ESCAPINGS for z in (False, True)]
    n = args.variant_clients
    print(f"# {args.repo}: plain HTTP, {args.gpus} GPUs x {args.containers} containers; a Prometheus scrape "
          f"every {args.interval:g} s for {args.seconds:g} s per phase; floods of {n} clients")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        settings = build_host(folder, capture, args.gpus, args.containers)
        assert settings.nvml_replay is not None
        with exporter(args.repo, folder, None, args.nofile, settings.nvml_replay) as (proc, port):
            body = scrape_once(port, None)[1]
            families = sorted(set(re.findall(rb"^# TYPE (\S+)", body, re.M)))
            query = "&".join(f"name[]={f.decode()}" for f in families)
            phases = {
                "alone": None,
                f"one address rotating {len(variants)} Accept variants": [
                    [("127.0.0.2", "/metrics", variants[(7 * i + k) % len(variants)]) for k in range(len(variants))]
                    for i in range(n)],
                f"{n} addresses with name[] filters of their own": [
                    [(f"127.0.1.{i + 1}", f"/metrics?{query}&name[]=nothing_{i}_{k}", {}) for k in range(50)]
                    for i in range(n)],
            }
            for phase, clients in phases.items():
                flood = flooding(port, clients) if clients else contextlib.nullcontext(Counter())
                with flood as answers:
                    watch = Watch(proc.pid)
                    watch.start()
                    cpu0 = cpu_seconds(proc.pid)
                    latencies: list[float] = []
                    errors: Counter[str] = Counter()
                    t_end = time.monotonic() + args.seconds
                    while time.monotonic() < t_end:
                        t0 = time.monotonic()
                        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                        try:
                            conn.request("GET", "/metrics", headers=PROMETHEUS_HEADERS)
                            r = conn.getresponse()
                            r.read()
                            if r.status != 200:
                                errors[f"HTTP {r.status}"] += 1
                        except (OSError, http.client.HTTPException) as exc:
                            errors[type(exc).__name__] += 1
                        finally:
                            conn.close()
                        latencies.append(time.monotonic() - t0)
                        time.sleep(max(0.0, args.interval - (time.monotonic() - t0)))
                    cpu = cpu_seconds(proc.pid) - cpu0
                    watch.stop()
                ms = sorted(x * 1000 for x in latencies)
                failed += sum(errors.values())
                print(f"{phase}: scrapes {len(ms)}, errors {sum(errors.values())} {dict(errors) if errors else ''}; "
                      f"latency ms p50 {percentile(ms, 50):.0f}, p99 {percentile(ms, 99):.0f}, max {ms[-1]:.0f}; "
                      f"exporter RSS max {max(watch.rss, default=0) / 2**20:.0f} MiB, CPU {cpu / args.seconds:.2f} "
                      f"cores; flood answers {dict(sorted(answers.items())) or '-'}")
    print(f"# end {loadavg()}")
    return 1 if failed else 0
