"""What a kubelet device ID names on this host: pure parsing against the host's device list.

A device plugin advertises its devices to the kubelet under IDs of its own choosing, and the kubelet's
pod-resources API hands those IDs back per container. The forms the NVIDIA and GKE plugins use:

==========================  ======================================================================
``GPU-<uuid>``              a whole GPU by NVML UUID (NVIDIA k8s-device-plugin, ``deviceIDStrategy=uuid``)
``MIG-<uuid>``              a MIG instance by NVML UUID (R470+ drivers)
``MIG-GPU-<uuid>/<gi>/<ci>``  a MIG instance by parent UUID, GPU and compute instance (drivers before R470)
``<n>``                     a whole GPU by NVML index (``deviceIDStrategy=index``)
``<id>::<n>``               replica ``n`` of ``<id>`` (NVIDIA plugin time-slicing or MPS sharing)
``nvidia<m>``               GKE: the GPU behind ``/dev/nvidia<m>``
``nvidia<m>/gi<g>``         GKE: GPU instance ``g`` of that GPU (a MIG instance)
``…/vgpu<n>``               GKE time-sharing: replica ``n`` of ``nvidia<m>`` or ``nvidia<m>/gi<g>``
==========================  ======================================================================

Sources: NVIDIA k8s-device-plugin (``::`` replicas, ``deviceIDStrategy``); GoogleCloudPlatform/
container-engine-accelerators ``pkg/gpu/nvidia`` (device IDs are the ``/dev`` node names, MIG ``/gi<g>``,
``gpusharing.go``'s ``nvidia0/vgpu0`` and ``nvidia0/gi0/vgpu0``).

``nvidia<m>`` is matched on the device node's minor number (``Device.minor``) where the host's devices
carry one, else on the NVML index: GKE's plugin names devices by their ``/dev`` node, and NVML's index
and the minor number can differ (dcgm-exporter takes ``m`` as the index; both agree on most hosts).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from collectors.model import Device

IdForm = Literal["uuid", "mig-uuid", "mig-legacy", "index", "gke", "gke-mig"]

_UUID = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
_GPU_UUID = re.compile(rf"GPU-{_UUID}")
_MIG_UUID = re.compile(rf"MIG-{_UUID}")
_MIG_LEGACY = re.compile(rf"MIG-(?P<parent>GPU-{_UUID})/(?P<gi>[0-9]+)/(?P<ci>[0-9]+)")
_INDEX = re.compile(r"[0-9]+")
_GKE = re.compile(r"nvidia(?P<node>[0-9]+)(?:/gi(?P<gi>[0-9]+))?(?:/vgpu(?P<replica>[0-9]+))?")
_MAX_ID_LENGTH = 256  # longer than any form above: refused without a regex run


@dataclass(frozen=True)
class Resolved:
    """A device ID resolved to one device of this host.

    ``uuid`` is the device's NVML UUID (``GPU-…`` for a whole GPU, ``MIG-…`` for a MIG instance),
    ``index`` the NVML index of the GPU (a MIG instance's parent's), ``kind`` ``"gpu"`` or ``"mig"``,
    ``replica`` the sharing replica number (``::n`` or GKE's ``/vgpu<n>``; ``None`` when not shared),
    ``form`` which ID form matched, ``device_id`` the ID as the kubelet gave it.
    """

    device_id: str
    form: IdForm
    uuid: str
    index: int
    kind: Literal["gpu", "mig"]
    replica: int | None = None


@dataclass(frozen=True)
class Unresolved:
    """A device ID that names no device of this host: ``reason`` is one line saying why."""

    device_id: str
    reason: str


def resolve(device_id: str, devices: Sequence[Device]) -> Resolved | Unresolved:
    """Resolve one kubelet device ID against ``devices`` (this host's GPUs and MIG instances, as
    ``collectors.model.Device``). Never raises: an ID of no known form, or one naming a device this host
    does not have, comes back as ``Unresolved`` with the reason."""
    if not device_id:
        return Unresolved(device_id, "empty device ID")
    if len(device_id) > _MAX_ID_LENGTH:
        return Unresolved(device_id[:_MAX_ID_LENGTH] + "…", f"device ID longer than {_MAX_ID_LENGTH} characters")
    base, replica = device_id, None
    if "::" in device_id:
        base, _, suffix = device_id.rpartition("::")
        if not _INDEX.fullmatch(suffix):
            return Unresolved(device_id, f"replica suffix {suffix!r} is not a number")
        replica = int(suffix)
        if "::" in base:
            return Unresolved(device_id, "more than one '::' replica suffix")
    found = _resolve_base(base, devices)
    if isinstance(found, str):
        return Unresolved(device_id, found)
    form, device, gke_replica = found
    if gke_replica is not None:
        if replica is not None:
            return Unresolved(device_id, "both a '::' and a '/vgpu' replica")
        replica = gke_replica
    return Resolved(device_id=device_id, form=form, uuid=device.uuid, index=device.index, kind=device.kind,
                    replica=replica)


def _resolve_base(base: str, devices: Sequence[Device]) -> tuple[IdForm, Device, int | None] | str:
    """The device ``base`` (an ID without ``::n``) names, with its form and GKE replica, or why not."""
    gpus = [d for d in devices if d.kind == "gpu"]
    migs = [d for d in devices if d.kind == "mig"]
    if _GPU_UUID.fullmatch(base):
        gpu = _first(gpus, lambda d: d.uuid.lower() == base.lower())
        return ("uuid", gpu, None) if gpu else f"no GPU with UUID {base} on this host"
    if _MIG_UUID.fullmatch(base):
        mig = _first(migs, lambda d: d.uuid.lower() == base.lower())
        return ("mig-uuid", mig, None) if mig else f"no MIG instance with UUID {base} on this host"
    if m := _MIG_LEGACY.fullmatch(base):
        parent, gi, ci = m["parent"].lower(), int(m["gi"]), int(m["ci"])
        mig = _first(migs, lambda d: d.parent_uuid.lower() == parent and d.gpu_instance_id == gi
                     and d.compute_instance_id == ci)
        return ("mig-legacy", mig, None) if mig else (
            f"no MIG instance GPU instance {gi} compute instance {ci} on GPU {m['parent']} on this host")
    if _INDEX.fullmatch(base):
        gpu = _first(gpus, lambda d: d.index == int(base))
        return ("index", gpu, None) if gpu else f"no GPU with index {int(base)} on this host"
    if m := _GKE.fullmatch(base):
        node = int(m["node"])
        gpu = _first(gpus, lambda d: (d.minor if d.minor is not None else d.index) == node)
        if gpu is None:
            return f"no GPU behind /dev/nvidia{node} on this host"
        replica = int(m["replica"]) if m["replica"] is not None else None
        if m["gi"] is None:
            return ("gke", gpu, replica)
        gi = int(m["gi"])
        found = [d for d in migs if d.parent_uuid.lower() == gpu.uuid.lower() and d.gpu_instance_id == gi]
        if len(found) > 1:  # GKE makes one compute instance per GPU instance; more is not its layout
            return f"GPU instance {gi} on /dev/nvidia{node} holds {len(found)} compute instances: ambiguous"
        return ("gke-mig", found[0], replica) if found else f"no GPU instance {gi} on /dev/nvidia{node} on this host"
    return "not a known device ID form (GPU-/MIG- UUID, index, <id>::<n>, nvidia<m>[/gi<g>][/vgpu<n>])"


def _first(devices: Sequence[Device], match: Callable[[Device], bool]) -> Device | None:
    return next((d for d in devices if match(d)), None)
