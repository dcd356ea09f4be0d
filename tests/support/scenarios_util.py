"""Replay scenarios the container tests build: two H200s (from the real capture) with minors 0 and 1."""

from __future__ import annotations

from pathlib import Path


def two_gpu_scenario(tmp_path: Path, fixtures_dir: Path, uuids: tuple[str, str],
                     processes: dict[str, list[tuple[int, int]]]) -> Path:
    """Write ``scenario.toml``: GPUs ``uuids`` (index and minor 0 and 1) with ``{uuid: [(pid, used
    bytes)]}`` compute processes; returns its path."""
    capture = fixtures_dir / "h200" / "nvidia-smi-q.xml"
    text = ""
    for i, uuid in enumerate(uuids):
        text += f'[[gpu]]\ncapture = "{capture}"\nindex = {i}\nminor = {i}\nuuid = "{uuid}"\n'
        for pid, used in processes.get(uuid, []):
            text += f"[[gpu.process]]\npid = {pid}\nused_memory_bytes = {used}\n"
    path = tmp_path / "scenario.toml"
    path.write_text(text)
    return path
