#!/usr/bin/env python3
"""Record what pynvml answers for each NVML call accelstats makes, on every GPU and MIG instance:
live (default), or over the replay of a capture (``--nvml-replay FILE``), so that the two can be
compared (``--compare LIVE.json REPLAY.json``, a Markdown table on stdout).

Run by ``scripts/gpu-check.sh`` on a GPU host next to ``nvidia-smi -q -x`` taken at the same
moment. Values are as pynvml returns them, structures as ``nvmlStructToFriendlyObject`` dicts,
errors as ``"NVMLError_<Name>"`` (or the exception class for anything else).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pynvml

# (call, arguments after the handle): the calls of collectors/nvidia.py, pcie.py and xid.py
DEVICE_CALLS: list[tuple[str, tuple[Any, ...]]] = [
    ("nvmlDeviceGetName", ()), ("nvmlDeviceGetUUID", ()), ("nvmlDeviceGetIndex", ()),
    ("nvmlDeviceGetMinorNumber", ()), ("nvmlDeviceGetPciInfo", ()), ("nvmlDeviceGetVbiosVersion", ()),
    ("nvmlDeviceGetSerial", ()), ("nvmlDeviceGetBoardPartNumber", ()), ("nvmlDeviceGetMigMode", ()),
    ("nvmlDeviceGetComputeMode", ()), ("nvmlDeviceGetPersistenceMode", ()), ("nvmlDeviceGetDisplayActive", ()),
    ("nvmlDeviceGetCudaComputeCapability", ()), ("nvmlDeviceGetArchitecture", ()),
    ("nvmlDeviceGetMaxPcieLinkGeneration", ()), ("nvmlDeviceGetMaxPcieLinkWidth", ()),
    ("nvmlDeviceGetCurrPcieLinkGeneration", ()), ("nvmlDeviceGetCurrPcieLinkWidth", ()),
    ("nvmlDeviceGetMemoryInfo", ()), ("nvmlDeviceGetMemoryInfo", ("v2",)), ("nvmlDeviceGetBAR1MemoryInfo", ()),
    ("nvmlDeviceGetUtilizationRates", ()), ("nvmlDeviceGetEncoderUtilization", ()),
    ("nvmlDeviceGetDecoderUtilization", ()), ("nvmlDeviceGetPowerUsage", ()),
    ("nvmlDeviceGetEnforcedPowerLimit", ()), ("nvmlDeviceGetTotalEnergyConsumption", ()),
    ("nvmlDeviceGetTemperature", (0,)), ("nvmlDeviceGetFieldValues", ("memory_temp",)),
    ("nvmlDeviceGetClockInfo", (0,)), ("nvmlDeviceGetClockInfo", (1,)), ("nvmlDeviceGetClockInfo", (2,)),
    ("nvmlDeviceGetClockInfo", (3,)), ("nvmlDeviceGetMaxClockInfo", (0,)), ("nvmlDeviceGetMaxClockInfo", (1,)),
    ("nvmlDeviceGetMaxClockInfo", (2,)), ("nvmlDeviceGetMaxClockInfo", (3,)),
    ("nvmlDeviceGetCurrentClocksEventReasons", ()), ("nvmlDeviceGetCurrentClocksThrottleReasons", ()),
    ("nvmlDeviceGetPerformanceState", ()), ("nvmlDeviceGetFanSpeed", ()),
    ("nvmlDeviceGetTotalEccErrors", (0, 0)), ("nvmlDeviceGetTotalEccErrors", (1, 1)),
    ("nvmlDeviceGetRemappedRows", ()), ("nvmlDeviceGetPcieReplayCounter", ()),
    ("nvmlDeviceGetPcieThroughput", (0,)), ("nvmlDeviceGetPcieThroughput", (1,)),
    ("nvmlDeviceGetComputeRunningProcesses", ()), ("nvmlDeviceGetGraphicsRunningProcesses", ()),
    ("nvmlDeviceGetMPSComputeRunningProcesses", ()), ("nvmlDeviceGetProcessUtilization", (0,)),
    ("nvmlDeviceGetSamples", (1, 0)), ("nvmlDeviceGetMaxMigDeviceCount", ()),
    ("nvmlDeviceGetSupportedEventTypes", ()), ("nvmlDeviceIsMigDeviceHandle", ()),
    ("nvmlDeviceGetGpuInstanceId", ()), ("nvmlDeviceGetComputeInstanceId", ()),
]
SYSTEM_CALLS = ["nvmlSystemGetDriverVersion", "nvmlSystemGetCudaDriverVersion", "nvmlSystemGetNVMLVersion",
                "nvmlDeviceGetCount"]


def plain(value: Any) -> Any:
    """JSON-able form of a pynvml answer."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "_fields_"):
        obj = pynvml.nvmlStructToFriendlyObject(value)
        return {k: plain(getattr(obj, k)) for k, *_ in value._fields_ if not k.startswith("_")}
    if isinstance(value, pynvml.nvmlFriendlyObject):
        return {k: plain(v) for k, v in vars(value).items()}
    if hasattr(value, "value"):  # a ctypes scalar (nvmlDeviceIsMigDeviceHandle)
        return value.value
    return value if isinstance(value, (int, float, str, type(None))) else repr(value)


def ask(nv: Any, call: str, *args: Any) -> Any:
    try:
        return plain(getattr(nv, call)(*args))
    except pynvml.NVMLError as exc:
        return type(exc).__name__
    except pynvml.NVMLLibraryMismatchError as exc:  # a plain Exception in pynvml: recorded, not fatal
        return f"{type(exc).__name__}: {exc}"


def record(nv: Any) -> dict[str, Any]:
    nv.nvmlInit()
    out: dict[str, Any] = {"system": {c: ask(nv, c) for c in SYSTEM_CALLS}, "devices": []}
    handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
    for h in list(handles):
        count = ask(nv, "nvmlDeviceGetMaxMigDeviceCount", h)
        for slot in range(count if isinstance(count, int) else 0):
            try:
                handles.append(nv.nvmlDeviceGetMigDeviceHandleByIndex(h, slot))
            except pynvml.NVMLError:
                continue
    for h in handles:
        answers: dict[str, Any] = {}
        for call, args in DEVICE_CALLS:
            real = [nv.nvmlMemory_v2 if a == "v2" else [nv.NVML_FI_DEV_MEMORY_TEMP] if a == "memory_temp" else a
                    for a in args]
            key = call + ("" if not args else "(" + ",".join(map(str, args)) + ")")
            if call == "nvmlDeviceGetMemoryInfo" and args:
                answers[key] = ask(nv, call, h, real[0])
            else:
                answers[key] = ask(nv, call, h, *real)
        out["devices"].append(answers)
    nv.nvmlShutdown()
    return out


def compare(live: dict[str, Any], replay: dict[str, Any]) -> str:
    """A Markdown table of the calls whose answer differs in kind (value vs error, or error name)."""
    rows = []
    for i, (a, b) in enumerate(zip(live["devices"], replay["devices"], strict=False)):
        for key in a:
            x, y = a[key], b.get(key)
            errors = [isinstance(v, str) and v.startswith("NVML") for v in (x, y)]
            if any(errors) and x != y:
                rows.append(f"| {i} | `{key}` | {json.dumps(x)[:80]} | {json.dumps(y)[:80]} |")
    head = ["### NVML calls: live pynvml vs the replay of a capture taken at the same moment", "",
            f"- devices: live {len(live['devices'])}, replay {len(replay['devices'])}",
            f"- system: live {live['system']}, replay {replay['system']}", ""]
    if not rows:
        return "\n".join([*head, "Every call answers a value where the other does, or the same error.", ""])
    return "\n".join([*head, "| device | call | live | replay |", "|---|---|---|---|", *rows, ""])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvml-replay", help="answer from the replay of this capture or scenario")
    parser.add_argument("--compare", nargs=2, metavar=("LIVE", "REPLAY"))
    a = parser.parse_args()
    if a.compare:
        live, replay = (json.loads(Path(p).read_text()) for p in a.compare)
        print(compare(live, replay))
        return 0
    if a.nvml_replay:
        from collectors.replay.lib import open_replay
        nv: Any = open_replay(a.nvml_replay)
    else:
        nv = pynvml
    json.dump(record(nv), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
