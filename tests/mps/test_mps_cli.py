"""``accelstats mps start|status|stop`` and the MPS families, through the real code path against the
``nvidia-cuda-mps-control`` test double (tests/support/mps_double) and the H200 replay."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

DOUBLE = Path(__file__).resolve().parents[1] / "support" / "mps_double"
H200 = "GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c10"
CID = "c" * 64


@pytest.fixture
def host(tmp_path: Path, fixtures_dir: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """A config with one MPS resource (4 replicas of the replayed H200), PATH with the double first,
    and a fake /proc where PID 4242 is in a docker container. Stops the daemon at the end."""
    proc = tmp_path / "proc"
    (proc / "4242").mkdir(parents=True)
    (proc / "4242" / "cgroup").write_text(f"0::/system.slice/docker-{CID}.scope\n")
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'nvml_replay = "{fixtures_dir / "h200" / "nvidia-smi-q.xml"}"\nproc_root = "{proc}"\n'
                   f'[mps]\nroot = "{tmp_path / "mps"}"\ntimeout = 3\n'
                   '[[mps.resources]]\nname = "nvidia.com/gpu"\nreplicas = 4\n')
    env = {**os.environ, "PATH": f"{DOUBLE}{os.pathsep}{os.environ['PATH']}"}
    yield cfg, env
    run(env, "mps", "stop", "--config", str(cfg))


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "accelstats", *args], env=env, capture_output=True, text=True,
                          timeout=60, check=False)


def test_start_status_dump_stop(host: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    cfg, env = host
    started = run(env, "mps", "start", "--config", str(cfg))
    assert started.returncode == 0, started.stderr
    pipe = tmp_path / "mps" / "nvidia.com" / "gpu" / "pipe"
    assert f"CUDA_MPS_PIPE_DIRECTORY={pipe}" in started.stdout
    (pipe / "double.clients").write_text(json.dumps({"777": [4242, 4343]}))

    status = run(env, "mps", "status", "--json", "--config", str(cfg))
    assert status.returncode == 0, status.stderr
    (row,) = json.loads(status.stdout)
    assert (row["resource"], row["devices"], row["replicas"], row["healthy"]) == ("nvidia.com/gpu", [H200], 4, True)
    assert row["active_thread_percentage"] == 25.0  # 100 // replicas
    assert row["pinned_memory_limit_bytes"] == {H200: 143771 * 2**20 // 4 // 2**20 * 2**20}
    assert row["servers"] == [777]
    assert row["clients"] == [{"server": 777, "pid": 4242, "container": f"/system.slice/docker-{CID}.scope"},
                              {"server": 777, "pid": 4343, "container": ""}]  # 4343: not in a container

    cgroup2 = tmp_path / "cgroup2"  # a cgroup v2 root (no devices.list): process evidence decides
    cgroup2.mkdir()
    (cgroup2 / "cgroup.controllers").touch()
    dump = run(env, "dump", "--config", str(cfg), "--cgroup-root", str(cgroup2))
    assert dump.returncode == 0, dump.stderr
    fams = {f.name: f for f in text_string_to_metric_families(dump.stdout)}
    value = {f: {tuple(s.labels.values()): s.value for s in fams[f].samples} for f in (
        "accelstats_mps_daemon_up", "accelstats_mps_active_thread_ratio", "accelstats_mps_servers",
        "accelstats_mps_clients", "accelstats_mps_pinned_memory_limit_bytes")}
    assert value["accelstats_mps_daemon_up"] == {("nvidia.com/gpu",): 1.0}
    assert value["accelstats_mps_active_thread_ratio"] == {("nvidia.com/gpu",): 0.25}
    assert value["accelstats_mps_servers"] == {("nvidia.com/gpu",): 1.0}
    assert value["accelstats_mps_clients"] == {("nvidia.com/gpu",): 2.0}
    assert value["accelstats_mps_pinned_memory_limit_bytes"] == {("nvidia.com/gpu", H200): 35942 * 2**20}
    # the replay lists no process; the daemon's get_device_client_list names 4242 on its device 0 (the
    # H200): the client counts in its container (4343 is a host process: no container)
    procs = {(s.labels["id"], s.labels["uuid"], s.labels["attribution"]): s.value
             for s in fams["accelstats_container_gpu_processes"].samples}
    assert procs == {(f"/system.slice/docker-{CID}.scope", H200, "process"): 1.0}
    assert "accelstats_container_gpu_memory_used_bytes" not in fams  # the daemon gives no memory: absent, not 0

    stopped = run(env, "mps", "stop", "--config", str(cfg))
    assert stopped.returncode == 0, stopped.stderr
    assert not pipe.exists()
    down = run(env, "dump", "--config", str(cfg))
    assert 'accelstats_mps_daemon_up{resource="nvidia.com/gpu"} 0.0' in down.stdout


def test_replicas_beyond_the_gpu_limit_is_a_clear_error(tmp_path: Path, fixtures_dir: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'nvml_replay = "{fixtures_dir / "h200" / "nvidia-smi-q.xml"}"\n[mps]\nroot = "{tmp_path}"\n'
                   '[[mps.resources]]\nname = "big"\nreplicas = 49\n')
    env = {**os.environ, "PATH": f"{DOUBLE}{os.pathsep}{os.environ['PATH']}"}
    proc = run(env, "mps", "start", "--config", str(cfg))
    assert proc.returncode == 2
    assert "big" in proc.stderr and "48" in proc.stderr and proc.stderr.count("accelstats: error:") == 1


def test_mig_gpu_cannot_be_an_mps_device(tmp_path: Path, fixtures_dir: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'nvml_replay = "{fixtures_dir / "public" / "a100-sxm4-v12.xml"}"\n[mps]\nroot = "{tmp_path}"\n'
                   '[[mps.resources]]\nname = "mig"\nreplicas = 2\n')
    env = {**os.environ, "PATH": f"{DOUBLE}{os.pathsep}{os.environ['PATH']}"}
    proc = run(env, "mps", "start", "--config", str(cfg))
    assert proc.returncode == 2 and "MIG" in proc.stderr and "mig" in proc.stderr


def test_missing_daemon_binary_is_a_clear_error(tmp_path: Path, fixtures_dir: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'nvml_replay = "{fixtures_dir / "h200" / "nvidia-smi-q.xml"}"\n[mps]\nroot = "{tmp_path}"\n'
                   '[[mps.resources]]\nname = "r"\nreplicas = 2\n')
    env = {**os.environ, "PATH": "/nonexistent"}
    proc = run(env, "mps", "start", "--config", str(cfg))
    assert proc.returncode == 2 and "not found" in proc.stderr


@pytest.mark.parametrize("fmt", ["table", "json"])
def test_status_without_a_control_binary_says_why_once(tmp_path: Path, fixtures_dir: Path, fmt: str) -> None:
    """No ``nvidia-cuda-mps-control`` on PATH: every command would fail alike; the reason is said once."""
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'nvml_replay = "{fixtures_dir / "h200" / "nvidia-smi-q.xml"}"\n[mps]\nroot = "{tmp_path}"\n'
                   '[[mps.resources]]\nname = "r"\nreplicas = 2\n')
    env = {**os.environ, "PATH": "/nonexistent"}
    proc = run(env, "mps", "status", "--config", str(cfg), *(["--json"] if fmt == "json" else []))
    assert proc.returncode == 1, proc.stderr
    shown = json.loads(proc.stdout)[0]["reason"] if fmt == "json" else proc.stdout
    assert shown.count("control binary nvidia-cuda-mps-control not found on PATH") == 1, shown


def test_exclusive_process_opt_in_is_set_by_start_and_restored_by_stop(tmp_path: Path, fixtures_dir: Path) -> None:
    """``mps.exclusive_process = true``: ``mps start`` switches the GPU with nvidia-smi (here the double in
    tests/support/mps_double), ``mps stop`` — another process — puts the recorded mode back."""
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'nvml_replay = "{fixtures_dir / "h200" / "nvidia-smi-q.xml"}"\n'
                   f'[mps]\nroot = "{tmp_path / "mps"}"\nexclusive_process = true\n'
                   '[[mps.resources]]\nname = "r"\nreplicas = 2\n')
    state = tmp_path / "smi.json"
    state.write_text(json.dumps({"modes": {H200: "Default"}}))
    env = {**os.environ, "PATH": f"{DOUBLE}{os.pathsep}{os.environ['PATH']}", "NVIDIA_SMI_DOUBLE_STATE": str(state)}
    try:
        started = run(env, "mps", "start", "--config", str(cfg))
        assert started.returncode == 0, started.stderr
        assert json.loads(state.read_text())["modes"] == {H200: "Exclusive_Process"}
    finally:
        stopped = run(env, "mps", "stop", "--config", str(cfg))
    assert stopped.returncode == 0, stopped.stderr
    assert json.loads(state.read_text())["modes"] == {H200: "Default"}
    assert not (tmp_path / "mps" / "r").exists()


def test_stop_and_status_work_while_nvml_is_down_or_a_gpu_is_gone(host: tuple[Path, dict[str, str]],
                                                                  tmp_path: Path, fixtures_dir: Path) -> None:
    """The operator stops a daemon when a GPU fell off the bus or the driver is down: stop and status reach
    it through the pipe directory alone (start still needs NVML, to validate)."""
    cfg, env = host
    assert run(env, "mps", "start", "--config", str(cfg)).returncode == 0
    pipe = tmp_path / "mps" / "nvidia.com" / "gpu" / "pipe"
    down = tmp_path / "down.toml"
    down.write_text(f'[[gpu]]\ncapture = "{fixtures_dir / "h200" / "nvidia-smi-q.xml"}"\n'
                    '[[fault]]\ncall = "nvmlInit"\nerror = "DRIVER_NOT_LOADED"\n')
    first, rest = cfg.read_text().split("\n", 1)
    assert first.startswith("nvml_replay = ")
    nvml_down = tmp_path / "down-config.toml"
    nvml_down.write_text(f'nvml_replay = "{down}"\n{rest}')
    assert run(env, "mps", "start", "--config", str(nvml_down)).returncode == 2  # start validates: NVML needed
    status = run(env, "mps", "status", "--json", "--config", str(nvml_down))
    assert status.returncode == 0, status.stderr
    assert "devices not resolved" in status.stderr
    (row,) = json.loads(status.stdout)
    assert row["healthy"] and row["devices"] == [] and row["pinned_memory_limit_bytes"] == {}
    stopped = run(env, "mps", "stop", "--config", str(nvml_down))
    assert stopped.returncode == 0, stopped.stderr
    assert "stopped 1 MPS control daemon(s): nvidia.com/gpu" in stopped.stdout
    assert not pipe.exists()
    again = run(env, "mps", "stop", "--config", str(nvml_down))
    assert "stopped 0 MPS control daemon(s)" in again.stdout  # nothing ran: it says so


def test_status_exits_1_when_a_daemon_is_down(host: tuple[Path, dict[str, str]]) -> None:
    cfg, env = host
    status = run(env, "mps", "status", "--config", str(cfg))  # never started
    assert status.returncode == 1 and "NO" in status.stdout and "reason:" in status.stdout
    assert status.stdout.count("Cannot find MPS control daemon") == 1  # said once, not once per command
