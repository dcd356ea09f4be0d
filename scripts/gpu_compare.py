"""Compare accelstats' live-NVML output with nvidia-smi's, taken in the same run (scripts/gpu-check.sh).

Usage: ``python3 scripts/gpu_compare.py OUTDIR`` where OUTDIR holds ``devices.json``, ``dump.prom``,
``nvidia-smi.csv`` and ``nvidia-smi-after.csv``. Prints a Markdown report; exits 1 on any mismatch.

Tolerances (the two tools read at slightly different instants): identity and framebuffer total are
exact (nvidia-smi prints MiB, rounded down); power within 10 % or 15 W of either nvidia-smi reading;
temperature within 3 °C; utilisation within 15 points of either reading.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

FIELDS = ["uuid", "memory_mib", "power_w", "temp_c", "util_pct", "bus_id", "name", "driver"]


def read_smi(path: Path) -> dict[str, dict[str, str]]:
    """nvidia-smi CSV rows keyed by UUID."""
    rows = {}
    for row in csv.reader(path.read_text().splitlines()):
        rec = dict(zip(FIELDS, (c.strip() for c in row), strict=False))
        rows[rec["uuid"]] = rec
    return rows


def num(value: str) -> float | None:
    try:
        return float(value)
    except ValueError:
        return None


def gauge(families: dict[str, object], name: str, uuid: str) -> float | None:
    """The value of ``name{uuid=...}`` in the parsed exposition, or None."""
    family = families.get(name)
    for s in getattr(family, "samples", ()):
        if s.labels.get("uuid") == uuid:
            return float(s.value)
    return None


def main() -> int:
    out = Path(sys.argv[1])
    devices = [d for d in json.loads((out / "devices.json").read_text()) if d["kind"] == "gpu"]
    before, after = read_smi(out / "nvidia-smi.csv"), read_smi(out / "nvidia-smi-after.csv")
    families = {f.name: f for f in text_string_to_metric_families((out / "dump.prom").read_text())}
    source = {s.labels["source"] for s in families["accelstats_gpu_info"].samples}
    ok = True
    lines = ["| GPU | check | accelstats | nvidia-smi (before / after) | tolerance | result |",
             "|---|---|---|---|---|---|"]

    def row(uuid: str, what: str, ours: object, theirs: str, tol: str, good: bool) -> None:
        nonlocal ok
        ok &= good
        lines.append(f"| {uuid[:12]}… | {what} | {ours} | {theirs} | {tol} | {'ok' if good else 'MISMATCH'} |")

    if set(before) != {d["uuid"] for d in devices}:
        ok = False
        lines.append(f"| - | UUID set | {sorted(d['uuid'] for d in devices)} | {sorted(before)} | exact | MISMATCH |")
    for d in devices:
        b, a = before.get(d["uuid"]), after.get(d["uuid"])
        if b is None or a is None:
            continue
        row(d["uuid"], "name", d["name"], b["name"], "exact", d["name"] == b["name"])
        row(d["uuid"], "PCI bus id", d["pci_bus_id"], b["bus_id"], "exact (case-insensitive)",
            d["pci_bus_id"].lower() == b["bus_id"].lower())
        mib = d["memory_total_bytes"] // 2**20 if d["memory_total_bytes"] is not None else None
        row(d["uuid"], "memory total MiB", mib, b["memory_mib"], "exact", str(mib) == b["memory_mib"])
        prom = gauge(families, "accelstats_gpu_memory_total_bytes", d["uuid"])
        row(d["uuid"], "/metrics memory total MiB", None if prom is None else int(prom) // 2**20, b["memory_mib"],
            "exact", prom is not None and str(int(prom) // 2**20) == b["memory_mib"])
        prom_w = gauge(families, "accelstats_gpu_power_watts", d["uuid"])
        row(d["uuid"], "/metrics power W", prom_w, f"{b['power_w']} / {a['power_w']}", "10 % or 15 W",
            prom_w is not None and any(abs(prom_w - x) <= max(15.0, 0.1 * x)
                                       for x in (num(b["power_w"]), num(a["power_w"])) if x is not None))
        pw = [x for x in (num(b["power_w"]), num(a["power_w"])) if x is not None]
        ours_pw = d["power_watts"]
        row(d["uuid"], "power W", ours_pw, f"{b['power_w']} / {a['power_w']}", "10 % or 15 W",
            ours_pw is not None and any(abs(ours_pw - x) <= max(15.0, 0.1 * x) for x in pw))
        tc = [x for x in (num(b["temp_c"]), num(a["temp_c"])) if x is not None]
        ours_t = d["temperature_celsius"]
        row(d["uuid"], "temperature C", ours_t, f"{b['temp_c']} / {a['temp_c']}", "3 C",
            ours_t is not None and any(abs(ours_t - x) <= 3 for x in tc))
        ut = [x for x in (num(b["util_pct"]), num(a["util_pct"])) if x is not None]
        ours_u = None if d["utilization_ratio"] is None else round(d["utilization_ratio"] * 100, 1)
        row(d["uuid"], "utilisation %", ours_u, f"{b['util_pct']} / {a['util_pct']}", "15 points",
            ours_u is not None and any(abs(ours_u - x) <= 15 for x in ut))
    up = [s.value for s in families["accelstats_gpu_up"].samples]
    lines.append("")
    lines.append(f"accelstats_gpu_info source={sorted(source)}; accelstats_gpu_up={up}; "
                 f"driver={next(iter(before.values()))['driver'] if before else '?'}")
    lines.append(f"\nresult: {'PASS' if ok and source == {'nvml'} and all(v == 1 for v in up) else 'FAIL'}")
    print("\n".join(lines))
    return 0 if ok and source == {"nvml"} and all(v == 1 for v in up) else 1


if __name__ == "__main__":
    sys.exit(main())
