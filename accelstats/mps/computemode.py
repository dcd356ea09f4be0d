"""The opt-in EXCLUSIVE_PROCESS compute-mode switch of an MPS resource, restored on stop.

NVIDIA's Kubernetes plugin sets EXCLUSIVE_PROCESS on every GPU before starting MPS and never puts
the old mode back; docs/mps.md makes it an explicit opt-in (``mps.exclusive_process``), and the
issue asks for the mode to be restored on stop. ``accelstats mps start`` and ``stop`` are separate
processes, so the modes found before the switch are kept in a small JSON file beside the
resource's directories (``<root>/<resource>/compute-modes.json``): whoever stops the daemon reads
it back, restores each GPU and removes the file.

The mode is read and set with ``nvidia-smi`` (``--query-gpu=compute_mode`` and ``-c``), run with a
timeout like every MPS control command: it is the documented tool for it, it keeps ``pynvml`` out
of everything but the NVIDIA collector (docs/design.md), and a test double on ``PATH`` can stand in for
it on hosts without a GPU (``tests/support/mps_double/nvidia-smi``). Changing the compute mode needs root.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

STATE_FILE = "compute-modes.json"
# nvidia-smi --query-gpu=compute_mode prints these; -c takes the upper-case form
MODES = {"Default": "DEFAULT", "Exclusive_Thread": "EXCLUSIVE_THREAD", "Prohibited": "PROHIBITED",
         "Exclusive_Process": "EXCLUSIVE_PROCESS"}


class ComputeModeError(Exception):
    """nvidia-smi is missing, did not answer within the timeout, failed, or printed a mode it should not."""


class ComputeModeSwitch:
    """Sets EXCLUSIVE_PROCESS on GPUs and restores what was there before.

    ``state_file``: where the previous modes are kept (JSON ``{uuid: mode}``, mode as nvidia-smi's
    ``-c`` takes it); ``binary``: ``nvidia-smi`` looked up on PATH, or a path; ``timeout``: seconds
    for each run. Every method raises :class:`ComputeModeError` on failure, except
    :meth:`restore`, which reports.
    """

    def __init__(self, state_file: Path, binary: str = "nvidia-smi", timeout: float = 3.0) -> None:
        self.state_file = state_file
        self.binary = binary
        self.timeout = timeout

    def _run(self, args: list[str]) -> str:
        binary = self.binary if "/" in self.binary else shutil.which(self.binary)
        if binary is None or not os.access(binary, os.X_OK):
            raise ComputeModeError(f"{self.binary} not found (needed for mps.exclusive_process)")
        try:
            done = subprocess.run([binary, *args], capture_output=True, timeout=self.timeout, check=False,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise ComputeModeError(f"nvidia-smi {' '.join(args)} did not answer within {self.timeout:g} s") from None
        except OSError as exc:
            raise ComputeModeError(f"cannot run {binary}: {exc}") from exc
        out = done.stdout.decode(errors="replace").strip()
        if done.returncode != 0:
            detail = done.stderr.decode(errors="replace").strip() or out or "no output"
            raise ComputeModeError(f"nvidia-smi {' '.join(args)} failed with exit status {done.returncode}: "
                                   f"{detail[:300]}")
        return out

    def current(self, uuid: str) -> str:
        """The compute mode of GPU ``uuid`` as ``-c`` takes it (``DEFAULT``, ``EXCLUSIVE_PROCESS``, …)."""
        text = self._run(["--query-gpu=compute_mode", "--format=csv,noheader", "-i", uuid])
        mode = MODES.get(text.splitlines()[0].strip() if text else "")
        if mode is None:
            raise ComputeModeError(f"nvidia-smi printed compute mode {text[:100]!r} for GPU {uuid}")
        return mode

    def set_mode(self, uuid: str, mode: str) -> None:
        """``nvidia-smi -i <uuid> -c <mode>``."""
        self._run(["-i", uuid, "-c", mode])

    def _saved(self) -> dict[str, str]:
        try:
            data = json.loads(self.state_file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise ComputeModeError(f"cannot read {self.state_file}: {exc}") from exc
        if not isinstance(data, dict) or not all(isinstance(v, str) and v in MODES.values() for v in data.values()):
            raise ComputeModeError(f"{self.state_file} does not hold {{uuid: compute mode}}")
        return {str(k): v for k, v in data.items()}

    def _save(self, saved: dict[str, str]) -> None:
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(saved, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, self.state_file)

    def set_exclusive(self, uuids: Sequence[str]) -> None:
        """Set EXCLUSIVE_PROCESS on each GPU, recording its previous mode first (a mode recorded by an
        earlier start that was never restored is kept: it is the real original). On failure the GPUs
        already switched are restored and ComputeModeError names the GPU at fault."""
        saved = self._saved()
        for uuid in uuids:
            try:
                before = self.current(uuid)
                saved.setdefault(uuid, before)
                self._save(saved)
                if before != "EXCLUSIVE_PROCESS":
                    self.set_mode(uuid, "EXCLUSIVE_PROCESS")
            except (ComputeModeError, OSError) as exc:
                problems = self.restore()
                extra = f" (restoring the others: {'; '.join(problems)})" if problems else ""
                raise ComputeModeError(f"cannot set EXCLUSIVE_PROCESS on GPU {uuid}: {exc}{extra}") from exc

    def restore(self) -> list[str]:
        """Put back every recorded mode and remove the record; never raises. Returns the problems
        (a GPU that could not be restored stays in the record, so a later stop tries again)."""
        try:
            saved = self._saved()
        except ComputeModeError as exc:
            return [str(exc)]
        problems: list[str] = []
        left: dict[str, str] = {}
        for uuid, mode in saved.items():
            try:
                if self.current(uuid) != mode:
                    self.set_mode(uuid, mode)
            except ComputeModeError as exc:
                problems.append(f"cannot restore compute mode {mode} on GPU {uuid}: {exc}")
                left[uuid] = mode
        try:
            if left:
                self._save(left)
            else:
                self.state_file.unlink(missing_ok=True)
        except OSError as exc:
            problems.append(f"cannot update {self.state_file}: {exc}")
        return problems
