"""The installed plugin binary and the plugin configuration the Nomad tests send it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

H200 = "GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c10"


def binary() -> str:
    """The console script pip installed next to this interpreter (or on PATH)."""
    beside = Path(sys.executable).parent / "nomad-device-accelstats"
    found = str(beside) if beside.exists() else shutil.which("nomad-device-accelstats")
    assert found, "nomad-device-accelstats is not installed (pip install .)"
    return found


def config(scenario: Path | None = None, devdir: Path | None = None, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"fingerprint_period": "1m", **extra}
    if scenario is not None:
        cfg["nvml_replay"] = str(scenario)
    if devdir is not None:
        cfg["file_devices"] = {"dir": str(devdir), "list_period": "200ms"}
    return cfg


def mps_stop(replay: Path, root: Path, resource: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``accelstats mps stop`` for one resource under ``root``: the daemons outlive the plugin."""
    cfg = root.parent / "mps-stop.toml"
    cfg.write_text(f'nvml_replay = "{replay}"\n[mps]\nroot = "{root}"\n'
                   f'[[mps.resources]]\nname = "{resource}"\nreplicas = 2\n')
    return subprocess.run([sys.executable, "-m", "accelstats", "mps", "stop", "--config", str(cfg)],
                          env=env, capture_output=True, text=True, timeout=60, check=False)
