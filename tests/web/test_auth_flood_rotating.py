"""Issue 24, row 1: a wrong-password flood from rotating source addresses against a real
``accelstats serve --web-config`` with basic auth (bcrypt cost 10, plain HTTP); the scraper's first
login after the start must get ``200`` within 10 s, retrying once a second on ``503``
(``Retry-After: 1``), under every flood shape:

| shape                      | flood's sources (64 clients, another process)      | scraper   |
|----------------------------|----------------------------------------------------|-----------|
| one address                | 127.0.0.2                                          | 127.0.0.1 |
| 1000 addresses             | 127.0.0.2 - 127.0.3.233, in turn (the scraper's /24) | 127.0.0.1 |
| a fresh address a request  | 127.1.0.0/16, never the same twice (an IPv6 /64's worth) | 127.0.0.1 |

Before the fix the fresh-address shape answered every try ``503``: each flooding address tied with
the scraper's (one arrival each) and the gate refused the newcomer. A scraper that tries again only
at its next scrape, as Prometheus does, is tried too: it must still be known as a retry after the
flood's refusals in between. The gate's order itself (prefix
levels, shedding, serving, what it remembers, retries) is tried on
:class:`accelstats.web.auth.CheckGate` directly below.
"""

from __future__ import annotations

import ipaddress
import resource
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import bcrypt
import pytest
from support.http_attack_util import serve_process
from support.webconfig_util import SCRAPER, Flood, fetch

from accelstats.web import auth as webauth

PASSWORD = "legit-pw"
SCRAPER_ADDRESS = "192.0.2.1"  # the gate's unit tests: a scraper on 192.0.2.0/24
FIRST_LOGIN_WITHIN = 10.0  # seconds: issue 24's build requirement


@pytest.fixture
def server(fixtures_dir: Path, tmp_path: Path) -> Iterator[int]:
    """``accelstats serve`` on a free port, basic auth for ``prometheus`` (cost 10), plain HTTP
    (:func:`support.http_attack_util.serve_process`: until ``/healthz`` answers; SIGTERM, then SIGKILL)."""
    web = tmp_path / "web.yml"
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=10)).decode()
    web.write_text(f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    args = ["--collector", "nvidia", "--nvml-replay", str(fixtures_dir / "h200" / "nvidia-smi-q.xml"),
            "--web-config", str(web), "--log-level", "warning"]
    with serve_process(args, tmp_path / "serve.log", resource.getrlimit(resource.RLIMIT_NOFILE)[0]) as (_, port):
        yield port


def first_login(port: int, within: float) -> tuple[int, list[str], float]:
    """Log in from :data:`SCRAPER` as a scraper does: on ``503`` try again after its ``Retry-After``
    (1 s), until ``200`` or ``within`` seconds; (last status, every try's status, seconds taken)."""
    began = time.monotonic()
    tries: list[str] = []
    status = 0
    while time.monotonic() - began < within:
        try:
            status, headers, _ = fetch(port, None, auth=("prometheus", PASSWORD), source=SCRAPER, timeout=within)
        except OSError as exc:
            status, headers = 0, {}
            tries.append(type(exc).__name__)
        else:
            tries.append(str(status))
        if status == 200:
            break
        time.sleep(float(headers.get("Retry-After", "1")))
    return status, tries, time.monotonic() - began


@pytest.mark.parametrize("shape, sources", [
    ("one address", "127.0.0.2"),
    ("1000 addresses", "127.0.0.0/22*1000"),
    ("a fresh address a request", "127.1.0.0/16"),
])
def test_a_first_login_gets_through_a_flood_within_10_s(server: int, shape: str, sources: str) -> None:
    flood = Flood(server, sources, 64, "prometheus")
    try:
        assert flood.wait_answers(20, timeout=60, status="503"), f"the flood never filled the gate: {flood.responses}"
        status, tries, took = first_login(server, FIRST_LOGIN_WITHIN)
        answered = dict(flood.responses)
    finally:
        flood.stop()
    report = f"{shape}: tries {tries} in {took:.2f} s; flood answers {answered}"
    print(report)
    assert status == 200 and took <= FIRST_LOGIN_WITHIN, report
    assert "200" not in answered and "500" not in answered, report


def test_a_scraper_retrying_only_at_its_next_scrape_is_remembered_through_a_fresh_address_flood(
        server: int) -> None:
    """| flood's sources (64 clients)                      | scraper                                       |
    |----------------------------------------------------|-----------------------------------------------|
    | 127.0.0.0/8: a fresh address, /24 and /16 a request | 127.0.0.1; again after 8192 flood answers     |

    The scraper ties with the flood at every prefix level (its /16 is flooded like the other 255), so
    its first try may be refused. It tries again as Prometheus does at its next scrape, after a gap
    in which the flood had 8192 answers, twice what the gate used to remember (about 3 s here;
    Prometheus' 15 s hold some 40 000).
    Its second try should get ``200``: it carries the credentials of a refused check of its address, a retry, and
    a guess is shed instead. The test allows a third: the retry only ranks among the addresses whose prefixes are
    the heaviest at every level, and with the flood slowed by a loaded 2-core CI machine the scraper's own /16 or
    /24 was once the heaviest, so its second try was shed too (CI run of 22f8848: tries [503, 503]); a scraper
    that keeps trying at each scrape still gets in. Before the fix the gate remembered refused credentials for the
    4096 addresses refused last, which the flood turns over; this end-to-end case did not always fail then (1 of 6
    runs with a gap of 12 288 answers: the flood's walk sometimes puts several waiters in one /24, which keeps the
    scraper's lighter /24 in without a retry); the gate test below fails every time."""
    flood = Flood(server, "127.0.0.0/8", 64, "prometheus")
    try:
        assert flood.wait_answers(20, timeout=60, status="503"), f"the flood never filled the gate: {flood.responses}"
        tries = []
        for _ in range(3):
            before = sum(flood.responses.values())
            status = fetch(server, None, auth=("prometheus", PASSWORD), source=SCRAPER, timeout=30)[0]
            tries.append(status)
            if status == 200:
                break
            assert flood.wait_answers(before + 2 * webauth.MAX_ADDRESSES, timeout=60), flood.responses
            between = sum(flood.responses.values()) - before
        answered = dict(flood.responses)
    finally:
        flood.stop()
    report = f"tries {tries}; flood answers {answered}" + (f", {between} between the tries" if len(tries) > 1 else "")
    print(report)
    assert tries[-1] == 200, report
    assert "200" not in answered and "500" not in answered, report


# --------------------------------------------------------------------------------------------
# the gate's order, on CheckGate itself (one slot, a waiting room of 4, 2 per address)


def test_prefixes_widest_first() -> None:
    assert webauth.prefixes("127.1.2.3") == ("4:0/0", "4:127/8", "4:32513/16", "4:8323330/24", "4:2130772483/32")
    assert webauth.prefixes("::ffff:127.1.2.3") == webauth.prefixes("127.1.2.3")  # a dual-stack socket's IPv4 peer
    v6 = webauth.prefixes("2001:db8:a:b::1%eth0")  # the scope is no part of the address
    assert v6[1:4] == ("6:536939960/32", f"6:{0x20010db8000a}/48", f"6:{0x20010db8000a000b}/64")
    assert v6[4] == f"6:{0x20010db8000a000b0000000000000001}/128"
    assert webauth.prefixes("") == ("?", "?", "?", "?", "?")
    assert webauth.prefixes("/run/x.sock") == ("?", "?", "?", "?", "?/run/x.sock")


def fresh(prefix: str, count: int) -> list[str]:
    """``count`` addresses of ``prefix`` (an IPv4 /24 or /16, an IPv6 /64), each used once, spread over it."""
    net = ipaddress.ip_network(prefix)
    return [str(net.network_address + 1 + 4099 * i % (net.num_addresses - 2)) for i in range(count)]


def acquire_in_thread(gate: webauth.CheckGate, source: str, results: dict[str, bool], name: str,
                      order: list[str], credentials: bytes = b"") -> threading.Thread:
    """``gate.acquire(source, credentials)`` in a thread: ``results[name]`` becomes its answer; a
    granted slot is noted in ``order`` and released."""
    def run() -> None:
        got = gate.acquire(source, credentials)
        results[name] = got
        if got:
            order.append(name)
            gate.release()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


# | flood: fresh addresses of  | the newcomer              | the newcomer's check                        |
FRESH_FLOOD_TABLE = [
    ("127.1.0.0/16", "127.0.0.1", "waits, pushes out a flooding check, is served next"),
    ("2001:db8:a::/64", "2001:db8:b::1", "waits, pushes out a flooding check, is served next"),
    ("2001:db8:a::/64", "2001:db8:a::ffff", "refused: it ties with the flood's fresh addresses"),
    ("127.1.2.0/24", "127.1.2.255", "refused: it ties with the flood's fresh addresses"),
]


@pytest.mark.parametrize("flood_prefix, newcomer, expected", FRESH_FLOOD_TABLE)
def test_check_gate_a_fresh_address_flood_is_one_heavy_prefix(flood_prefix: str, newcomer: str,
                                                               expected: str) -> None:
    """200 checks, each from a fresh address of one prefix, meet a full gate (one holds the slot, 4
    wait, the rest are refused); then a newcomer comes. Before the fix every newcomer tied with the
    flood's addresses (one arrival each) and was refused, wherever it came from."""
    now = [0.0]
    gate = webauth.CheckGate(slots=1, max_wait=30, max_waiting=4, per_source=2, clock=lambda: now[0])
    flood = fresh(flood_prefix, 200)
    assert gate.acquire(flood[0])  # holds the slot
    results: dict[str, bool] = {}
    order: list[str] = []
    threads = []
    for i, address in enumerate(flood[1:], 1):
        now[0] += 0.005
        threads.append(acquire_in_thread(gate, address, results, f"flood{i}", order))
        until(lambda i=i: gate.waiting() == min(i, 4) and len(results) == max(0, i - 4),  # type: ignore[misc]
              f"flood{i} to wait or be refused")
    assert [name for name, got in results.items() if got] == []  # refused newcomers, 4 still waiting
    threads.append(acquire_in_thread(gate, newcomer, results, "newcomer", order))
    until(lambda: "newcomer" in results or len(results) == 196, "the newcomer to wait or be refused")
    if expected.startswith("refused"):
        assert results.get("newcomer") is False and gate.waiting() == 4
    else:
        assert "newcomer" not in results and gate.waiting() == 4  # it waits; a flooding check was pushed out
    gate.release()
    for t in threads:
        t.join(timeout=10)
    if not expected.startswith("refused"):
        assert order[0] == "newcomer", order  # its prefix was never served: it goes first


def test_check_gate_remembers_a_flooding_prefix_while_its_addresses_churn() -> None:
    """10 000 fresh addresses of one IPv6 /64, 0.01 s apart: the /64 and its /48 and /32 stay
    remembered, with the load of all of them (about 10 / (1 - 2 ** -0.001) = 14 432 arrivals, decayed),
    while each level keeps at most MAX_ADDRESSES nodes: the first addresses are forgotten."""
    now = [0.0]
    gate = webauth.CheckGate(slots=10 ** 6, max_wait=1, clock=lambda: now[0])
    flood = fresh("2001:db8:a::/64", 10_000)
    for address in flood:
        now[0] += 0.01
        assert gate.acquire(address)
    assert gate.load(flood[0]) == 0.0 and gate.load(flood[-1]) == 1.0
    expected = sum(0.5 ** (0.01 * k / webauth.LOAD_HALF_LIFE) for k in range(10_000))
    for level in (1, 2, 3):  # /32, /48, /64
        assert gate.load(flood[0], level) == pytest.approx(expected)


def test_check_gate_a_scraper_trying_its_password_again_is_not_shed_before_a_guess() -> None:
    """The waiting room (2) holds two guesses from two addresses of the scraper's own /24, each seen
    once; the scraper's first try ties with them (one arrival each) and, arriving last, is refused.
    Its second try, with the credentials its refused check had, is a retry: a guess is shed instead,
    although the scraper's address is now the more loaded, and the scraper gets a slot. Before the fix
    (no retries) the second try was refused too: the more loaded address."""
    now = [0.0]
    gate = webauth.CheckGate(slots=1, max_wait=30, max_waiting=2, per_source=2, clock=lambda: now[0])
    assert gate.acquire("192.0.2.99", b"guess-0")  # holds the slot
    results: dict[str, bool] = {}
    order: list[str] = []
    threads = []
    for waiting, (name, address) in enumerate((("guess1", "192.0.2.10"), ("guess2", "192.0.2.11")), 1):
        threads.append(acquire_in_thread(gate, address, results, name, order, credentials=name.encode()))
        until(lambda waiting=waiting: gate.waiting() == waiting, f"{name} to wait")  # type: ignore[misc]
    assert gate.acquire(SCRAPER_ADDRESS, b"scraper-pw") is False  # first try: refused at once
    threads.append(acquire_in_thread(gate, SCRAPER_ADDRESS, results, "again", order, credentials=b"scraper-pw"))
    until(lambda: "guess2" in results or "again" in results, "a guess to be shed or the scraper refused")
    assert results == {"guess2": False} and gate.waiting() == 2
    gate.release()
    for t in threads:
        t.join(timeout=10)
    assert results == {"guess1": True, "guess2": False, "again": True}, results
    assert order == ["guess1", "again"]


def test_check_gate_remembers_a_refused_scraper_through_a_flood_of_fresh_addresses() -> None:
    """As above, in one IPv6 /64 (the scraper ties with the guesses at every prefix level), but between
    the scraper's refused first try and its next scrape, 10 000 guesses from fresh addresses of its /64
    are refused too (10 s of a 1000-a-second flood). Its next try is still a retry: a guess is shed
    instead and the scraper gets a slot. Before the fix the refused credentials were an LRU of 4096
    addresses, which the flood turned over: the scraper was forgotten and refused again."""
    now = [0.0]
    gate = webauth.CheckGate(slots=1, max_wait=30, max_waiting=2, per_source=2, clock=lambda: now[0])
    guesses = iter(fresh("2001:db8:a::/64", 10_003))
    scraper = "2001:db8:a::1"
    assert gate.acquire(next(guesses), b"guess-0")  # holds the slot
    results: dict[str, bool] = {}
    order: list[str] = []
    threads = []
    for waiting, name in enumerate(("guess1", "guess2"), 1):
        threads.append(acquire_in_thread(gate, next(guesses), results, name, order, credentials=name.encode()))
        until(lambda waiting=waiting: gate.waiting() == waiting, f"{name} to wait")  # type: ignore[misc]
    assert gate.acquire(scraper, b"scraper-pw") is False  # first try: refused at once
    for i, address in enumerate(guesses, 3):
        now[0] += 0.001
        assert gate.acquire(address, b"guess-%d" % i) is False
    threads.append(acquire_in_thread(gate, scraper, results, "next scrape", order, credentials=b"scraper-pw"))
    until(lambda: "guess1" in results or "next scrape" in results, "a guess to be shed or the scraper refused")
    assert results == {"guess1": False} and gate.waiting() == 2, results
    gate.release()
    for t in threads:
        t.join(timeout=10)
    assert results == {"guess1": False, "guess2": True, "next scrape": True}, results


def test_check_gate_serves_a_check_that_waited_half_its_time_before_fresh_prefixes() -> None:
    """| at (s) | check                          | its prefixes                   |
    |--------|--------------------------------|--------------------------------|
    | 0      | 192.0.2.50 holds the slot      | 192.0.2.0/24 and wider: served |
    | 0      | the scraper, 192.0.2.1, waits  | as above                       |
    | 6      | 10.1.0.1, 10.2.0.1, 10.3.0.1   | never served                   |

    ``max_wait`` is 10 s: when the slot is freed at 6 s the scraper has waited more than half of it
    and goes first, then the others by prefix. Before the fix the slot went to the never-served
    prefixes first, and a many-prefix flood kept bringing new ones until the scraper timed out
    (docs/performance.md: `--auth-flood prefixes --auth-retry 15`)."""
    now = [0.0]
    gate = webauth.CheckGate(slots=1, max_wait=10, max_waiting=4, per_source=2, clock=lambda: now[0])
    assert gate.acquire("192.0.2.50", b"guess-0")
    results: dict[str, bool] = {}
    order: list[str] = []
    threads = [acquire_in_thread(gate, SCRAPER_ADDRESS, results, "scraper", order, credentials=b"scraper-pw")]
    until(lambda: gate.waiting() == 1, "the scraper to wait")
    now[0] = 6.0
    for waiting, address in enumerate(("10.1.0.1", "10.2.0.1", "10.3.0.1"), 2):
        threads.append(acquire_in_thread(gate, address, results, address, order, credentials=address.encode()))
        until(lambda waiting=waiting: gate.waiting() == waiting, f"{address} to wait")  # type: ignore[misc]
    gate.release()
    for t in threads:
        t.join(timeout=10)
    assert order == ["scraper", "10.1.0.1", "10.2.0.1", "10.3.0.1"], order
