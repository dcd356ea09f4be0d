"""The catalog against the published contract, spec/metrics.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from accelstats import catalog

# spec/metrics.md abbreviates some names with "…"; these are the expansions, as the spec's rows read.
ABBREVIATED = {
    "accelstats_gpu_decoder_utilization_ratio", "accelstats_gpu_memory_used_bytes",
    "accelstats_gpu_memory_free_bytes", "accelstats_gpu_memory_reserved_bytes",
    "accelstats_gpu_bar1_memory_used_bytes", "accelstats_gpu_row_remap_pending",
    "accelstats_gpu_row_remap_failure", "accelstats_gpu_pcie_link_width",
    "accelstats_file_device_modified_timestamp_seconds", "accelstats_file_device_mode",
}


def spec_families(shared_dir: Path) -> set[str]:
    text = (shared_dir / "spec" / "metrics.md").read_text()
    body = text.split("## 5.")[0]
    return {n for n in re.findall(r"`((?:accelstats|container_accelerator)_[a-z0-9_]+)", body) if not n.endswith("_")}


def test_every_spec_family_is_in_the_catalog(shared_dir: Path) -> None:
    names = {f.name for f in catalog.ALL}
    wanted = spec_families(shared_dir) | ABBREVIATED
    assert wanted - names == set()


def test_catalog_names_are_unique_and_conventional() -> None:
    names = [f.name for f in catalog.ALL]
    assert len(names) == len(set(names))
    for f in catalog.ALL:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", f.name), f.name
        assert f.name.endswith("_total") == (f.type == "counter"), f.name
        assert f.help.endswith("."), f.name
        for unit in ("_mib", "_mb", "_ms", "_mhz", "_percent", "_milliwatts"):
            assert unit not in f.name, f"{f.name}: not a base unit"


@pytest.mark.parametrize(
    ("name", "help_"),
    [
        ("container_accelerator_memory_total_bytes", "Total accelerator memory."),
        ("container_accelerator_memory_used_bytes", "Total accelerator memory allocated."),
        ("container_accelerator_duty_cycle",
         "Percent of time over the past sample period during which the accelerator was actively processing."),
    ],
)
def test_cadvisor_families_exact(name: str, help_: str) -> None:
    family = next(f for f in catalog.ALL if f.name == name)
    assert family.help == help_
    assert family.type == "gauge"
    assert family.labels == ("id", "name", "image", "container", "pod", "namespace", "make", "model", "acc_id")


def test_label_sets() -> None:
    for f in catalog.GPU_SAMPLED:
        assert f.labels[:3] == ("uuid", "gpu", "model")
    for f in catalog.CONTAINER[1:]:
        assert f.labels == ("id", "name", "image", "container", "pod", "namespace", "uuid", "gpu", "attribution")
    for f in catalog.FILES:
        assert f.labels == (("device", "vendor", "type", "name", "path") if f is not catalog.FILES_SKIPPED else ())
    assert "source" in catalog.GPU_INFO.labels
    assert "parent_uuid" in catalog.GPU_INFO.labels
