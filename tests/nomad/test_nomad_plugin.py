"""The installed ``nomad-device-accelstats`` driven as a Nomad client drives it (spec/nomad-plugin.md).

Every test launches the console script as a subprocess over a real unix-socket gRPC connection
(``support.nomadclient.launcher``): handshake, the three processes A/B/C of an agent start, config
encoded as go-cty encodes it, and Nomad's validation of every message.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from support.nomadclient.ctymsgpack import encode_for_spec
from support.nomadclient.launcher import PluginProcess, StreamTimeoutError, run_lifecycle
from support.nomadclient.validate import validate_fingerprint, validate_reserve, validate_stats
from support.plugin_util import H200, binary, config, mps_stop
from support.ports import free_port

MPS_DOUBLE = Path(__file__).resolve().parents[1] / "support" / "mps_double"  # nvidia-smi, MPS control

LOST = "GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c11"




@pytest.fixture
def scenario(tmp_path: Path, fixtures_dir: Path) -> Path:
    """An H200, a second H200 that is lost after 10 calls, and the A100 with 4 MIG instances."""
    h200 = fixtures_dir / "h200" / "nvidia-smi-q.xml"
    a100 = fixtures_dir / "public" / "a100-sxm4-v12.xml"
    path = tmp_path / "fleet.toml"
    path.write_text(f"""
[[gpu]]
capture = "{h200}"
minor = 0
[[gpu]]
capture = "{h200}"
minor = 1
uuid = "{LOST}"
pci_bus_id = "00000000:00:07.0"
[[gpu]]
capture = "{a100}"
minor = 2
[[fault]]
gpu = 1
call = "nvmlDeviceGetMemoryInfo"
error = "GPU_IS_LOST"
after_calls = 1
""")
    return path


@pytest.fixture
def devdir(tmp_path: Path) -> Path:
    d = tmp_path / "devices"
    d.mkdir()
    return d




def test_agent_start_a_b_c_with_gpus_mig_and_files(scenario: Path, devdir: Path) -> None:
    (devdir / "dev0").write_text("hello")
    report = run_lifecycle(binary(), config(scenario, devdir), stats_messages=2, reserve_ids="fingerprinted",
                           socket_dir=True)
    assert report.ok, report.problems
    for name in "ABC":
        p = report.process(name)
        assert p.shutdown["exited_by_itself"] and p.exec_to_handshake_s < 10
        assert p.health == "SERVING" and p.stdout_after_handshake == []
    c = report.process("C")
    fingerprint = [m["message"] for m in c.messages if m["call"].startswith("Fingerprint")][-1]
    groups = {(g["vendor"], g["device_type"], g["device_name"]): g for g in fingerprint["device_group"]}
    assert set(groups) == {("nvidia", "gpu", "NVIDIA H200"), ("nomad", "file", "mock"),
                           ("nvidia", "gpu", "NVIDIA A100-SXM4-80GB MIG 1g.20gb")}  # the MIG parent is not offered
    assert len(groups[("nvidia", "gpu", "NVIDIA A100-SXM4-80GB MIG 1g.20gb")]["devices"]) == 4
    h200 = groups[("nvidia", "gpu", "NVIDIA H200")]
    assert h200["attributes"]["memory"]["unit"] == "MiB" and int(h200["attributes"]["memory"]["int_val"]) == 143771
    assert {d["ID"] for d in h200["devices"]} == {H200, LOST}


@pytest.mark.slow  # more than ~5 s: real daemons, deadlines or a soak
def test_lost_gpu_is_unhealthy_and_the_stream_goes_on(scenario: Path) -> None:
    with PluginProcess(binary()) as plugin:
        spec = plugin.config_schema().spec
        plugin.set_config(encode_for_spec(spec, config(scenario)))
        stream = plugin.fingerprint()
        deadline = time.monotonic() + 20
        lost = None
        while time.monotonic() < deadline:
            message = stream.read(timeout=15)  # health is re-checked every 5 s
            assert validate_fingerprint(message) == []
            devices = {d.ID: d for g in message.device_group for d in g.devices}
            if not devices[LOST].healthy:
                lost = devices[LOST]
                break
        assert lost is not None, "the lost GPU never turned unhealthy"
        assert "GPU_IS_LOST" in lost.health_description and "reset" in lost.health_description
        assert devices[H200].healthy
        stats = plugin.stats(1.0).read(timeout=10)
        assert validate_stats(stats) == []
        h200 = next(g for g in stats.groups if g.name == "NVIDIA H200")
        lost_stats = h200.instance_stats[LOST].stats.attributes["GPU utilization"]
        assert lost_stats.string_val.value == "N/A" and lost_stats.unit == "%"  # reported per device, not fatal
        power = h200.instance_stats[H200].stats.attributes["Power usage"]
        assert power.unit == "W" and 100 < power.float_numerator_val.value < 200  # watts, not milliwatts
        assert stream.open


@pytest.mark.parametrize(("cfg", "field"), [
    ({"fingerprint_period": "5x"}, "fingerprint_period"),
    ({"fingerprint_period": "-1s"}, "fingerprint_period"),
    ({"file_devices": {"dir": "/tmp", "list_period": "soon"}}, "file_devices.list_period"),
    ({"file_devices": {"dir": "/tmp", "unhealthy_perm": "777"}}, "file_devices.unhealthy_perm"),
    ({"metrics_listen": "nowhere"}, "metrics_listen"),
])
def test_bad_config_is_invalid_argument_naming_the_field(cfg: dict[str, Any], field: str) -> None:
    with PluginProcess(binary()) as plugin:
        spec = plugin.config_schema().spec
        with pytest.raises(Exception) as err:
            plugin.set_config(encode_for_spec(spec, cfg))
        assert err.value.code().name == "INVALID_ARGUMENT"  # type: ignore[attr-defined]
        assert field in err.value.details()  # type: ignore[attr-defined]


def test_unknown_config_key_is_invalid_argument() -> None:
    import msgpack

    with PluginProcess(binary()) as plugin:
        with pytest.raises(Exception) as err:
            plugin.set_config(msgpack.packb({"enabled": True, "fingerprint_periode": "1m"}))
        assert err.value.code().name == "INVALID_ARGUMENT"  # type: ignore[attr-defined]
        assert "fingerprint_periode" in err.value.details()  # type: ignore[attr-defined]


@pytest.mark.parametrize(("ids", "message"), [
    ([], "no device IDs"),
    (["nope"], 'unknown device "nope"'),
    (["../../etc/passwd"], 'unknown device "../../etc/passwd"'),
])
def test_bad_reserve_is_invalid_argument(devdir: Path, ids: list[str], message: str) -> None:
    (devdir / "dev0").write_text("")
    with PluginProcess(binary()) as plugin:
        plugin.set_config(encode_for_spec(plugin.config_schema().spec, config(devdir=devdir)))
        plugin.fingerprint().read(timeout=10)
        with pytest.raises(Exception) as err:
            plugin.reserve(ids, timeout=10)
        assert err.value.code().name == "INVALID_ARGUMENT"  # type: ignore[attr-defined]
        assert message in err.value.details()  # type: ignore[attr-defined]


def test_reserve_gpus_gives_env_and_device_nodes_for_any_driver(scenario: Path, devdir: Path) -> None:
    (devdir / "dev0").write_text("")
    with PluginProcess(binary()) as plugin:
        plugin.set_config(encode_for_spec(plugin.config_schema().spec, config(scenario, devdir)))
        plugin.fingerprint().read(timeout=10)
        mig = next(g for g in plugin.fingerprint().read(timeout=10).device_group if "MIG" in g.device_name)
        mig_ids = [d.ID for d in mig.devices][:2]
        res = plugin.reserve([H200, *mig_ids], timeout=10)
        assert validate_reserve(res) == []
        c = res.container_res
        # CUDA_VISIBLE_DEVICES only, by default: NVIDIA_VISIBLE_DEVICES would make Nomad's docker driver
        # require the nvidia runtime (drivers/docker/driver.go:1065-1073)
        assert dict(c.envs) == {"CUDA_VISIBLE_DEVICES": ",".join([H200, *mig_ids])}  # request order
        nodes = [d.host_path for d in c.devices]
        uvm = [n for n in ("/dev/nvidia-uvm", "/dev/nvidia-uvm-tools") if os.path.exists(n)]  # only when loaded
        assert nodes == ["/dev/nvidia0", "/dev/nvidia2", "/dev/nvidiactl", *uvm]
        assert all(d.task_path == d.host_path and d.permissions == "rw" for d in c.devices)
        files = plugin.reserve(["dev0"], timeout=10).container_res
        assert [(m.task_path, m.host_path, m.read_only) for m in files.mounts] == [
            ("/tmp/task-mounts/dev0", str(devdir / "dev0"), False)]


def test_file_device_changes_reach_fingerprint_within_list_period(devdir: Path) -> None:
    with PluginProcess(binary()) as plugin:
        plugin.set_config(encode_for_spec(plugin.config_schema().spec, config(devdir=devdir)))
        stream = plugin.fingerprint()

        def next_files(expect: object) -> list[tuple[str, bool]]:
            deadline = time.monotonic() + 5
            while True:
                message = stream.read(timeout=max(0.1, deadline - time.monotonic()))
                assert validate_fingerprint(message) == []
                got = [(d.ID, d.healthy) for g in message.device_group for d in g.devices]
                if got == expect or time.monotonic() > deadline:
                    return got

        assert next_files([]) == []  # an empty directory still yields a first message
        (devdir / "a").write_text("x")
        assert next_files([("a", True)]) == [("a", True)]
        os.chmod(devdir / "a", 0o777)
        assert next_files([("a", False)]) == [("a", False)]
        (devdir / "a").unlink()
        assert next_files([]) == []  # removing the last file sends the empty list
        with pytest.raises(StreamTimeoutError):
            stream.read(timeout=0.8)  # nothing changed: nothing sent


def test_metrics_listen_serves_the_same_snapshot(scenario: Path, unused_port: int) -> None:
    with PluginProcess(binary()) as plugin:
        plugin.set_config(encode_for_spec(plugin.config_schema().spec,
                                          config(scenario, metrics_listen=f"127.0.0.1:{unused_port}")))
        plugin.fingerprint().read(timeout=10)
        with urllib.request.urlopen(f"http://127.0.0.1:{unused_port}/metrics", timeout=10) as r:
            body = r.read().decode()
        assert f'accelstats_gpu_up{{gpu="0",model="NVIDIA H200",uuid="{H200}"}} 1.0' in body
        assert 'source="replay"' in body


def test_metrics_listen_accounts_per_allocation(tmp_path: Path, fixtures_dir: Path, unused_port: int) -> None:
    """With ``metrics_listen`` the plugin publishes the accounting counters per allocation: the task's
    cgroup (Nomad's ``<alloc>.<task>.scope``), with the allocation in ``accelstats_container_info``."""
    alloc, task = "8f0a2c1e-7d4b-4a6e-9c3f-1b2d3e4f5a6b", "train"
    cgroup = f"/nomad.slice/share.slice/{alloc}.{task}.scope"
    scenario = tmp_path / "one.toml"
    scenario.write_text(f'[[gpu]]\ncapture = "{fixtures_dir / "h200" / "nvidia-smi-q.xml"}"\n'
                        '[[gpu.process]]\npid = 4242\nused_memory_bytes = 1048576\nsm_utilization_percent = 40\n')
    devices = tmp_path / "cgroup" / "devices"
    (devices / cgroup.lstrip("/")).mkdir(parents=True)
    (devices / "devices.list").write_text("a *:* rwm\n")
    (devices / cgroup.lstrip("/") / "devices.list").write_text("c 195:0 rw\n")
    (tmp_path / "proc" / "4242").mkdir(parents=True)
    (tmp_path / "proc" / "4242" / "cgroup").write_text(f"5:devices:{cgroup}\n0::{cgroup}\n")
    with PluginProcess(binary()) as plugin:
        plugin.set_config(encode_for_spec(plugin.config_schema().spec, config(
            scenario, metrics_listen=f"127.0.0.1:{unused_port}", cgroup_root=str(tmp_path / "cgroup"),
            proc_root=str(tmp_path / "proc"))))
        plugin.fingerprint().read(timeout=10)
        deadline, sm = time.monotonic() + 20, 0.0
        while sm <= 0 and time.monotonic() < deadline:  # the sampler reads once a second
            with urllib.request.urlopen(f"http://127.0.0.1:{unused_port}/metrics", timeout=10) as r:
                body = r.read().decode()
            sm = sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                     if line.startswith("accelstats_container_gpu_sm_seconds_total{") and f'id="{cgroup}"' in line)
            time.sleep(0.2)
    assert sm > 0
    info = next(line for line in body.splitlines() if line.startswith("accelstats_container_info{"))
    assert f'alloc_id="{alloc}"' in info and f'task="{task}"' in info and f'id="{cgroup}"' in info
    allocated = next(line for line in body.splitlines()
                     if line.startswith("accelstats_container_gpu_allocated_seconds_total{"))
    assert f'id="{cgroup}"' in allocated and f'uuid="{H200}"' in allocated and float(allocated.rsplit(" ", 1)[1]) > 0


@pytest.fixture
def unused_port() -> int:
    return free_port()


def test_without_the_cookie_it_explains_and_exits_1() -> None:
    env = {k: v for k, v in os.environ.items() if k != "NOMAD_PLUGIN_MAGIC_COOKIE"}
    proc = subprocess.run([binary()], env=env, capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 1 and proc.stdout == ""
    assert "plugin for HashiCorp Nomad" in proc.stderr


def test_sigint_is_ignored_and_sigterm_kills_at_once() -> None:
    plugin = PluginProcess(binary()).start()
    try:
        assert plugin.proc is not None
        plugin.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert plugin.proc.poll() is None and plugin.health() == "SERVING"
        assert plugin.handshake is not None
        socket_dir = Path(plugin.handshake.address).parent
        assert socket_dir.is_dir()
        t0 = time.monotonic()
        plugin.proc.send_signal(signal.SIGTERM)  # a Go plugin dies of it: Nomad relaunches it
        assert plugin.proc.wait(timeout=5) == -signal.SIGTERM
        assert time.monotonic() - t0 < 2.0
        assert not socket_dir.exists()  # its private socket directory is removed first
        assert plugin.hclog_problems() == []
    finally:
        plugin.close()


def test_launcher_command_line(devdir: Path, tmp_path: Path) -> None:
    (devdir / "d").write_text("")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(config(devdir=devdir)))
    proc = subprocess.run([sys.executable, "-m", "support.nomadclient.launcher", binary(), str(cfg), "--quiet-logs"],
                          capture_output=True, text=True, timeout=120, check=False,
                          cwd=Path(__file__).resolve().parents[1])  # tests/: where the support package is
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads(proc.stdout)["ok"] is True


@pytest.fixture(autouse=True)
def _no_leftover_plugins() -> Iterator[None]:
    """Every plugin a test started has exited when it ends (Shutdown, SIGTERM, or the context)."""
    yield
    import psutil

    deadline = time.monotonic() + 3
    while True:
        mine = [c.pid for c in psutil.Process().children(recursive=True)
                if "nomad-device-accelstats" in " ".join(c.cmdline())]
        if not mine or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert mine == [], f"plugin processes left running: {mine}"


@pytest.mark.slow  # more than ~5 s: real daemons, deadlines or a soak
def test_critical_xid_makes_the_gpu_unhealthy(tmp_path: Path, fixtures_dir: Path) -> None:
    h200 = fixtures_dir / "h200" / "nvidia-smi-q.xml"
    path = tmp_path / "xid.toml"
    path.write_text(f'[[gpu]]\ncapture = "{h200}"\n[[gpu.xid]]\nxid = 48\nat_s = 0.3\n')
    with PluginProcess(binary()) as plugin:
        plugin.set_config(encode_for_spec(plugin.config_schema().spec, config(path)))
        stream = plugin.fingerprint()
        first = stream.read(timeout=10).device_group[0].devices[0]
        assert first.ID == H200
        later = stream.read(timeout=15).device_group[0].devices[0]  # sent on the change, within 5 s
        assert (later.healthy, "XID 48" in later.health_description) == (False, True)


def test_ignored_gpu_ids_hide_gpus_and_their_mig_instances(scenario: Path) -> None:
    with PluginProcess(binary()) as plugin:
        spec = plugin.config_schema().spec
        plugin.set_config(encode_for_spec(spec, config(scenario, ignored_gpu_ids=[LOST])))
        ids = {d.ID for g in plugin.fingerprint().read(timeout=10).device_group for d in g.devices}
        assert H200 in ids and LOST not in ids


def test_reserve_of_a_mig_instance_adds_its_capability_nodes(scenario: Path, tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "driver" / "nvidia-caps").mkdir(parents=True)
    (proc / "driver" / "nvidia-caps" / "mig-minors").write_text(
        "config 1\nmonitor 2\ngpu2/gi3/access 30\ngpu2/gi3/ci0/access 31\n")
    with PluginProcess(binary()) as plugin:
        plugin.set_config(encode_for_spec(plugin.config_schema().spec, config(scenario, proc_root=str(proc))))
        groups = plugin.fingerprint().read(timeout=10).device_group
        mig = next(g for g in groups if "MIG" in g.device_name)
        caps = ["/dev/nvidia-caps/nvidia-cap30", "/dev/nvidia-caps/nvidia-cap31"]
        if all(os.path.exists(c) for c in caps):  # a host with this MIG layout
            res = plugin.reserve([d.ID for d in mig.devices], timeout=10).container_res
            nodes = [d.host_path for d in res.devices]
            assert nodes[:3] == ["/dev/nvidia2", *caps] and "/dev/nvidiactl" in nodes
            return
        # Nomad's exec driver fails a task whose device node is missing (executor_linux_cgo.go:929-933),
        # docker too: the fingerprint marks that instance unhealthy (so it is not scheduled), naming the
        # node, and Reserve refuses it rather than hand out a task that cannot start
        missing = next(c for c in caps if not os.path.exists(c))
        unhealthy = [(d.healthy, d.health_description) for d in mig.devices if missing in d.health_description]
        assert len(unhealthy) == 1 and unhealthy[0][0] is False, [(d.ID, d.healthy) for d in mig.devices]
        assert sum(d.healthy for d in mig.devices) == len(mig.devices) - 1  # the others have no cap entries
        with pytest.raises(grpc.RpcError) as err:
            plugin.reserve([d.ID for d in mig.devices], timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"device node {missing} does not exist" in err.value.details()  # type: ignore[attr-defined]


@pytest.mark.slow  # more than ~5 s: real daemons, deadlines or a soak
def test_nvml_gone_keeps_gpus_listed_unhealthy(tmp_path: Path, fixtures_dir: Path) -> None:
    h200 = fixtures_dir / "h200" / "nvidia-smi-q.xml"
    path = tmp_path / "gone.toml"
    path.write_text(f'[[gpu]]\ncapture = "{h200}"\n[[fault]]\ncall = "nvmlDeviceGetMemoryInfo"\n'
                    'error = "DRIVER_NOT_LOADED"\nafter_calls = 1\n')
    with PluginProcess(binary()) as plugin:
        plugin.set_config(encode_for_spec(plugin.config_schema().spec, config(path)))
        stream = plugin.fingerprint()
        first = stream.read(timeout=10)
        assert [(d.ID, d.healthy) for g in first.device_group for d in g.devices] == [(H200, True)]
        later = stream.read(timeout=15)
        (device,) = [d for g in later.device_group for d in g.devices]
        assert (device.ID, device.healthy) == (H200, False)
        assert "DRIVER_NOT_LOADED" in device.health_description
        assert later.device_group[0].attributes["memory"].int_val == 143771  # attributes kept


def test_cancelled_streams_give_their_workers_back(scenario: Path) -> None:
    with PluginProcess(binary()) as plugin:
        plugin.set_config(encode_for_spec(plugin.config_schema().spec, config(scenario)))
        for _ in range(30):  # more than the server has workers, each cancelled mid-sleep
            s = plugin.stats(600.0)
            s.read(timeout=10)
            s.cancel()
            f = plugin.fingerprint()
            f.read(timeout=10)
            f.cancel()
        t0 = time.monotonic()
        plugin.reserve([H200], timeout=10)
        assert time.monotonic() - t0 < 2.0
        assert plugin.health() == "SERVING"


def test_failed_setconfig_is_not_remembered_as_applied(scenario: Path, unused_port: int) -> None:
    import socket

    with socket.socket() as busy, PluginProcess(binary()) as plugin:
        busy.bind(("127.0.0.1", unused_port))
        busy.listen()
        spec = plugin.config_schema().spec
        data = encode_for_spec(spec, config(scenario, metrics_listen=f"127.0.0.1:{unused_port}"))
        for _ in range(2):  # the same bytes twice: both fail
            with pytest.raises(Exception) as err:
                plugin.set_config(data)
            assert err.value.code().name == "INVALID_ARGUMENT"  # type: ignore[attr-defined]
            assert "metrics_listen" in err.value.details()  # type: ignore[attr-defined]


def test_mps_replicas_are_offered_apart_from_whole_gpus_and_reserved_with_the_pipe(
        tmp_path: Path, fixtures_dir: Path) -> None:
    h200 = fixtures_dir / "h200" / "nvidia-smi-q.xml"
    root = tmp_path / "mps"
    env = {**os.environ, "PATH": f"{MPS_DOUBLE}{os.pathsep}{os.environ['PATH']}"}
    cfg = config(None, nvml_replay=str(h200),
                 mps={"root": str(root), "resource": [{"name": "shared", "replicas": 4}]})
    with PluginProcess(binary(), env=env) as plugin:
        plugin.set_config(encode_for_spec(plugin.config_schema().spec, cfg))
        fp = plugin.fingerprint().read(timeout=20)
        assert validate_fingerprint(fp) == []
        groups = {(g.vendor, g.device_type, g.device_name): g for g in fp.device_group}
        assert list(groups) == [("nvidia", "mps", "NVIDIA H200")]  # never whole and shared at once
        group = groups[("nvidia", "mps", "NVIDIA H200")]
        assert [d.ID for d in group.devices] == [f"{H200}::{n}" for n in range(4)]
        assert all(d.healthy for d in group.devices)
        assert group.attributes["mps_replicas"].int_val == 4
        assert group.attributes["memory"].int_val == 143771 // 4  # the per-replica pinned limit, MiB
        res = plugin.reserve([f"{H200}::1"], timeout=10).container_res
        assert validate_reserve(plugin.reserve([f"{H200}::0"], timeout=10)) == []
        pipe = root / "shared" / "pipe"
        # the pipe dir at the very path the variable names (raw_exec applies no mounts), the daemon's
        # /dev/shm (the host's) at /dev/shm: k8s-device-plugin's client layout
        assert dict(res.envs) == {"CUDA_MPS_PIPE_DIRECTORY": str(pipe),
                                  "CUDA_VISIBLE_DEVICES": H200}  # the server has every GPU of the resource
        assert [(m.task_path, m.host_path) for m in res.mounts] == [(str(pipe), str(pipe)),
                                                                   ("/dev/shm", "/dev/shm")]
        assert res.devices[0].host_path == "/dev/nvidia0"
        assert (pipe.parent / ".started").exists()
        # a task asking count = 2: refused by default, naming the GPU and the option (k8s-device-plugin's
        # failRequestsGreaterThanOne); with the option off, the one-replica reservation (one MPS client)
        with pytest.raises(grpc.RpcError) as err:
            plugin.reserve([f"{H200}::1", f"{H200}::2"], timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert f"2 MPS replicas in one request (2 of GPU {H200}), at most 1" in err.value.details()  # type: ignore[attr-defined]
        assert "fail_requests_greater_than_one = false" in err.value.details()  # type: ignore[attr-defined]
        daemon = (pipe / "nvidia-cuda-mps-control.pid").read_text()
        opted_in = {**cfg, "mps": {**cfg["mps"], "fail_requests_greater_than_one": False}}
        plugin.set_config(encode_for_spec(plugin.config_schema().spec, opted_in))
        assert plugin.reserve([f"{H200}::1", f"{H200}::2"], timeout=10).container_res == res
        assert (pipe / "nvidia-cuda-mps-control.pid").read_text() == daemon  # Reserve's option: no daemon restart
        pid = (pipe / "nvidia-cuda-mps-control.pid").read_text().strip()
    try:
        # the plugin exited (an agent restart): the daemon keeps serving the tasks that use it ...
        assert (pipe.parent / ".started").exists() and Path(f"/proc/{pid}").exists()
        with PluginProcess(binary(), env=env) as plugin:  # ... and the next plugin process adopts it
            plugin.set_config(encode_for_spec(plugin.config_schema().spec, cfg))
            fp = plugin.fingerprint().read(timeout=20)
            assert [(d.ID, d.healthy) for g in fp.device_group for d in g.devices] == [
                (f"{H200}::{n}", True) for n in range(4)]  # the same IDs, healthy
            assert (pipe / "nvidia-cuda-mps-control.pid").read_text().strip() == pid  # not restarted
    finally:
        stopped = mps_stop(h200, root, "shared", env)
    assert stopped.returncode == 0, stopped.stderr
    assert not pipe.exists()  # `accelstats mps stop` is how an operator stops it for good




@pytest.mark.slow  # more than ~5 s: real daemons, deadlines or a soak
def test_mps_replicas_are_unhealthy_while_the_daemon_does_not_answer(tmp_path: Path, fixtures_dir: Path) -> None:
    h200 = fixtures_dir / "h200" / "nvidia-smi-q.xml"
    root = tmp_path / "mps"
    env = {**os.environ, "PATH": f"{MPS_DOUBLE}{os.pathsep}{os.environ['PATH']}"}
    cfg = config(None, nvml_replay=str(h200),
                 mps={"root": str(root), "timeout": "500ms", "resource": [{"name": "shared", "replicas": 2}]})
    try:
        with PluginProcess(binary(), env=env) as plugin:
            plugin.set_config(encode_for_spec(plugin.config_schema().spec, cfg))
            stream = plugin.fingerprint()
            assert all(d.healthy for g in stream.read(timeout=20).device_group for d in g.devices)
            (root / "shared" / "pipe" / "double.hang").write_text("")  # the daemon accepts, never answers
            later = stream.read(timeout=20)
            assert [(d.healthy, "running but not answering" in d.health_description) for g in later.device_group
                    for d in g.devices] == [(False, True), (False, True)]  # wedged: unhealthy, not restarted
            (root / "shared" / "pipe" / "double.hang").unlink()
            again = stream.read(timeout=20)
            assert all(d.healthy for g in again.device_group for d in g.devices)  # answers again: healthy
    finally:
        assert mps_stop(h200, root, "shared", env).returncode == 0
