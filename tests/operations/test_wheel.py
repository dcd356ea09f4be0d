"""The wheel holds the product: no Nomad client emulator, no fault machinery, no tests; and the data
the product reads at run time (the NVML symbol lists)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_the_product_and_not_the_test_rig(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                           "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("accelstats-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"accelstats", "collectors", next(n for n in top if n.endswith(".dist-info"))}
    for rig in ("launcher.py", "ctymsgpack.py", "validate.py", "replay_faults.py"):
        assert not [n for n in names if n.endswith("/" + rig)], rig
    assert "collectors/replay/symbols.json" in names
    assert "collectors/replay/lib.py" in names and "accelstats/nomad/plugin.py" in names
