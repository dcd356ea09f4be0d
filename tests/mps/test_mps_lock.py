"""``accelstats mps start`` and ``stop`` run at the same time for one resource.

Real parallel processes (``python3 -m accelstats mps start|stop``, the H200 replay, the
``nvidia-cuda-mps-control`` double of tests/support/mps_double first on PATH, as tests/mps/test_mps_cli.py
runs them). Before the per-resource lock, a losing start removed the winner's "stale" pipe dir or
stopped the winner's daemon in its cleanup, and the winner still said "started" with nothing
running. Afterwards, reality is read from ``/proc`` (the daemons whose environment names the
pipe dir), not from what the commands said, and every command's report must match it.

The last tests hold the lock from a process that is then killed (the lock goes with it: a crashed
start never blocks the next one), and have the Nomad plugin lose a start race (it adopts the daemon
the winner started instead of reporting its replicas unhealthy).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from accelstats.mps import daemon as mps_daemon
from accelstats.mps.daemon import Daemon
from accelstats.mps.rules import MpsError, MpsGpu, MpsResource, Root
from accelstats.nomad.mpsshares import PluginMps
from accelstats.settings import MpsResourceSettings, MpsSettings

DOUBLE = Path(__file__).resolve().parents[1] / "support" / "mps_double"
REPO_ROOT = Path(__file__).resolve().parents[2]
H200 = MpsGpu(uuid="GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c10", index=0, memory_total_bytes=143771 * 2**20,
              compute_capability="9.0", mig_enabled=False)
RESOURCE = "nvidia.com/gpu"
STARTS = 6  # parallel starts per round (2 cores here: enough to overlap every start with another)
ROUNDS = 2  # on the code before the lock, 1 round in 3 ended with "started" and no daemon running


def proc_state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(errors="replace")
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()[0]


def daemons(root: Path) -> list[int]:
    """Live control daemons (``… nvidia-cuda-mps-control -d`` processes) whose CUDA_MPS_PIPE_DIRECTORY
    is under ``root``: what really runs, whatever anyone reported."""
    prefix = b"CUDA_MPS_PIPE_DIRECTORY=" + os.fsencode(root)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (any(v.startswith(prefix) for v in environ.split(b"\0")) and b"-d" in argv
                and proc_state(int(entry.name)) not in (None, "Z")):
            found.append(int(entry.name))
    return found


@pytest.fixture
def host(tmp_path: Path, fixtures_dir: Path) -> Iterator[tuple[Path, Path, dict[str, str]]]:
    """(config file, MPS root, environment): one resource of 4 replicas on the replayed H200, the
    double first on PATH. Kills any daemon left under the root at the end."""
    root = tmp_path / "mps"
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'nvml_replay = "{fixtures_dir / "h200" / "nvidia-smi-q.xml"}"\n'
                   f'[mps]\nroot = "{root}"\ntimeout = 5\n'
                   f'[[mps.resources]]\nname = "{RESOURCE}"\nreplicas = 4\n')
    env = {**os.environ, "PATH": f"{DOUBLE}{os.pathsep}{os.environ['PATH']}"}
    yield cfg, root, env
    for pid in daemons(root):
        os.kill(pid, signal.SIGKILL)


def parallel(env: dict[str, str], commands: list[list[str]]) -> list[subprocess.CompletedProcess[str]]:
    """Run ``python3 -m accelstats <command>`` for every command at once; their results, in order."""
    procs = [subprocess.Popen([sys.executable, "-m", "accelstats", *c], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for c in commands]
    out = []
    for argv, p in zip(commands, procs, strict=True):
        stdout, stderr = p.communicate(timeout=120)
        out.append(subprocess.CompletedProcess(argv, p.returncode, stdout, stderr))
    return out


def accelstats(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "accelstats", *args], env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def pipe_dir(root: Path) -> Path:
    return root.joinpath(*RESOURCE.split("/"), "pipe")


def assert_one_healthy_daemon(root: Path, env: dict[str, str]) -> int:
    """Exactly one control daemon runs for the resource, its pid file names it, the start completed
    (``.started``) and it answers with the configured settings (25 % = 100 // 4 replicas). Returns
    its PID."""
    running = daemons(root)
    assert len(running) == 1, f"daemons running: {running}"
    pipe = pipe_dir(root)
    assert (pipe / "nvidia-cuda-mps-control.pid").read_text().strip() == str(running[0])
    assert (pipe.parent / ".started").is_file()
    answer = subprocess.run([str(DOUBLE / "nvidia-cuda-mps-control")], input="get_default_active_thread_percentage\n",
                            env={**env, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)}, capture_output=True, text=True,
                            timeout=30, check=False)
    assert (answer.returncode, answer.stdout.strip()) == (0, "25.0"), answer.stderr
    return running[0]


def assert_nothing_left(root: Path) -> None:
    """No daemon runs and nothing of the resource is left."""
    assert daemons(root) == []
    assert not (root / RESOURCE.split("/")[0]).exists(), sorted(p.name for p in root.rglob("*"))


def wait_gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(proc_state(p) not in (None, "Z") for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.slow  # more than ~5 s: real daemons, deadlines or a soak
def test_parallel_starts_leave_exactly_one_daemon_and_say_so(host: tuple[Path, Path, dict[str, str]]) -> None:
    """Several ``mps start`` at once: one says "started" and its daemon runs; every other one says a
    daemon is already running (exit 2), and nothing it did stopped the winner."""
    cfg, root, env = host
    for round_ in range(ROUNDS):
        results = parallel(env, [["mps", "start", "--config", str(cfg)]] * STARTS)
        winners = [r for r in results if r.returncode == 0]
        losers = [r for r in results if r.returncode != 0]
        assert len(winners) == 1, [(r.returncode, r.stdout, r.stderr) for r in results]
        assert f"started {RESOURCE}: CUDA_MPS_PIPE_DIRECTORY={pipe_dir(root)}" in winners[0].stdout
        for r in losers:
            assert r.returncode == 2 and r.stderr.count("accelstats: error:") == 1, r.stderr
            assert "already running" in r.stderr and "stop it first" in r.stderr, r.stderr
        pid = assert_one_healthy_daemon(root, env)  # the winner's report is true
        stopped = accelstats(env, "mps", "stop", "--config", str(cfg))
        assert stopped.returncode == 0, stopped.stderr
        assert f"stopped 1 MPS control daemon(s): {RESOURCE}" in stopped.stdout, f"round {round_}"
        assert wait_gone([pid])
        assert_nothing_left(root)


@pytest.mark.slow  # more than ~5 s: real daemons, deadlines or a soak
def test_parallel_start_and_stop_agree_with_what_runs(host: tuple[Path, Path, dict[str, str]]) -> None:
    """``mps start`` and ``mps stop`` at once, with and without a daemon running before: they are done
    one after the other, in either order, and what runs afterwards is what that order leaves."""
    cfg, root, env = host
    for round_ in range(ROUNDS):
        # nothing ran before: the start always starts; a daemon runs afterwards unless the stop came second
        start, stop = parallel(env, [["mps", "start", "--config", str(cfg)], ["mps", "stop", "--config", str(cfg)]])
        assert start.returncode == 0 and f"started {RESOURCE}" in start.stdout, (round_, start.stderr)
        assert stop.returncode == 0, stop.stderr
        if f"stopped 1 MPS control daemon(s): {RESOURCE}" in stop.stdout:  # the stop saw the start's daemon:
            assert_nothing_left(root)  # it came second
        if daemons(root):
            assert_one_healthy_daemon(root, env)
        else:
            assert_nothing_left(root)

        # a daemon runs before: either the stop came first and the start started a new one, or the
        # start came first, was refused (one runs already), and the stop stopped it
        if not daemons(root):
            assert accelstats(env, "mps", "start", "--config", str(cfg)).returncode == 0
        before = assert_one_healthy_daemon(root, env)
        start, stop = parallel(env, [["mps", "start", "--config", str(cfg)], ["mps", "stop", "--config", str(cfg)]])
        assert stop.returncode == 0 and f"stopped 1 MPS control daemon(s): {RESOURCE}" in stop.stdout, stop.stderr
        assert wait_gone([before])
        if start.returncode == 0:
            assert f"started {RESOURCE}" in start.stdout
            assert assert_one_healthy_daemon(root, env) != before
        else:
            assert start.returncode == 2 and "already running" in start.stderr, (round_, start.stderr)
            assert_nothing_left(root)
        accelstats(env, "mps", "stop", "--config", str(cfg))
        assert_nothing_left(root)


def test_a_killed_lock_holder_never_blocks_the_next_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While another process holds the resource's lock, a start and a stop wait for it (here 0.3 s, then
    "another process is starting or stopping it"); once that process is killed, the kernel has released
    the lock and the next start goes ahead at once. ``stop_found`` says whether there was a daemon."""
    monkeypatch.setattr(mps_daemon, "LOCK_WAIT_MIN_S", 0.3)
    monkeypatch.setattr(mps_daemon, "LOCK_WAIT_TIMEOUTS", 0)
    root = tmp_path / "mps"
    daemon = Daemon(MpsResource(RESOURCE, 2, (H200.uuid,)), [H200], Root(root),
                    binary=str(DOUBLE / "nvidia-cuda-mps-control"), timeout=5.0)
    code = ("import sys, time; from pathlib import Path; from accelstats.mps.proc import acquire_lock; "
            "acquire_lock(Path(sys.argv[1]), 5.0, True); print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(daemon.lock_file)], cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(MpsError, match="another process is starting or stopping it"):
            daemon.start()
        found, problems = daemon.stop_found()
        assert not found and len(problems) == 1 and "another process is starting or stopping it" in problems[0]
        assert daemons(root) == []
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
    t0 = time.monotonic()
    daemon.start()
    try:
        assert time.monotonic() - t0 < 5.0
        assert daemons(root) == [daemon.pid()]
    finally:
        assert daemon.stop_found() == (True, [])
    assert daemon.stop_found() == (False, [])  # nothing left to stop, and nothing created to find that out
    assert sorted(p.name for p in root.iterdir()) == []


def test_the_plugin_adopts_the_daemon_that_won_a_start_race(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin finds no daemon, and before its start takes the lock an ``accelstats mps start`` (here
    another Daemon object, as another process would) starts one: the plugin's start is refused as
    already running, and the plugin adopts that daemon, healthy, rather than marking its replicas
    unhealthy for the 30 s retry interval."""
    root = tmp_path / "mps"
    double = str(DOUBLE / "nvidia-cuda-mps-control")
    winner = Daemon(MpsResource("shared", 4, (H200.uuid,)), [H200], Root(root), binary=double, timeout=5.0)
    real_health, real_running = Daemon.assert_healthy, Daemon.running
    race = {"checked": False}

    def health(self: Daemon) -> None:
        if self is not winner and not race["checked"]:  # the plugin's first look: nothing answers yet ...
            race["checked"] = True
            winner.start()  # ... and then the other start wins
            raise MpsError("no control daemon yet")
        real_health(self)

    def running(self: Daemon) -> bool:
        if self is not winner and race["checked"] and not race.get("looked"):  # the plugin's look at the
            race["looked"] = True  # process, taken before the winner's daemon was there
            return False
        return real_running(self)

    monkeypatch.setattr(Daemon, "assert_healthy", health)
    monkeypatch.setattr(Daemon, "running", running)
    try:
        plugin = PluginMps(MpsSettings(root=root, timeout=5.0, resources=(MpsResourceSettings("shared", 4),)),
                           binary=double)
        share = plugin.shares([H200])[H200.uuid]
        assert (share.healthy, share.reason) == (True, ""), share.reason
        assert daemons(root) == [winner.pid()]  # the winner's daemon, adopted: not replaced, not stopped
    finally:
        monkeypatch.undo()
        winner.stop()
    assert daemons(root) == []
