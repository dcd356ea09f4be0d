"""What a new user meets in the first hour (issue 26): README's commands as written, and the command
line's output.

| README or command                         | what it shows                                            |
|-------------------------------------------|----------------------------------------------------------|
| "No GPU here?" line after the Quick start | runs with the interpreter the Quick start installed into |
| Development: the slow tests               | a command that counts them, no count that goes stale     |
| `accelstats devices` with MIG instances   | every name whole, columns aligned                        |
| a host without NVIDIA PCI devices         | the reason at INFO (not a failure); NVML broken: WARNING |
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
QUICK_START_PYTHON = ".venv/bin/python"  # what the Quick start's lines install into and run


def run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "accelstats", *args], capture_output=True, text=True,
                          timeout=60, check=False, cwd=cwd)


def fenced_block_after(marker: str) -> list[str]:
    """The command lines of the first fenced block after ``marker`` in README.md."""
    after = README.split(marker, 1)[1]
    block = after.split("```", 2)[1]
    return [line for line in block.splitlines()[1:] if line.strip() and not line.lstrip().startswith("#")]


def test_quick_start_installs_into_the_venv_the_no_gpu_line_runs() -> None:
    quick_start = fenced_block_after("## Quick start")
    assert all(f"{QUICK_START_PYTHON} -m pip install" in line for line in quick_start), quick_start


def test_the_no_gpu_line_runs_as_written_with_the_quick_starts_interpreter() -> None:
    (line,) = fenced_block_after("No GPU here?")
    words = shlex.split(line)
    assert words[:3] == [QUICK_START_PYTHON, "-m", "accelstats"], line  # not python3: click is in .venv only
    done = subprocess.run([sys.executable, *words[1:]], capture_output=True, text=True, timeout=60, check=False,
                          cwd=REPO)  # this interpreter stands for .venv/bin/python (the one running the tests)
    assert done.returncode == 0, done.stderr
    assert 'accelstats_gpu_info{' in done.stdout and 'source="replay"' in done.stdout


def test_readme_names_no_slow_test_count_that_goes_stale() -> None:
    development = README.split("## Development", 1)[1]
    assert not re.search(r"\b\d+ of \d{3,}\b", development), "a count of tests goes stale: give the command"
    assert f"{QUICK_START_PYTHON} -m pytest -q --collect-only -m slow | tail -n 1" in development


@pytest.mark.slow
def test_the_readme_command_counts_the_slow_tests() -> None:
    done = subprocess.run(f"{shlex.quote(sys.executable)} -m pytest -q --collect-only -m slow | tail -n 1",
                          shell=True, capture_output=True, text=True, timeout=120, check=False, cwd=REPO)
    assert re.fullmatch(r"\d+/\d+ tests collected \(\d+ deselected\) in [\d.]+s", done.stdout.strip()), done.stdout


def test_devices_shows_mig_names_whole_and_aligned(fixtures_dir: Path) -> None:
    done = run("devices", "--nvml-replay", str(fixtures_dir / "public" / "a100-sxm4-v12.xml"))
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.splitlines()
    migs = [r for r in rows if r.startswith("mig")]
    assert len(migs) == 4 and all("NVIDIA A100-SXM4-80GB MIG 1g.20gb " in r for r in migs), done.stdout
    up = header.index(" UP ") + 1
    assert all(r[up:up + 4] == "yes " for r in rows), done.stdout


def test_a_host_without_nvidia_devices_says_so_at_info(tmp_path: Path) -> None:
    done = run("dump", "--sysfs-root", str(tmp_path))  # no bus/pci/devices/*/vendor of 0x10de
    assert done.returncode == 0, done.stderr
    (said,) = [line for line in done.stderr.splitlines() if "NVIDIA GPUs not available" in line]
    assert " INFO " in said and "no NVIDIA PCI device" in said, done.stderr
    assert "WARNING" not in done.stderr
    assert 'state="no_device"' in done.stdout


def test_nvidia_devices_that_nvml_cannot_read_are_a_warning(tmp_path: Path) -> None:
    device = tmp_path / "bus" / "pci" / "devices" / "0000:00:06.0"
    device.mkdir(parents=True)
    (device / "vendor").write_text("0x10de\n")
    done = run("dump", "--sysfs-root", str(tmp_path))
    if 'state="ready"' in done.stdout:
        pytest.skip("NVML answers on this host: no broken-NVML state to see")
    (said,) = [line for line in done.stderr.splitlines() if "NVIDIA GPUs not available" in line]
    assert " WARNING " in said and "nvmlInit failed" in said, done.stderr
    assert 'state="unavailable"' in done.stdout
