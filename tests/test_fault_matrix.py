"""The fault matrix (issue 7): one test per row and surface; this docstring is the table.

Surfaces: **exporter** = ``/metrics`` over HTTP from a served exporter (in-process
``accelstats.exporter.serve``, or ``python3 -m accelstats serve`` as a child process where the row
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
Row 3: GPU_IS_LOST on 1 of 8 GPUs
    exporter  8 ``gpu_up`` series, 7 at 1 with their readings, the lost one 0 with none, on every
              scrape; the error counted in ``nvml_errors_total``
    plugin    8 devices: 7 healthy, the lost one unhealthy naming GPU_IS_LOST; its Stats "N/A"
Row 4: UNKNOWN / TIMEOUT on a single call
    exporter  that GPU ``up`` 0 in that scrape only (STYLE.md §3: device-lost errors), the other GPU
              untouched, the error counted; ``up`` 1 on the next scrape
    plugin    that GPU unhealthy naming the error in that Fingerprint, healthy in the next
Row 5: an NVML call hangs (``hang_seconds = 4``; deadline 1.5 s)
    exporter  every scrape in < 2 s: the other GPU with its (last) values, the stuck one ``up`` 0; no
              thread per scrape; once the call returns, both ``up`` 1 and the same threads as before
    plugin    Fingerprint in < 2 s: the stuck GPU unhealthy ("did not answer"), the other healthy with
              Stats; recovered after; the same threads as before
    (a hung PCIe throughput call: tests/test_pcie_sampler.py)
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

import time
from pathlib import Path

import pytest
from faultmatrix_util import (
    H200_UUID,
    Plugin,
    eight_h200,
    gpu_utilization,
    replay_exporter,
    scrape,
    serve_subprocess,
    thread_names,
    uuid_of,
    wait_until,
)

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
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        pass
    else:
        pynvml.nvmlShutdown()
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

# Setup makes 24 calls naming each GPU (enumeration, XID registration, the first PCIe round) and a
# pass 29: GPU 5 is enumerated, then lost in the middle of the first pass, and stays lost.
ONE_OF_EIGHT_LOST = '[[fault]]\ngpu = 5\ncall = "*"\nerror = "GPU_IS_LOST"\nafter_calls = 40\n'


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

HANG = '[[fault]]\ngpu = 1\ncall = "nvmlDeviceGetMemoryInfo"\nhang_seconds = 4\nafter_calls = 1\ntimes = 1\n'


def test_row5_hung_call_exporter(tmp_path: Path, h200: Path) -> None:
    scenario = eight_h200(tmp_path, h200, HANG, count=2)
    with replay_exporter(tmp_path, scenario) as exporter:
        assert exporter.scrape().values("accelstats_gpu_up", "uuid") == {uuid_of(0): 1.0, OTHER: 1.0}
        before = thread_names()
        hung_at = time.monotonic()
        stuck = [exporter.scrape() for _ in range(3)]  # the first waits out the deadline, then at once
        print(f"scrapes while the call hangs: {[round(s.seconds, 3) for s in stuck]} s")
        for got in stuck:
            assert got.seconds < 2.0
            assert got.values("accelstats_gpu_up", "uuid") == {uuid_of(0): 1.0, OTHER: 0.0}
            assert got.value("accelstats_gpu_memory_total_bytes", uuid=uuid_of(0)) == float(143771 << 20)
        assert thread_names() == before  # no thread per stuck scrape
        assert time.monotonic() - hung_at < 4.0  # all of that while the call was still hung
        wait_until(lambda: exporter.scrape().values("accelstats_gpu_up", "uuid") == {uuid_of(0): 1.0, OTHER: 1.0})
        assert thread_names() == before  # the call returned: no thread left behind


def test_row5_hung_call_plugin(tmp_path: Path, h200: Path) -> None:
    scenario = eight_h200(tmp_path, h200, HANG, count=2)
    with Plugin(plugin_config(scenario)) as plugin:
        assert plugin.fingerprint() == {uuid_of(0): (True, ""), OTHER: (True, "")}
        before = thread_names()
        t0 = time.monotonic()
        fp = plugin.fingerprint()
        took = time.monotonic() - t0
        assert took < 2.0
        assert fp[uuid_of(0)] == (True, "") and not fp[OTHER][0] and "did not answer within 1.5s" in fp[OTHER][1]
        stats = plugin.stats()
        assert gpu_utilization(stats[uuid_of(0)]).isdigit() and gpu_utilization(stats[OTHER]) == "N/A"
        assert thread_names() == before
        wait_until(lambda: plugin.fingerprint() == {uuid_of(0): (True, ""), OTHER: (True, "")})
        assert thread_names() == before
