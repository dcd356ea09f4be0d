"""Kubelet device IDs resolved against one host's devices: a spec table (accelstats/kubernetes/device_ids.py)."""

from __future__ import annotations

import pytest

from accelstats.kubernetes.device_ids import Resolved, Unresolved, resolve
from collectors.model import Device

GPU0 = "GPU-11111111-2222-3333-4444-555555555555"
GPU1 = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
MIG_A = "MIG-0a0a0a0a-0000-1111-2222-333333333333"  # GPU1, GPU instance 1, compute instance 0
MIG_B = "MIG-0b0b0b0b-0000-1111-2222-333333333333"  # GPU1, GPU instance 2, compute instance 0

# This host: GPU0 at index 0 behind /dev/nvidia0, GPU1 (MIG on) at index 1 behind /dev/nvidia3 (index and
# minor differ, as they may), with two MIG instances.
HOST = (
    Device(uuid=GPU0, index=0, minor=0, name="NVIDIA H100 80GB HBM3"),
    Device(uuid=GPU1, index=1, minor=3, name="NVIDIA A100-SXM4-80GB", mig_mode="enabled"),
    Device(uuid=MIG_A, index=1, minor=None, name="NVIDIA A100-SXM4-80GB MIG 1g.10gb", kind="mig",
           parent_uuid=GPU1, gpu_instance_id=1, compute_instance_id=0, mig_profile="1g.10gb"),
    Device(uuid=MIG_B, index=1, minor=None, name="NVIDIA A100-SXM4-80GB MIG 3g.40gb", kind="mig",
           parent_uuid=GPU1, gpu_instance_id=2, compute_instance_id=0, mig_profile="3g.40gb"),
)

RESOLVED = [
    # (device ID from the kubelet,           form,         uuid,  gpu index, kind,  replica)
    (GPU0,                                   "uuid",       GPU0,  0,         "gpu", None),
    (GPU1.upper(),                           "uuid",       GPU1,  1,         "gpu", None),  # hex case
    (MIG_A,                                  "mig-uuid",   MIG_A, 1,         "mig", None),
    (f"MIG-{GPU1}/2/0",                      "mig-legacy", MIG_B, 1,         "mig", None),
    (f"{GPU0}::0",                           "uuid",       GPU0,  0,         "gpu", 0),
    (f"{GPU0}::7",                           "uuid",       GPU0,  0,         "gpu", 7),
    (f"{MIG_B}::3",                          "mig-uuid",   MIG_B, 1,         "mig", 3),
    ("0",                                    "index",      GPU0,  0,         "gpu", None),
    ("1",                                    "index",      GPU1,  1,         "gpu", None),
    ("1::2",                                 "index",      GPU1,  1,         "gpu", 2),
    ("nvidia0",                              "gke",        GPU0,  0,         "gpu", None),
    ("nvidia3",                              "gke",        GPU1,  1,         "gpu", None),  # the minor
    ("nvidia3/gi1",                          "gke-mig",    MIG_A, 1,         "mig", None),
    ("nvidia3/gi2",                          "gke-mig",    MIG_B, 1,         "mig", None),
    ("nvidia0/vgpu4",                        "gke",        GPU0,  0,         "gpu", 4),
    ("nvidia3/gi1/vgpu0",                    "gke-mig",    MIG_A, 1,         "mig", 0),
]  # fmt: skip

UNRESOLVED = [
    # (device ID,                            reason contains)
    ("",                                     "empty device ID"),
    ("GPU-99999999-2222-3333-4444-555555555555", "no GPU with UUID"),
    (MIG_A.replace("0a0a", "0c0c"),          "no MIG instance with UUID"),
    (f"MIG-{GPU1}/5/0",                      "no MIG instance GPU instance 5 compute instance 0"),
    ("2",                                    "no GPU with index 2"),
    ("nvidia1",                              "no GPU behind /dev/nvidia1"),  # index 1 is minor 3
    ("nvidia0/gi1",                          "no GPU instance 1 on /dev/nvidia0"),
    ("nvidia3/gi9",                          "no GPU instance 9"),
    (f"{GPU0}::",                            "replica suffix '' is not a number"),
    (f"{GPU0}::x",                           "replica suffix 'x' is not a number"),
    (f"{GPU0}::1::2",                        "more than one '::'"),
    ("nvidia0/vgpu1::2",                     "both a '::' and a '/vgpu' replica"),
    ("GPU-1234",                             "not a known device ID form"),
    ("-1",                                   "not a known device ID form"),
    ("nvidia0/gi",                           "not a known device ID form"),
    ("/dev/nvidia0",                         "not a known device ID form"),
    ("gpu-0",                                "not a known device ID form"),  # a DRA device name, not an ID
    ("x" * 300,                              "longer than 256 characters"),
]  # fmt: skip


@pytest.mark.parametrize(("device_id", "form", "uuid", "index", "kind", "replica"), RESOLVED,
                         ids=[row[0] for row in RESOLVED])
def test_resolves(device_id: str, form: str, uuid: str, index: int, kind: str, replica: int | None) -> None:
    assert resolve(device_id, HOST) == Resolved(device_id=device_id, form=form,  # type: ignore[arg-type]
                                                uuid=uuid, index=index, kind=kind, replica=replica)  # type: ignore[arg-type]


@pytest.mark.parametrize(("device_id", "reason"), UNRESOLVED, ids=[row[0][:60] or "empty" for row in UNRESOLVED])
def test_does_not_resolve(device_id: str, reason: str) -> None:
    got = resolve(device_id, HOST)
    assert isinstance(got, Unresolved)
    assert reason in got.reason
    assert "\n" not in got.reason
    assert len(got.device_id) <= 260


def test_gke_node_number_is_the_index_where_minors_are_unknown() -> None:
    """A host whose devices carry no minor number (``Device.minor`` None): ``nvidia<m>`` falls back to the index."""
    host = (Device(uuid=GPU0, index=0, minor=None, name="x"), Device(uuid=GPU1, index=1, minor=None, name="y"))
    assert resolve("nvidia1", host) == Resolved("nvidia1", "gke", GPU1, 1, "gpu")


def test_gke_gpu_instance_with_two_compute_instances_is_ambiguous() -> None:
    second = Device(uuid="MIG-0d0d0d0d-0000-1111-2222-333333333333", index=1, minor=None, name="z", kind="mig",
                    parent_uuid=GPU1, gpu_instance_id=1, compute_instance_id=1)
    got = resolve("nvidia3/gi1", HOST + (second,))
    assert isinstance(got, Unresolved) and "2 compute instances: ambiguous" in got.reason


def test_a_mig_uuid_never_resolves_to_a_whole_gpu_nor_an_index_to_a_mig_instance() -> None:
    assert isinstance(resolve(GPU1.replace("GPU-", "MIG-"), HOST), Unresolved)
    migs_only = tuple(d for d in HOST if d.kind == "mig")
    assert isinstance(resolve("1", migs_only), Unresolved)  # MIG instances carry their parent's index
