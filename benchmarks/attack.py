"""Attack: the latency of a real scrape while 2000 hostile connections are open.

Starts ``python3 -m accelstats serve`` (this checkout, or ``--repo DIR``: another checkout, e.g. the
code before the fix) on ``127.0.0.1`` over the replayed H200 capture, under a soft ``RLIMIT_NOFILE``
of ``--nofile`` (8192: ``systemd/accelstats.service``'s ``LimitNOFILE``; 1024 is what systemd gives
without it), with a web configuration of TLS (a self-signed P-256 certificate made with ``openssl``)
and basic auth (a cost-12 bcrypt hash, ``bcrypt.gensalt()``'s default and the README's); ``--plain``
serves plain HTTP without auth instead.

This process then opens ``--connections`` hostile connections and holds them, opening a new one of
the same kind whenever the server closes one (so the count stays up through the server's deadlines):

* ``idle``: TCP connected, nothing sent;
* ``tls-stall``: the first half of a ClientHello, then nothing (``--plain``: half a request head);
* ``tls-idle``: the TLS handshake finished, then nothing, no credentials (``--plain``: idle);
* ``slow-header``: (TLS: after the handshake) a request head sent one byte every ``--trickle`` seconds
  (2 s), never finished.

They are spread evenly over the kinds and driven by one selector thread. Once they are open, a
scraper requests ``/metrics`` every ``--interval`` seconds (0.2) for ``--seconds`` (60), each time on
a new connection (a TLS handshake each: the worst case; ``--keep-alive`` reuses one, as Prometheus
does), with the right password and a 10 s timeout (Prometheus' default ``scrape_timeout``), timed
from connect to the last byte.

Printed: scrapes, errors, latency p50/p99/max (target: p99 <= 1 s); the hostile connections held
(min and mean over the run) and how many the server closed; the exporter's threads (``Threads:`` of
``/proc/<pid>/status``), open fds (``/proc/<pid>/fd``) and RSS, max and median, sampled every 0.5 s;
the exporter's CPU; ``accelstats_http_connections_refused_total`` from the last scrape.

``--requests`` attacks with requests that cost work instead of stalled connections: the exporter
(plain HTTP) over the scrape benchmark's host (``--gpus`` 8 x ``--containers`` 1000: 2 MB answers);
from 127.0.0.2, half the connections send ``GET /metrics`` with a ``name[]`` filter naming every
family, 20 times pipelined, with a 4 KiB receive buffer, and never read (``no-read``); the other half
connect, send one such request and close, over and over (``fire-forget``). The scraper comes from
127.0.0.1.

``--urandom N`` runs the other part instead: the exporter (plain HTTP, all collectors) over a
cgroup v1 devices tree of N docker containers whose ``devices.list`` is a symlink to ``/dev/urandom``
(plus one normal container), scraped ``--urandom-scrapes`` times (200) one after another; printed:
the exporter's RSS (``VmRSS``) after the first scrape and after every further fifth of them
(target: flat; the run stops when RSS passes ``--rss-limit``, 2048 MiB, as the code before the fix
did), the scrape latency, the containers published and the skipped ``devices.list``
reads counted (``accelstats_attribution_skipped_total{reason="devices_list_unreadable"}``).

``--undecidable-programs N`` runs a third part instead (``benchmarks/attack_programs.py``): a real
exporter over a cgroup v2 subtree of N containers with helper-calling device programs and
``--looping-programs`` (20) with distinct long loops, ``--program-scrapes`` (300) scrapes: RSS,
first and later scrape times and CPU, and the cost of replaced and of new programs.

``--variants`` runs row 3 of issue 24 instead (``benchmarks/attack_variants.py``): rotating ``Accept``
variants from one address and ``name[]`` filters from ``--variant-clients`` addresses against a Prometheus scraper.

``--auth-flood SHAPE`` (issue 24) runs a wrong-password flood from rotating source addresses instead
(``benchmarks/attack_auth.py``): the scraper's first logins under it (target: within 10 s).

Usage: ``python3 benchmarks/attack.py [--connections 2000] [--seconds 60] [--nofile 8192] [--plain]
[--keep-alive] [--repo DIR]``, or ``python3 benchmarks/attack.py --urandom 50 [--repo DIR]``, or
``python3 benchmarks/attack.py --auth-flood all [--auth-rounds 5] [--repo DIR]`` (exit status 1 when a
first login took over 10 s). Raises
this process's own RLIMIT_NOFILE as needed. Exit status 1 when p99 is above 1 s or a scrape failed
(``--urandom``: when a scrape failed or RSS grew by 5 MiB or more). Figures go to docs/performance.md.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import errno
import http.client
import os
import re
import resource
import select
import selectors
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import bcrypt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # support.ports: the one free_port

from scrape import build_host, default_shared, loadavg, machine, percentile  # benchmarks/ is sys.path[0]
from support.ports import free_port

REPO = Path(__file__).resolve().parents[1]
PASSWORD = "attack-benchmark"
KINDS_TLS = ("idle", "tls-stall", "tls-idle", "slow-header")
KINDS_PLAIN = ("idle", "half-head", "idle", "slow-header")
KINDS_REQUESTS = ("no-read", "fire-forget")
ATTACKER_SOURCE = "127.0.0.2"  # --requests: the flood's address (the scraper's is 127.0.0.1)
IP_BIND_ADDRESS_NO_PORT = 24  # linux/in.h; not in Python's socket module before 3.12
SLOW_HEAD = b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nUser-Agent: slow\r\nX-Pad: " + b"a" * 100000



def make_web_config(folder: Path, plain: bool) -> Path | None:
    """``web.yml`` in ``folder`` with a self-signed certificate for localhost and one user
    (``prometheus``, :data:`PASSWORD`, bcrypt cost 12); None with ``plain``."""
    if plain:
        return None
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(folder / "tls.key"), "-out", str(folder / "tls.crt")],
                   check=True, capture_output=True)
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt()).decode()
    web = folder / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: tls.crt\n  key_file: tls.key\n"
                   f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    return web


@contextlib.contextmanager
def exporter(repo: Path, folder: Path, web: Path | None, nofile: int, capture: Path,
             collectors: tuple[str, ...] = ("nvidia",)) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """``python3 -m accelstats serve`` from ``repo`` with soft RLIMIT_NOFILE ``nofile`` over the
    cgroup, proc and rootfs trees under ``folder`` (made empty where absent), ``collectors`` only (none
    given: all); yields (process, port) once ``/healthz`` answers; SIGTERM at the end."""
    port = free_port()
    for d in ("cgroup", "proc", "rootfs"):
        (folder / d).mkdir(exist_ok=True)
    config = folder / "config.toml"
    config.write_text("")
    argv = [sys.executable, "-m", "accelstats", "serve", "--listen", f"127.0.0.1:{port}", "--config", str(config),
            "--nvml-replay", str(capture), "--cgroup-root", str(folder / "cgroup"),
            "--proc-root", str(folder / "proc"), "--rootfs", str(folder / "rootfs"), "--log-level", "warning",
            "--web-config", str(web) if web else ""]
    for name in collectors:
        argv += ["--collector", name]

    def limit() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))

    log = folder / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)}, stdout=out,
                                stderr=subprocess.STDOUT, preexec_fn=limit)
    try:
        ctx = ssl.create_default_context(cafile=str(folder / "tls.crt")) if web else None
        end = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"accelstats serve exited {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if scrape_once(port, ctx, "/healthz", 2.0)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > end:
                raise RuntimeError(f"accelstats serve did not answer within 60 s: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield proc, port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


AUTH = {"Authorization": "Basic " + base64.b64encode(f"prometheus:{PASSWORD}".encode()).decode()}


def scrape_once(port: int, ctx: ssl.SSLContext | None, path: str = "/metrics", timeout: float = 10.0,
                conn: http.client.HTTPConnection | None = None) -> tuple[int, bytes]:
    """One GET on ``conn`` or a new connection (closed after); (status, body)."""
    own = conn is None
    if conn is None:
        conn = (http.client.HTTPSConnection("localhost", port, context=ctx, timeout=timeout) if ctx
                else http.client.HTTPConnection("127.0.0.1", port, timeout=timeout))
    try:
        conn.request("GET", path, headers=AUTH if ctx else {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        if own:
            conn.close()


def client_hello() -> bytes:
    """The first flight of a Python TLS client."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


@dataclass(eq=False)
class _Hostile:
    kind: str
    sock: socket.socket
    stage: str = "connecting"  # connecting, handshake, holding, trickling
    sent: int = 0
    next_byte: float = 0.0


@dataclass
class Attacker:
    """Holds ``target`` hostile connections to 127.0.0.1:``port`` (kinds spread evenly), reopening any
    the server closes, on one selector thread until :meth:`stop`."""

    port: int
    target: int
    tls: bool
    trickle: float = 2.0
    request: bytes = b""  # --requests: what no-read and fire-forget connections send
    pipeline: int = 20  # --requests: requests each no-read connection sends at once
    kinds: tuple[str, ...] = ()
    held: int = 0  # connections established and being hostile now
    opened: int = 0
    closed_by_server: int = 0
    connect_errors: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _next_check: float = 0.0

    def start(self) -> None:
        """Run in a daemon thread."""
        self._thread = threading.Thread(target=self._run, name="attacker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop and close every hostile connection."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def _run(self) -> None:
        kinds = self.kinds or (KINDS_TLS if self.tls else KINDS_PLAIN)
        hello = client_hello()
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        sel = selectors.DefaultSelector()
        conns: set[_Hostile] = set()
        pending = [kinds[i % len(kinds)] for i in range(self.target)]

        def close(h: _Hostile, by_server: bool) -> None:
            conns.discard(h)
            with contextlib.suppress(KeyError, ValueError):
                sel.unregister(h.sock)
            h.sock.close()
            if h.stage in ("holding", "trickling"):
                self.held -= 1
            if by_server:
                self.closed_by_server += 1
            pending.append(h.kind)

        def hold(h: _Hostile, stage: str) -> None:
            h.stage = stage
            h.next_byte = time.monotonic() + self.trickle
            self.held += 1
            sel.modify(h.sock, selectors.EVENT_READ, h)

        def progress(h: _Hostile) -> None:
            if h.stage == "connecting":
                err = h.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    self.connect_errors += 1
                    close(h, False)
                    return
                if h.kind in ("tls-idle", "slow-header") and self.tls:
                    sel.unregister(h.sock)
                    h.sock = ctx.wrap_socket(h.sock, server_hostname="localhost", do_handshake_on_connect=False)
                    sel.register(h.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, h)
                    h.stage = "handshake"
                    progress(h)
                    return
                if h.kind == "fire-forget":  # connect, send, close: the cheapest request there is
                    with contextlib.suppress(OSError):
                        h.sock.send(self.request)
                    close(h, False)
                    return
                if h.kind == "no-read":  # ask for many answers and never read one
                    with contextlib.suppress(BlockingIOError):
                        h.sock.send(self.request * self.pipeline)
                    sel.unregister(h.sock)  # not watched: reading would read the answers
                    h.stage = "holding"
                    self.held += 1
                    return
                if h.kind == "tls-stall":
                    h.sock.send(hello[:len(hello) // 2])
                elif h.kind == "half-head":
                    h.sock.send(SLOW_HEAD[:40])
                hold(h, "trickling" if h.kind == "slow-header" else "holding")
                return
            if h.stage == "handshake":
                assert isinstance(h.sock, ssl.SSLSocket)
                try:
                    h.sock.do_handshake()
                except ssl.SSLWantReadError:
                    sel.modify(h.sock, selectors.EVENT_READ, h)
                    return
                except ssl.SSLWantWriteError:
                    sel.modify(h.sock, selectors.EVENT_WRITE, h)
                    return
                except OSError:
                    close(h, True)
                    return
                hold(h, "trickling" if h.kind == "slow-header" else "holding")
                return
            try:  # holding or trickling: readable means closed (or TLS session tickets)
                if not h.sock.recv(65536):
                    close(h, True)
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                pass
            except OSError:
                close(h, True)

        try:
            while not self._stop.is_set():
                for _ in range(min(len(pending), 200)):  # at most 2000 new connections a second
                    kind = pending.pop()
                    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    if self.kinds:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                        # the port is picked at connect(), which may reuse a TIME_WAIT pair (tcp_tw_reuse
                        # covers loopback): a bind alone ran out of ports on 127.0.0.2 right after a run
                        sock.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
                        sock.bind((ATTACKER_SOURCE, 0))
                    sock.setblocking(False)
                    rc = sock.connect_ex(("127.0.0.1", self.port))
                    if rc not in (0, errno.EINPROGRESS):
                        self.connect_errors += 1
                        sock.close()
                        pending.append(kind)
                        break
                    h = _Hostile(kind, sock)
                    conns.add(h)
                    self.opened += 1
                    sel.register(sock, selectors.EVENT_WRITE, h)
                for key, _ in sel.select(0.1):
                    h = key.data
                    if h in conns:
                        try:
                            progress(h)
                        except OSError:
                            if h in conns:
                                close(h, True)
                now = time.monotonic()
                if now >= self._next_check:  # no-read connections the server closed (POLLRDHUP)
                    self._next_check = now + 1.0
                    for h in [h for h in conns if h.kind == "no-read" and h.stage == "holding"]:
                        poller = select.poll()
                        poller.register(h.sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
                        if poller.poll(0):
                            close(h, True)
                for h in [h for h in conns if h.stage == "trickling" and h.next_byte <= now]:
                    try:
                        h.sent += h.sock.send(SLOW_HEAD[h.sent:h.sent + 1])
                        h.next_byte = now + self.trickle
                    except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                        pass
                    except OSError:
                        close(h, True)
        finally:
            for h in list(conns):
                h.sock.close()
            sel.close()


@dataclass
class Watch:
    """Samples ``/proc/<pid>`` every 0.5 s: threads, fds, RSS (bytes); and ``held`` of the attacker."""

    pid: int
    attacker: Attacker | None = None
    threads: list[int] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        """Sample in a daemon thread until :meth:`stop`."""
        threading.Thread(target=self._loop, name="watch", daemon=True).start()

    def stop(self) -> None:
        """Stop sampling."""
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            try:
                status = Path(f"/proc/{self.pid}/status").read_text()
                fds = len(os.listdir(f"/proc/{self.pid}/fd"))
            except OSError:
                return
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            self.threads.append(int(fields["Threads"]))
            self.rss.append(int(fields["VmRSS"].split()[0]) * 1024)
            self.fds.append(fds)
            if self.attacker is not None:
                self.held.append(self.attacker.held)


def urandom_tree(cgroup: Path, containers: int) -> None:
    """A cgroup v1 devices tree under ``cgroup``: the root allows everything, one docker container
    is granted GPU 0 (``c 195:0 rw``) and ``containers`` more have a ``devices.list`` that is a
    symlink to ``/dev/urandom`` (what a hostile or broken tree can hold: an endless character device)."""
    devices = cgroup / "devices"
    devices.mkdir(parents=True)
    (devices / "devices.list").write_text("a *:* rwm\n")
    good = devices / "docker" / ("a" * 64)
    good.mkdir(parents=True)
    (good / "devices.list").write_text("c 195:0 rw\nc 195:255 rw\n")
    (good / "cgroup.procs").write_text("")
    for i in range(containers):
        hostile = devices / "docker" / f"{i:064x}"
        hostile.mkdir()
        (hostile / "devices.list").symlink_to("/dev/urandom")
        (hostile / "cgroup.procs").write_text("")


def vm_rss_mib(pid: int) -> float:
    """``VmRSS`` of ``pid`` in MiB (``/proc/<pid>/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def urandom_run(args: argparse.Namespace, capture: Path) -> int:
    """Item 7's half of the benchmark: RSS over ``--urandom-scrapes`` scrapes of :func:`urandom_tree`.
    Exit status 1 when a scrape failed or RSS grew by 5 MiB or more after the first scrape."""
    print(f"# {args.repo}: {args.urandom} containers with devices.list -> /dev/urandom, 1 normal; "
          f"{args.urandom_scrapes} scrapes one after another, plain HTTP, all collectors")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        urandom_tree(folder / "cgroup", args.urandom)
        with exporter(args.repo, folder, None, args.nofile, capture, collectors=()) as (proc, port):
            marks = {1} | {args.urandom_scrapes * k // 5 for k in range(1, 6)}
            rss: list[tuple[int, float]] = []
            latencies: list[float] = []
            failed = 0
            body = b""
            for n in range(1, args.urandom_scrapes + 1):
                t0 = time.monotonic()
                try:
                    status, body = scrape_once(port, None, timeout=30.0)
                    failed += status != 200
                except (OSError, http.client.HTTPException):
                    failed += 1
                latencies.append(time.monotonic() - t0)
                now = vm_rss_mib(proc.pid)
                if n in marks or now > args.rss_limit:
                    rss.append((n, now))
                if now > args.rss_limit:
                    print(f"stopped after scrape {n}: RSS {now:.0f} MiB is past --rss-limit {args.rss_limit:g} MiB")
                    break
    ms = sorted(x * 1000 for x in latencies)
    print("RSS MiB after scrape " + ", ".join(f"{n}: {mib:.1f}" for n, mib in rss))
    growth = rss[-1][1] - rss[0][1]
    print(f"RSS growth after the first scrape: {growth:+.1f} MiB (target: flat, < 5 MiB)")
    print(f"scrapes {len(ms)}, failed {failed}; latency ms p50 {percentile(ms, 50):.1f}, p99 {percentile(ms, 99):.1f}, "
          f"max {ms[-1]:.1f}")
    published = len(re.findall(rb"^accelstats_container_info\{", body, re.M))
    skipped = re.search(rb'accelstats_attribution_skipped_total\{reason="devices_list_unreadable"\} (\S+)', body)
    print(f"last scrape: {published} container(s) in accelstats_container_info; "
          f"accelstats_attribution_skipped_total{{reason=\"devices_list_unreadable\"}} "
          f"{float(skipped.group(1)) if skipped else 'not published'}")
    print(f"# end {loadavg()}")
    return 1 if failed or growth >= 5 else 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (``/proc/<pid>/stat`` fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    """Start the exporter, open the hostile connections, time the scrapes, print the figures."""
    from attack_auth import AUTH_FLOOD_SHAPES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between scrapes")
    parser.add_argument("--trickle", type=float, default=2.0, help="seconds between the bytes of a slow head")
    parser.add_argument("--nofile", type=int, default=8192, help="the exporter's soft RLIMIT_NOFILE")
    parser.add_argument("--plain", action="store_true", help="plain HTTP, no auth (default: TLS + basic auth)")
    parser.add_argument("--keep-alive", action="store_true", help="scrape over one kept connection")
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose accelstats to run")
    parser.add_argument("--shared", type=Path, default=default_shared())
    parser.add_argument("--requests", action="store_true",
                        help="instead of stalled connections: requests that cost work (plain HTTP, big host)")
    parser.add_argument("--gpus", type=int, default=8, help="--requests: replayed GPUs")
    parser.add_argument("--containers", type=int, default=1000, help="--requests: containers holding them")
    parser.add_argument("--urandom", type=int, default=0, metavar="N",
                        help="instead: RSS over scrapes of N containers whose devices.list is /dev/urandom")
    parser.add_argument("--urandom-scrapes", type=int, default=200)
    parser.add_argument("--variants", action="store_true",
                        help="instead: rotating Accept variants and name[] filters (issue 24 row 3; big host)")
    parser.add_argument("--variant-clients", type=int, default=32, help="--variants: connections and addresses")
    parser.add_argument("--rss-limit", type=float, default=2048.0,
                        help="MiB: stop the --urandom run when the exporter's RSS passes this (old code)")
    parser.add_argument("--undecidable-programs", type=int, default=0, metavar="N",
                        help="instead: N cgroups with undecidable device programs (root, cgroup2)")
    parser.add_argument("--looping-programs", type=int, default=20)
    parser.add_argument("--program-scrapes", type=int, default=300)
    parser.add_argument("--auth-flood", choices=[*AUTH_FLOOD_SHAPES, "all"],
                        help="instead: first logins under a wrong-password flood from rotating addresses")
    parser.add_argument("--auth-rounds", type=int, default=5, help="--auth-flood: fresh exporters per shape")
    parser.add_argument("--auth-deadline", type=float, default=30.0, help="--auth-flood: seconds a login tries")
    parser.add_argument("--auth-retry", type=float, default=1.0,
                        help="--auth-flood: seconds between a 503 and the next try (Prometheus: the scrape interval)")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = args.connections * 2 + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
    capture = args.shared / "fixtures" / "h200" / "nvidia-smi-q.xml"
    print(f"# {machine()}")
    print(f"# start {loadavg()}")
    if args.urandom:
        return urandom_run(args, capture)
    if args.undecidable_programs:
        from attack_programs import programs_run
        return programs_run(args, capture)
    if args.variants:
        from attack_variants import variants_run
        return variants_run(args, capture)
    if args.auth_flood:
        from attack_auth import auth_flood_run
        return auth_flood_run(args, capture)
    args.plain = args.plain or args.requests
    mode = "plain HTTP" if args.plain else "TLS + basic auth (bcrypt cost 12)"
    kinds = KINDS_REQUESTS if args.requests else KINDS_PLAIN if args.plain else KINDS_TLS
    host = f"{args.gpus} GPUs x {args.containers} containers" if args.requests else "1 GPU"
    print(f"# {args.repo}: {mode}, {host}, exporter RLIMIT_NOFILE {args.nofile}; {args.connections} hostile "
          f"connections ({', '.join(sorted(set(kinds)))}{' from ' + ATTACKER_SOURCE if args.requests else ''}); "
          f"a scrape every {args.interval:g} s for {args.seconds:g} s, "
          f"{'one kept connection' if args.keep_alive else 'a new connection each'}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        web = make_web_config(folder, args.plain)
        ctx = None if args.plain else ssl.create_default_context(cafile=str(folder / "tls.crt"))
        replay = capture
        if args.requests:
            settings = build_host(folder, capture, args.gpus, args.containers)
            assert settings.nvml_replay is not None
            replay = settings.nvml_replay
        with exporter(args.repo, folder, web, args.nofile, replay) as (proc, port):
            scrape_once(port, ctx)  # bcrypt once: successful checks are cached
            idle_threads = int(dict(line.split(":", 1) for line in Path(f"/proc/{proc.pid}/status").read_text()
                                    .splitlines() if ":" in line)["Threads"])
            idle_fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
            request = b""
            if args.requests:  # a name[] filter naming every family: a full body, encoded per filter
                families = sorted(set(re.findall(rb"^# TYPE (\S+)", scrape_once(port, ctx)[1], re.M)))
                query = "&".join(f"name[]={f.decode()}" for f in families)
                request = f"GET /metrics?{query} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode()
            attacker = Attacker(port, args.connections, tls=not args.plain, trickle=args.trickle,
                                request=request, kinds=KINDS_REQUESTS if args.requests else ())
            attacker.start()
            end = time.monotonic() + 60
            holding = args.connections * (0.95 if not args.requests else 0.45)  # fire-forget ones never hold
            while attacker.held < holding and time.monotonic() < end:
                time.sleep(0.1)
            print(f"hostile connections open: {attacker.held} after {attacker.opened} opened "
                  f"({time.monotonic() - end + 60:.1f} s)")
            watch = Watch(proc.pid, attacker)
            watch.start()
            cpu0 = cpu_seconds(proc.pid)
            latencies: list[float] = []
            errors: Counter[str] = Counter()
            body = b""
            kept = None
            if args.keep_alive:
                kept = (http.client.HTTPSConnection("localhost", port, context=ctx, timeout=10) if ctx
                        else http.client.HTTPConnection("127.0.0.1", port, timeout=10))
            t_end = time.monotonic() + args.seconds
            while time.monotonic() < t_end:
                t0 = time.monotonic()
                try:
                    status, got = scrape_once(port, ctx, conn=kept)
                    if status == 200 and got.endswith(b"\n"):
                        body = got
                    else:
                        errors[f"HTTP {status}"] += 1
                except (OSError, http.client.HTTPException) as exc:
                    errors[type(exc).__name__] += 1
                    if kept is not None:
                        kept.close()
                latencies.append(time.monotonic() - t0)
                time.sleep(max(0.0, args.interval - (time.monotonic() - t0)))
            cpu = cpu_seconds(proc.pid) - cpu0
            watch.stop()
            attacker.stop()
    ms = sorted(x * 1000 for x in latencies)
    p99 = percentile(ms, 99)
    print(f"scrapes {len(ms)}, errors {sum(errors.values())} {dict(errors) if errors else ''}")
    print(f"scrape latency ms: p50 {percentile(ms, 50):.1f}, p99 {p99:.1f}, max {ms[-1]:.1f} (target p99 <= 1000)")
    held = watch.held or [0]
    print(f"hostile connections held: min {min(held)}, mean {statistics.mean(held):.0f}; opened {attacker.opened}, "
          f"closed by the server {attacker.closed_by_server}, connect errors {attacker.connect_errors}")
    print(f"exporter before the attack: {idle_threads} threads, {idle_fds} fds")
    print(f"exporter during: threads max {max(watch.threads, default=0)} (median "
          f"{statistics.median(watch.threads or [0]):.0f}), fds max {max(watch.fds, default=0)} (median "
          f"{statistics.median(watch.fds or [0]):.0f}), RSS max {max(watch.rss, default=0) / 2**20:.1f} MiB; "
          f"CPU {cpu:.1f} s = {cpu / args.seconds:.2f} cores")
    refused = re.findall(rb'accelstats_http_connections_refused_total\{reason="([a-z_]+)"\} (\S+)', body)
    counts = ", ".join(f"{r.decode()} {float(v):.0f}" for r, v in refused)
    print(f"refused (last scrape): {counts or 'not published'}")
    print(f"# end {loadavg()}")
    return 1 if errors or p99 > 1000 else 0


if __name__ == "__main__":
    sys.exit(main())
