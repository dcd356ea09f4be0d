"""The kubelet's pod-resources proto (accelstats/kubernetes/proto): the facts of k8s.io/kubelet v0.36.3
``pkg/apis/podresources/v1/api.proto`` (package, service, methods, field names, numbers and types), and the
committed generated code up to date with it (scripts/gen-protos.sh, its pinned grpcio-tools)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pytest
from conftest import in_ci

from accelstats.kubernetes.proto import podresources_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "accelstats" / "kubernetes" / "proto"
GEN_PROTOS = ROOT / "scripts" / "gen-protos.sh"
GENERATED = ("podresources_pb2.py", "podresources_pb2_grpc.py", "podresources_pb2.pyi")

METHODS = [
    # method,                   request,                        response
    ("List",                    "ListPodResourcesRequest",      "ListPodResourcesResponse"),
    ("GetAllocatableResources", "AllocatableResourcesRequest",  "AllocatableResourcesResponse"),
    ("Get",                     "GetPodResourcesRequest",       "GetPodResourcesResponse"),
]  # fmt: skip

FIELDS = [
    # message,                      field,               number, type
    ("AllocatableResourcesResponse", "devices",           1, "repeated ContainerDevices"),
    ("AllocatableResourcesResponse", "cpu_ids",           2, "repeated int64"),
    ("AllocatableResourcesResponse", "memory",            3, "repeated ContainerMemory"),
    ("ListPodResourcesResponse",     "pod_resources",     1, "repeated PodResources"),
    ("PodResources",                 "name",              1, "string"),
    ("PodResources",                 "namespace",         2, "string"),
    ("PodResources",                 "containers",        3, "repeated ContainerResources"),
    ("ContainerResources",           "name",              1, "string"),
    ("ContainerResources",           "devices",           2, "repeated ContainerDevices"),
    ("ContainerResources",           "cpu_ids",           3, "repeated int64"),
    ("ContainerResources",           "memory",            4, "repeated ContainerMemory"),
    ("ContainerResources",           "dynamic_resources", 5, "repeated DynamicResource"),
    ("ContainerMemory",              "memory_type",       1, "string"),
    ("ContainerMemory",              "size",              2, "uint64"),
    ("ContainerMemory",              "topology",          3, "TopologyInfo"),
    ("ContainerDevices",             "resource_name",     1, "string"),
    ("ContainerDevices",             "device_ids",        2, "repeated string"),
    ("ContainerDevices",             "topology",          3, "TopologyInfo"),
    ("TopologyInfo",                 "nodes",             1, "repeated NUMANode"),
    ("NUMANode",                     "ID",                1, "int64"),
    ("DynamicResource",              "claim_name",        2, "string"),  # 1 (class_name) removed in 1.31
    ("DynamicResource",              "claim_namespace",   3, "string"),
    ("DynamicResource",              "claim_resources",   4, "repeated ClaimResource"),
    ("ClaimResource",                "cdi_devices",       1, "repeated CDIDevice"),
    ("ClaimResource",                "driver_name",       2, "string"),
    ("ClaimResource",                "pool_name",         3, "string"),
    ("ClaimResource",                "device_name",       4, "string"),
    ("ClaimResource",                "share_id",          5, "optional string"),
    ("CDIDevice",                    "name",              1, "string"),
    ("GetPodResourcesRequest",       "pod_name",          1, "string"),
    ("GetPodResourcesRequest",       "pod_namespace",     2, "string"),
    ("GetPodResourcesResponse",      "pod_resources",     1, "PodResources"),
]  # fmt: skip

EMPTY = ["AllocatableResourcesRequest", "ListPodResourcesRequest"]


def _type(field: Any) -> str:
    from google.protobuf.descriptor import FieldDescriptor

    if field.message_type is not None:
        name = str(field.message_type.name)
    else:
        name = {FieldDescriptor.TYPE_STRING: "string", FieldDescriptor.TYPE_INT64: "int64",
                FieldDescriptor.TYPE_UINT64: "uint64"}[field.type]
    repeated = field.is_repeated if hasattr(field, "is_repeated") else field.label == FieldDescriptor.LABEL_REPEATED
    if repeated:
        return f"repeated {name}"
    return f"optional {name}" if field.has_presence and field.message_type is None else name


def test_package_and_service() -> None:
    assert pb.DESCRIPTOR.package == "v1"
    service = pb.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert service.full_name == "v1.PodResourcesLister"
    got = [(m.name, m.input_type.name, m.output_type.name) for m in service.methods]
    assert got == METHODS
    assert not any(m.client_streaming or m.server_streaming for m in service.methods)


@pytest.mark.parametrize(("message", "name", "number", "kind"), FIELDS, ids=[f"{m}.{f}" for m, f, *_ in FIELDS])
def test_field(message: str, name: str, number: int, kind: str) -> None:
    field = pb.DESCRIPTOR.message_types_by_name[message].fields_by_name[name]
    assert (field.number, _type(field)) == (number, kind)


def test_no_other_messages_or_fields() -> None:
    listed = {(m, f, n) for m, f, n, _ in FIELDS}
    have = {(m.name, f.name, f.number) for m in pb.DESCRIPTOR.message_types_by_name.values() for f in m.fields}
    assert have == listed
    assert set(pb.DESCRIPTOR.message_types_by_name) == {m for m, *_ in FIELDS} | set(EMPTY)


def test_wire_bytes() -> None:
    """A ContainerDevices as the kubelet's Go code encodes it (tag = field number << 3 | wire type)."""
    devices = pb.ContainerDevices(resource_name="a", device_ids=["0", "1"],
                                  topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=1)]))
    assert devices.SerializeToString() == b"\x0a\x01a\x12\x010\x12\x011\x1a\x04\x0a\x02\x08\x01"
    claim = pb.ClaimResource(share_id="")  # optional: present even when empty
    assert claim.SerializeToString() == b"\x2a\x00"


def test_header_records_the_kubelet_release() -> None:
    header = (PROTO_DIR / "podresources.proto").read_text(encoding="utf-8")
    assert "k8s.io/kubelet v0.36.3 (Kubernetes 1.36.3), commit\n// bbb4f8f0907ace5f317f33e06413a55a5f4636f6" in header


def _pin() -> str:
    m = re.search(r"^GRPCIO_TOOLS_VERSION=([0-9.]+)$", GEN_PROTOS.read_text(encoding="utf-8"), re.M)
    assert m, "scripts/gen-protos.sh has no GRPCIO_TOOLS_VERSION= line"
    return m.group(1)


@pytest.mark.slow  # installs the pinned grpcio-tools in a throwaway environment (about 10 s)
@pytest.mark.xdist_group("pinned_grpcio_tools")
def test_generated_code_is_current(tmp_path: Path) -> None:
    """Byte for byte: scripts/gen-protos.sh, with the pinned grpcio-tools, reproduces the committed files.
    Skips where the pinned generator cannot be installed (offline), fails so under ``CI=true``."""
    pin = _pin()
    try:
        python = Path(sys.executable) if version("grpcio-tools") == pin else None
    except PackageNotFoundError:
        python = None
    if python is None:
        venv = tmp_path / "venv"
        python = venv / "bin" / "python"
        for step in ([sys.executable, "-m", "venv", str(venv)],
                     [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                      "--only-binary=:all:", f"grpcio-tools=={pin}"]):
            done = subprocess.run(step, capture_output=True, text=True, timeout=600, check=False)
            if done.returncode != 0:
                why = f"cannot install grpcio-tools=={pin}: {done.stderr.strip()[-500:]}"
                if in_ci():
                    pytest.fail(why, pytrace=False)
                pytest.skip(why)
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run(["bash", str(GEN_PROTOS), "--out", str(out)], env={**os.environ, "PYTHON": str(python)},
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    fresh = out / "accelstats" / "kubernetes" / "proto"
    assert sorted(p.name for p in fresh.iterdir()) == sorted(GENERATED)
    stale = [n for n in GENERATED if (fresh / n).read_bytes() != (PROTO_DIR / n).read_bytes()]
    assert not stale, f"{', '.join(stale)} stale: run scripts/gen-protos.sh (grpcio-tools=={pin}) and commit"
