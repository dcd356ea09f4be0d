"""Check that accelstats attributed a real CUDA process to its docker-named cgroup (scripts/gpu-check.sh).

Usage: ``python3 scripts/gpu_container_check.py CONTAINERS_JSON CGROUP_DIR PID CONTAINER_ID``. Reads
NVML's ``usedGpuMemory`` for PID now (pynvml, compute processes of every GPU; it must be a number)
and compares it with the ``memory_used_bytes`` accelstats reported for the container
``/system.slice/docker-<id>.scope``: runtime docker, that id, each such GPU attributed by
``process`` with exactly that memory (other GPUs CUDA merely holds open, ``open_fd``, are ignored).
Prints a Markdown section; exits 1 on any mismatch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pynvml


def nvml_used(pid: int) -> dict[str, int | None]:
    """{GPU UUID: usedGpuMemory of pid} over every GPU where NVML lists pid as a compute process."""
    pynvml.nvmlInit()
    try:
        found = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid == pid:
                    uuid = pynvml.nvmlDeviceGetUUID(h)
                    found[uuid.decode() if isinstance(uuid, bytes) else uuid] = p.usedGpuMemory
        return found
    finally:
        pynvml.nvmlShutdown()


def main() -> int:
    rows = json.loads(Path(sys.argv[1]).read_text())
    cgroup = "/" + str(Path(sys.argv[2]).relative_to("/sys/fs/cgroup"))
    pid, cid = int(sys.argv[3]), sys.argv[4]
    expected = nvml_used(pid)
    row = next((r for r in rows if r["cgroup"] == cgroup), None)
    got = {d["uuid"]: (d["attribution"], d["memory_used_bytes"])
           for d in (row["devices"] if row else []) if d["attribution"] != "open_fd"}
    ok = (row is not None and row["runtime"] == "docker" and row["id"] == cid and bool(expected)
          and all(isinstance(m, int) for m in expected.values())
          and got == {u: ("process", m) for u, m in expected.items()})
    print(f"\n### CUDA process {pid} in {cgroup}\n")
    print(f"- NVML usedGpuMemory for the PID: {expected}")
    print(f"- accelstats containers --json row: runtime={row and row['runtime']!r} id={row and row['id'][:12]!r} "
          f"devices={row and row['devices']}")
    print(f"\nresult: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
