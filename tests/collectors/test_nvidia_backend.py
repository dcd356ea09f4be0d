"""NvidiaBackend over the replay: values in base units, absent stays absent, errors stay per device,
and NVML that cannot start is retried without a restart."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from support.faultmatrix_util import HELD, HeldHang, assert_no_new_threads, live_threads, wait_until

from accelstats.manager import AcceleratorManager, Collection
from accelstats.settings import FileDevicesSettings, Settings
from accelstats.web.exposition import render
from collectors.model import Device, DeviceSnapshot, NoDataError
from collectors.nvidia import NvidiaBackend, nvidia_pci_devices
from collectors.replay.lib import open_replay

MIB = 1 << 20
H200_UUID = "GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c10"


def backend(path: Path, **kw: float) -> NvidiaBackend:
    return NvidiaBackend(open_replay(path), **kw)


def snapshot(b: NvidiaBackend) -> DeviceSnapshot:
    snap = DeviceSnapshot()
    b.update(snap)
    return snap


def write_scenario(tmp_path: Path, capture: Path, body: str) -> Path:
    path = tmp_path / "scenario.toml"
    path.write_text(body.replace("CAPTURE", str(capture)))
    return path


@pytest.fixture
def h200(fixtures_dir: Path) -> Path:
    return fixtures_dir / "h200" / "nvidia-smi-q.xml"


def test_h200_capture_in_base_units(h200: Path) -> None:
    b = backend(h200)
    assert b.setup()
    snap = snapshot(b)
    (dev,) = snap.devices
    s = snap.samples[dev.uuid]
    assert (dev.uuid, dev.index, dev.minor, dev.name) == (H200_UUID, 0, 0, "NVIDIA H200")
    assert (dev.pci_bus_id, dev.compute_capability, dev.architecture) == ("00000000:00:06.0", "9.0", "hopper")
    assert (dev.mig_mode, dev.persistence_mode, dev.compute_mode) == ("disabled", "enabled", "default")
    assert s.up and s.error == ""
    assert s.memory_total_bytes == 143771 * MIB
    assert s.memory_reserved_bytes == 616 * MIB
    assert s.memory_used_bytes == 0
    assert s.bar1_total_bytes == 262144 * MIB
    assert s.power_limit_watts == 700.0
    assert s.power_watts is not None and 100 < s.power_watts < 150
    assert dict(s.temperatures_celsius)["gpu"] > 0
    assert dict(s.max_clocks_hz)["sm"] == 1980e6
    assert dict(s.clocks_hz)["memory"] == 3201e6
    assert s.performance_state == 0
    assert dict(s.clock_events)["gpu_idle"] is True
    assert s.pcie_link_generation == 5 and s.pcie_link_width == 16 and s.pcie_replays == 3
    assert s.fan_speed_ratio is None  # N/A on the H200: absent, never 0
    assert s.processes == ()
    assert snap.source == "replay" and snap.driver_version == "580.159.04" and snap.cuda_driver_version == "13.0"


@pytest.mark.parametrize(
    ("capture", "expected"),
    [
        ("public/tesla-t4.xml", [("gpu", "Tesla T4")]),
        ("public/dual_a5000-v13.xml", [("gpu", "NVIDIA RTX A5000"), ("gpu", "NVIDIA RTX A5000")]),
        ("public/a100-sxm4-v12.xml",
         [("gpu", "NVIDIA A100-SXM4-80GB")] + [("mig", "NVIDIA A100-SXM4-80GB MIG 1g.20gb")] * 4),
    ],
)
def test_every_public_capture_enumerates(fixtures_dir: Path, capture: str, expected: list[tuple[str, str]]) -> None:
    b = backend(fixtures_dir / capture)
    assert b.setup()
    snap = snapshot(b)
    assert [(d.kind, d.name) for d in snap.devices] == expected
    assert all(snap.samples[d.uuid].up for d in snap.devices)


def test_dual_a5000_minor_is_not_the_index(fixtures_dir: Path) -> None:
    b = backend(fixtures_dir / "public" / "dual_a5000-v13.xml")
    b.setup()
    assert [(d.index, d.minor) for d in b.devices()] == [(0, 1), (1, 0)]


def test_mig_instances_have_no_utilisation(fixtures_dir: Path) -> None:
    b = backend(fixtures_dir / "public" / "a100-sxm4-v12.xml")
    b.setup()
    snap = snapshot(b)
    parent, *migs = snap.devices
    assert parent.mig_mode == "enabled"
    for m in migs:
        assert m.kind == "mig" and m.parent_uuid == parent.uuid and m.uuid.startswith("MIG-")
        assert m.minor is None and m.mig_profile == "1g.20gb"
        s = snap.samples[m.uuid]
        assert s.utilization_ratio is None  # NOT_SUPPORTED under MIG: absent, never a fake 0
        assert s.memory_total_bytes is not None and s.memory_total_bytes > 0
    assert sorted(m.gpu_instance_id or 0 for m in migs) == [3, 4, 5, 6]


def test_lost_gpu_does_not_blank_the_others(tmp_path: Path, h200: Path) -> None:
    scenario = write_scenario(tmp_path, h200, """
[[gpu]]
capture = "CAPTURE"
[[gpu]]
capture = "CAPTURE"
uuid = "GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c11"
minor = 1
pci_bus_id = "00000000:00:07.0"
[[fault]]
gpu = 1
call = "nvmlDeviceGetMemoryInfo"
error = "GPU_IS_LOST"
""")
    b = backend(scenario)
    b.setup()
    snap = snapshot(b)
    first, second = (snap.samples[d.uuid] for d in snap.devices)
    assert first.up and first.memory_total_bytes == 143771 * MIB
    assert not second.up and "GPU_IS_LOST" in second.error and second.memory_total_bytes is None
    assert b.call.errors[("nvmlDeviceGetMemoryInfo", "GPU_IS_LOST")] == 1


def test_other_errors_make_one_value_absent_and_are_counted(tmp_path: Path, h200: Path) -> None:
    scenario = write_scenario(tmp_path, h200, """
[[gpu]]
capture = "CAPTURE"
[[fault]]
gpu = 0
call = "nvmlDeviceGetPowerUsage"
error = "NO_PERMISSION"
""")
    b = backend(scenario)
    b.setup()
    s = snapshot(b).samples[H200_UUID]
    assert s.up and s.power_watts is None and s.power_limit_watts == 700.0
    assert b.call.errors[("nvmlDeviceGetPowerUsage", "NO_PERMISSION")] == 1


def test_nvml_that_cannot_start_is_retried_without_restart(tmp_path: Path, h200: Path) -> None:
    scenario = write_scenario(tmp_path, h200, """
[[gpu]]
capture = "CAPTURE"
[[fault]]
call = "nvmlInit"
error = "DRIVER_NOT_LOADED"
times = 2
""")
    b = backend(scenario, retry_interval=0.05)
    assert not b.setup()
    assert b.status == "nvmlInit failed: DRIVER_NOT_LOADED"
    snap = DeviceSnapshot()
    with pytest.raises(NoDataError):
        b.update(snap)  # too early to retry: still the first failure
    assert snap.nvml_status == "nvmlInit failed: DRIVER_NOT_LOADED" and snap.devices == []
    time.sleep(0.06)
    with pytest.raises(NoDataError):
        b.update(DeviceSnapshot())  # second attempt fails too (times = 2)
    time.sleep(0.06)
    snap = snapshot(b)  # the driver "came back": picked up on the next retry
    assert [d.uuid for d in snap.devices] == [H200_UUID]


def test_library_missing_serves_files_without_gpu_families(tmp_path: Path, h200: Path) -> None:
    scenario = write_scenario(tmp_path, h200, """
[[gpu]]
capture = "CAPTURE"
[[fault]]
call = "nvmlInit"
error = "LIBRARY_NOT_FOUND"
""")
    (tmp_path / "devs").mkdir()
    (tmp_path / "devs" / "dev0").write_text("x")
    settings = Settings(nvml_replay=scenario, cgroup_root=tmp_path / "cg", proc_root=tmp_path / "proc",
                        file_devices=FileDevicesSettings(dir=tmp_path / "devs"))
    with AcceleratorManager(settings, open_replay(scenario)) as m:
        names = {f.name for f in render(m.collect())}
    assert not any(n.startswith("accelstats_gpu_") for n in names)
    assert "accelstats_file_device_info" in names
    assert "accelstats_scrape_collector_success" in names


def test_process_share_and_not_found_means_zero(tmp_path: Path, h200: Path) -> None:
    scenario = write_scenario(tmp_path, h200, """
[[gpu]]
capture = "CAPTURE"
[[gpu.process]]
pid = 101
used_memory_bytes = 1073741824
sm_utilization_percent = 35
[[gpu.process]]
pid = 102
used_memory_bytes = 2147483648
""")
    b = backend(scenario)
    b.setup()
    procs = {p.pid: p for p in snapshot(b).samples[H200_UUID].processes or ()}
    assert procs[101].used_memory_bytes == 1 << 30 and procs[101].sm_utilization_ratio == pytest.approx(0.35)
    assert procs[102].used_memory_bytes == 2 << 30 and procs[102].sm_utilization_ratio == 0.0


def test_pci_scan_gates_nvml(tmp_path: Path) -> None:
    dev = tmp_path / "bus" / "pci" / "devices"
    for addr, vendor in (("0000:00:01.0", "0x8086"), ("0000:00:06.0", "0x10de")):
        (dev / addr).mkdir(parents=True)
        (dev / addr / "vendor").write_text(vendor + "\n")
    assert nvidia_pci_devices(tmp_path) == ["0000:00:06.0"]
    assert nvidia_pci_devices(tmp_path / "absent") == []


TWO_H200 = """
[[gpu]]
capture = "CAPTURE"
[[gpu]]
capture = "CAPTURE"
uuid = "GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c11"
minor = 1
pci_bus_id = "00000000:00:07.0"
"""


@pytest.mark.parametrize("times", ["", "times = 2"])
def test_lost_gpu_stays_down_while_the_others_report_over_many_collections(
        tmp_path: Path, h200: Path, times: str) -> None:
    """Across collections and re-enumerations: the healthy GPU never disappears, the lost one keeps
    its up=0 series (so an alert on it cannot resolve by the series vanishing) and, when it answers
    again, comes back up without a restart."""
    scenario = write_scenario(tmp_path, h200, TWO_H200 + f"""
[[fault]]
gpu = 1
call = "*"
error = "GPU_IS_LOST"
after_calls = 20
{times}
""")
    b = backend(scenario, retry_interval=0.01, pcie_interval=0)  # the fault counts the pass's calls only
    b.setup()
    ups = []
    for _ in range(6):
        time.sleep(0.015)
        snap = snapshot(b)
        ups.append([(uuid[-2:], s.up) for uuid, s in snap.samples.items()])
    for row in ups:
        assert ("10", True) in row and len(row) == 2
    assert ("11", False) in ups[0]
    if times:  # the fault ended: a re-enumeration gave the GPU a working handle again
        assert ups[-1] == [("10", True), ("11", True)]
    else:
        assert ups[-1] == [("10", True), ("11", False)]


def test_a_process_in_two_lists_is_counted_once(tmp_path: Path, h200: Path) -> None:
    scenario = write_scenario(tmp_path, h200, """
[[gpu]]
capture = "CAPTURE"
[[gpu.process]]
pid = 77
used_memory_bytes = 1048576
type = "compute"
[[gpu.process]]
pid = 77
used_memory_bytes = 1048576
type = "graphics"
""")
    b = backend(scenario)
    b.setup()
    s = snapshot(b).samples[H200_UUID]
    assert [(p.pid, p.type, p.used_memory_bytes) for p in s.processes or ()] == [(77, "compute", 1048576)]


def test_a_process_in_two_lists_takes_its_type_from_the_first_and_a_known_amount_from_either(
        tmp_path: Path, h200: Path) -> None:
    """An MPS client is in the MPS list (its type) and the compute list; where one list says "not
    available", the amount the other knows counts (collection and accounting read the lists alike)."""
    scenario = write_scenario(tmp_path, h200, """
[[gpu]]
capture = "CAPTURE"
[[gpu.process]]
pid = 78
type = "mps"
[[gpu.process]]
pid = 78
used_memory_bytes = 1048576
type = "compute"
""")
    b = backend(scenario)
    b.setup()
    s = snapshot(b).samples[H200_UUID]
    assert [(p.pid, p.type, p.used_memory_bytes) for p in s.processes or ()] == [(78, "mps", 1048576)]


def test_a_process_list_nvml_does_not_support_stays_absent(tmp_path: Path, h200: Path) -> None:
    scenario = write_scenario(tmp_path, h200, """
[[gpu]]
capture = "CAPTURE"
[gpu.override]
performance_state = 32
[[fault]]
gpu = 0
call = "nvmlDeviceGetMPSComputeRunningProcesses"
error = "NOT_SUPPORTED"
""")
    b = backend(scenario)
    b.setup()
    s = snapshot(b).samples[H200_UUID]
    assert s.process_types == ("compute", "graphics")
    families = {f.name: f for f in render(_collection(s))}
    types = {smp.labels["type"] for smp in families["accelstats_gpu_processes"].samples}
    assert types == {"compute", "graphics"}  # no mps series: not a fake 0
    assert s.performance_state is None  # NVML_PSTATE_UNKNOWN (32) is absent
    assert "accelstats_gpu_performance_state" not in families


def test_a_c_plus_g_process_counts_in_both_lists_it_is_in(tmp_path: Path, h200: Path) -> None:
    """| PID | lists             | compute | graphics |
    |-----|-------------------|---------|----------|
    | 51  | compute, graphics | 1       | 1        |
    | 52  | compute           | 1       |          |
    | 53  | graphics          |         | 1        |
    accelstats_gpu_processes counts each list, as nvidia-smi's C+G says; the process is one process
    (memory counted once)."""
    scenario = write_scenario(tmp_path, h200, """
[[gpu]]
capture = "CAPTURE"
[[gpu.process]]
pid = 51
used_memory_bytes = 1048576
[[gpu.process]]
pid = 51
type = "graphics"
used_memory_bytes = 1048576
[[gpu.process]]
pid = 52
[[gpu.process]]
pid = 53
type = "graphics"
""")
    b = backend(scenario)
    b.setup()
    s = snapshot(b).samples[H200_UUID]
    assert sorted(p.pid for p in s.processes or ()) == [51, 52, 53]
    families = {f.name: f for f in render(_collection(s))}
    counts = {smp.labels["type"]: smp.value for smp in families["accelstats_gpu_processes"].samples}
    assert counts == {"compute": 2.0, "graphics": 2.0, "mps": 0.0}


def test_memory_info_falls_back_to_v1_on_drivers_without_v2(tmp_path: Path, h200: Path) -> None:
    path = tmp_path / "old.toml"  # a library without nvmlDeviceGetMemoryInfo_v2, as before R510
    path.write_text(f'missing_functions = ["nvmlDeviceGetMemoryInfo_v2"]\n[[gpu]]\ncapture = "{h200.as_posix()}"\n')
    b = NvidiaBackend(open_replay(path), pci_scan=False)
    b.setup()
    try:
        s = snapshot(b).samples[H200_UUID]
        assert s.memory_total_bytes == 143771 * MIB and s.memory_reserved_bytes is None
        s = snapshot(b).samples[H200_UUID]  # v2 is not asked again
        assert b.call.errors[("nvmlDeviceGetMemoryInfo", "FUNCTION_NOT_FOUND")] == 1
    finally:
        b.close()


def test_a_device_that_answers_v2_not_supported_gets_v1_for_that_reading_only(tmp_path: Path, h200: Path) -> None:
    path = write_scenario(tmp_path, h200, f'[[gpu]]\ncapture = "{h200.as_posix()}"\n[[fault]]\n'
                          'call = "nvmlDeviceGetMemoryInfo"\nerror = "NOT_SUPPORTED"\ntimes = 1\n')
    b = NvidiaBackend(open_replay(path), pci_scan=False)
    b.setup()
    try:
        # the fault hits the v2 call; v1 answers for that reading (no reserved figure), then v2 again
        first, second = (snapshot(b).samples[H200_UUID] for _ in range(2))
        assert (first.memory_total_bytes, first.memory_reserved_bytes) == (143771 * MIB, None)
        assert second.memory_reserved_bytes == 616 * MIB
    finally:
        b.close()


def _collection(sample: object) -> Collection:
    snap = DeviceSnapshot()
    snap.devices.append(Device(uuid=H200_UUID, index=0, minor=0, name="NVIDIA H200"))
    snap.samples[H200_UUID] = sample  # type: ignore[assignment]
    return Collection(snapshot=snap)


DEADLINE = 1.5  # NvidiaBackend's default deadline (collectors/nvidia.py): a collection waits for NVML at most this
MARGIN = 1.0  # for a loaded machine: the only timing bounds here are the deadline and this margin on it


def test_a_hung_nvml_call_costs_one_deadline_then_nothing_and_leaks_no_thread(tmp_path: Path, h200: Path) -> None:
    """GPU 1's memory call hangs until the test releases it (HeldHang): the first collection waits
    the deadline (1.5 s, plus a margin), the next ones do not wait another; GPU 0 keeps its readings,
    GPU 1 is down while stuck, one worker thread serves it all, and GPU 1 is up again once the call
    returns."""
    scenario = write_scenario(tmp_path, h200, TWO_H200 + f"""
[[fault]]
gpu = 1
call = "nvmlDeviceGetMemoryInfo"
hang_seconds = {HELD:g}
after_calls = 1
times = 1
""")
    with HeldHang() as hang:
        b = NvidiaBackend(open_replay(scenario, sleep=hang.sleep))
        try:
            first = snapshot(b)  # a complete pass: the fault lets one call through first
            assert all(s.up for s in first.samples.values())
            before = live_threads()
            timings, ups = [], []
            for _ in range(5):
                t0 = time.monotonic()
                snap = snapshot(b)
                timings.append(time.monotonic() - t0)
                ups.append([s.up for s in snap.samples.values()])
                assert snap.samples[H200_UUID].memory_total_bytes == 143771 * MIB
            assert (hang.entered, hang.in_progress) == (1, 1)  # all five while the call hung, in one pass
            assert timings[0] < DEADLINE + MARGIN  # waited at most the deadline
            assert max(timings[1:]) < DEADLINE  # then nothing: none waited another deadline
            assert all(u == [True, False] for u in ups)
            assert "did not answer within 1.5s" in snap.samples["GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c11"].error
            assert_no_new_threads(before)  # no thread per stuck collection
            hang.release()
            wait_until(lambda: [s.up for s in snapshot(b).samples.values()] == [True, True])
            assert_no_new_threads(before)
        finally:
            b.close()


def _devices_or_none(b: NvidiaBackend) -> list[str] | None:
    """UUIDs of one collection's devices, or None when it raised NoDataError (NVML not up yet)."""
    try:
        return [d.uuid for d in snapshot(b).devices]
    except NoDataError:
        return None


def test_hung_nvml_init_does_not_block_collection(tmp_path: Path, h200: Path) -> None:
    """nvmlInit hangs until the test releases it, then fails once (DRIVER_NOT_LOADED): collections
    answer "did not answer within 1.5s" meanwhile (the first after the deadline, the next at once,
    with no second init), and the retry after release brings the GPU."""
    scenario = write_scenario(tmp_path, h200, f"""
[[gpu]]
capture = "CAPTURE"
[[fault]]
call = "nvmlInit"
hang_seconds = {HELD:g}
times = 1
error = "DRIVER_NOT_LOADED"
""")
    with HeldHang() as hang:
        b = NvidiaBackend(open_replay(scenario, sleep=hang.sleep), retry_interval=0.05)
        try:
            took = []
            for _ in range(2):
                t0 = time.monotonic()
                with pytest.raises(NoDataError, match=r"did not answer within 1\.5s"):
                    b.update(DeviceSnapshot())
                took.append(time.monotonic() - t0)
            assert (hang.entered, hang.in_progress) == (1, 1)  # both while init hung; no second init started
            assert took[0] < DEADLINE + MARGIN and took[1] < DEADLINE
            hang.release()  # the stuck init ends (failing); the retry is due: a later pass succeeds
            wait_until(lambda: _devices_or_none(b) == [H200_UUID])
        finally:
            b.close()


def test_critical_xid_events_are_counted_and_application_xids_do_not_mark_the_gpu(tmp_path: Path, h200: Path) -> None:
    gpu0, gpu1 = TWO_H200.split("[[gpu]]")[1:]
    scenario = write_scenario(tmp_path, h200, f"""
[[gpu]]{gpu0}[[gpu.xid]]
xid = 13
at_s = 0.1
[[gpu]]{gpu1}[[gpu.xid]]
xid = 79
at_s = 0.2
""")
    b = backend(scenario)
    b.setup()
    uuid_calls = b.call.nvml.library.calls["nvmlDeviceGetUUID"]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        snap = snapshot(b)
        lost = snap.samples["GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c11"]
        if lost.xid_errors and snap.samples[H200_UUID].xid_errors:
            break
        time.sleep(0.1)
    assert (lost.xid_errors, lost.xid_critical) == (((79, 1),), 79)
    ok = snap.samples[H200_UUID]
    assert (ok.xid_errors, ok.xid_critical) == (((13, 1),), 0)  # an application's own fault: watched, none critical
    families = {f.name: f for f in render(Collection(snapshot=snap))}
    assert sorted((s.labels["xid"], s.value) for s in families["accelstats_gpu_xid_errors"].samples) == [
        ("13", 1.0), ("79", 1.0)]
    # the log's "unfit for new work" is in /metrics too: the lost GPU's critical XID, 0 for the other
    assert sorted((s.labels["uuid"], s.value) for s in families["accelstats_gpu_critical_xid"].samples) == [
        (H200_UUID, 0.0), ("GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c11", 79.0)]
    # each event's device was told by its handle's address, not by asking NVML for its UUID again
    assert b.call.nvml.library.calls["nvmlDeviceGetUUID"] == uuid_calls
    b.shutdown()
    assert b.xid_watcher is None


def test_an_mps_client_listed_as_compute_too_is_an_mps_process(tmp_path: Path, h200: Path) -> None:
    """spec/mps.md: NVML lists the client in the compute and the MPS list, the server in compute only."""
    scenario = write_scenario(tmp_path, h200, """
[[gpu]]
capture = "CAPTURE"
[[gpu.process]]
pid = 473
used_memory_bytes = 824180736
type = "compute"
[[gpu.process]]
pid = 473
used_memory_bytes = 824180736
type = "mps"
[[gpu.process]]
pid = 490
used_memory_bytes = 69206016
type = "compute"
""")
    b = backend(scenario)
    b.setup()
    s = snapshot(b).samples[H200_UUID]
    assert sorted((p.pid, p.type) for p in s.processes or ()) == [(473, "mps"), (490, "compute")]


def test_a_scrape_arriving_as_a_late_pass_finishes_does_not_wedge_the_backend(
        h200: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a pass marks itself done a moment before its worker is free again. A scrape in that
    moment used to create a new pass the worker refused to start; that pass never ran, never ended,
    and every later scrape answered "NVML did not answer" forever. Here the moment is stretched to
    0.4 s (a pass that sleeps after its work) and the scrape lands in it."""
    b = backend(h200, deadline=0.1, pcie_interval=0)
    real = b._run_pass
    slow = threading.Event()

    def pass_then_linger(p: object) -> None:
        real(p)  # type: ignore[arg-type]
        if slow.is_set():
            time.sleep(0.4)  # done, but the worker is still busy (as between p.done and done.set())

    monkeypatch.setattr(b, "_run_pass", pass_then_linger)
    assert b.setup()
    assert [d.uuid for d in snapshot(b).devices] == [H200_UUID]
    slow.set()
    snapshot(b)  # this pass lingers past the 0.1 s deadline
    time.sleep(0.15)  # now inside the lingering moment: the pass is done, the worker busy
    during = snapshot(b)
    slow.clear()
    time.sleep(0.4)  # the worker is free again
    after = snapshot(b)
    assert [d.uuid for d in during.devices] == [H200_UUID]  # the finished pass's readings
    assert [d.uuid for d in after.devices] == [H200_UUID] and after.samples[H200_UUID].up


def test_a_gpu_that_stays_lost_is_reported_once_not_at_every_refresh(tmp_path: Path, h200: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    scenario = write_scenario(tmp_path, h200, TWO_H200 + '[[fault]]\ngpu = 1\ncall = "*"\nerror = "GPU_IS_LOST"\n')
    b = backend(scenario, retry_interval=0.0)
    try:
        with caplog.at_level("DEBUG", logger="collectors.nvidia"):
            b.setup()
            for _ in range(5):
                b._refresh()
        said = [r for r in caplog.records if "GPU index 1 not enumerated" in r.getMessage()]
        assert len(said) == 6 and [r.levelname for r in said].count("WARNING") == 1
    finally:
        b.close()


def test_shutdown_does_not_wait_for_the_xid_event_wait_and_nvml_is_shut_down_after_it(
        h200: Path, caplog: pytest.LogCaptureFixture) -> None:
    """SIGTERM and every CLI command end with a shutdown: it must not pay the XID thread's event wait
    (up to xid.WAIT_MS). The thread shuts NVML down itself when its wait ends."""
    from collectors import xid

    b = backend(h200)
    snapshot(b)
    watcher = b.xid_watcher
    assert watcher is not None and watcher.watching and watcher._thread is not None
    state = b.call.nvml.state  # this backend's replay (the process may hold others)
    assert state.initialised == 1
    with caplog.at_level("DEBUG", logger="collectors.nvidia"):
        b.shutdown()  # returns without joining the thread: it is in a wait of up to WAIT_MS
    assert "nvmlShutdown left to the XID thread" in caplog.text
    wait_until(lambda: state.initialised == 0, timeout=2 * xid.WAIT_MS / 1000 + 5)
    wait_until(lambda: watcher._thread is not None and not watcher._thread.is_alive(), timeout=5)
