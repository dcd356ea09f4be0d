"""accelstats_gpu_pcie_throughput_bytes_per_second: the background sampler (collectors/pcie.py).

| what | asserted |
|---|---|
| capture values | ``<tx_util>884 KB/s`` / ``<rx_util>422 KB/s`` (H200) → tx 905216, rx 432128 bytes/s |
| scenario override | ``pcie_tx_kbps = 850`` → 870400 bytes/s; ``pcie_rx_kbps = "N/A"`` → no rx series |
| staleness | a reading older than 3 intervals is absent, not repeated |
| lost GPU | GPU_IS_LOST on one GPU's PCIe call: its reading absent, the other GPU's present, error counted |
| MIG | instances get no series (NVML measures the physical link); the parent does |
| hang | PCIe call hung until released: scrapes done with all else meanwhile; PCIe ages out; no 2nd round; back |
| off | ``pcie_interval = 0``: no sampler, no thread, no series; config ``nvml_pcie_interval`` parses 0, rejects < 0 |
| close | stop joins the timer thread; close ends the worker too |
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import pytest
from support.faultmatrix_util import HELD, HeldHang

from accelstats.config import load_config
from accelstats.manager import Collection
from accelstats.settings import ConfigError
from accelstats.web.exposition import render
from collectors.model import DeviceSnapshot
from collectors.nvidia import NvidiaBackend
from collectors.nvml_call import NvmlCaller
from collectors.pcie import STALE_INTERVALS, PcieSampler
from collectors.replay.lib import open_replay

H200_UUID = "GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c10"
SECOND_UUID = "GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c11"
TWO_H200 = """
[[gpu]]
capture = "CAPTURE"
[[gpu]]
capture = "CAPTURE"
uuid = "GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c11"
minor = 1
pci_bus_id = "00000000:00:07.0"
"""


@pytest.fixture
def h200(fixtures_dir: Path) -> Path:
    return fixtures_dir / "h200" / "nvidia-smi-q.xml"


def scenario(tmp_path: Path, capture: Path, body: str) -> Path:
    path = tmp_path / "scenario.toml"
    path.write_text(body.replace("CAPTURE", str(capture)))
    return path


def snapshot(b: NvidiaBackend) -> DeviceSnapshot:
    snap = DeviceSnapshot()
    b.update(snap)
    return snap


def pcie(snap: DeviceSnapshot, uuid: str = H200_UUID) -> dict[str, float]:
    return dict(snap.samples[uuid].pcie_throughput_bytes_per_second)


def wait_for(predicate: object, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.01)
    raise AssertionError(f"not true within {timeout}s")


def test_capture_kb_per_second_become_bytes_per_second_by_direction(h200: Path) -> None:
    b = NvidiaBackend(open_replay(h200))
    try:
        snap = snapshot(b)  # setup waits for the first round: the first scrape has values
        assert pcie(snap) == {"tx": 884 * 1024, "rx": 422 * 1024}
        families = {f.name: f for f in render(Collection(snapshot=snap))}
        series = {s.labels["direction"]: s.value
                  for s in families["accelstats_gpu_pcie_throughput_bytes_per_second"].samples}
        assert series == {"tx": 905216.0, "rx": 432128.0}
    finally:
        b.close()


def test_scenario_override_and_a_direction_nvml_does_not_answer(tmp_path: Path, h200: Path) -> None:
    path = scenario(tmp_path, h200, """
[[gpu]]
capture = "CAPTURE"
[gpu.override]
pcie_tx_kbps = 850
pcie_rx_kbps = "N/A"
""")
    b = NvidiaBackend(open_replay(path))
    try:
        snap = snapshot(b)
        assert pcie(snap) == {"tx": 850 * 1024}  # rx NOT_SUPPORTED: absent, never 0
        families = {f.name: f for f in render(Collection(snapshot=snap))}
        assert [s.labels["direction"] for s in
                families["accelstats_gpu_pcie_throughput_bytes_per_second"].samples] == ["tx"]
    finally:
        b.close()


def test_a_reading_older_than_three_intervals_is_absent(h200: Path) -> None:
    replay = open_replay(h200)
    replay.nvmlInit()
    now = [1000.0]
    sampler = PcieSampler(NvmlCaller(replay), replay, interval=60.0, clock=lambda: now[0])
    try:
        sampler.start({H200_UUID: replay.nvmlDeviceGetHandleByIndex(0)})
        assert dict(sampler.reading(H200_UUID)) == {"tx": 905216.0, "rx": 432128.0}
        now[0] += STALE_INTERVALS * 60.0  # exactly three intervals old: still served
        assert sampler.reading(H200_UUID) != ()
        now[0] += 0.001
        assert sampler.reading(H200_UUID) == ()
        assert sampler.reading("GPU-unknown") == ()
    finally:
        assert sampler.close()


def test_a_lost_gpu_loses_its_reading_and_the_other_keeps_its_own(tmp_path: Path, h200: Path) -> None:
    path = scenario(tmp_path, h200, TWO_H200 + """
[[fault]]
gpu = 1
call = "nvmlDeviceGetPcieThroughput"
error = "GPU_IS_LOST"
""")
    b = NvidiaBackend(open_replay(path))
    try:
        snap = snapshot(b)
        assert pcie(snap, H200_UUID) == {"tx": 905216.0, "rx": 432128.0}
        assert pcie(snap, SECOND_UUID) == {}
        assert snap.samples[SECOND_UUID].up  # only the PCIe call fails: the pass reads the GPU
        assert b.call.errors[("nvmlDeviceGetPcieThroughput", "GPU_IS_LOST")] == 1
    finally:
        b.close()


def test_mig_instances_get_no_pcie_series(fixtures_dir: Path) -> None:
    replay = open_replay(fixtures_dir / "public" / "a100-sxm4-v12.xml")
    asked: list[object] = []

    class Counting:
        """The replay, recording the handles nvmlDeviceGetPcieThroughput is asked for."""

        def __getattr__(self, name: str) -> object:
            return getattr(replay, name)

        def nvmlDeviceGetPcieThroughput(self, handle: object, counter: int) -> object:  # noqa: N802
            asked.append(handle)
            return replay.nvmlDeviceGetPcieThroughput(handle, counter)

    b = NvidiaBackend(Counting(), pci_scan=False)
    try:
        snap = snapshot(b)
        parent, *migs = snap.devices
        assert pcie(snap, parent.uuid) == {"tx": 4000 * 1024, "rx": 0.0}
        assert len(migs) == 4 and all(pcie(snap, m.uuid) == {} for m in migs)
        parent_handle = replay.nvmlDeviceGetHandleByIndex(0)
        # never a MIG handle: every handle asked is the parent GPU's (same address)
        assert asked and {ctypes.cast(h, ctypes.c_void_p).value for h in asked} == {
            ctypes.cast(parent_handle, ctypes.c_void_p).value}
    finally:
        b.close()


def test_a_hung_pcie_call_never_delays_a_scrape_and_its_values_age_out(tmp_path: Path, h200: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """The third PCIe call (the second round's first) hangs until the test releases it (HeldHang);
    rounds every 0.1 s; the sampler's clock is the test's, moved by hand past three intervals. No
    timing is asserted: a scrape that waited for the PCIe call could not complete while it hangs,
    and one that waited past the (30 s) deadline would have the GPU down."""
    path = scenario(tmp_path, h200, f"""
[[gpu]]
capture = "CAPTURE"
[[fault]]
call = "nvmlDeviceGetPcieThroughput"
hang_seconds = {HELD:g}
after_calls = 2
times = 1
""")
    now = [1000.0]
    with HeldHang() as hang:
        b = NvidiaBackend(open_replay(path, sleep=hang.sleep), deadline=30.0, pcie_interval=0.1)
        assert b.pcie is not None
        b.pcie.clock = lambda: now[0]
        b.pcie.hang_after = 0.3  # the log calls the round hung after 0.3 s (default 10 s)
        try:
            snapshot(b)  # NVML set up; the first round (2 calls, no hang) runs
            wait_for(lambda: pcie(snapshot(b)) == {"tx": 905216.0, "rx": 432128.0})
            wait_for(lambda: hang.in_progress == 1)  # the second round is stuck in its first call
            fresh = snapshot(b)
            now[0] += STALE_INTERVALS * 0.1 + 0.001
            aged = snapshot(b)
            for snap in (fresh, aged):
                s = snap.samples[H200_UUID]
                assert s.up and s.memory_total_bytes == 143771 << 20  # the scrape's own values are all there
            assert pcie(fresh) == {"tx": 905216.0, "rx": 432128.0}  # served while fresh ...
            assert pcie(aged) == {}  # ... absent once older than three intervals, not repeated
            # the timer came round while the round hung, and did not start a second one
            wait_for(lambda: "an NVML call hangs" in caplog.text)
            assert (hang.entered, hang.in_progress, b.pcie.rounds) == (1, 1, 1)
            assert len(b.pcie.threads) == 2  # the timer and the one stuck worker
            hang.release()
            wait_for(lambda: b.pcie is not None and not b.pcie.busy)  # the call returns
            wait_for(lambda: pcie(snapshot(b)) != {})  # the next rounds read again
        finally:
            b.close()


def test_pcie_interval_zero_reads_nothing_and_starts_no_thread(h200: Path) -> None:
    b = NvidiaBackend(open_replay(h200), pcie_interval=0)
    try:
        snap = snapshot(b)
        assert b.pcie is None and pcie(snap) == {}
        assert snap.samples[H200_UUID].up
    finally:
        b.close()


@pytest.mark.parametrize(("value", "expected"), [("0", 0.0), ("2.5", 2.5), ("30", 30.0)])
def test_config_nvml_pcie_interval(tmp_path: Path, value: str, expected: float) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(f"nvml_pcie_interval = {value}\n")
    assert load_config(cfg).nvml_pcie_interval == expected


@pytest.mark.parametrize("value", ["-1", "inf", '"10"'])
def test_config_nvml_pcie_interval_rejects(tmp_path: Path, value: str) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(f"nvml_pcie_interval = {value}\n")
    with pytest.raises(ConfigError, match="nvml_pcie_interval"):
        load_config(cfg)


def test_stop_joins_the_timer_and_close_ends_the_worker(h200: Path) -> None:
    b = NvidiaBackend(open_replay(h200), pcie_interval=0.05)
    assert b.pcie is not None
    snapshot(b)
    wait_for(lambda: b.pcie is not None and b.pcie.rounds >= 3)  # the timer runs rounds
    assert {t.name for t in b.pcie.threads} == {"accelstats-pcie", "accelstats-pcie-nvml"}
    b.shutdown()  # NVML shut down: the timer is joined, readings dropped
    assert [t.name for t in b.pcie.threads] == ["accelstats-pcie-nvml"]
    assert b.pcie.reading(H200_UUID) == ()
    b.close()
    assert b.pcie.threads == ()


def test_replay_pcie_throughput_unit_is_kb_per_second(h200: Path) -> None:
    """The replay answers the capture's KB/s as NVML does (the sampler multiplies by 1024)."""
    replay = open_replay(h200)
    replay.nvmlInit()
    h = replay.nvmlDeviceGetHandleByIndex(0)
    assert replay.nvmlDeviceGetPcieThroughput(h, replay.NVML_PCIE_UTIL_TX_BYTES) == 884
    assert replay.nvmlDeviceGetPcieThroughput(h, replay.NVML_PCIE_UTIL_RX_BYTES) == 422


def test_shutdown_during_a_hung_pcie_call_leaves_nvml_and_the_sampler_running(tmp_path: Path, h200: Path) -> None:
    """nvmlShutdown under a running call is undefined: shutdown() backs off, and the sampler's timer
    goes on (NVML stays initialised), so values come back once the call returns (released by the test)."""
    path = scenario(tmp_path, h200, f"""
[[gpu]]
capture = "CAPTURE"
[[fault]]
call = "nvmlDeviceGetPcieThroughput"
hang_seconds = {HELD:g}
after_calls = 2
times = 1
""")
    with HeldHang() as hang:
        b = NvidiaBackend(open_replay(path, sleep=hang.sleep), pcie_interval=0.1)
        assert b.pcie is not None
        try:
            snapshot(b)
            wait_for(lambda: hang.in_progress == 1)
            b.shutdown()
            assert hang.in_progress == 1  # shut down while the call hung
            assert b.devices() != []  # not shut down: handles kept
            assert "accelstats-pcie" in {t.name for t in b.pcie.threads}  # the timer runs again
            hang.release()
            wait_for(lambda: pcie(snapshot(b)) == {"tx": 905216.0, "rx": 432128.0})
        finally:
            b.close()
