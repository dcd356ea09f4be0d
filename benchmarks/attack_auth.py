"""``benchmarks/attack.py --auth-flood SHAPE`` (issue 24) runs a wrong-password flood instead: 64 clients in
another process (tests/support/webconfig_util.py's ``Flood``, over TLS, a new connection and a fresh
random password for ``prometheus`` each request) from rotating source addresses: ``one`` (127.0.0.2),
``1000`` (127.0.0.2 - 127.0.3.233 in turn: the scraper's /24), ``fresh`` (a fresh address of 127.1.0.0/16
per request: what an IPv6 /64 gives anyone), ``prefixes`` (a fresh address of 127.0.0.0/8 per request, a
fresh /24 each, the /8's 256 /16s in turn: an attacker with many prefixes), or ``all`` of them in turn.
Each of ``--auth-rounds`` rounds (5) starts the exporter afresh (the cache of successful checks is empty,
as after a restart or a password change), starts the flood, waits for its first ``503``, then logs in
from 127.0.0.1 as a scraper does: on ``503`` again after ``Retry-After`` (1 s; ``--auth-retry``:
Prometheus tries again at its next scrape), until ``200`` or ``--auth-deadline`` seconds (30). Printed
per shape: the first logins' times and tries, and the flood's answers by status with its rate (target:
every first login within 10 s).
"""

from __future__ import annotations

import argparse
import http.client
import ssl
import tempfile
import time
from collections import Counter
from pathlib import Path

from attack import exporter, make_web_config, scrape_once  # benchmarks/ is sys.path[0]
from scrape import loadavg

AUTH_FLOOD_SHAPES = {  # --auth-flood: the flood's sources (tests/support/webconfig_util.py flood_sources)
    "one": "127.0.0.2",
    "1000": "127.0.0.0/22*1000",
    "fresh": "127.1.0.0/16",
    "prefixes": "127.0.0.0/8",
}
FIRST_LOGIN_TARGET = 10.0  # seconds: issue 24's build requirement


def auth_flood_run(args: argparse.Namespace, capture: Path) -> int:
    """Issue 24's auth floods from rotating addresses (the module's docstring): per shape, the
    scraper's first-login times and tries over ``--auth-rounds`` fresh exporters, and the flood's
    answers. Exit status 1 when a first login took longer than :data:`FIRST_LOGIN_TARGET`."""
    from support.webconfig_util import Flood  # tests/ is on sys.path

    shapes = list(AUTH_FLOOD_SHAPES) if args.auth_flood == "all" else [args.auth_flood]
    print(f"# {args.repo}: TLS + basic auth (bcrypt cost 12); a flood of 64 clients, a wrong password "
          f"and a new TLS connection each request; {args.auth_rounds} fresh exporter(s) per shape; "
          f"the scraper tries again {args.auth_retry:g} s after a 503")
    worst = 0.0
    for shape in shapes:
        took: list[float] = []
        tries: list[str] = []
        answers: Counter[str] = Counter()
        flood_s = 0.0
        for _ in range(args.auth_rounds):
            with tempfile.TemporaryDirectory() as tmp:
                folder = Path(tmp)
                web = make_web_config(folder, plain=False)
                ctx = ssl.create_default_context(cafile=str(folder / "tls.crt"))
                with exporter(args.repo, folder, web, args.nofile, capture) as (_, port):
                    flood = Flood(port, AUTH_FLOOD_SHAPES[shape], 64, "prometheus", cafile=str(folder / "tls.crt"))
                    began_flood = time.monotonic()
                    try:
                        if not flood.wait_answers(1, timeout=60, status="503"):
                            raise RuntimeError(f"the flood never filled the gate: {flood.responses}")
                        began = time.monotonic()
                        statuses = []
                        while True:
                            try:
                                status = scrape_once(port, ctx, timeout=args.auth_deadline)[0]
                            except (OSError, http.client.HTTPException) as exc:
                                status = type(exc).__name__
                            statuses.append(str(status))
                            if status == 200 or time.monotonic() - began > args.auth_deadline:
                                break
                            time.sleep(args.auth_retry)  # 1: the 503's Retry-After
                        took.append(time.monotonic() - began if status == 200 else float("inf"))
                        tries.append("/".join(statuses) if len(statuses) <= 3 else
                                     f"{len(statuses)} tries, {statuses.count('503')} of them 503, last {statuses[-1]}")
                        answers.update(dict(flood.responses))
                    finally:
                        flood_s += time.monotonic() - began_flood
                        flood.stop()
        worst = max(worst, *took)
        shown = ", ".join(f"{t:.2f}" if t != float("inf") else f"none in {args.auth_deadline:g}" for t in took)
        print(f"{shape} ({AUTH_FLOOD_SHAPES[shape]}): first login s {shown}; tries {tries}")
        print(f"{shape}: flood answers {dict(sorted(answers.items()))}, {sum(answers.values()) / flood_s:.0f}/s")
    print(f"# end {loadavg()}")
    return 1 if worst > FIRST_LOGIN_TARGET else 0
