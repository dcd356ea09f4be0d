"""Cost against the alternatives: accelstats scrape vs the NVML floor vs nvidia-smi.

For each case (G GPUs, N containers: ``scrape.build_host``'s synthetic cgroup v1 tree) it measures,
interleaved round by round in one process so that all three see the same machine state:

(a) **accelstats**: one full scrape, ``generate_latest`` on the exporter's registry (collection:
    the NVML pass on the backend's worker thread + the cgroup walk and attribution; rendering;
    encoding);
(b) **the NVML floor**: the NVML calls of one steady scrape, timed alone. The NVML object is wrapped
    (``load.RecordingNVML``) and every call the scrape's NVML worker thread (``accelstats-nvml``,
    collectors/nvidia.py) makes during one collection is recorded; the floor replays exactly that
    sequence, same functions, same handles and arguments, against the same backend, with the
    sample timestamps of ``nvmlDeviceGetSamples`` / ``nvmlDeviceGetProcessUtilization`` moved
    forward as the backend moves them. A collection that refreshes the slow values (every 10 s)
    is not used as the sequence; medians of (a) hardly ever include one either;
(c) **nvidia-smi**: ``nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits`` spawned once
    per scrape and its CSV parsed, as exporters that shell out to it do (fields: telegraf's
    ``nvidia_smi`` input's query). Only with ``--live`` and where ``nvidia-smi`` exists; otherwise
    the reason is printed and nothing is measured;
(d) CPU per scrape: ``time.process_time`` around (a) and (b) (every thread of this process: the
    NVML worker included, the background PCIe and XID threads too), ``getrusage(RUSAGE_CHILDREN)``
    around (c); and the RSS of a real ``accelstats serve`` for the first case, idle after start-up
    and after one scrape.

Without ``--live`` NVML is the replay of the H200 capture, which answers in microseconds: the ratio
then measures accelstats' own Python work against an almost free floor. ``--live`` uses the real
NVML (pynvml) of this host: the run for the H200 machine, where the target is accelstats / floor
≤ 2 (p50) for 1 GPU x 10 containers; cases with more GPUs than the host has are not measured.

The containers are granted the GPUs' minor numbers: 0..G-1 for the replay, and with ``--live`` the
minors NVML reports for GPUs 0..G-1 (read through the same pynvml), since a real GPU's minor need
not be its index. Every container is granted one GPU, so a case in which fewer (or more) containers
hold a GPU measured other work than it says: the run stops with exit status 3.

Usage: ``python3 benchmarks/cost.py [--live] [--rounds 200] [--pause S] [--shared DIR]``. Exit status
1 when ``--live`` and the target is missed, 2 when ``--live`` finds no NVML, 3 when the number of
containers holding a GPU is not the number asked for. Figures go to docs/performance.md.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import http.client
import io
import logging
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from load import RecordingNVML, ServeProcess  # benchmarks/ is sys.path[0] when run as a script
from prometheus_client.exposition import generate_latest
from scrape import build_host, default_shared, loadavg, machine, percentile, write_scenario

from accelstats.manager import AcceleratorManager
from accelstats.settings import Settings
from accelstats.web.exposition import make_registry
from collectors.replay.lib import open_replay

NVML_WORKER = "accelstats-nvml"  # the scrape's NVML thread (collectors/nvidia.py, DeadlineWorker name)
SLOW_CALLS = frozenset({"nvmlDeviceGetBAR1MemoryInfo", "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetFieldValues",
                        "nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetRemappedRows",
                        "nvmlDeviceGetPcieReplayCounter"})  # NvidiaBackend._slow: every slow_interval
# telegraf's nvidia_smi input (plugins/inputs/nvidia_smi README, older versions): a typical per-scrape query
SMI_FIELDS = ("fan.speed,memory.total,memory.used,memory.free,pstate,temperature.gpu,name,uuid,compute_mode,"
              "utilization.gpu,utilization.memory,index")
CASES = ((1, 10), (8, 100))
TARGET = 2.0

Call = tuple[str, tuple[Any, ...], dict[str, Any]]


class Floor:
    """Replays a recorded sequence of NVML calls against ``nvml`` (the unwrapped backend). Errors the
    calls raise (NOT_SUPPORTED on a fan-less GPU, NOT_FOUND for no new samples) are what the scrape
    got too; they are counted in ``errors``, by name."""

    def __init__(self, nvml: Any, calls: list[Call]) -> None:
        self.nvml = nvml
        self.calls = [(getattr(nvml, name), name, args, kwargs) for name, args, kwargs in calls]
        self.timestamps: dict[int, int] = {}  # position in the sequence -> last sample timestamp (µs)
        self.errors: Counter[str] = Counter()

    def __call__(self) -> None:
        """Make every call once, in order."""
        for i, (fn, name, args, kwargs) in enumerate(self.calls):
            if name == "nvmlDeviceGetSamples":
                args = (args[0], args[1], self.timestamps.get(i, args[2]))
            elif name == "nvmlDeviceGetProcessUtilization":
                args = (args[0], self.timestamps.get(i, args[1]))
            try:
                value = fn(*args, **kwargs)
            except self.nvml.NVMLError as exc:
                self.errors[f"{name}: {type(exc).__name__}"] += 1
                continue
            if name == "nvmlDeviceGetSamples" and value[1]:
                self.timestamps[i] = max(s.timeStamp for s in value[1])
            elif name == "nvmlDeviceGetProcessUtilization" and value:
                self.timestamps[i] = max(s.timeStamp for s in value)


def smi_argv() -> tuple[list[str] | None, str]:
    """The nvidia-smi command, and a note: the fields this nvidia-smi does not know are dropped (named
    in the note). (None, why) when there is no nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, "not measured: no nvidia-smi on this machine"
    known = subprocess.run([smi, "--help-query-gpu"], capture_output=True, text=True, timeout=30).stdout
    fields = [f for f in SMI_FIELDS.split(",") if f'"{f}"' in known]
    dropped = [f for f in SMI_FIELDS.split(",") if f not in fields]
    note = f"{len(fields)} fields" + (f" (this nvidia-smi lacks {', '.join(dropped)})" if dropped else "")
    return [smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"], note


def smi_once(argv: list[str]) -> int:
    """Spawn nvidia-smi, parse its CSV; the number of GPU rows. Raises RuntimeError when it fails."""
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {out.returncode}: {out.stderr.strip()[:300]}")
    return len(list(csv.reader(io.StringIO(out.stdout))))


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall ms, CPU ms of this process) for one call of ``fn``."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000, (time.process_time() - c0) * 1000


def timed_child(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall ms, CPU ms of the child processes that ended meanwhile) for one call of ``fn``."""
    r0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    fn()
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (time.perf_counter() - t0) * 1000, (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) * 1000


def record_steady(nvml: RecordingNVML, scrape: Callable[[], object]) -> list[Call]:
    """The NVML calls of one scrape that does not refresh the slow values. Raises RuntimeError when
    the scrape's NVML thread made no call (the thread name changed: see NVML_WORKER)."""
    for _ in range(3):
        with nvml.record(NVML_WORKER) as calls:
            scrape()
        if not calls:
            raise RuntimeError(f"no NVML call on thread {NVML_WORKER!r}: has collectors/nvidia.py renamed it?")
        if not any(name in SLOW_CALLS for name, _, _ in calls):
            return list(calls)
    raise RuntimeError("every recorded scrape refreshed the slow values")


def measure(settings: Settings, nvml: Any, rounds: int, smi: list[str] | None, pause: float = 0.0) -> dict[str, Any]:
    """One case: (a), (b) and, with ``smi``, (c) interleaved for ``rounds`` rounds, (a) and (b) each
    after a ``pause`` of seconds (see the module docstring). Returns the (wall ms, CPU ms) pairs of
    each, the recorded calls and what the last collection held."""
    recorder = RecordingNVML(nvml)
    manager = AcceleratorManager(settings, recorder)
    manager.setup()
    registry = make_registry(manager)
    try:
        size = 0
        for _ in range(3):  # NVML init, enumeration, the first slow read
            size = len(generate_latest(registry))
        calls = record_steady(recorder, lambda: generate_latest(registry))
        floor = Floor(nvml, calls)
        floor()
        a, f, s = [], [], []
        for _ in range(rounds):
            time.sleep(pause)  # before (a) and before (b): each finds the same age of NVML samples
            a.append(timed(lambda: generate_latest(registry)))
            time.sleep(pause)
            f.append(timed(floor))
            if smi is not None:
                s.append(timed_child(lambda: smi_once(smi)))
        last = manager.latest
        with_gpu = sum(1 for c in last.containers if c.accelerators) if last is not None else 0
        devices = len(last.snapshot.devices) if last is not None else 0
    finally:
        manager.destroy()
        manager.close()
    return {"a": a, "floor": f, "smi": s, "calls": calls, "floor_errors": floor.errors, "bytes": size,
            "with_gpu": with_gpu, "devices": devices}


def idle_rss(settings: Settings, workdir: Path) -> tuple[float, float]:
    """RSS (MiB) of a real ``accelstats serve`` for ``settings``: 2 s after it answered /healthz (it
    collects once at start-up), and 2 s after one more scrape."""
    with ServeProcess(settings, workdir) as server:
        time.sleep(2)
        before = server.ps.memory_info().rss / 2**20
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        try:
            conn.request("GET", "/metrics")
            conn.getresponse().read()
        finally:
            conn.close()
        time.sleep(2)
        return before, server.ps.memory_info().rss / 2**20


def row(label: str, pairs: list[tuple[float, float]], extra: str = "") -> str:
    """One printed line: p50/p99 wall ms and mean CPU ms per call."""
    wall = sorted(w for w, _ in pairs)
    cpu = sum(c for _, c in pairs) / len(pairs)
    return f"  {label:<44} p50 {percentile(wall, 50):8.3f} ms  p99 {percentile(wall, 99):8.3f} ms  " \
           f"CPU {cpu:7.3f} ms/scrape{extra}"


def gpu_minors(nvml: Any) -> list[int]:
    """The minor numbers (``/dev/nvidia<minor>``) of the GPUs this NVML sees, in NVML index order
    (initialises and shuts down once). Raises ``nvml.NVMLError`` when NVML fails, RuntimeError when a
    GPU has no minor number (a container cannot be granted it)."""
    nvml.nvmlInit()
    try:
        minors = []
        for i in range(int(nvml.nvmlDeviceGetCount())):
            minor = nvml.nvmlDeviceGetMinorNumber(nvml.nvmlDeviceGetHandleByIndex(i))
            if minor is None or not 0 <= int(minor) < 2**20:
                raise RuntimeError(f"GPU {i}: NVML reports no usable minor number ({minor!r})")
            minors.append(int(minor))
        return minors
    finally:
        nvml.nvmlShutdown()


def main() -> int:
    """Measure every case and print the figures; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--live", action="store_true", help="real NVML (pynvml) instead of the replay")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--pause", type=float, default=None,
                        help="seconds between rounds, so that NVML has new utilisation samples as it has for a "
                             "scrape every 15 s (default: 0.25 with --live, 0 for the replay)")
    parser.add_argument("--shared", type=Path, default=default_shared())
    args = parser.parse_args()
    pause = args.pause if args.pause is not None else (0.25 if args.live else 0.0)
    logging.basicConfig(level=logging.WARNING)
    capture = args.shared / "fixtures" / "h200" / "nvidia-smi-q.xml"
    print(f"# {machine()}")
    print(f"# start {loadavg()}; NVML: {'live (pynvml)' if args.live else 'replay of the H200 capture'}; "
          f"{args.rounds} interleaved rounds per case, {pause:g} s apart")
    smi, smi_note = smi_argv()
    if not args.live and smi is not None:
        smi, smi_note = None, "not measured: replay run (nvidia-smi would read the real GPU, not the replay)"
    host_minors: list[int] = []
    if args.live:
        import pynvml

        try:
            host_minors = gpu_minors(pynvml)
        except pynvml.NVMLError as exc:
            print(f"cost.py: error: --live needs NVML: {exc}", file=sys.stderr)
            return 2
        print(f"# live GPU minors (NVML index order): {host_minors}")
    host_gpus = len(host_minors)
    verdict = 0
    for gpus, containers in CASES:
        title = f"{gpus} GPU{'s' if gpus > 1 else ''} x {containers} containers"
        if args.live and gpus > host_gpus:
            print(f"\n{title}: not measured: this host has {host_gpus} GPU(s)")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            settings = build_host(root, None, gpus, containers, host_minors[:gpus] if args.live else None)
            (root / "rootfs").mkdir()
            nvml: Any
            if args.live:
                import pynvml

                nvml, replay = pynvml, None
            else:
                replay = write_scenario(root / "scenario.toml", capture, gpus)
                nvml = open_replay(replay)
            settings = dataclasses.replace(settings, nvml_replay=replay, rootfs=root / "rootfs")
            r = measure(settings, nvml, args.rounds, smi, pause)
            if r["with_gpu"] != containers:
                print(f"cost.py: error: {title}: {r['with_gpu']} containers hold a GPU, {containers} asked for "
                      "(the grants do not name the GPUs accelstats found): the figures would not be that case's",
                      file=sys.stderr)
                return 3
            smi_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # before serve is a child
            ratio = percentile(sorted(w for w, _ in r["a"]), 50) / percentile(sorted(w for w, _ in r["floor"]), 50)
            names = Counter(name for name, _, _ in r["calls"])
            print(f"\n{title} ({r['devices']} devices, {r['with_gpu']} containers holding one; "
                  f"{r['bytes']} bytes of exposition)")
            print(row("(a) accelstats scrape (generate_latest)", r["a"]))
            errors = f"; raised: {dict(r['floor_errors'])}" if r["floor_errors"] else ""
            print(row(f"(b) NVML floor ({len(r['calls'])} calls alone)", r["floor"], errors))
            if r["smi"]:
                print(row(f"(c) nvidia-smi --query-gpu, {smi_note}", r["smi"], " (child CPU)"))
            else:
                print(f"  (c) nvidia-smi --query-gpu: {smi_note}")
            print(f"  ratio accelstats / floor (p50): {ratio:.2f}")
            listed = ", ".join(f"{n.removeprefix('nvmlDevice')} x{c}" for n, c in names.items())
            print(f"  floor calls: {listed}")
            if args.live and (gpus, containers) == CASES[0]:
                met = ratio <= TARGET
                print(f"  target accelstats / floor <= {TARGET:g} for 1 GPU x 10 containers: "
                      f"{'met' if met else 'MISSED'}")
                verdict = 0 if met else 1
            if (gpus, containers) == CASES[0]:
                before, after = idle_rss(settings, root)
                print(f"  accelstats serve RSS: {before:.1f} MiB idle after start-up, {after:.1f} MiB after a scrape")
            if r["smi"]:
                print(f"  nvidia-smi peak RSS (largest child so far): {smi_peak:.1f} MiB")
    print(f"\n# end {loadavg()}")
    return verdict


if __name__ == "__main__":
    sys.exit(main())
