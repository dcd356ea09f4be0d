#!/usr/bin/env python3
"""Regenerate ``collectors/replay/symbols.json``: the functions each NVIDIA driver generation's
``libnvidia-ml`` exports, and their C parameter types, read from NVIDIA's own ``nvml.h``.

Source: the ``src/nvml.h`` that NVIDIA publishes with each driver release in
https://github.com/NVIDIA/nvidia-settings (one git tag per driver version). The header declares
every exported function: the current names, and (under ``NVML_NO_UNVERSIONED_FUNC_DEFS``) the older
unversioned and ``_vN`` names the library keeps exporting for old binaries.

Usage: ``scripts/nvml-symbols.py <nvidia-settings git directory> [TAG ...]`` (default tags below); the
JSON records, for each generation, the tag, the header's path and its SHA-256.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

TAGS = ["470.256.02", "510.108.03", "515.105.01", "525.147.05", "535.309.01", "545.29.06", "550.144.03",
        "560.35.03", "565.77", "570.211.01", "575.64.05", "580.173.02", "590.48.01"]
OUT = Path(__file__).resolve().parent.parent / "collectors" / "replay" / "symbols.json"
_PROTO = re.compile(r"(?:nvmlReturn_t\s+DECLDIR|const\s+DECLDIR\s+char\s*\*)\s+(\w+)\s*\(([^)]*)\)", re.S)


def _param_type(param: str) -> str:
    """``unsigned int *count`` -> ``unsigned int *``; ``void`` -> ``""``."""
    param = " ".join(param.replace("*", " * ").split())
    if param in ("", "void"):
        return ""
    words = param.split(" ")
    if words[-1] != "*" and len(words) > 1 and words[-1] not in ("int", "long", "char"):
        words = words[:-1]  # drop the parameter name
    return " ".join(words).replace(" *", "*")


def parse(header: str) -> dict[str, list[str]]:
    """Function name -> C parameter types, for every function ``header`` declares."""
    text = re.sub(r"/\*.*?\*/", "", header, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    out: dict[str, list[str]] = {}
    for name, params in _PROTO.findall(text):
        types = [_param_type(p) for p in params.split(",")]
        out[name] = [t for t in types if t]
    return out


def main(argv: list[str]) -> int:
    git_dir, tags = argv[1], argv[2:] or TAGS
    generations: dict[str, dict[str, object]] = {}
    signatures: dict[str, list[str]] = {}
    for tag in tags:
        raw = subprocess.run(["git", "--git-dir", git_dir, "show", f"{tag}:src/nvml.h"], check=True,
                             capture_output=True).stdout
        protos = parse(raw.decode())
        for name, types in protos.items():
            signatures[name] = types  # a name keeps its signature; newer headers win
        generations[tag] = {
            "source": f"github.com/NVIDIA/nvidia-settings tag {tag}, src/nvml.h",
            "sha256": hashlib.sha256(raw).hexdigest(),
            "symbols": sorted(protos),
        }
    OUT.write_text(json.dumps({"generations": generations, "signatures": dict(sorted(signatures.items()))},
                              indent=1) + "\n")
    print(f"wrote {OUT}: " + ", ".join(f"{t} {len(g['symbols'])} symbols"  # type: ignore[arg-type]
                                       for t, g in generations.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
