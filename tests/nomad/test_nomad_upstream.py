"""Where the Nomad device plugin must do what upstream does (docs/nomad.md, "Compared with upstream").

One test (or more) per difference, as docs/nomad.md's "Compared with upstream" table numbers them:

2. a Go plugin dies on SIGTERM; Nomad relaunches a plugin whose streams fail UNAVAILABLE and drops
   one whose Fingerprint ends cleanly — ``test_sigterm_kills_the_plugin_and_nomad_relaunches_it``;
3. docker requires the ``nvidia`` runtime when the env holds ``NVIDIA_VISIBLE_DEVICES`` —
   ``test_the_default_reservation_runs_under_docker_without_the_nvidia_runtime``;
1, 4. MPS clients share the server's ``/dev/shm``; the pipe dir is at the path the variable names —
   ``test_mps_clients_of_every_task_driver_reach_the_daemon``;
5, 11. nomad-device-nvidia's attribute names, values and units, numbers typed so that Nomad compares
   them — ``test_attributes_are_typed_and_valued_as_the_docs_table_says`` and the MIG test;
6. one Reserve per ``device`` block, envs merged last-wins —
   ``test_one_reserve_per_device_block_and_the_envs_merged_last_wins``;
7. non-JSON stderr is logged at DEBUG — ``test_a_crash_is_one_hclog_line_at_error_level`` and the
   thread variant;
8. the MPS pipe dir is labelled ``container_file_t`` under SELinux —
   ``test_the_pipe_dir_is_labelled_for_containers_only_under_selinux``;
10. exec fails a task whose device node does not exist —
   ``test_a_missing_mig_capability_node_fails_the_reserve``;
12. go-cty numbers — tests/nomad/test_nomad_client_unit.py ``test_encode_number``;
13. ECC stats are corrected volatile counts — ``test_ecc_stats_are_corrected_volatile_counts``;
14. ``.started`` at ``<root>/<resource>/.started`` — tests/mps/test_mps.py
   ``test_start_uses_minimal_env_and_configures_by_ordinal``;
15. a request of more than one MPS replica is refused unless opted out of ``failRequestsGreaterThanOne``
   — tests/nomad/test_nomad_mps.py ``test_reserve_refuses_more_than_one_replica_unless_opted_in`` and
   tests/nomad/test_nomad_plugin.py ``test_mps_replicas_are_offered_apart_from_whole_gpus_and_reserved_with_the_pipe``.

9 (which device number ``set_default_device_pinned_mem_limit`` takes on a narrowed daemon) is a
documented difference whose measurement needs a multi-GPU host (docs/gpu-check.md); what accelstats
sends is tests/mps/test_mps.py ``test_start_uses_minimal_env_and_configures_by_ordinal``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from support.mps_util import DOUBLE, GPUS, UUID0, serving
from support.nomadclient import attributes as nomad_attr
from support.nomadclient.ctymsgpack import encode_for_spec
from support.nomadclient.launcher import (
    GONE,
    MAGIC_COOKIE_KEY,
    MAGIC_COOKIE_VALUE,
    RELAUNCH,
    RETRY,
    PluginProcess,
    StreamEndedError,
    StreamFailedError,
    nomad_reaction,
    parse_log_line,
)
from support.nomadclient.validate import docker_requires_nvidia_runtime, validate_reserve
from support.plugin_util import H200, binary, config, mps_stop

from accelstats.manager import Collection
from accelstats.mps.proc import CONTAINER_FILE_LABEL, label_for_containers
from accelstats.nomad import devices
from accelstats.nomad.config import DEFAULTS
from accelstats.nomad.mpsshares import PluginMps
from accelstats.nomad.proto import device_pb2, structs_pb2
from accelstats.settings import MpsResourceSettings, MpsSettings
from collectors.model import Device, DeviceSample, DeviceSnapshot

REPO = Path(__file__).resolve().parents[2]
A100_MIG = "NVIDIA A100-SXM4-80GB MIG 1g.20gb"


def mps_env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{DOUBLE.parent}{os.pathsep}{os.environ['PATH']}"}


@pytest.fixture
def fleet(tmp_path: Path, fixtures_dir: Path) -> Path:
    """The H200 capture and the A100 with MIG instances, as one host."""
    path = tmp_path / "fleet.toml"
    path.write_text(f'[[gpu]]\ncapture = "{fixtures_dir / "h200" / "nvidia-smi-q.xml"}"\nminor = 0\n'
                    f'[[gpu]]\ncapture = "{fixtures_dir / "public" / "a100-sxm4-v12.xml"}"\nminor = 1\n')
    return path


def attrs_of(group: Any) -> dict[str, nomad_attr.Attr]:
    return {k: nomad_attr.from_proto(v) for k, v in group.attributes.items()}


# ------------------------------------------------------------------------------------------ 2


@pytest.mark.slow  # an MPS daemon, two plugin processes
def test_sigterm_kills_the_plugin_and_nomad_relaunches_it(tmp_path: Path, fixtures_dir: Path) -> None:
    h200 = fixtures_dir / "h200" / "nvidia-smi-q.xml"
    root = tmp_path / "mps"
    cfg = config(None, nvml_replay=str(h200), mps={"root": str(root), "resource": [{"name": "shared", "replicas": 2}]})
    env = mps_env()
    try:
        with PluginProcess(binary(), env=env) as plugin:
            plugin.set_config(encode_for_spec(plugin.config_schema().spec, cfg))
            fingerprint, stats = plugin.fingerprint(), plugin.stats(0.2)
            assert fingerprint.read(timeout=20).device_group
            stats.read(timeout=20)
            daemon = (root / "shared" / "pipe" / "nvidia-cuda-mps-control.pid").read_text().strip()
            assert plugin.proc is not None
            plugin.proc.send_signal(signal.SIGTERM)
            assert plugin.proc.wait(timeout=5) == -signal.SIGTERM  # died of it, as a Go plugin does
            outcomes = []
            for stream in (fingerprint, stats):
                with pytest.raises((StreamFailedError, StreamEndedError)) as err:
                    while True:
                        stream.read(timeout=5)
                outcomes.append(nomad_reaction(stream.name, err.value))
            assert outcomes == [RELAUNCH, RELAUNCH]
            assert Path(f"/proc/{daemon}").exists()  # the MPS daemon keeps serving its tasks
            assert plugin.hclog_problems() == []
            assert any("SIGTERM" in r.message and r.level == "warn" for r in plugin.logs)
    finally:
        stopped = mps_stop(h200, root, "shared", env)
        assert stopped.returncode == 0, stopped.stderr
    assert serving(root) == []


def test_nomad_drops_a_plugin_whose_fingerprint_ends_cleanly() -> None:
    """The reading the SIGTERM test relies on: only a clean end takes the devices off the node."""
    assert nomad_reaction("Fingerprint", StreamEndedError("Fingerprint: the plugin ended the stream")) == GONE
    assert nomad_reaction("Fingerprint", StreamFailedError("UNAVAILABLE", "Socket closed")) == RELAUNCH
    assert nomad_reaction("Fingerprint", StreamFailedError("INTERNAL", "boom")) == GONE  # handleFingerprintError
    assert nomad_reaction("Stats", StreamFailedError("INTERNAL", "boom")) == RETRY


# ------------------------------------------------------------------------------------------ 3


def test_the_default_reservation_runs_under_docker_without_the_nvidia_runtime(fleet: Path) -> None:
    with PluginProcess(binary()) as plugin:
        spec = plugin.config_schema().spec
        plugin.set_config(encode_for_spec(spec, config(fleet)))
        plugin.fingerprint().read(timeout=20)
        res = plugin.reserve([H200], timeout=10)
        assert validate_reserve(res) == []
        assert dict(res.container_res.envs) == {"CUDA_VISIBLE_DEVICES": H200}
        assert not docker_requires_nvidia_runtime(dict(res.container_res.envs))
        # where the NVIDIA runtime is installed, operators ask for its variable too
        plugin.set_config(encode_for_spec(spec, config(fleet, visible_devices_env=["NVIDIA_VISIBLE_DEVICES",
                                                                                   "CUDA_VISIBLE_DEVICES"])))
        plugin.fingerprint().read(timeout=20)
        envs = dict(plugin.reserve([H200], timeout=10).container_res.envs)
        assert envs == {"CUDA_VISIBLE_DEVICES": H200, "NVIDIA_VISIBLE_DEVICES": H200}
        assert docker_requires_nvidia_runtime(envs)
        for bad in ([], ["NVIDIA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"], ["LD_PRELOAD"]):
            with pytest.raises(grpc.RpcError) as err:
                plugin.set_config(encode_for_spec(spec, config(fleet, visible_devices_env=bad)))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("config: visible_devices_env: ")  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------------ 1, 4


def test_mps_clients_of_every_task_driver_reach_the_daemon(tmp_path: Path) -> None:
    root = tmp_path / "mps"
    mps = PluginMps(MpsSettings(root=root, timeout=2.0, resources=(MpsResourceSettings("shared", 2, (0,)),)),
                    binary=str(DOUBLE))
    try:
        share = mps.shares(GPUS)[UUID0]
        gpu = Device(index=0, minor=0, uuid=UUID0, name="NVIDIA H200")
        snap = devices.Snapshot(devices={f"{UUID0}::0": devices.Reservable("mps", device=gpu, parent_minor=0,
                                                                          mps=share)})
        res = devices.reserve(device_pb2, snap, [f"{UUID0}::0"], {}, dev_root=str(tmp_path / "dev"))
        pipe = res.envs["CUDA_MPS_PIPE_DIRECTORY"]
        mounts = {m.task_path: m.host_path for m in res.mounts}
        # docker and exec: the host pipe dir is mounted at the very path the variable names, and the
        # daemon's /dev/shm at /dev/shm (server and clients share one /dev/shm)
        assert mounts == {pipe: pipe, "/dev/shm": str(mps_daemon_shm())}
        # raw_exec applies no mounts: the variable alone must lead a client to the daemon
        raw_exec = {"PATH": os.environ["PATH"], **dict(res.envs)}
        answer = subprocess.run([str(DOUBLE)], input="get_default_active_thread_percentage\n", env=raw_exec,
                                capture_output=True, text=True, timeout=30, check=False)
        assert (answer.returncode, answer.stdout.strip()) == (0, "50.0"), answer.stderr
    finally:
        for pid in serving(root):
            os.kill(pid, signal.SIGKILL)


def mps_daemon_shm() -> Path:
    from accelstats.mps.daemon import Daemon
    from accelstats.mps.rules import MpsResource, Root

    return Daemon(MpsResource("x", 2, (UUID0,)), GPUS, Root("/tmp/unused")).shm_dir


# ------------------------------------------------------------------------------------------ 5, 11

#: attribute -> (type, unit, value on the H200 capture); None: not sent for the H200.
H200_ATTRIBUTES: dict[str, tuple[str, str, Any] | None] = {
    "memory": ("int", "MiB", 143771),
    "power": ("int", "W", 126),
    "bar1": ("int", "MiB", 262144),
    "driver_version": ("string", "", "580.159.04"),
    "cores_clock": ("int", "MHz", 1980),
    "memory_clock": ("int", "MHz", 3201),
    "pci_bandwidth": ("int", "MB/s", 49152),  # gen 5, 16 lanes, 3072 MB/s per lane
    "display_state": None,  # NVML: DEPRECATED on driver 580
    "persistence_mode": ("int", "", 1),
    "compute_capability": ("float", "", 9.0),
    "architecture": ("string", "", "hopper"),
}


def docs_attribute_table() -> dict[str, tuple[str, str, str]]:
    """docs/nomad.md's attribute table: name -> (type, unit, H200 value) as written."""
    text = (REPO / "docs" / "nomad.md").read_text()
    section = text.split("### Attributes", 1)[1].split("###", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `([a-z0-9_]+)` \| (\w+)(?:, (\S+))? \| ([^|]+?) \|", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3) or "", m.group(4).strip())
    return rows


def test_attributes_are_typed_and_valued_as_the_docs_table_says(fleet: Path) -> None:
    with PluginProcess(binary()) as plugin:
        plugin.set_config(encode_for_spec(plugin.config_schema().spec, config(fleet)))
        groups = {g.device_name: g for g in plugin.fingerprint().read(timeout=20).device_group}
    got = attrs_of(groups["NVIDIA H200"])
    want = {k: v for k, v in H200_ATTRIBUTES.items() if v is not None}
    assert {k: (a.kind, a.unit, getattr(a, f"{a.kind}_val")) for k, a in got.items()} == want
    table = docs_attribute_table()
    # the type and unit of an attribute the H200 does not send, as the A100's fingerprint has it
    typed = {name: row[:2] for name, row in H200_ATTRIBUTES.items() if row is not None} | {
        "display_state": ("int", "")}
    for name, row in H200_ATTRIBUTES.items():
        typ, unit, value = table[name]
        assert (typ.lower(), unit) == typed[name], name
        assert value == ("—" if row is None else str(row[2])), name
    # Nomad compares each against the literal a job would write: "9.0" is a Float, "1" an Int
    for name, (_, unit, value) in want.items():
        literal = f"{value} {unit}".strip()
        assert nomad_attr.constraint_met(got[name], "=", literal), (name, literal)
    assert nomad_attr.constraint_met(got["compute_capability"], ">=", "8.0")
    assert nomad_attr.constraint_met(got["pci_bandwidth"], ">=", "32768 MB/s")
    assert nomad_attr.constraint_met(got["memory"], ">=", "80 GiB")
    # what a string-typed capability did: the documented affinity never applied
    assert not nomad_attr.constraint_met(nomad_attr.Attr(string_val="9.0"), "=", "9.0")


def test_the_docs_affinity_example_applies_to_the_h200(fleet: Path) -> None:
    text = (REPO / "docs" / "nomad.md").read_text()
    example = re.search(r'attribute = "\$\{device\.attr\.compute_capability\}"\s+value\s+= "([^"]+)"', text)
    assert example is not None
    with PluginProcess(binary()) as plugin:
        plugin.set_config(encode_for_spec(plugin.config_schema().spec, config(fleet)))
        groups = {g.device_name: g for g in plugin.fingerprint().read(timeout=20).device_group}
    assert nomad_attr.constraint_met(attrs_of(groups["NVIDIA H200"])["compute_capability"], "=", example.group(1))


def test_mig_groups_inherit_the_parents_power_bar1_pcie_and_clocks(fleet: Path) -> None:
    with PluginProcess(binary()) as plugin:
        plugin.set_config(encode_for_spec(plugin.config_schema().spec, config(fleet)))
        groups = {g.device_name: g for g in plugin.fingerprint().read(timeout=20).device_group}
    mig = attrs_of(groups[A100_MIG])
    assert (mig["display_state"].kind, mig["display_state"].unit) == ("int", "")  # as docs/nomad.md says
    assert {k: getattr(a, f"{a.kind}_val") for k, a in mig.items()} == {
        "memory": 19968, "mig_profile": "1g.20gb", "compute_capability": 8.0, "architecture": "ampere",
        "driver_version": "580.159.04",
        # from the A100 (nomad-device-nvidia driver_linux.go:152-161)
        "power": 67, "bar1": 131072, "pci_bandwidth": 32768, "cores_clock": 1275, "memory_clock": 1593,
        "display_state": 1, "persistence_mode": 0}


def test_current_draw_and_clocks_do_not_resend_the_fingerprint() -> None:
    """nomad-device-nvidia reads power and clocks when its device set changes; accelstats keeps them
    while a group's devices and their health stay the same, so a fingerprint is not re-sent (and the
    node not updated) each time a clock moves."""
    gpu = Device(index=0, minor=0, uuid=H200, name="NVIDIA H200", max_pcie_generation=5, max_pcie_width=16)

    def collection(watts: float, mhz: float, up: bool = True) -> Collection:
        sample = DeviceSample(uuid=H200, up=up, memory_total_bytes=143771 << 20, power_watts=watts,
                              clocks_hz=(("graphics", mhz * 1e6),), error="" if up else "GPU_IS_LOST")
        return Collection(snapshot=DeviceSnapshot(devices=[gpu], samples={H200: sample}, driver_version="580"))

    first = devices.fingerprint(device_pb2, structs_pb2, collection(126.4, 1980), DEFAULTS)
    second = devices.fingerprint(device_pb2, structs_pb2, collection(700.0, 1755), DEFAULTS, first)
    assert second.groups[0].SerializeToString(deterministic=True) == first.groups[0].SerializeToString(
        deterministic=True)
    changed = devices.fingerprint(device_pb2, structs_pb2, collection(690.0, 1700, up=False), DEFAULTS, second)
    assert not changed.groups[0].devices[0].healthy  # health changed: the group is sent anew ...
    again = devices.fingerprint(device_pb2, structs_pb2, collection(690.0, 1700), DEFAULTS, changed)
    assert attrs_of(again.groups[0])["power"].int_val == 690  # ... and the next read is taken


# ------------------------------------------------------------------------------------------ 6


@pytest.mark.slow  # an MPS daemon
def test_one_reserve_per_device_block_and_the_envs_merged_last_wins(tmp_path: Path, fixtures_dir: Path) -> None:
    h200 = fixtures_dir / "h200" / "nvidia-smi-q.xml"
    scenario = tmp_path / "two.toml"
    scenario.write_text(f'[[gpu]]\ncapture = "{h200}"\n[[gpu]]\ncapture = "{h200}"\nminor = 1\n'
                        f'uuid = "{H200[:-2]}11"\npci_bus_id = "00000000:00:07.0"\n')
    whole = H200[:-2] + "11"
    root = tmp_path / "mps"
    env = mps_env()
    cfg = config(scenario, mps={"root": str(root), "resource": [{"name": "shared", "replicas": 2,
                                                                  "devices": [H200]}]})
    try:
        with PluginProcess(binary(), env=env) as plugin:
            plugin.set_config(encode_for_spec(plugin.config_schema().spec, cfg))
            plugin.fingerprint().read(timeout=20)
            with pytest.raises(grpc.RpcError):  # one Reserve with both: refused
                plugin.reserve([whole, f"{H200}::0"], timeout=10)
            # a task with `device "nvidia/gpu"` then `device "nvidia/mps"`: two Reserves, nothing refused,
            # and the MPS block's CUDA_VISIBLE_DEVICES wins (docs/nomad.md: never mix them in one task)
            task = plugin.reserve_task([[whole], [f"{H200}::0"]], timeout=10)
            assert task.envs == {"CUDA_VISIBLE_DEVICES": H200,
                                 "CUDA_MPS_PIPE_DIRECTORY": str(root / "shared" / "pipe")}
            assert {"/dev/nvidia0", "/dev/nvidia1"} <= {host for _, host, _ in task.devices}
            reverse = plugin.reserve_task([[f"{H200}::0"], [whole]], timeout=10)
            assert reverse.envs["CUDA_VISIBLE_DEVICES"] == whole and "CUDA_MPS_PIPE_DIRECTORY" in reverse.envs
    finally:
        stopped = mps_stop(scenario, root, "shared", env)
        assert stopped.returncode == 0, stopped.stderr


# ------------------------------------------------------------------------------------------ 7


def hclog_records(stderr: str) -> list[Any]:
    records = [parse_log_line(line) for line in stderr.splitlines() if line.strip()]
    assert [r.problem for r in records if r.problem] == [] and all(r.structured for r in records), stderr
    return records


def test_a_crash_is_one_hclog_line_at_error_level(tmp_path: Path) -> None:
    env = {**os.environ, MAGIC_COOKIE_KEY: MAGIC_COOKIE_VALUE, "PLUGIN_UNIX_SOCKET_DIR": str(tmp_path / "missing")}
    proc = subprocess.run([binary()], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1 and proc.stdout == ""
    errors = [r for r in hclog_records(proc.stderr) if r.level == "error"]
    assert len(errors) == 1 and "FileNotFoundError" in errors[0].message, proc.stderr
    assert "Traceback" in json.loads(proc.stderr.strip().splitlines()[-1])["error"]


def test_an_uncaught_exception_in_another_thread_is_one_hclog_error_line() -> None:
    code = ("import threading\nfrom accelstats.nomad import server\nserver._logging()\nserver.install_excepthooks()\n"
            "t = threading.Thread(target=lambda: 1 / 0, name='worker')\nt.start()\nt.join()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    (record,) = hclog_records(proc.stderr)
    assert record.level == "error" and "thread worker: ZeroDivisionError" in record.message


# ------------------------------------------------------------------------------------------ 8


def test_the_pipe_dir_is_labelled_for_containers_only_under_selinux(tmp_path: Path) -> None:
    pipe = tmp_path / "pipe"
    (pipe / "sub").mkdir(parents=True)
    (pipe / "control").write_text("")
    calls: list[tuple[str, str, bytes]] = []
    assert not label_for_containers(pipe, tmp_path / "no-selinuxfs", lambda *a: calls.append(a))
    assert calls == []
    selinuxfs = tmp_path / "selinuxfs"
    selinuxfs.mkdir()
    (selinuxfs / "enforce").write_text("1")
    assert label_for_containers(pipe, selinuxfs, lambda *a: calls.append(a))
    assert sorted(calls) == sorted((str(p), "security.selinux", CONTAINER_FILE_LABEL)
                                   for p in (pipe, pipe / "sub", pipe / "control"))
    assert CONTAINER_FILE_LABEL == b"system_u:object_r:container_file_t:s0"


# ------------------------------------------------------------------------------------------ 10


def test_a_missing_mig_capability_node_fails_the_reserve(tmp_path: Path) -> None:
    mig = Device(index=0, minor=None, uuid="MIG-1", name=A100_MIG, kind="mig", parent_uuid="GPU-A",
                 gpu_instance_id=3, compute_instance_id=0, mig_profile="1g.20gb")
    snap = devices.Snapshot(devices={"MIG-1": devices.Reservable("mig", device=mig, parent_minor=2)})
    dev = tmp_path / "dev"
    (dev / "nvidia-caps").mkdir(parents=True)
    (dev / "nvidia-caps" / "nvidia-cap30").write_text("")
    caps = {(2, 3, 0): [30, 31]}
    with pytest.raises(devices.ReserveError, match=f"device node {dev}/nvidia-caps/nvidia-cap31 does not exist"):
        devices.reserve(device_pb2, snap, ["MIG-1"], caps, dev_root=str(dev))
    # the fingerprint already says so, so that the scheduler places nothing on it
    parent = Device(index=0, minor=2, uuid="GPU-A", name="NVIDIA A100-SXM4-80GB", mig_mode="enabled")
    samples = {u: DeviceSample(uuid=u, up=True, memory_total_bytes=1 << 34) for u in ("GPU-A", "MIG-1")}
    host = Collection(snapshot=DeviceSnapshot(devices=[parent, mig], samples=samples))
    (detected,) = devices.fingerprint(device_pb2, structs_pb2, host, DEFAULTS, mig_caps=caps,
                                      dev_root=str(dev)).groups[0].devices
    assert not detected.healthy and f"{dev}/nvidia-caps/nvidia-cap31 does not exist" in detected.health_description
    (dev / "nvidia-caps" / "nvidia-cap31").write_text("")
    (detected,) = devices.fingerprint(device_pb2, structs_pb2, host, DEFAULTS, mig_caps=caps,
                                      dev_root=str(dev)).groups[0].devices
    assert detected.healthy
    res = devices.reserve(device_pb2, snap, ["MIG-1"], caps, dev_root=str(dev))
    assert [d.host_path for d in res.devices][:3] == [f"{dev}/nvidia2", f"{dev}/nvidia-caps/nvidia-cap30",
                                                      f"{dev}/nvidia-caps/nvidia-cap31"]


# ------------------------------------------------------------------------------------------ 13


def test_ecc_stats_are_corrected_volatile_counts() -> None:
    sample = DeviceSample(uuid=H200, up=True, ecc_errors=(("corrected", "volatile", 3), ("uncorrected", "volatile", 2),
                                                          ("corrected", "aggregate", 70)))
    _, stats = devices.gpu_stats(structs_pb2, sample)
    ecc = stats.attributes["ECC memory errors"]
    assert ecc.int_numerator_val.value == 3 and "corrected, volatile" in ecc.desc
    assert stats.attributes["ECC L1 errors"].string_val.value == "N/A"  # per-location counts are not read
