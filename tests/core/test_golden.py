"""Golden /metrics output for every fixture capture (node_exporter's end-to-end pattern).

The exposition of ``accelstats dump --nvml-replay <capture>`` on an empty cgroup tree must equal
``tests/core/golden/<capture>.prom``, less the lines whose values depend on the moment (collector
durations, energy counted from when the replay was loaded, the Python version). After an intended
change, regenerate with ``ACCELSTATS_UPDATE_GOLDEN=1 python3 -m pytest tests/core/test_golden.py`` and
review the diff.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from accelstats.manager import AcceleratorManager
from accelstats.settings import KubernetesSettings, Settings
from accelstats.web.exposition import exposition
from collectors.replay.lib import open_replay

GOLDEN = Path(__file__).parent / "golden"
VOLATILE = ("accelstats_scrape_collector_duration_seconds{", "accelstats_gpu_energy_joules_total{",
            "accelstats_build_info{", "accelstats_gpu_last_success_timestamp_seconds{",
            "accelstats_scrape_collector_last_success_timestamp_seconds{")
CAPTURES = ["h200/nvidia-smi-q.xml", "public/a100-sxm4-v12.xml", "public/dual_a5000-v13.xml",
            "public/tesla-t4.xml"]


def stable(text: str) -> str:
    return "".join(line + "\n" for line in text.splitlines() if not line.startswith(VOLATILE))


@pytest.mark.parametrize("capture", CAPTURES)
def test_exposition_matches_golden(fixtures_dir: Path, tmp_path: Path, capture: str) -> None:
    path = fixtures_dir / capture
    settings = Settings(nvml_replay=path, cgroup_root=tmp_path / "cgroup", proc_root=tmp_path / "proc",
                        kubernetes=KubernetesSettings(pod_resources_socket=tmp_path / "kubelet.sock"))  # none there
    with AcceleratorManager(settings, open_replay(path)) as manager:
        text = stable(exposition(manager).decode())
    golden = GOLDEN / (Path(capture).stem + ".prom")
    if os.environ.get("ACCELSTATS_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert text == golden.read_text()
