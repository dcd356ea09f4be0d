"""A request flood in its own process (so that its threads do not share the server's GIL), for
tests/web/test_http_encodings.py and benchmarks/attack.py.

``python3 http_flood.py PORT``, then one line of JSON on stdin: a list with one entry per client thread,
each a list of ``[source address, path, {header: value}]`` that the thread sends one after another, round
and round, each on a new connection to 127.0.0.1:PORT. Prints ``started`` once every thread has had an
answer, runs until the rest of its stdin ends, then prints the answers counted by status (JSON: ``{"200": n, "503": n,
"OSError": n}``) and exits.
"""

from __future__ import annotations

import http.client
import itertools
import json
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from subprocess import PIPE, Popen
from typing import Any

Request = tuple[str, str, dict[str, str]]  # source address, path, headers


def flood(port: int, clients: list[list[Request]], stop: threading.Event, started: threading.Barrier | None,
          counts: Counter[str]) -> list[threading.Thread]:
    """Start one thread per entry of ``clients``; each waits at ``started`` after its first answer."""

    def run(requests: list[Request]) -> None:
        first = True
        for source, path, headers in itertools.cycle(requests):
            if stop.is_set():
                return
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30, source_address=(source, 0))
            try:
                conn.request("GET", path, headers=headers)
                response = conn.getresponse()
                response.read()
                counts[str(response.status)] += 1
            except OSError as exc:
                counts[type(exc).__name__] += 1
            finally:
                conn.close()
            if first and started is not None:
                first = False
                started.wait()

    threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in clients]
    for t in threads:
        t.start()
    return threads


@contextmanager
def flooding(port: int, clients: list[list[Request]]) -> Iterator[Counter[str]]:
    """Run :func:`flood` in a child process while the block runs (entered once every client has had an
    answer); the counter is filled with the child's counts on the way out."""
    counts: Counter[str] = Counter()
    with Popen([sys.executable, __file__, str(port)], stdin=PIPE, stdout=PIPE, text=True) as child:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(json.dumps(clients) + "\n")
        child.stdin.flush()
        line = child.stdout.readline()
        if line.strip() != "started":
            raise RuntimeError(f"the flood did not start: {line!r}")
        try:
            yield counts
        finally:
            child.stdin.close()
            counts.update(json.loads(child.stdout.read() or "{}"))


def main() -> None:
    port, spec = int(sys.argv[1]), json.loads(sys.stdin.readline())
    clients: list[list[Any]] = [[(s, p, h) for s, p, h in c] for c in spec]
    stop = threading.Event()
    counts: Counter[str] = Counter()
    started = threading.Barrier(len(clients) + 1)
    threads = flood(port, clients, stop, started, counts)
    started.wait(60)
    print("started", flush=True)
    sys.stdin.read()
    stop.set()
    for t in threads:
        t.join(35)
    print(json.dumps(dict(counts)), flush=True)


if __name__ == "__main__":
    main()
