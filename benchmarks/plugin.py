"""Nomad plugin costs: exec → handshake time, and CPU per Stats tick for 8 replayed GPUs.

1. Launches ``nomad-device-accelstats`` as a Nomad client does (cookie and go-plugin env) 10 times
   and prints the median and max time from exec to the handshake line (Nomad pays it three times per
   agent start).
2. Starts it once more with 8 H200s replayed (SetConfig with ``nvml_replay``), opens Fingerprint and
   a Stats stream at 1 s, and measures the plugin process's CPU time (user + system, psutil) over
   ``--seconds`` seconds of streaming: printed as % of one core and ms per tick.

Usage: ``python3 benchmarks/plugin.py [--seconds 20] [--shared DIR]``. Figures go to docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import msgpack
import psutil
from scrape import default_shared  # benchmarks/ is sys.path[0] when run as a script

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


def main() -> None:
    """Run both measurements and print them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--shared", type=Path, default=default_shared())
    args = parser.parse_args()
    binary = shutil.which("nomad-device-accelstats") or sys.exit("nomad-device-accelstats not on PATH (pip install .)")
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
