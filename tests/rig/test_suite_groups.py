"""The suite's own layout: modules marked ``xdist_group`` run on one worker (pyproject's ``--dist
loadgroup``), so what they start once (a Prometheus, the container runtimes) is started once."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


def test_an_xdist_group_runs_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "test_grouped.py").write_text(
        "import pytest\npytestmark = pytest.mark.xdist_group('one')\n"
        + "".join(f"def test_{i}():\n    pass\n" for i in range(6)))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "3", "--dist", "loadgroup",
                           "-v", str(tmp_path / "test_grouped.py")], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    workers = set(re.findall(r"\[(gw\d+)\] .*PASSED", proc.stdout))
    assert len(workers) == 1, f"the group ran on {sorted(workers)}: pytest and pytest-xdist disagree\n{proc.stdout}"
