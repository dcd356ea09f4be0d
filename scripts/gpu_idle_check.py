"""On a cgroup v2 GPU host: a container granted GPU 0 that runs nothing is attributed ``devices_cgroup``
with memory 0 (scripts/gpu-check.sh).

Usage: ``python3 scripts/gpu_idle_check.py OUT_DIR [REPLAY]`` as root, from the repository root
(``REPLAY``, an NVML replay file, only to try the script on a machine without a GPU; on a hybrid
host the cgroup2 mount at ``/sys/fs/cgroup/unified`` is used). Makes what
runc makes for ``--device /dev/nvidia<minor>`` on a v2 host: the cgroup
``/system.slice/docker-<64 hex>.scope`` with a ``BPF_CGROUP_DEVICE`` program in runc's shape that
allows runc's default devices, ``nvidiactl`` and GPU 0's node (its NVML minor number), and one
sleeping process in it (nothing on the GPU). Then runs ``accelstats containers --json`` (live NVML)
and checks the container's row: runtime docker, that id, GPU 0 by ``devices_cgroup``, memory 0,
``devices_cgroup`` restricted; and that the kernel itself refuses the process another GPU's node
when the host has one. Prints a Markdown section; exits 1 on any mismatch. Removes what it made.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pynvml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support import bpf_util  # tests/support/bpf_util.py: runc-shaped program, loader

RUNC_DEFAULTS = [("c", None, None, "m", True), ("b", None, None, "m", True), ("c", 1, 3, "rwm", True),
                 ("c", 1, 5, "rwm", True), ("c", 1, 7, "rwm", True), ("c", 1, 8, "rwm", True),
                 ("c", 1, 9, "rwm", True), ("c", 5, 0, "rwm", True), ("c", 5, 2, "rwm", True),
                 ("c", 136, None, "rwm", True), ("c", 10, 200, "rwm", True)]


def gpus(replay: str | None) -> list[tuple[str, int]]:
    """(UUID, minor) of each physical GPU, from NVML (or from ``accelstats devices`` on a replay)."""
    if replay is not None:
        proc = subprocess.run([sys.executable, "-m", "accelstats", "devices", "--json", "--nvml-replay", replay],
                              capture_output=True, text=True, timeout=60, check=True)
        return [(d["uuid"], d["minor"]) for d in json.loads(proc.stdout) if d["kind"] == "gpu"]
    pynvml.nvmlInit()
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            out.append((uuid.decode() if isinstance(uuid, bytes) else uuid, pynvml.nvmlDeviceGetMinorNumber(h)))
        return out
    finally:
        pynvml.nvmlShutdown()


def main() -> int:
    out = Path(sys.argv[1])
    replay = sys.argv[2] if len(sys.argv) > 2 else None
    root = bpf_util.unified_root()
    if root is None:
        print("no cgroup2 mount")
        return 1
    found = gpus(replay)
    uuid, minor = found[0]
    cid = secrets.token_hex(32)
    path = f"/system.slice/docker-{cid}.scope"
    cgroup = Path(f"{root}{path}")
    extra = [*(["--nvml-replay", replay] if replay else []), *(["--cgroup-root", str(root)] if str(root) !=
                                                               "/sys/fs/cgroup" else [])]
    code = bpf_util.runc_style([*RUNC_DEFAULTS, ("c", 195, 255, "rw", True), ("c", 195, minor, "rw", True)])
    sleeper = None
    checks: dict[str, bool] = {}
    row: dict[str, object] = {}
    with contextlib.ExitStack() as stack:
        made_parent = not cgroup.parent.exists()
        cgroup.mkdir(parents=True)
        if made_parent:
            stack.callback(lambda: cgroup.parent.rmdir())
        stack.callback(lambda: [time.sleep(0.2), cgroup.rmdir()])
        fd = bpf_util.load_program(code)
        try:
            bpf_util.attach(cgroup, fd)
        finally:
            os.close(fd)
        sleeper = subprocess.Popen(["sh", "-c", f"echo $$ > {cgroup}/cgroup.procs && exec sleep 120"])
        stack.callback(lambda: (sleeper.kill(), sleeper.wait()))
        for _ in range(50):
            if Path(f"/proc/{sleeper.pid}/cgroup").read_text().strip().endswith(path):
                break
            time.sleep(0.1)
        proc = subprocess.run([sys.executable, "-m", "accelstats", "containers", "--json", *extra],
                              capture_output=True, text=True, timeout=60, check=False)
        (out / "idle-containers.json").write_text(proc.stdout)
        (out / "idle-containers.err").write_text(proc.stderr)
        rows = {r["cgroup"]: r for r in json.loads(proc.stdout or "[]")}
        row = rows.get(path, {})
        listed = row.get("devices", [])
        devices = [(d["uuid"], d["attribution"], d["memory_used_bytes"]) for d in listed]  # type: ignore[union-attr]
        checks["accelstats containers exits 0"] = proc.returncode == 0
        checks["the container is listed, runtime docker, its id"] = (row.get("runtime"), row.get("id")) == (
            "docker", cid)
        checks[f"GPU 0 ({uuid}, minor {minor}) by devices_cgroup with memory 0"] = devices == [
            (uuid, "devices_cgroup", 0)]
        checks["devices_cgroup restricted"] = row.get("devices_cgroup") == "restricted"
        node = Path(f"/dev/nvidia{found[1][1]}") if len(found) > 1 else None
        if node is not None and node.exists():  # the kernel agrees: the other GPU's node is refused
            probe = subprocess.run(["sh", "-c", f"echo $$ > {cgroup}/cgroup.procs && exec cat {node}"],
                                   capture_output=True, text=True, timeout=30, check=False)
            checks["the kernel refuses the other GPU's node (EPERM)"] = "Operation not permitted" in probe.stderr
    print("\n### A container granted GPU 0 and running nothing (cgroup v2 device program)\n")
    for what, good in checks.items():
        print(f"- {'PASS' if good else 'FAIL'}: {what}")
    print(f"- row: {json.dumps(row)[:1500]}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
