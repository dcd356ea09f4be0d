"""The fast encoder (accelstats/web/exposition.py) writes what prometheus_client's encoders write, byte for byte.

Compared in text 0.0.4, text 1.0.0, OpenMetrics 1.0.0, OpenMetrics with allow-utf-8 escaping and
Prometheus 2.x's Accept header, each plain and gzipped:

* every fixture capture, 8 GPUs x 40 containers (v1 devices cgroups);
* the H200 capture, 8 GPUs x 1000 containers;
* a v2 host with GPU processes in containers (process attribution: container memory, SM, processes);
* hand-made edge cases: escapes in label values and HELP, empty label values, NaN, +Inf, -Inf, -0.0,
  huge and tiny values, undecodable bytes in names.

Escapings that rewrite names (dots, values) and ``name[]`` filters are served by prometheus_client's
encoder, never the fast one.

The reference is ``SharedExposition(fast=False)``: the same collection rendered into prometheus_client
families (accelstats/web/exposition.py) and encoded by prometheus_client.
"""

from __future__ import annotations

import gzip
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from accelstats.attribution.containers import AcceleratorStats, ContainerMetadata, ContainerStats
from accelstats.cgroups.identity import ContainerIdentity
from accelstats.manager import AcceleratorManager, Collection
from accelstats.settings import Settings
from accelstats.web.app import ServerCounters, SharedExposition, negotiate
from accelstats.web.exposition import OPENMETRICS, TEXT, supported
from collectors.model import CollectorResult, Device, DeviceSample, DeviceSnapshot, FileDevice, MpsDaemonReading
from collectors.replay.lib import open_replay

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "benchmarks") not in sys.path:  # benchmarks/ is not a package
    sys.path.insert(0, str(REPO / "benchmarks"))
import scrape as bench  # noqa: E402

ACCEPTS = {
    "text 0.0.4": "",
    "text 1.0.0": "text/plain; version=1.0.0",
    "OpenMetrics": "application/openmetrics-text; version=1.0.0",
    "OpenMetrics, allow-utf-8": "application/openmetrics-text; version=1.0.0; escaping=allow-utf-8",
    "Prometheus 2.x": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                      "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
}


class _Fixed:
    """A manager stand-in that hands out one finished collection (what SharedExposition asks of it)."""

    def __init__(self, collection: Collection) -> None:
        self.collection = collection

    def collect(self) -> Collection:
        return self.collection


def bodies(collection: Collection, accept: str, encoding: str = "") -> tuple[bytes, bytes]:
    """(fast, reference) bodies of one collection for one request, with the server's counters after."""
    out = []
    for fast in (True, False):
        shared = SharedExposition(_Fixed(collection), extra=[ServerCounters()], fast=fast)  # type: ignore[arg-type]
        body, _ = shared.body(accept, encoding)
        if fast and supported(negotiate(accept)[1]) is not None:  # the fast encoder did write it
            assert shared.fast is not None and shared.fast.cached
        out.append(body)
    return out[0], out[1]


def assert_same(collection: Collection) -> None:
    for what, accept in ACCEPTS.items():
        fast, reference = bodies(collection, accept)
        assert fast == reference, f"{what}: first difference at byte {_first_difference(fast, reference)}"
        zipped, zipped_ref = bodies(collection, accept, "gzip")
        assert gzip.decompress(zipped) == gzip.decompress(zipped_ref) == reference, what


def _first_difference(a: bytes, b: bytes) -> str:
    i = next((n for n, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"{i}: {a[max(0, i - 80):i + 80]!r} vs {b[max(0, i - 80):i + 80]!r}"


def collect(settings: Settings) -> Collection:
    assert settings.nvml_replay is not None
    with AcceleratorManager(settings, open_replay(settings.nvml_replay)) as manager:
        return manager.collect()


CAPTURES = ["h200/nvidia-smi-q.xml", "public/a100-sxm4-v12.xml", "public/dual_a5000-v13.xml", "public/tesla-t4.xml"]


@pytest.mark.parametrize("capture", CAPTURES)
def test_every_capture_encodes_as_the_reference(capture: str, fixtures_dir: Path, tmp_path: Path) -> None:
    collection = collect(bench.build_host(tmp_path, fixtures_dir / capture, gpus=8, containers=40))
    assert len([c for c in collection.containers if c.accelerators]) == 40
    assert_same(collection)


def test_eight_gpus_and_a_thousand_containers_encode_as_the_reference(fixtures_dir: Path, tmp_path: Path) -> None:
    collection = collect(bench.build_host(tmp_path, fixtures_dir / CAPTURES[0], gpus=8, containers=1000))
    assert len([c for c in collection.containers if c.accelerators]) == 1000
    assert_same(collection)


def test_process_attributed_containers_encode_as_the_reference(fixtures_dir: Path, tmp_path: Path) -> None:
    settings = bench.build_v2_host(tmp_path, fixtures_dir / CAPTURES[0], gpus=2, containers=20, gpu_processes=30,
                                   other_processes=50)
    collection = collect(settings)
    fast, _ = bodies(collection, "")
    assert b"accelstats_container_gpu_memory_used_bytes{" in fast  # the process-attributed families are there
    assert_same(collection)


STRANGE = ['quote " inside', "back\\slash", "new\nline", "", "tab\tand unicode ü 漢", "-0",
           "trailing \\", '\\"', "{}=,"]
UNDECODABLE = "\udcff undecodable"  # os.fsdecode of a byte that is not UTF-8: in cgroup and file names only


def edge_collection() -> Collection:
    gpus = [Device(uuid=f"GPU-{i}", index=i, minor=i, name=name, pci_bus_id="", vbios_version=name)
            for i, name in enumerate(STRANGE)]
    values = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1e300, 5e-324, 123456789.0, 2.5e7]
    samples = {g.uuid: DeviceSample(uuid=g.uuid, up=True, power_watts=v, memory_total_bytes=2**64 - 1,
                                    temperatures_celsius=(("gpu", v),), clocks_hz=(("sm", 1.98e9),))
               for g, v in zip(gpus, values, strict=True)}
    files = [FileDevice(id=f"f{i}", path=f"/srv/{name}{UNDECODABLE if i == 1 else ''}", vendor="nomad", type="file",
                        name="mock", healthy=i % 2 == 0, health_description="", size_bytes=i,
                        modified_timestamp_seconds=v, permissions="-rw-r--r--", mode=0o644)
             for i, (name, v) in enumerate(zip(STRANGE, values, strict=True))]
    containers = [ContainerStats(
        cgroup=f"/docker/{name}", identity=ContainerIdentity(runtime="docker", id=name),
        metadata=ContainerMetadata(name=name + (UNDECODABLE if i == 2 else ""), image=name, container="", pod=name,
                                   namespace=""),
        accelerators=[AcceleratorStats(make="nvidia", model=name, id=f"GPU-{i}", minor=i, index=i,
                                       attribution="process", memory_total_bytes=1, memory_used_bytes=None,
                                       duty_cycle=v,
                                       container_memory_used_bytes=2**53 + 1, container_sm_utilization_ratio=v,
                                       container_processes=0, device_open=i % 2 == 0)])
        for i, (name, v) in enumerate(zip(STRANGE, values, strict=True))]
    snapshot = DeviceSnapshot(devices=gpus, samples=samples, file_devices=files, driver_version='580 "x"',
                              nvml_state="unavailable", nvml_status="driver\nnot \\loaded",
                              mps=[MpsDaemonReading(resource=name, up=True, active_thread_ratio=0.25,
                                                    pinned_memory_limit_bytes=(("GPU-0", None), ("GPU-1", 1 << 30)))
                                   for name in STRANGE[:3]],
                              collector_results=[CollectorResult(name="files", success=True, duration_seconds=1e-9)])
    return Collection(snapshot=snapshot, containers=containers, attribution_skipped={'vanished "x"': 3},
                      nvml_errors={("nvmlDeviceGetUUID", "GPU_IS_LOST"): 2}, collector_last_success={"files": 1.5e9})


def test_escapes_special_values_and_empty_labels_encode_as_the_reference() -> None:
    collection = edge_collection()
    fast, _ = bodies(collection, "")
    assert rb'model="quote \" inside"' in fast and rb'\\xff undecodable' in fast and b"NaN" in fast
    assert_same(collection)


@pytest.mark.parametrize(("accept", "fast"), [
    ("", TEXT),
    ("text/plain; version=1.0.0; escaping=underscores", TEXT),
    ("application/openmetrics-text; version=1.0.0", OPENMETRICS),
    ("application/openmetrics-text; version=1.0.0; escaping=allow-utf-8", OPENMETRICS),
    ("application/openmetrics-text; version=1.0.0; escaping=dots", None),  # rewrites accelstats_gpu_up
    ("application/openmetrics-text; version=1.0.0; escaping=values", None),
    ("text/plain; version=1.0.0; escaping=dots", None),
])
def test_which_requests_the_fast_encoder_serves(accept: str, fast: str | None) -> None:
    _, content_type, _ = negotiate(accept)
    assert supported(content_type) == fast
    if fast is None:  # and what prometheus_client writes for them is what is served
        fast_body, reference = bodies(edge_collection(), accept)
        assert fast_body == reference


def test_filtered_requests_are_encoded_by_the_reference(fixtures_dir: Path, tmp_path: Path) -> None:
    collection = collect(bench.build_host(tmp_path, fixtures_dir / CAPTURES[0], gpus=2, containers=3))
    shared: Any = SharedExposition(_Fixed(collection), extra=[ServerCounters()])  # type: ignore[arg-type]
    body, _ = shared.body("", "", names=["accelstats_gpu_up"])
    assert body.startswith(b"# HELP accelstats_gpu_up ") and b"accelstats_gpu_info" not in body


def test_the_label_cache_drops_what_the_scrapes_no_longer_use(fixtures_dir: Path, tmp_path: Path) -> None:
    """Containers come and go: strings of those gone are dropped at the second scrape without them
    (the first finds them a third or more of those held), not kept until some size limit."""
    from accelstats.web.exposition import FastEncoder

    encoder = FastEncoder()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    small = collect(bench.build_host(tmp_path / "a", fixtures_dir / CAPTURES[0], gpus=1, containers=5))
    big = collect(bench.build_host(tmp_path / "b", fixtures_dir / CAPTURES[0], gpus=1, containers=50))
    one_small = FastEncoder()
    one_small.encode(small, TEXT)
    encoder.encode(big, TEXT)
    assert encoder.cached > 3 * one_small.cached
    encoder.encode(small, TEXT)
    assert encoder.cached > 3 * one_small.cached  # kept one scrape more (a lookup a sample, no copy)
    encoder.encode(small, TEXT)
    assert encoder.cached == one_small.cached  # the 50 are gone
    assert encoder.encode(small, TEXT) == one_small.encode(small, TEXT)  # and what is kept is served the same
    assert encoder.encode(big, TEXT) == FastEncoder().encode(big, TEXT)  # the 50 back: rendered again
