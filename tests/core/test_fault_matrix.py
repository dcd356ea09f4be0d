"""The fault matrix: one test per row and surface; this docstring is the table.

Surfaces: **exporter** = ``/metrics`` over HTTP from a served exporter (in-process
``accelstats.web.server.serve``, or ``python3 -m accelstats serve`` as a child process where the row
says "process"); **plugin** = the Nomad plugin's ``DevicePluginState`` after a real SetConfig
(go-cty msgpack), Fingerprint and Stats built by the functions its gRPC servicers call. Faults
come from NVML replay scenarios (``[[fault]]``) and, for the host rows, from real files, cgroups
and processes. Rows 1-5 are in this file, rows 6-10 in ``test_fault_matrix_host.py``.

Row 1: NVML library missing at start, then present
    fault     ``nvmlInit`` LIBRARY_NOT_FOUND once (replay); and live pynvml on a host without libnvidia-ml
    exporter  (process) ``/metrics`` answers: ``scrape_collector_success{nvidia}`` 0, no GPU series,
              file devices served; after the retry the GPU is ``up`` 1, no restart. Live: the same,
              and the log names LIBRARY_NOT_FOUND (skipped where the library loads)
    plugin    no GPU in the first Fingerprint; the GPU healthy in a later one
Row 2: DRIVER_NOT_LOADED, then recovery (at ``nvmlInit``; mid-session, on a reading call)
    exporter  nvidia success 0 and no GPU series while it lasts; ``gpu_up`` 1 again after the retry
    plugin    at init: no GPU, then healthy; mid-session: the GPUs stay listed, unhealthy, naming
              DRIVER_NOT_LOADED, then healthy
Row 3: GPU_IS_LOST on 1 of 8 GPUs (``nvmlDeviceGetMemoryInfo`` of GPU 5, the first reading of a
       pass, fails from the first pass on: enumerated, then lost)
    exporter  8 ``gpu_up`` series, 7 at 1 with their readings, the lost one 0 with none, on every
              scrape; the error counted in ``nvml_errors_total``
    plugin    8 devices: 7 healthy, the lost one unhealthy naming GPU_IS_LOST; its Stats "N/A"
Row 4: UNKNOWN / TIMEOUT on a single call
    exporter  that GPU ``up`` 0 in that scrape only (STYLE.md §3: device-lost errors), the other GPU
              untouched, the error counted; ``up`` 1 on the next scrape
    plugin    that GPU unhealthy naming the error in that Fingerprint, healthy in the next
Row 5: an NVML call hangs: GPU 0 of 3, its ``nvmlDeviceGetMemoryInfo`` (the first call of the pass)
       after one complete pass; the collection's deadline is 1.5 s. In-process rows hold the hang
       (``hang_seconds = HELD``, :class:`faultmatrix_util.HeldHang`) until the test releases it, and
       move the replay's clock 100 s forward before the hang (energy is re-read on every pass there)
    exporter  every scrape answers in < 2 s (the issue's bound) while the call is still hung: GPU 0
              ``up`` 0, GPUs 1 and 2 ``up`` 1 with the values of the last complete pass (its power,
              memory and energy: a fresh read would show the clock's 100 s of energy); no thread
              that was not there before; once released, all ``up`` 1, fresh energy, and still no
              new thread
    plugin    Fingerprint in < 2 s: GPU 0 unhealthy ("did not answer within 1.5s"), 1 and 2 healthy,
              their Stats and readings those of the last complete pass, GPU 0's "N/A"; recovered
              after release; no new thread
    plugin    (process: the real ``nomad-device-accelstats`` through ``PluginProcess``, the call hung
              600 s) the Fingerprint stream sends GPU 0 unhealthy, 1 and 2 healthy; Stats keep coming
              every second (GPU 0 "N/A"); Reserve answers; Shutdown ends the process within Nomad's
              2 s grace although the call still hangs
    "The last values" are those of the GPUs the stuck pass has not reached, from the last
    complete pass. The stuck GPU itself has none: it is marked down (``up`` 0, no readings, and
    not its previous readings, which would hide that it stopped answering).
    (a hung PCIe throughput call: tests/collectors/test_pcie_sampler.py)
Row 6: a cgroup removed mid-walk (real cgroup v1 directories, and a replayed tree; removed from a
       hook at three moments: while the walk lists, before its PIDs are read, before devices.list)
    exporter  ``/metrics`` 200, the other container still attributed, the removal counted once as
              ``cgroup_vanished`` (not as ``devices_list_unreadable``), the stopped container not listed
    plugin    n/a: Fingerprint, Stats and Reserve carry no container data (the plugin's optional
              /metrics is the exporter's code path)
Row 7: a PID gone mid-read (a real child process, killed and reaped from a hook: before its
       ``/proc/<pid>/cgroup`` is read; after ``cgroup.procs`` listed it, before its fds are read)
    exporter  ``/metrics`` 200, GPU series intact; ``pid_vanished`` counted in the first case, the
              process still tied to its container in the second
    plugin    n/a, as row 6
Row 8: devices.list unreadable (the kernel's file, ``chmod 000``, read by an exporter process whose
       bounding set lacks CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH: a real EACCES for root)
    exporter  (process) ``/metrics`` 200, GPU series intact, ``devices_list_unreadable`` counted at
              every collection, that container without series, the other attributed
    plugin    n/a, as row 6
Row 9: 10 000 containers (a cgroup v1 tree replayed as plain directories)
    exporter  ``/metrics`` 200 with the 100 containers that hold a GPU; times printed, not asserted
    plugin    n/a, as row 6
Row 10: the file-devices directory deleted and recreated
    exporter  files success 0 and no file series while it is gone; the new file after, no restart
    plugin    Fingerprint without file devices while gone, with the new one (healthy) after
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.faultmatrix_util import (
    H200_UUID,
    HELD,
    HeldHang,
    Plugin,
    ReplayClock,
    assert_no_new_threads,
    eight_h200,
    gpu_utilization,
    live_threads,
    plugin_binary,
    replay_exporter,
    scrape,
    serve_subprocess,
    uuid_of,
    wait_until,
)
from support.nomadclient.ctymsgpack import encode_for_spec
from support.nomadclient.launcher import PluginProcess

LOST = uuid_of(5)
OTHER = uuid_of(1)


@pytest.fixture
def h200(fixtures_dir: Path) -> Path:
    return fixtures_dir / "h200" / "nvidia-smi-q.xml"


def plugin_config(scenario: Path, **extra: object) -> dict[str, object]:
    return {"nvml_replay": str(scenario), "fingerprint_period": "1m", **extra}


# -- row 1: NVML library missing at start, then present -----------------------------------------------

def test_row1_library_missing_then_present_exporter_process(tmp_path: Path, h200: Path) -> None:
    scenario = eight_h200(tmp_path, h200, '[[fault]]\ncall = "nvmlInit"\nerror = "LIBRARY_NOT_FOUND"\ntimes = 1\n',
                          count=1)
    for d in ("devs", "cgroup", "proc"):
        (tmp_path / d).mkdir()
    (tmp_path / "devs" / "dev0").write_text("x")
    config = tmp_path / "config.toml"
    config.write_text("nvml_retry_interval = 3\n")
    args = ["--config", str(config), "--nvml-replay", str(scenario), "--file-devices", str(tmp_path / "devs"),
            "--cgroup-root", str(tmp_path / "cgroup"), "--proc-root", str(tmp_path / "proc")]
    with serve_subprocess(args, tmp_path / "serve.log") as (_, url):
        first = scrape(url)
        assert first.value("accelstats_scrape_collector_success", collector="nvidia") == 0.0
        assert "accelstats_gpu_up" not in first.families
        assert first.values("accelstats_file_device_info", "device") == {"dev0": 1.0}
        wait_until(lambda: scrape(url).values("accelstats_gpu_up", "uuid") == {H200_UUID: 1.0}, timeout=15)
        assert scrape(url).value("accelstats_scrape_collector_success", collector="nvidia") == 1.0


def test_row1_real_pynvml_without_libnvidia_ml_exporter_process(tmp_path: Path) -> None:
    """Live NVML (no replay) on a host whose PCI scan finds an NVIDIA device but which has no
    libnvidia-ml: pynvml's real nvmlInit fails, /metrics still answers. Skipped where the library loads."""
    # asked in a process of its own: in this one, pynvml may hold a replayed library already
    probe = subprocess.run([sys.executable, "-c", "import pynvml\ntry:\n    pynvml.nvmlInit()\n"
                            "except pynvml.NVMLError_LibraryNotFound:\n    print('missing')"],
                           capture_output=True, text=True, timeout=60, check=False)
    if probe.stdout.strip() != "missing":
        pytest.skip("libnvidia-ml is installed here: the library is not missing")
    sysfs = tmp_path / "sys"
    (sysfs / "bus" / "pci" / "devices" / "0000:00:06.0").mkdir(parents=True)
    (sysfs / "bus" / "pci" / "devices" / "0000:00:06.0" / "vendor").write_text("0x10de\n")
    config = tmp_path / "config.toml"
    config.write_text(f'sysfs_root = "{sysfs}"\n')
    (tmp_path / "cgroup").mkdir()
    args = ["--config", str(config), "--cgroup-root", str(tmp_path / "cgroup"), "--proc-root", "/proc"]
    with serve_subprocess(args, tmp_path / "serve.log") as (_, url):
        got = scrape(url)
        assert got.value("accelstats_scrape_collector_success", collector="nvidia") == 0.0
        assert "accelstats_gpu_up" not in got.families
    assert "nvmlInit failed: LIBRARY_NOT_FOUND" in (tmp_path / "serve.log").read_text()


def test_row1_library_missing_then_present_plugin(tmp_path: Path, h200: Path) -> None:
    scenario = eight_h200(tmp_path, h200, '[[fault]]\ncall = "nvmlInit"\nerror = "LIBRARY_NOT_FOUND"\ntimes = 1\n',
                          count=1)
    with Plugin(plugin_config(scenario)) as plugin:
        assert plugin.fingerprint() == {}
        plugin.backend.retry_interval = 0.05
        time.sleep(0.1)
        assert plugin.fingerprint() == {H200_UUID: (True, "")}


# -- row 2: DRIVER_NOT_LOADED, then recovery ------------------------------------------------------------

DRIVER_FAULTS = {
    "at_init": '[[fault]]\ncall = "nvmlInit"\nerror = "DRIVER_NOT_LOADED"\ntimes = 2\n',
    "mid_session": '[[fault]]\ngpu = 0\ncall = "nvmlDeviceGetMemoryInfo"\nerror = "DRIVER_NOT_LOADED"\n'
                   'after_calls = 1\ntimes = 2\n',
}


@pytest.mark.parametrize("when", list(DRIVER_FAULTS))
def test_row2_driver_not_loaded_then_recovery_exporter(tmp_path: Path, h200: Path, when: str) -> None:
    scenario = eight_h200(tmp_path, h200, DRIVER_FAULTS[when], count=2)
    with replay_exporter(tmp_path, scenario, nvml_retry_interval=0.3) as exporter:
        scrapes = [exporter.scrape()]
        if when == "mid_session":
            assert scrapes[0].values("accelstats_gpu_up", "uuid") == {uuid_of(0): 1.0, uuid_of(1): 1.0}
            scrapes = [exporter.scrape()]  # the second pass meets the unloaded driver
        gone = scrapes[0]
        assert gone.value("accelstats_scrape_collector_success", collector="nvidia") == 0.0
        assert "accelstats_gpu_up" not in gone.families and "accelstats_gpu_memory_total_bytes" not in gone.families
        wait_until(lambda: exporter.scrape().values("accelstats_gpu_up", "uuid") == {
            uuid_of(0): 1.0, uuid_of(1): 1.0}, timeout=10)


@pytest.mark.parametrize("when", list(DRIVER_FAULTS))
def test_row2_driver_not_loaded_then_recovery_plugin(tmp_path: Path, h200: Path, when: str) -> None:
    scenario = eight_h200(tmp_path, h200, DRIVER_FAULTS[when], count=2)
    with Plugin(plugin_config(scenario)) as plugin:
        if when == "at_init":
            assert plugin.fingerprint() == {}  # no GPU known yet: nothing to keep
        else:
            assert plugin.fingerprint() == {uuid_of(0): (True, ""), uuid_of(1): (True, "")}
            gone = plugin.fingerprint()
            assert set(gone) == {uuid_of(0), uuid_of(1)}  # kept, so Nomad does not drop them
            assert all(not healthy and "DRIVER_NOT_LOADED" in why for healthy, why in gone.values())
        plugin.backend.retry_interval = 0.05
        wait_until(lambda: plugin.fingerprint() == {uuid_of(0): (True, ""), uuid_of(1): (True, "")})


# -- row 3: GPU_IS_LOST on 1 of 8 GPUs ------------------------------------------------------------------

# Enumeration reads no memory info, and memory info is the first reading of every pass (collectors/
# nvidia.py, NvidiaBackend.sample): GPU 5 is enumerated, then lost at its first reading, and stays
# lost (a re-enumeration finds it, its next reading fails again), whatever the number of calls a pass makes.
ONE_OF_EIGHT_LOST = '[[fault]]\ngpu = 5\ncall = "nvmlDeviceGetMemoryInfo"\nerror = "GPU_IS_LOST"\n'


def test_row3_gpu_lost_on_one_of_eight_exporter(tmp_path: Path, h200: Path) -> None:
    scenario = eight_h200(tmp_path, h200, ONE_OF_EIGHT_LOST)
    with replay_exporter(tmp_path, scenario) as exporter:
        for _ in range(2):
            got = exporter.scrape()
            assert got.values("accelstats_gpu_up", "uuid") == {uuid_of(i): 0.0 if i == 5 else 1.0 for i in range(8)}
            memory = got.values("accelstats_gpu_memory_total_bytes", "uuid")
            assert memory == {uuid_of(i): float(143771 << 20) for i in range(8) if i != 5}
            assert got.value("accelstats_scrape_collector_success", collector="nvidia") == 1.0
        errors = [s for s in got.families["accelstats_nvml_errors"] if s.labels["error"] == "GPU_IS_LOST"]
        assert errors and all(s.value >= 1 for s in errors)


def test_row3_gpu_lost_on_one_of_eight_plugin(tmp_path: Path, h200: Path) -> None:
    scenario = eight_h200(tmp_path, h200, ONE_OF_EIGHT_LOST)
    with Plugin(plugin_config(scenario)) as plugin:
        fp = plugin.fingerprint()
        assert sorted(fp) == sorted(uuid_of(i) for i in range(8))
        assert [uuid for uuid, (healthy, _) in fp.items() if not healthy] == [LOST]
        assert "GPU_IS_LOST" in fp[LOST][1]
        stats = plugin.stats()
        assert gpu_utilization(stats[LOST]) == "N/A"
        assert all(gpu_utilization(stats[uuid_of(i)]).isdigit() for i in range(8) if i != 5)


# -- row 4: UNKNOWN / TIMEOUT on a single call ------------------------------------------------------

def single_call_fault(error: str) -> str:
    return (f'[[fault]]\ngpu = 1\ncall = "nvmlDeviceGetPowerUsage"\nerror = "{error}"\n'
            "after_calls = 1\ntimes = 1\n")


@pytest.mark.parametrize("error", ["UNKNOWN", "TIMEOUT"])
def test_row4_unknown_or_timeout_on_one_call_exporter(tmp_path: Path, h200: Path, error: str) -> None:
    scenario = eight_h200(tmp_path, h200, single_call_fault(error), count=2)
    with replay_exporter(tmp_path, scenario) as exporter:
        ups = [exporter.scrape().values("accelstats_gpu_up", "uuid") for _ in range(2)]
        got = exporter.scrape()
        assert ups[0] == {uuid_of(0): 1.0, OTHER: 1.0}
        assert ups[1] == {uuid_of(0): 1.0, OTHER: 0.0}  # the collection whose call failed
        assert got.values("accelstats_gpu_up", "uuid") == {uuid_of(0): 1.0, OTHER: 1.0}  # and only that one
        assert got.value("accelstats_nvml_errors", call="nvmlDeviceGetPowerUsage", error=error) == 1.0
        assert set(got.values("accelstats_gpu_power_watts", "uuid")) == {uuid_of(0), OTHER}


@pytest.mark.parametrize("error", ["UNKNOWN", "TIMEOUT"])
def test_row4_unknown_or_timeout_on_one_call_plugin(tmp_path: Path, h200: Path, error: str) -> None:
    scenario = eight_h200(tmp_path, h200, single_call_fault(error), count=2)
    with Plugin(plugin_config(scenario)) as plugin:
        assert plugin.fingerprint() == {uuid_of(0): (True, ""), OTHER: (True, "")}
        during = plugin.fingerprint()
        assert during[uuid_of(0)] == (True, "") and not during[OTHER][0] and error in during[OTHER][1]
        assert plugin.fingerprint() == {uuid_of(0): (True, ""), OTHER: (True, "")}


# -- row 5: an NVML call that hangs -----------------------------------------------------------------

THREE = [uuid_of(i) for i in range(3)]
STUCK, REST = THREE[0], THREE[1:]
ALL_UP = {u: 1.0 for u in THREE}
HUNG_GPU0 = (f'[[fault]]\ngpu = 0\ncall = "nvmlDeviceGetMemoryInfo"\nhang_seconds = {HELD:g}\n'
             "after_calls = 1\ntimes = 1\n")
ENERGY = "accelstats_gpu_energy_joules"  # the parser's name of accelstats_gpu_energy_joules_total
LAST_READ = "accelstats_gpu_last_success_timestamp_seconds"


def held_replay(hang: HeldHang, clock: ReplayClock) -> dict[str, object]:
    return {"sleep": hang.sleep, "clock": clock}


def test_row5_hung_call_exporter(tmp_path: Path, h200: Path) -> None:
    scenario = eight_h200(tmp_path, h200, HUNG_GPU0, count=3)
    clock = ReplayClock()
    with HeldHang() as hang, replay_exporter(tmp_path, scenario, replay=held_replay(hang, clock)) as exporter:
        exporter.backend.slow_interval = 0  # slow reads on every pass: the stuck GPU is asked on each
        complete = exporter.scrape()  # the fault lets one memory call through: a complete pass
        assert complete.values("accelstats_gpu_up", "uuid") == ALL_UP
        clock.advance(100.0)
        before = live_threads()
        stuck = [exporter.scrape() for _ in range(3)]  # the first waits out the deadline, the others not
        assert (hang.entered, hang.in_progress) == (1, 1)  # all three answered while the call hung, in one pass
        print(f"scrapes while the call hangs: {[round(s.seconds, 3) for s in stuck]} s")
        read_at = complete.values(LAST_READ, "uuid")
        assert set(read_at) == set(THREE)
        for got in stuck:
            assert got.seconds < 2.0  # "/metrics still answers within 2 s"
            assert got.values("accelstats_gpu_up", "uuid") == {STUCK: 0.0, REST[0]: 1.0, REST[1]: 1.0}
            for family in ("accelstats_gpu_power_watts", "accelstats_gpu_memory_total_bytes", ENERGY):
                last = {u: v for u, v in complete.values(family, "uuid").items() if u in REST}
                assert got.values(family, "uuid") == last, family  # the last pass's, and none for GPU 0
            # ...and they say so: every GPU's readings are as of the complete pass, not of this scrape
            assert got.values(LAST_READ, "uuid") == read_at
        assert_no_new_threads(before)  # no thread per stuck scrape
        hang.release()
        wait_until(lambda: exporter.scrape().values("accelstats_gpu_up", "uuid") == ALL_UP)
        # read anew (the energy family is the accounting split's reading here, every tenth round)
        assert all(t > read_at[u] for u, t in exporter.scrape().values(LAST_READ, "uuid").items())
        assert hang.in_progress == 0
        assert_no_new_threads(before)  # the call returned: no thread left behind


def test_row5_hung_call_plugin(tmp_path: Path, h200: Path) -> None:
    scenario = eight_h200(tmp_path, h200, HUNG_GPU0, count=3)
    clock = ReplayClock()
    healthy = {u: (True, "") for u in THREE}
    with HeldHang() as hang, Plugin(plugin_config(scenario), replay=held_replay(hang, clock)) as plugin:
        plugin.backend.slow_interval = 0
        assert plugin.fingerprint() == healthy
        complete = plugin.collection()
        stats_before = plugin.stats(complete)
        clock.advance(100.0)
        before = live_threads()
        t0 = time.monotonic()
        fp = plugin.fingerprint()
        took = time.monotonic() - t0
        stuck = plugin.collection()
        stats = plugin.stats(stuck)
        assert (hang.entered, hang.in_progress) == (1, 1)  # all of it while the call hung
        assert took < 2.0  # the bound, as for /metrics
        assert not fp[STUCK][0] and "did not answer within 1.5s" in fp[STUCK][1]
        assert {u: fp[u] for u in REST} == {u: (True, "") for u in REST}
        assert gpu_utilization(stats[STUCK]) == "N/A"
        for u in REST:
            assert (stats[u].summary, stats[u].stats) == (stats_before[u].summary, stats_before[u].stats)
            assert stuck.snapshot.samples[u].energy_joules == complete.snapshot.samples[u].energy_joules
        assert_no_new_threads(before)
        hang.release()
        wait_until(lambda: plugin.fingerprint() == healthy)
        fresh = plugin.collection().snapshot.samples
        assert all(fresh[u].energy_joules > complete.snapshot.samples[u].energy_joules for u in THREE)
        assert_no_new_threads(before)


@pytest.mark.slow  # more than ~5 s: real daemons, deadlines or a soak
def test_row5_hung_call_plugin_process(tmp_path: Path, h200: Path) -> None:
    """The real plugin process, as a Nomad client runs it: the replay's hang is real here (600 s,
    longer than the test), so everything below happens while the call hangs."""
    scenario = eight_h200(tmp_path, h200, '[[fault]]\ngpu = 0\ncall = "nvmlDeviceGetMemoryInfo"\n'
                          'hang_seconds = 600\nafter_calls = 1\ntimes = 1\n', count=3)
    with PluginProcess(plugin_binary()) as plugin:
        plugin.set_config(encode_for_spec(plugin.config_schema().spec, plugin_config(scenario)))
        fingerprints = plugin.fingerprint()
        first = fingerprints.read(timeout=15)
        assert {d.ID: d.healthy for g in first.device_group for d in g.devices} == {u: True for u in THREE}
        stats = plugin.stats(1.0)  # its first collection is the second pass: GPU 0's memory call hangs
        for _ in range(3):
            message = stats.read(timeout=15)
            by_id = {i: s for g in message.groups for i, s in g.instance_stats.items()}
            assert gpu_utilization(by_id[STUCK]) == "N/A"
            assert all(gpu_utilization(by_id[u]).isdigit() for u in REST)
        later = fingerprints.read(timeout=15)  # health is re-checked every 5 s: sent on the change
        devices = {d.ID: d for g in later.device_group for d in g.devices}
        assert not devices[STUCK].healthy and "did not answer within 1.5s" in devices[STUCK].health_description
        assert all(devices[u].healthy for u in REST)
        reserved = plugin.reserve([REST[0]], timeout=10).container_res
        assert "/dev/nvidia1" in [d.host_path for d in reserved.devices]
        assert fingerprints.open and stats.open
        result = plugin.shutdown()
    assert result.exited_by_itself, result  # within Nomad's 2 s grace, the call still hung
