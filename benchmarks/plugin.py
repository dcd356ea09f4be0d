"""Nomad plugin costs: exec → handshake time, and CPU per Stats tick for 8 replayed GPUs.

1. Launches ``nomad-device-accelstats`` as a Nomad client does (cookie and go-plugin env) 10 times
   and prints the median and max time from exec to the handshake line (Nomad pays it three times per
   agent start).
2. Starts it once more with 8 H200s replayed (SetConfig with ``nvml_replay``), opens Fingerprint and
   a Stats stream at 1 s, and measures the plugin process's CPU time (user + system, psutil) over
   ``--seconds`` seconds of streaming: printed as % of one core and ms per tick.

``--reserve-storm`` measures instead: with Fingerprint (``fingerprint_period``
1 s) and Stats (1 s) streams open and read, ``--threads`` threads fire Reserve back to back for
``--seconds``: valid ID sets (one GPU, three, all eight), unknown IDs and an empty list, in turn.
Every answer is checked (valid → a reservation naming those GPUs that Nomad's checks accept; bad →
INVALID_ARGUMENT with the reason); printed: Reserves/s, latency p50/p99 per kind, wrong answers,
messages each stream delivered meanwhile, the plugin's CPU and its health afterwards.
``tests/nomad/test_plugin_storm.py`` runs the same storm (:func:`reserve_storm`) as a test.

Usage: ``python3 benchmarks/plugin.py [--seconds 20] [--reserve-storm [--threads 8]] [--shared DIR]``.
Figures go to docs/performance.md.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import msgpack
import psutil
from scrape import default_shared, loadavg, machine, percentile, write_scenario  # benchmarks/ is sys.path[0]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the Nomad client emulator: test support
from support.nomadclient.ctymsgpack import encode_for_spec
from support.nomadclient.launcher import (
    PluginProcess,
    StreamEndedError,
    StreamFailedError,
    StreamHandle,
    StreamTimeoutError,
)
from support.nomadclient.validate import validate_fingerprint, validate_reserve, validate_stats

from accelstats.nomad.proto import base_pb2, base_pb2_grpc, device_pb2, device_pb2_grpc
from accelstats.nomad.server import MAGIC_COOKIE_KEY, MAGIC_COOKIE_VALUE

ENV = {MAGIC_COOKIE_KEY: MAGIC_COOKIE_VALUE, "PLUGIN_MIN_PORT": "10000", "PLUGIN_MAX_PORT": "25000",
       "PLUGIN_PROTOCOL_VERSIONS": "2"}


def launch(binary: str) -> tuple[subprocess.Popen[str], str, float]:
    """Start the plugin; return (process, socket path, seconds from exec to the handshake line)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([binary], env={**os.environ, **ENV}, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    elapsed = time.perf_counter() - t0
    parts = line.split("|")
    if len(parts) != 5 or parts[4] != "grpc":
        proc.kill()
        raise SystemExit(f"bad handshake line: {line!r}")
    return proc, parts[3], elapsed


# --------------------------------------------------------------------------- Reserve storm


@dataclass
class StormResult:
    """What a Reserve storm got: per kind (``valid``, ``unknown``, ``empty``) the number of correct
    answers and their latencies (seconds); every wrong answer, described; the storm's wall time."""

    correct: Counter[str] = field(default_factory=Counter)
    latencies: dict[str, list[float]] = field(default_factory=dict)
    wrong: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def total(self) -> int:
        """Reserves answered (correctly or not)."""
        return sum(self.correct.values()) + len(self.wrong)


def check_reserve(kind: str, ids: Sequence[str], call: Callable[[], Any]) -> str:
    """Make one Reserve (``call``) and judge its answer for ``ids`` of ``kind``: "" when correct, else
    what was wrong. valid: a ReserveResponse Nomad accepts (validate.validate_reserve) whose
    CUDA_VISIBLE_DEVICES lists ``ids`` in order; unknown: INVALID_ARGUMENT naming the first ID;
    empty: INVALID_ARGUMENT "no device IDs" (spec/nomad-plugin.md §2, plugin.py Reserve)."""
    try:
        res = call()
    except grpc.RpcError as err:
        code, details = err.code().name, err.details()
        expected = {"unknown": f'unknown device "{ids[0]}"' if ids else "", "empty": "no device IDs"}.get(kind)
        if expected is None:
            return f"valid {list(ids)}: {code}: {details}"
        if code != "INVALID_ARGUMENT" or expected not in details:
            return f"{kind} {list(ids)}: {code}: {details} (expected INVALID_ARGUMENT with {expected!r})"
        return ""
    if kind != "valid":
        return f"{kind} {list(ids)}: answered a reservation instead of INVALID_ARGUMENT"
    problems = validate_reserve(res)
    visible = res.container_res.envs.get("CUDA_VISIBLE_DEVICES")
    if problems or visible != ",".join(ids):
        return f"valid {list(ids)}: CUDA_VISIBLE_DEVICES {visible!r}, problems {problems}"
    return ""


def reserve_storm(plugin: PluginProcess, valid: Sequence[Sequence[str]], threads: int, seconds: float) -> StormResult:
    """``threads`` threads fire Reserve on ``plugin`` back to back for ``seconds``, each going round the
    cases (every ID set of ``valid``, two unknown IDs, an empty list) from its own starting point;
    every answer is judged by :func:`check_reserve`. A call that hangs past 10 s is a wrong answer
    (DEADLINE_EXCEEDED)."""
    cases: list[tuple[str, list[str]]] = [("valid", list(ids)) for ids in valid]
    cases += [("unknown", ["GPU-00000000-0000-0000-0000-000000000000"]), ("unknown", ["../../etc/passwd"]),
              ("empty", [])]
    result = StormResult(latencies={kind: [] for kind, _ in cases})
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def fire(start: int) -> None:
        n = start
        while time.monotonic() < end:
            kind, ids = cases[n % len(cases)]
            n += 1
            t0 = time.perf_counter()
            wrong = check_reserve(kind, ids, functools.partial(plugin.reserve, ids, timeout=10))
            elapsed = time.perf_counter() - t0
            with lock:
                if wrong:
                    result.wrong.append(wrong)
                else:
                    result.correct[kind] += 1
                    result.latencies[kind].append(elapsed)

    workers = [threading.Thread(target=fire, args=(i,), name=f"reserve-{i}", daemon=True) for i in range(threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    result.seconds = time.perf_counter() - t0
    return result


class StreamCounter:
    """Reads a plugin stream in a thread, as Nomad does, and keeps (monotonic time, problems) per
    message (``validate`` checks each one); ``failure`` holds why the stream stopped, if it did. A
    context manager: leaving it stops reading (the stream stays open for later reads)."""

    def __init__(self, handle: StreamHandle, validate: Callable[[Any], list[str]]) -> None:
        self.handle = handle
        self.validate = validate
        self.messages: list[tuple[float, list[str]]] = []
        self.failure = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name=f"count-{handle.name}", daemon=True)

    def __enter__(self) -> StreamCounter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                message = self.handle.read(timeout=0.2)
            except StreamTimeoutError:
                continue
            except (StreamEndedError, StreamFailedError) as exc:
                self.failure = str(exc)
                return
            self.messages.append((time.monotonic(), self.validate(message)))

    def between(self, start: float, end: float) -> int:
        """Messages that arrived between two ``time.monotonic()`` readings."""
        return sum(1 for t, _ in self.messages if start <= t <= end)

    @property
    def problems(self) -> list[str]:
        """Every validation problem of every message read."""
        return [p for _, ps in self.messages for p in ps]


def storm_config(scenario: Path) -> dict[str, Any]:
    """The plugin config of the storm: the replay, a full fingerprint every second (so the
    Fingerprint stream delivers one per second without a device change)."""
    return {"fingerprint_period": "1s", "nvml_replay": str(scenario)}


def run_reserve_storm(binary: str, capture: Path, threads: int, seconds: float) -> None:
    """The ``--reserve-storm`` benchmark: 8 replayed H200s, streams at 1 s, the storm; prints figures."""
    with tempfile.TemporaryDirectory() as tmp, PluginProcess(binary) as plugin:
        scenario = write_scenario(Path(tmp) / "eight.toml", capture, 8)
        plugin.set_config(encode_for_spec(plugin.config_schema().spec, storm_config(scenario)))
        fingerprint = plugin.fingerprint()
        first = fingerprint.read(timeout=30)
        gpus = sorted(d.ID for g in first.device_group for d in g.devices)
        stats = plugin.stats(1.0)
        stats.read(timeout=30)
        p, me = psutil.Process(plugin.pid), psutil.Process()
        with StreamCounter(fingerprint, validate_fingerprint) as fp, StreamCounter(stats, validate_stats) as st:
            cpu0, mine0, t0 = sum(p.cpu_times()[:2]), sum(me.cpu_times()[:2]), time.monotonic()
            r = reserve_storm(plugin, [gpus[:1], gpus[2:5], gpus], threads, seconds)
            t1 = time.monotonic()
            cpu, mine = sum(p.cpu_times()[:2]) - cpu0, sum(me.cpu_times()[:2]) - mine0
        every = sorted(x for v in r.latencies.values() for x in v)
        print(f"Reserve storm: {threads} threads x {r.seconds:.1f} s, {len(gpus)} replayed GPUs: {r.total} Reserves = "
              f"{r.total / r.seconds:.0f}/s; wrong answers {len(r.wrong)}{': ' + r.wrong[0] if r.wrong else ''}")
        if every:
            print(f"  latency all: p50 {percentile(every, 50) * 1000:.2f} ms, "
                  f"p99 {percentile(every, 99) * 1000:.2f} ms")
        for kind, lat in r.latencies.items():
            lat.sort()
            if lat:
                print(f"  {kind:<8} {r.correct[kind]:>6} correct, p50 {percentile(lat, 50) * 1000:.2f} ms, "
                      f"p99 {percentile(lat, 99) * 1000:.2f} ms")
        print(f"  meanwhile: Fingerprint {fp.between(t0, t1)} messages (period 1 s), Stats {st.between(t0, t1)} "
              f"(interval 1 s), problems {fp.problems + st.problems}, stream failures "
              f"{[f for f in (fp.failure, st.failure) if f]}")
        print(f"  CPU: plugin {cpu:.1f} s = {cpu / (t1 - t0):.2f} cores, the Reserve threads (this process) "
              f"{mine:.1f} s = {mine / (t1 - t0):.2f} cores; health afterwards {plugin.health()}; "
              f"hclog problems {plugin.hclog_problems()}")


def main() -> None:
    """Run both measurements (or, with ``--reserve-storm``, the storm) and print them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--reserve-storm", action="store_true", help="measure a Reserve storm instead")
    parser.add_argument("--threads", type=int, default=8, help="Reserve threads of the storm")
    parser.add_argument("--shared", type=Path, default=default_shared())
    args = parser.parse_args()
    binary = shutil.which("nomad-device-accelstats") or sys.exit("nomad-device-accelstats not on PATH (pip install .)")
    if args.reserve_storm:
        print(f"# {machine()}\n# start {loadavg()}")
        run_reserve_storm(binary, args.shared / "fixtures" / "h200" / "nvidia-smi-q.xml", args.threads, args.seconds)
        print(f"# end {loadavg()}")
        return
    print(f"# {time.strftime('%Y-%m-%d')} {platform.node()} {platform.machine()} cpus={os.cpu_count()} "
          f"python={platform.python_version()}")
    times = []
    for _ in range(10):
        proc, _, elapsed = launch(binary)
        times.append(elapsed)
        proc.terminate()
        proc.wait(10)
    print(f"exec -> handshake: median {statistics.median(times) * 1000:.0f} ms, max {max(times) * 1000:.0f} ms (n=10)")

    capture = args.shared / "fixtures" / "h200" / "nvidia-smi-q.xml"
    with tempfile.TemporaryDirectory() as tmp:
        scenario = Path(tmp) / "eight.toml"
        scenario.write_text("".join(
            f'[[gpu]]\ncapture = "{capture}"\nindex = {i}\nminor = {i}\nuuid = "GPU-{i:08x}-0000-4000-8000-'
            f'{secrets.token_hex(6)}"\n' for i in range(8)))
        proc, path, _ = launch(binary)
        try:
            channel = grpc.insecure_channel(f"unix:{path}")
            config = {"enabled": True, "ignored_gpu_ids": [], "fingerprint_period": "1m", "metrics_listen": "",
                      "nvml_replay": str(scenario), "cgroup_root": "/sys/fs/cgroup", "proc_root": "/proc",
                      "file_devices": None}
            base_pb2_grpc.BasePluginStub(channel).SetConfig(
                base_pb2.SetConfigRequest(msgpack_config=msgpack.packb(config), plugin_api_version="v0.1.0"))
            stub = device_pb2_grpc.DevicePluginStub(channel)
            fingerprint = stub.Fingerprint(device_pb2.FingerprintRequest())
            next(fingerprint)
            request = device_pb2.StatsRequest()
            request.collection_interval.FromSeconds(1)
            stats = stub.Stats(request)
            next(stats)  # warm
            p = psutil.Process(proc.pid)
            cpu0, t0, ticks = sum(p.cpu_times()[:2]), time.perf_counter(), 0
            while time.perf_counter() - t0 < args.seconds:
                message = next(stats)
                ticks += 1
                assert sum(len(g.instance_stats) for g in message.groups) == 8
            cpu = sum(p.cpu_times()[:2]) - cpu0
            wall = time.perf_counter() - t0
            print(f"Stats at 1 s, 8 replayed GPUs: {ticks} ticks in {wall:.1f} s, plugin CPU {cpu:.3f} s = "
                  f"{100 * cpu / wall:.2f} % of one core, {1000 * cpu / ticks:.1f} ms per tick "
                  f"(the Fingerprint stream's 5 s health checks included)")
            fingerprint.cancel()
            stats.cancel()
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
