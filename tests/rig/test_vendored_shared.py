"""tests/shared holds byte-identical copies of ../shared's inputs; drift fails here.

Without ../shared there is nothing to compare with: skipped, except under CI=true, where it fails
unless ``.ci/run`` said that this is a clone on its own (``ACCELSTATS_STANDALONE_CLONE=1``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import in_ci
from support.paths import BESIDE, VENDORED

COPIES = sorted(p.relative_to(VENDORED) for p in VENDORED.rglob("*") if p.is_file() and p.name != "README.md")


def _require_beside() -> None:
    if BESIDE.is_dir():
        return
    if in_ci() and os.environ.get("ACCELSTATS_STANDALONE_CLONE") != "1":
        pytest.fail(f"{BESIDE} missing under CI=true")
    pytest.skip("no ../shared beside this clone: nothing to compare with")


def test_every_fixture_is_vendored() -> None:
    _require_beside()
    originals = sorted(p.relative_to(BESIDE) for p in (BESIDE / "fixtures").rglob("*") if p.is_file())
    assert [p for p in originals if p not in COPIES] == []


@pytest.mark.parametrize("relative", COPIES, ids=str)
def test_copy_is_identical(relative: Path) -> None:
    original = BESIDE / relative
    _require_beside()
    assert (VENDORED / relative).read_bytes() == original.read_bytes()


@pytest.mark.parametrize(("standalone", "outcome"), [("1", "skipped"), ("", "failed")])
def test_a_clone_without_shared_beside_it_skips_the_comparison_only_when_ci_run_says_so(
        tmp_path: Path, standalone: str, outcome: str) -> None:
    """``.ci/run`` in a clone with no ../shared exports ``ACCELSTATS_STANDALONE_CLONE=1``: the comparison
    skips under CI=true; without that word from .ci/run a missing ../shared still fails under CI."""
    tests = Path(__file__).resolve().parents[1]
    clone = tmp_path / "clone"  # tmp_path/shared does not exist: nothing beside the clone
    (clone / "tests" / "rig").mkdir(parents=True)
    shutil.copy(tests.parent / "pyproject.toml", clone)
    shutil.copy(tests / "conftest.py", clone / "tests")
    shutil.copy(Path(__file__), clone / "tests" / "rig")
    for folder in ("support", "shared"):
        shutil.copytree(tests / folder, clone / "tests" / folder, ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "ACCELSTATS_SHARED"}
    env.update(CI="true", ACCELSTATS_STANDALONE_CLONE=standalone)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-q",
                           "tests/rig/test_vendored_shared.py", "-k", "not clone_without_shared"], cwd=clone, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    summary = done.stdout.strip().splitlines()[-1]
    assert outcome in summary and ("failed" in summary) == (outcome == "failed"), done.stdout
