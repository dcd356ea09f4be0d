"""On a GPU host: does an MPS client set up exactly as the Nomad plugin's reservation says reach the
control daemon? (scripts/gpu-check.sh runs it; docs/gpu-check.md records the answer.)

Usage: ``python scripts/mps_reservation_check.py <plugin binary> <mps root> <out dir>`` (as root, from
the repository root, with ``tests`` on PYTHONPATH). It launches the plugin as a Nomad client does, with
one MPS resource (2 replicas) on every GPU, reserves one replica through one ``device`` block, and
starts a CUDA client (torch) in a mount namespace of its own — what a container's mount setup is —
with the reservation's env and mounts applied, in three variants:

* ``reservation``: a private tmpfs on ``/dev/shm`` (as a container has), then the reservation's
  mounts (the pipe dir at its own path, the daemon's ``/dev/shm`` over the private one);
* ``private-shm``: the same without the reservation's ``/dev/shm`` mount (what the plugin did
  before: expected not to reach the server, which settles whether MPS needs the shared ``/dev/shm``);
* ``raw_exec``: env only, no namespace (Nomad's raw_exec applies no mounts).

A variant passes when the client's PID shows in the control daemon's ``ps`` while it holds GPU
memory. Prints one Markdown line per variant; exit 0 when ``reservation`` and ``raw_exec`` pass.
The daemon is stopped with ``accelstats mps stop`` at the end; compute modes are never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from support.nomadclient.ctymsgpack import encode_for_spec
from support.nomadclient.launcher import PluginProcess

STAGE = "/run/accelstats-shm-stage"  # where a client's namespace keeps the host's /dev/shm reachable
CLIENT = ("import os, sys, time, torch; x = torch.ones(1 << 26, device='cuda'); torch.cuda.synchronize(); "
          "open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(30)")


def client_command(variant: str, envs: dict[str, str], mounts: list[tuple[str, str]], ready: Path) -> list[str]:
    """The argv of one client variant (module docstring): ``envs`` and ``mounts`` ((task path, host
    path)) from the reservation; the client writes its PID to ``ready`` once it holds GPU memory."""
    py = [sys.executable, "-c", CLIENT, str(ready)]
    env = ["env", *(f"{k}={v}" for k, v in envs.items())]
    if variant == "raw_exec":
        return [*env, *py]
    # the host's /dev/shm is staged before the private tmpfs covers it (a container runtime binds
    # host paths from outside the container's mount tree, so the source is still the host's)
    steps = [f"mkdir -p {STAGE}", f"mount --bind /dev/shm {STAGE}", "mount -t tmpfs -o size=64m tmpfs /dev/shm"]
    for task, host in mounts:
        if variant == "private-shm" and task == "/dev/shm":
            continue
        source = STAGE if host == "/dev/shm" else host
        steps.append(f"mkdir -p {shlex.quote(task)} && mount --bind {shlex.quote(source)} {shlex.quote(task)}")
    steps.append("exec " + " ".join(shlex.quote(a) for a in [*env, *py]))
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", " && ".join(steps)]


def reached(pipe: str, ready: Path, proc: subprocess.Popen[bytes], out: Path) -> tuple[bool, str]:
    """(whether the client's PID is in the control daemon's ``ps`` answer in ``pipe``, what was seen),
    after waiting up to 60 s for the client to hold GPU memory (``ready``)."""
    for _ in range(120):
        if (ready.exists() and ready.read_text().strip()) or proc.poll() is not None:
            break
        time.sleep(0.5)
    if not ready.exists():
        return False, f"client did not get GPU memory (exit {proc.poll()}; log {out})"
    pid = ready.read_text().strip()
    ps = subprocess.run(["nvidia-cuda-mps-control"], input="ps\n", capture_output=True, text=True, timeout=30,
                        env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe}, check=False)
    rows = [line.split() for line in ps.stdout.splitlines()[1:]]
    return any(r and r[0] == pid for r in rows), f"client pid {pid}; daemon ps: {ps.stdout.strip()[:300]!r}"


def main() -> int:
    """Run the three variants and print the summary; 0 when the reservation and raw_exec variants
    reached the daemon and it stopped cleanly."""
    binary, root, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    config: dict[str, object] = {"fingerprint_period": "1m",
                                 "mps": {"root": str(root), "resource": [{"name": "nomad", "replicas": 2}]}}
    if os.environ.get("ACCELSTATS_CHECK_REPLAY"):  # a dry run of this script without a GPU
        config["nvml_replay"] = os.environ["ACCELSTATS_CHECK_REPLAY"]
    results: dict[str, tuple[bool, str]] = {}
    with PluginProcess(binary) as plugin:
        plugin.set_config(encode_for_spec(plugin.config_schema().spec, config))
        groups = plugin.fingerprint().read(timeout=60).device_group
        replica = next(d.ID for g in groups if g.device_type == "mps" for d in g.devices if d.healthy)
        task = plugin.reserve_task([[replica]], timeout=30)
        (out / "mps-reservation.json").write_text(json.dumps({"envs": task.envs, "mounts": task.mounts}, indent=1))
        pipe = task.envs["CUDA_MPS_PIPE_DIRECTORY"]
        for variant in ("reservation", "private-shm", "raw_exec"):
            ready = out / f"mps-client-{variant}.pid"
            log = out / f"mps-client-{variant}.log"
            with log.open("wb") as sink:
                proc = subprocess.Popen(client_command(variant, task.envs, [(t, h) for t, h, _ in task.mounts], ready),
                                        stdout=sink, stderr=subprocess.STDOUT)
                try:
                    results[variant] = reached(pipe, ready, proc, log)
                finally:
                    proc.kill()
                    proc.wait(timeout=30)
    stop_cfg = out / "mps-reservation.toml"
    replay = f'nvml_replay = "{config["nvml_replay"]}"\n' if "nvml_replay" in config else ""
    stop_cfg.write_text(f'{replay}[mps]\nroot = "{root}"\n[[mps.resources]]\nname = "nomad"\nreplicas = 2\n')
    stopped = subprocess.run([sys.executable, "-m", "accelstats", "mps", "stop", "--config", str(stop_cfg)],
                             capture_output=True, text=True, timeout=60, check=False)
    with contextlib.suppress(OSError):
        os.rmdir(STAGE)
    print("\n### An MPS client set up from the plugin's reservation\n")
    print(f"- reservation: env {task.envs}, mounts {task.mounts}")
    for variant, (ok, detail) in results.items():
        expect = "expected not to reach it" if variant == "private-shm" else "must reach it"
        print(f"- {'REACHED' if ok else 'NOT REACHED'} ({expect}): {variant}: {detail}")
    print(f"- mps stop: exit {stopped.returncode} {stopped.stderr.strip()[:300]}")
    return 0 if results["reservation"][0] and results["raw_exec"][0] and stopped.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
