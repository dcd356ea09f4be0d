"""GPM profiling and NVLink families: the background sampler (collectors/profiling.py, collectors/nvlink.py)
over the replayed library and the real pynvml, scenario tests/scenarios/h200_gpm.toml.

| what | asserted |
|---|---|
| values | ``sm_util = 80.0`` → ``accelstats_gpu_sm_active_ratio`` 0.8, tensor/pipe/DRAM likewise, per pipe |
| absent, never 0 | a metric the scenario leaves out (``dmma_tensor_util``): no series; a capture: no series |
| state | ready / unsupported with the reason (capture GPU, MIG instance without ``[gpu.mig.gpm]``) |
| MIG | an instance's own values (``[gpu.mig.gpm]``) on its MIG UUID |
| NVLink | up 1 / down 0, data bytes = KiB x 1024 by direction, errors by type |
| promtool | the whole exposition passes ``promtool check metrics`` |
| off / scrape path | ``profiling_interval = 0``: no sampler, no series, no state; no GPM call in the scrape pass |
| config | ``nvml_profiling_interval`` parses 0 and 2.5, rejects < 0; ``dcgm_names`` a bool |
| samples | every GPM sample allocated is freed at shutdown |
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from accelstats.config import load_config
from accelstats.manager import AcceleratorManager, Collection
from accelstats.settings import ConfigError, Settings
from accelstats.web.exposition import exposition, render
from collectors.model import DeviceSnapshot
from collectors.nvidia import NvidiaBackend
from collectors.replay.lib import open_replay

SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "h200_gpm.toml"
GPU0 = "GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c10"


def wait_for(predicate: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def samples(b: NvidiaBackend) -> dict[str, dict[str, float]]:
    """``{family: {label string: value}}`` of one collection's profiling and NVLink families."""
    snap = DeviceSnapshot()
    b.update(snap)
    out: dict[str, dict[str, float]] = {}
    for fam in render(Collection(snapshot=snap)):
        if fam.name.endswith(("_active_ratio", "_occupancy_ratio")) or "profiling" in fam.name or "nvlink" in fam.name:
            for s in fam.samples:
                key = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model",))
                out.setdefault(s.name, {})[key] = s.value
    return out


@pytest.fixture
def ready() -> NvidiaBackend:
    b = NvidiaBackend(open_replay(SCENARIO), pcie_interval=0, profiling_interval=0.05)
    b.setup()
    assert b.profiling is not None
    wait_for(lambda: b.profiling.rounds >= 2)  # type: ignore[union-attr]
    yield b
    b.close()


def test_gpu_values_are_the_scenarios_as_ratios(ready: NvidiaBackend) -> None:
    got = samples(ready)
    gpu0 = f"gpu=0,uuid={GPU0}"
    assert got["accelstats_gpu_sm_active_ratio"][gpu0] == pytest.approx(0.8)
    assert got["accelstats_gpu_sm_occupancy_ratio"][gpu0] == pytest.approx(0.4)
    assert got["accelstats_gpu_graphics_engine_active_ratio"][gpu0] == pytest.approx(0.9)
    assert got["accelstats_gpu_dram_active_ratio"][gpu0] == pytest.approx(0.3)
    tensor = {k: v for k, v in got["accelstats_gpu_tensor_active_ratio"].items() if GPU0 in k}
    assert tensor == pytest.approx({f"gpu=0,pipe={p},uuid={GPU0}": v
                                    for p, v in (("any", 0.55), ("hmma", 0.5), ("imma", 0.0), ("dfma", 0.05))})
    pipes = got["accelstats_gpu_pipe_active_ratio"]
    assert pipes == pytest.approx({f"gpu=0,pipe={p},uuid={GPU0}": v
                                   for p, v in (("fp64", 0.01), ("fp32", 0.125), ("fp16", 0.07), ("integer", 0.2))})
    assert got["accelstats_gpu_nvdec_active_ratio"] == pytest.approx({f"engine=0,gpu=0,uuid={GPU0}": 0.1})
    assert got["accelstats_gpu_profiling_state"][f"gpu=0,reason=,state=ready,uuid={GPU0}"] == 1.0


def test_mig_instances_render_their_own_values_or_say_why_not(ready: NvidiaBackend) -> None:
    migs = {d.gpu_instance_id: d.uuid for d in ready.devices() if d.kind == "mig"}
    got = samples(ready)
    assert got["accelstats_gpu_sm_active_ratio"][f"gpu=1,uuid={migs[1]}"] == pytest.approx(0.7)
    assert got["accelstats_gpu_tensor_active_ratio"][f"gpu=1,pipe=any,uuid={migs[1]}"] == pytest.approx(0.65)
    assert not any(migs[2] in k for fam in got.values() for k in fam if "state=" not in k)
    assert got["accelstats_gpu_profiling_state"][
        f"gpu=1,reason=nvmlGpmMigSampleGet: NOT_SUPPORTED,state=unsupported,uuid={migs[2]}"] == 1.0


def test_nvlink_links(ready: NvidiaBackend) -> None:
    got = samples(ready)
    assert got["accelstats_gpu_nvlink_up"] == {f"gpu=0,link=0,uuid={GPU0}": 1.0, f"gpu=0,link=1,uuid={GPU0}": 0.0}
    data = got["accelstats_gpu_nvlink_data_bytes_total"]
    assert data[f"direction=tx,gpu=0,link=0,uuid={GPU0}"] == 1024 * 1024
    assert data[f"direction=rx,gpu=0,link=0,uuid={GPU0}"] == 2048 * 1024
    errors = got["accelstats_gpu_nvlink_errors_total"]
    assert {k: v for k, v in errors.items() if "link=1" in k} == {
        f"gpu=0,link=1,type=crc_flit,uuid={GPU0}": 3.0, f"gpu=0,link=1,type=replay,uuid={GPU0}": 2.0,
        f"gpu=0,link=1,type=recovery,uuid={GPU0}": 1.0}


def test_metrics_left_out_are_absent_never_zero(ready: NvidiaBackend) -> None:
    got = samples(ready)
    assert not any("pipe=dmma" in k for k in got["accelstats_gpu_tensor_active_ratio"])
    gpu1 = "uuid=GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c11"
    assert [k for k in got["accelstats_gpu_sm_active_ratio"] if gpu1 in k] == [f"gpu=1,{gpu1}"]
    assert not any(gpu1 in k for k in got["accelstats_gpu_dram_active_ratio"])
    assert not any(gpu1 in k for k in got.get("accelstats_gpu_nvlink_up", {}))


def test_a_capture_has_no_profiling_series_and_says_why(fixtures_dir: Path) -> None:
    b = NvidiaBackend(open_replay(fixtures_dir / "h200" / "nvidia-smi-q.xml"), pcie_interval=0,
                      profiling_interval=0.05)
    try:
        b.setup()
        wait_for(lambda: b.profiling.rounds >= 2)  # type: ignore[union-attr]
        got = samples(b)
    finally:
        b.close()
    assert list(got) == ["accelstats_gpu_profiling_state"]
    (key,) = got["accelstats_gpu_profiling_state"]
    assert "state=unsupported" in key and "isSupportedDevice 0" in key


def test_interval_zero_reads_nothing_and_the_scrape_pass_makes_no_gpm_call() -> None:
    nvml = open_replay(SCENARIO)
    b = NvidiaBackend(nvml, pcie_interval=0, profiling_interval=0)
    try:
        assert b.profiling is None
        before = sum(n for name, n in nvml.library.calls.items() if "Gpm" in name or "NvLink" in name)
        assert samples(b) == {}
        after = sum(n for name, n in nvml.library.calls.items() if "Gpm" in name or "NvLink" in name)
        assert after == before
    finally:
        b.close()


def test_every_gpm_sample_is_freed_at_shutdown() -> None:
    nvml = open_replay(SCENARIO)
    b = NvidiaBackend(nvml, pcie_interval=0, profiling_interval=0.05)
    b.setup()
    wait_for(lambda: b.profiling.rounds >= 2)  # type: ignore[union-attr]
    assert len(nvml.state.gpm_samples) == 6  # two per GPM device: GPU 0, GPU 1, GPU 1's instance 1
    b.close()
    assert nvml.state.gpm_samples == set()


@pytest.mark.parametrize("dcgm_names", [False, True])
def test_promtool_accepts_the_profiling_exposition(tmp_path: Path, dcgm_names: bool) -> None:
    """accelstats' own families pass ``promtool check metrics``; with ``dcgm_names`` on, its only
    complaints are about dcgm-exporter's camelCase labels (``modelName``, ``UUID``…), which dashboards
    written for dcgm-exporter need as they are."""
    if shutil.which("promtool") is None:
        pytest.skip("promtool (Debian package prometheus) not installed")
    settings = Settings(nvml_replay=SCENARIO, cgroup_root=tmp_path / "cgroup", proc_root=tmp_path / "proc",
                        nvml_profiling_interval=0.05, dcgm_names=dcgm_names)
    with AcceleratorManager(settings, open_replay(SCENARIO)) as manager:
        exposition(manager)
        time.sleep(0.3)
        text = exposition(manager).decode()
    assert "accelstats_gpu_sm_active_ratio{" in text and "accelstats_gpu_nvlink_errors_total{" in text
    assert ("DCGM_FI_PROF_SM_ACTIVE{" in text) == dcgm_names
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                           timeout=60, check=False)
    complaints = [line for line in (check.stdout + check.stderr).splitlines() if line.strip()]
    if not dcgm_names:
        assert check.returncode == 0, complaints
    assert all(c.startswith("DCGM_FI_") and "camelCase" in c for c in complaints), complaints


@pytest.mark.parametrize(("value", "expected"), [("0", 0.0), ("2.5", 2.5)])
def test_config_nvml_profiling_interval(tmp_path: Path, value: str, expected: float) -> None:
    path = tmp_path / "config.toml"
    path.write_text(f"nvml_profiling_interval = {value}\ndcgm_names = true\n")
    settings = load_config(path, Settings())
    assert settings.nvml_profiling_interval == expected and settings.dcgm_names is True


@pytest.mark.parametrize("text", ["nvml_profiling_interval = -1", 'dcgm_names = "yes"'])
def test_config_rejects(tmp_path: Path, text: str) -> None:
    path = tmp_path / "config.toml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=r"nvml_profiling_interval|dcgm_names"):
        load_config(path, Settings())


def _holder(name: str, uuid: str, index: int) -> Any:
    from accelstats.attribution.containers import AcceleratorStats, ContainerIdentity, ContainerStats

    return ContainerStats(cgroup=f"/docker/{name}", identity=ContainerIdentity(runtime="docker", id=name),
                          accelerators=[AcceleratorStats(
                              make="nvidia", model="NVIDIA H200", id=uuid, minor=index, index=index,
                              attribution="devices_cgroup", memory_total_bytes=None, memory_used_bytes=None,
                              duty_cycle=None, container_memory_used_bytes=0, container_sm_utilization_ratio=None,
                              container_processes=0)])


def test_a_sole_holder_carries_its_devices_ratios_and_sharers_get_none(ready: NvidiaBackend) -> None:
    """GPU 0 held by container a alone: a's series carry GPU 0's SM, tensor and DRAM activity. The MIG
    instance 1 held by b alone: b gets the instance's own values. GPU 1 held by c and d: no series (GPM
    measures the device, not the processes)."""
    snap = DeviceSnapshot()
    ready.update(snap)
    mig1 = next(d.uuid for d in snap.devices if d.gpu_instance_id == 1)
    containers = [_holder("a", GPU0, 0), _holder("b", mig1, 1),
                  _holder("c", "GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c11", 1),
                  _holder("d", "GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c11", 1)]
    got: dict[str, dict[tuple[str, str], float]] = {}
    for fam in render(Collection(snapshot=snap, containers=containers)):
        if fam.name.startswith("accelstats_container_gpu_") and fam.name.endswith(("active_ratio", "occupancy_ratio")):
            for s in fam.samples:
                got.setdefault(s.name, {})[(s.labels["id"], s.labels.get("pipe", ""))] = s.value
    assert got["accelstats_container_gpu_sm_active_ratio"] == pytest.approx(
        {("/docker/a", ""): 0.8, ("/docker/b", ""): 0.7})
    assert got["accelstats_container_gpu_dram_active_ratio"] == pytest.approx(
        {("/docker/a", ""): 0.3, ("/docker/b", ""): 0.45})
    assert got["accelstats_container_gpu_tensor_active_ratio"][("/docker/a", "any")] == pytest.approx(0.55)
    assert got["accelstats_container_gpu_sm_occupancy_ratio"] == pytest.approx(
        {("/docker/a", ""): 0.4, ("/docker/b", ""): 0.35})
    assert not any(cid in ("/docker/c", "/docker/d") for fam in got.values() for cid, _ in fam)
