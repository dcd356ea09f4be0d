"""accelstats beside nvitop-exporter on the same replayed GPU: start-up, CPU per scrape, RSS, SIGTERM.

Both run as processes on the replayed H200 capture, 1 GPU, with accelstats also attributing 10
containers (a cgroup v1 tree, benchmarks/scrape.py ``build_host``). nvitop-exporter (``pip install
nvitop-exporter``; it brings nvitop) runs unchanged: its pynvml is handed the ABI-level replay
(``collectors.replay.lib.open_replay``) before it is imported, and it updates its gauges every
``--interval`` seconds in its own thread, so it is given the scrape interval. For each, in turn:

* exec → the first ``/metrics`` answer with status 200 (ms);
* CPU per scrape: the process's user + system time (``/proc/<pid>/stat``) over ``--scrapes``
  scrapes ``--interval`` seconds apart, divided by the scrapes (ms) — accelstats collects per scrape,
  nvitop-exporter per interval, so both pay for one reading of the GPU per scrape;
* RSS after those scrapes (MiB, ``VmRSS``);
* SIGTERM → exit (ms).

The runs alternate ``--rounds`` times after an untimed round that writes the bytecode (into a
temporary ``PYTHONPYCACHEPREFIX``, as an installed package has it); medians are printed.
Usage: ``python3 benchmarks/peers.py [--rounds 3] [--scrapes 20] [--interval 0.5]``. No pass/fail:
figures for docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # support.ports: the one free_port

from scrape import build_host, default_shared, loadavg, machine
from support.ports import free_port

NVITOP = """import sys
from collectors.replay.lib import open_replay
open_replay(sys.argv[1])
sys.argv = ["nvitop-exporter", "--bind-address", "127.0.0.1", "--port", sys.argv[2], "--interval", sys.argv[3]]
from nvitop_exporter.cli import main
sys.exit(main())
"""



def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (``/proc/<pid>/stat`` fields 14-15, clock ticks).
    Raises OSError when the process is gone."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    """Resident set size of ``pid`` in MiB (``VmRSS`` of ``/proc/<pid>/status``; NaN when absent)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def scrape(port: int) -> bool:
    """One GET of ``http://127.0.0.1:<port>/metrics``, read whole: True for status 200, False for
    anything else or no answer within 5 s."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            answer.read()
            return bool(answer.status == 200)
    except OSError:
        return False


def measure(command: list[str], port: int, scrapes: int, interval: float, env: dict[str, str]) -> dict[str, float]:
    """Start ``command`` (an exporter on ``port``), then the four figures of the module docstring:
    first answer (ms), CPU per scrape over ``scrapes`` scrapes ``interval`` s apart (ms), RSS (MiB),
    SIGTERM to exit (ms). Raises RuntimeError when it never answers within 60 s."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        while not scrape(port):
            if proc.poll() is not None or time.perf_counter() - t0 > 60:
                raise RuntimeError(f"{command[:4]} did not answer (exit {proc.poll()})")
            time.sleep(0.002)
        first = (time.perf_counter() - t0) * 1000
        cpu0 = cpu_seconds(proc.pid)
        for _ in range(scrapes):
            time.sleep(interval)
            scrape(port)
        per_scrape = (cpu_seconds(proc.pid) - cpu0) * 1000 / scrapes
        rss = rss_mib(proc.pid)
        t1 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        stop = (time.perf_counter() - t1) * 1000
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return {"first answer ms": first, "CPU ms per scrape": per_scrape, "RSS MiB": rss, "SIGTERM to exit ms": stop}


def compare(capture: Path, rounds: int, scrapes: int, interval: float) -> dict[str, dict[str, list[float]]]:
    """Alternate both exporters ``rounds`` times (after an untimed round) on ``capture``, 1 GPU, accelstats
    attributing 10 containers; {exporter: {figure: [one value per round]}} (module docstring)."""
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        settings = build_host(Path(tmp), capture, 1, 10)
        scenario = str(settings.nvml_replay)
        # bytecode as an installed package has it (pip compiles at install): cached in a temp dir,
        # filled by a first, untimed round
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
        for round_ in range(rounds + 1):
            port = free_port()
            runs = {
                "accelstats": [sys.executable, "-m", "accelstats", "serve", "--nvml-replay", scenario,
                               "--cgroup-root", str(settings.cgroup_root), "--proc-root", str(settings.proc_root),
                               "--listen", f"127.0.0.1:{port}", "--log-level", "error"],
                "nvitop-exporter": [sys.executable, "-c", NVITOP, scenario, str(port), str(interval)],
            }
            for name, command in runs.items():
                figures = measure(command, port, scrapes if round_ else 1, interval, env)
                for key, value in figures.items():
                    if round_:
                        results.setdefault(name, {}).setdefault(key, []).append(value)
    return results


def main() -> None:
    """Alternate both exporters ``--rounds`` times and print the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scrapes", type=int, default=20)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--shared", type=Path, default=default_shared())
    args = parser.parse_args()
    capture = args.shared / "fixtures" / "h200" / "nvidia-smi-q.xml"
    print(f"# {machine()} {loadavg()} rounds={args.rounds} scrapes={args.scrapes} interval={args.interval}s")
    results = compare(capture, args.rounds, args.scrapes, args.interval)
    keys = list(next(iter(results.values())))
    print(f"{'':<16}" + "".join(f"{k:>22}" for k in keys))
    for name, figures in results.items():
        print(f"{name:<16}" + "".join(f"{statistics.median(figures[k]):>22.2f}" for k in keys))
    a, n = results["accelstats"], results["nvitop-exporter"]
    ratio = statistics.median(a["CPU ms per scrape"]) / statistics.median(n["CPU ms per scrape"])
    print(f"accelstats / nvitop-exporter CPU per scrape: {ratio:.2f}")


if __name__ == "__main__":
    main()
