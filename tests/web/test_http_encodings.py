"""What one address, or a few, can make the server encode (issue 24, row 3).

A real :func:`serve` over a replayed 8 GPU x 1000 container host (3.3 MB bodies); a scraper (127.0.0.1,
Prometheus' ``Accept`` and gzip) is timed alone, then while others attack; ratios are measured in the
same test, never absolute times.

Attack: what happened before; what happens now.

* One address rotates ``Accept`` (text 0.0.4/1.0.0, OpenMetrics x escapings x gzip) on 8 connections:
  each variant was its own encoding, all under one lock, and the scraper waited for them. Now variants
  with the same bytes share a body (at most 4 fast ones per collection); bodies only prometheus_client
  writes (escapings ``dots``, ``values``) run one at a time in all (429 to the address that has it).
* 32 addresses send ``name[]`` filters of their own: 64 encodings ran at once (2 per address). Now one
  in all; the rest get 503 with ``Retry-After``.
* Every variant of one collection, in process: one body per content type string. Now one per format
  and gzip; the costly ones kept within ``COSTLY_BYTES``.

The flood runs in its own process (support/http_flood.py): in this one its threads would share the
server's GIL.
"""

from __future__ import annotations

import http.client
import itertools
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.http_flood import flooding

from accelstats import catalog
from accelstats.manager import AcceleratorManager, Collection
from accelstats.web import app, serve
from collectors.replay.lib import open_replay

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "benchmarks") not in sys.path:  # benchmarks/ is not a package
    sys.path.insert(0, str(REPO / "benchmarks"))
import scrape as bench  # noqa: E402

PROMETHEUS = {"Accept": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
                        "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1", "Accept-Encoding": "gzip"}
MEDIA = ["text/plain", "text/plain; version=0.0.4", "text/plain; version=1.0.0",
         "application/openmetrics-text", "application/openmetrics-text; version=1.0.0"]
ESCAPINGS = ["", "; escaping=underscores", "; escaping=allow-utf-8", "; escaping=dots", "; escaping=values"]
# every Accept variant an attacker can rotate through (0.0.4 and unversioned ones ignore the escaping)
VARIANTS = [({"Accept": m + e} | ({"Accept-Encoding": "gzip"} if z else {}))
            for m, e, z in itertools.product(MEDIA, ESCAPINGS, (False, True))]
FAST = [v for v in VARIANTS if "dots" not in v["Accept"] and "values" not in v["Accept"]]


class Host:
    """:func:`serve` on 127.0.0.1 over a replayed 8 GPU x 1000 container host; :attr:`made` holds the
    collections made and :attr:`shared` is the app's :class:`~accelstats.web.app.SharedExposition`."""

    def __init__(self, folder: Path, fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        settings = bench.build_host(folder, fixtures_dir / "h200" / "nvidia-smi-q.xml", gpus=8, containers=1000)
        assert settings.nvml_replay is not None
        self.manager = AcceleratorManager(settings, open_replay(settings.nvml_replay))
        self.manager.setup()
        self.made: set[float] = set()  # the collections handed out (their start times)
        original = self.manager.collect

        def collect() -> Collection:
            collection = original()
            self.made.add(collection.started)
            return collection

        self.manager.collect = collect  # type: ignore[method-assign]
        made: list[app.SharedExposition] = []

        class Recorded(app.SharedExposition):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                made.append(self)

        monkeypatch.setattr(app, "SharedExposition", Recorded)
        self.server, _ = serve(self.manager, "127.0.0.1", 0)
        (self.shared,) = made
        self.port: int = self.server.server_address[1]

    def get(self, headers: dict[str, str], path: str = "/metrics", source: str = "127.0.0.1",
            timeout: float = 30.0) -> tuple[int, float]:
        """One request on a new connection from ``source``: (status, seconds to the last byte)."""
        began = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout, source_address=(source, 0))
        try:
            conn.request("GET", path, headers=headers)
            response = conn.getresponse()
            response.read()
            return response.status, time.monotonic() - began
        finally:
            conn.close()

    def scraper_p50(self, scrapes: int) -> float:
        """Median seconds of ``scrapes`` Prometheus scrapes one after another (each must be a 200)."""
        times = []
        for _ in range(scrapes):
            status, took = self.get(PROMETHEUS)
            assert status == 200
            times.append(took)
        return statistics.median(times)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.manager.destroy(timeout=0.5)
        self.manager.close()


@pytest.fixture
def host(tmp_path: Path, fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Host]:
    h = Host(tmp_path, fixtures_dir, monkeypatch)
    yield h
    h.close()


def test_one_address_rotating_accept_variants_does_not_hold_up_a_scraper(host: Host) -> None:
    host.scraper_p50(2)  # warm: the fast encoder's label strings, the replay
    alone = host.scraper_p50(7)
    encodings, collections = host.shared.encodings, len(host.made)
    rotating = [[("127.0.0.2", "/metrics", VARIANTS[(7 * i + n) % len(VARIANTS)]) for n in range(len(VARIANTS))]
                for i in range(32)]  # 32 connections at once from one address, each through every variant
    with flooding(host.port, rotating) as statuses:
        attacked = host.scraper_p50(7)
    encodings, collections = host.shared.encodings - encodings, len(host.made) - collections
    print(f"scraper p50 {alone * 1000:.0f} ms alone, {attacked * 1000:.0f} ms under attack; {encodings} encodings "
          f"for {collections} collections; attacker's answers {dict(statuses)}")
    # 2026-12-05, 2-core VM: 4.5 to 5.4 x, 6.9 x at load average 11 (before: 4.5 to 33 x); a flood of
    # Prometheus' own variant on as many connections: 2.1 x, of /healthz: 3.5 x. What tells the two apart
    # is the encodings, a collection (2.2 to 2.3; before 2.5 to 5.3) and an answer (0.14 to 0.16; before
    # 0.50 to 0.58), and the 429s; the time bound only catches a scraper held up for good, with room for
    # 4 test workers on 2 cores.
    answered = statuses["200"] + 7
    assert encodings <= 3 * collections, f"{encodings} encodings for {collections} collections"
    assert encodings <= answered / 3, f"{encodings} encodings for {answered} answers"
    assert statuses["200"] > 0 and statuses["429"] > 0, dict(statuses)  # served, and re-escaped bodies capped
    assert attacked <= 20 * alone, f"scraper p50 {attacked:.2f} s under attack, {alone:.2f} s alone"


def test_32_addresses_sending_their_own_filters_do_not_hold_up_a_scraper(host: Host) -> None:
    host.scraper_p50(2)
    alone = host.scraper_p50(7)
    families = "&".join(f"name[]={spec.name}" for spec in catalog.COLLECTED)

    filters = [[(f"127.0.1.{i + 1}", f"/metrics?{families}&name[]=nothing_{i}_{n}", {}) for n in range(50)]
               for i in range(32)]  # 32 addresses, each with filters of its own (every family: a whole body)
    with flooding(host.port, filters) as statuses:
        attacked = host.scraper_p50(7)
    print(f"scraper p50 {alone * 1000:.0f} ms alone, {attacked * 1000:.0f} ms under attack; "
          f"attackers' answers {dict(statuses)}")
    # 2026-12-05, 2-core VM: 5.4 to 6.0 x, 7 to 8.6 x at load average 11, most of it the flood's 600
    # requests a second (before: 14 to 63 x, no 503). The 503s tell the two apart; the time bound leaves
    # room for 4 test workers on 2 cores (it failed the old code in 2 of 3 runs at load average 8 to 11).
    assert statuses["200"] > 0 and statuses["503"] > 0, dict(statuses)  # some served, the rest told to retry
    assert attacked <= 25 * alone, f"scraper p50 {attacked:.2f} s under attack, {alone:.2f} s alone"


class _Fixed:
    def __init__(self, collection: Collection) -> None:
        self.collection = collection

    def collect(self) -> Collection:
        return self.collection


def test_accept_variants_of_one_collection_share_their_bodies(host: Host) -> None:
    """In process, one collection: every variant whose bytes are the same is encoded once (text, OpenMetrics),
    gzipped once; the re-escaped ones (prometheus_client's encoder) each once, and kept within COSTLY_BYTES."""
    collection = host.manager.collect()
    shared = app.SharedExposition(_Fixed(collection))  # type: ignore[arg-type]
    bodies = {}
    for variant in VARIANTS:
        accept, encoding = app.negotiate(variant["Accept"])[2], variant.get("Accept-Encoding", "")
        body, headers = shared.body(accept, encoding)
        bodies.setdefault((dict(headers)["Content-Type"], encoding), body)
    fast = {k: v for k, v in bodies.items() if "dots" not in k[0] and "values" not in k[0]}
    assert len(set(fast.values())) == 4  # text and OpenMetrics, each plain and gzipped
    assert shared.encodings == 2 + 4  # + text and OpenMetrics with dots and with values
    assert sum(len(b) for b in shared._bodies.values()) <= 2 * (3 << 20) + 2 * (1 << 20) + app.COSTLY_BYTES


def test_a_scrape_given_an_older_collection_than_the_newest_seen_is_answered(host: Host) -> None:
    """Two scrapes can get two collections, and the one with the older collection can ask for its body after
    the newer one was seen (a small host collects fast): that body is made apart, outside the lock its
    encoding takes (before: the thread waited on a lock it held, and every later /metrics waited on it)."""
    older = host.manager.collect()
    newer = host.manager.collect()  # a call after the last one ended runs a collection of its own
    assert newer.started > older.started
    manager = _Fixed(newer)
    shared = app.SharedExposition(manager)  # type: ignore[arg-type]
    shared.body("", "")  # the newest collection seen
    manager.collection = older
    for names in (None, ["accelstats_gpu_info"]):
        done: list[bytes] = []
        worker = threading.Thread(target=lambda out=done, wanted=names: out.append(shared.body("", "", wanted)[0]),
                                  daemon=True)
        worker.start()
        worker.join(10)
        assert done and done[0].startswith(b"# HELP"), f"no body for an older collection (names {names})"
    manager.collection = newer
    assert shared.body("", "")[0].startswith(b"# HELP")  # and the next scrape is served
