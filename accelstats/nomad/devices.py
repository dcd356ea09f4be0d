"""From one collection to Nomad's messages: Fingerprint groups, Stats groups, Reserve answers.

Groups (docs/nomad.md, the metrics contract):

* NVIDIA GPUs: ``nvidia/gpu/<NVML name>``, one group per model, like HashiCorp's NVIDIA plugin, so
  existing job specs keep working; a GPU with MIG enabled is left out and its instances form
  ``nvidia/gpu/<name> MIG <profile>`` groups;
* file devices: ``<vendor>/<type>/<name>`` from the ``file_devices`` block, like Nomad's example plugin.

Device IDs are the GPU or MIG UUID and the file name: stable across restarts. A device NVML lost is
``healthy=false`` with a description a person can act on; it stays in the fingerprint.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from accelstats import catalog
from accelstats.manager import Collection
from accelstats.registry import enabled_names
from accelstats.settings import NomadSettings, Settings
from collectors.model import Device, DeviceSample, FileDevice

MIB = catalog.MIB
FILE_MOUNT_DIR = "/tmp/task-mounts"  # where the example plugin mounts a file device in the task


@dataclass(frozen=True)
class MpsShare:
    """A GPU offered as MPS replicas: its resource, the daemon's health and directories."""

    resource: str
    replicas: int
    healthy: bool
    reason: str
    pipe_dir: str
    shm_dir: str
    pinned_limit_bytes: int | None = None


#: What a reservation names the reserved UUIDs in by default (the ``visible_devices_env`` setting):
#: CUDA reads it in every task driver, and Nomad's docker driver does not then demand the ``nvidia``
#: runtime, as it does for ``NVIDIA_VISIBLE_DEVICES`` (docs/nomad.md, "Task drivers").
DEFAULT_VISIBLE_ENV = NomadSettings().visible_devices_env


@dataclass(frozen=True)
class Reservable:
    """What Reserve needs of one device of the latest fingerprint."""

    kind: str  # "gpu", "mig", "mps" or "file"
    device: Device | None = None
    file: FileDevice | None = None
    parent_minor: int | None = None
    mps: MpsShare | None = None


@dataclass
class Snapshot:
    """One fingerprint: the groups as sent, and every device ID it offers (for Reserve)."""

    groups: list[Any] = field(default_factory=list)
    devices: dict[str, Reservable] = field(default_factory=dict)


def _attr(structs: Any, value: object, unit: str = "") -> Any:
    if isinstance(value, bool):
        return structs.Attribute(bool_val=value)
    if isinstance(value, int):
        return structs.Attribute(int_val=value, unit=unit)
    if isinstance(value, float):
        return structs.Attribute(float_val=value, unit=unit)
    return structs.Attribute(string_val=str(value))


# nomad-device-nvidia's pci_bandwidth: MB/s per lane by the link's maximum generation, as it writes
# them (gen3 1 << 10, gen4 2 << 10, gen5 3 << 10, gen6 4 << 10: linear, not doubling); gen 1 and 2 give 0
# (hashicorp/nomad-device-nvidia nvml/driver_linux.go:208-219).
PCI_LANE_MBPS_NOMAD = {3: 1 << 10, 4: 2 << 10, 5: 3 << 10, 6: 4 << 10}
#: Attributes that nomad-device-nvidia reads as current values (power draw, clocks): they are taken
#: when a group's devices or their health change and kept otherwise, as that plugin does (it sends a
#: fingerprint only then), so a fingerprint is not re-sent because a clock moved.
VOLATILE_ATTRIBUTES = ("power", "cores_clock", "memory_clock")


def _flag(mode: str) -> int | None:
    return {"enabled": 1, "disabled": 0}.get(mode)


def _float_text(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def gpu_attributes(structs: Any, device: Device, sample: DeviceSample | None, driver: str,
                   parent: Device | None = None, parent_sample: DeviceSample | None = None) -> dict[str, Any]:
    """Fingerprint attributes with nomad-device-nvidia's names, values and units
    (hashicorp/nomad-device-nvidia ``fingerprint.go:184-232``, ``nvml/driver_linux.go:140-265``), typed
    so that Nomad's constraint and affinity comparison works (a job's literal ``"9.0"`` is parsed as a
    Float, ``"1"`` as an Int, and a String attribute compares with neither: Nomad
    ``plugins/shared/structs/attribute.go:84-93, 299-301``):

    * ``memory`` MiB (the MIG instance's own for a MIG instance), Int;
    * ``power`` W, the current draw (``nvmlDeviceGetPowerUsage``), Int;
    * ``bar1`` MiB, Int; ``cores_clock`` and ``memory_clock`` MHz, the current graphics and memory
      clocks (``nvmlDeviceGetClockInfo``), Int;
    * ``pci_bandwidth`` MB/s = the link's maximum width x 1024 per lane for gen 3, 2048 gen 4, 3072 gen
      5, 4096 gen 6, 0 for gen 1-2, Int;
    * ``display_state`` (``nvmlDeviceGetDisplayMode``) and ``persistence_mode``: Int 0 / 1 (HashiCorp's
      sends the strings "0" / "1", which no job literal compares equal to; docs/nomad.md);
    * ``driver_version``, ``architecture``, ``mig_profile``: String; ``compute_capability`` Float (9.0).

    A MIG instance takes power, BAR1, PCIe, clocks, display and persistence from its parent GPU
    (``parent``, ``parent_sample``), as nomad-device-nvidia does (``driver_linux.go:152-161``). A value
    NVML did not give is left out."""
    out: dict[str, Any] = {}
    s = sample if sample is not None and sample.up else None
    hw = parent if parent is not None else device
    ps = parent_sample if parent is not None else s
    ps = ps if ps is not None and ps.up else None
    if s is not None and s.memory_total_bytes is not None:
        out["memory"] = _attr(structs, s.memory_total_bytes // MIB, "MiB")
    if ps is not None and ps.power_watts is not None:
        out["power"] = _attr(structs, int(ps.power_watts), "W")
    if ps is not None and ps.bar1_total_bytes is not None:
        out["bar1"] = _attr(structs, ps.bar1_total_bytes // MIB, "MiB")
    if driver:
        out["driver_version"] = _attr(structs, driver)
    clocks = dict(ps.clocks_hz) if ps is not None else {}
    if "graphics" in clocks:
        out["cores_clock"] = _attr(structs, int(clocks["graphics"] // 1_000_000), "MHz")
    if "memory" in clocks:
        out["memory_clock"] = _attr(structs, int(clocks["memory"] // 1_000_000), "MHz")
    if hw.max_pcie_generation is not None and hw.max_pcie_width is not None:
        out["pci_bandwidth"] = _attr(structs, PCI_LANE_MBPS_NOMAD.get(hw.max_pcie_generation, 0) * hw.max_pcie_width,
                                     "MB/s")
    if (display := _flag(hw.display_mode)) is not None:
        out["display_state"] = _attr(structs, display)
    if (persistence := _flag(hw.persistence_mode)) is not None:
        out["persistence_mode"] = _attr(structs, persistence)
    if device.compute_capability and (cc := _float_text(device.compute_capability)) is not None:
        out["compute_capability"] = _attr(structs, cc)
    if device.architecture:
        out["architecture"] = _attr(structs, device.architecture)
    if device.kind == "mig":
        out["mig_profile"] = _attr(structs, device.mig_profile)
    return out


def health(sample: DeviceSample | None, parent: DeviceSample | None = None) -> tuple[bool, str]:
    """(healthy, description): a device that did not answer NVML, or whose GPU (for a MIG instance:
    its parent GPU) reported a critical XID, is unhealthy, with what to do."""
    if parent is not None and (not parent.up or parent.xid_critical):
        ok, why = health(parent)
        if not ok:
            return False, f"its GPU: {why}"
    if sample is None:
        return False, "not read yet"
    if sample.up and sample.xid_critical:
        return False, (f"the GPU reported critical XID {sample.xid_critical} (NVML event; see dmesg); drain its "
                       "jobs, then reset the GPU (nvidia-smi -r) or reboot; healthy again after the plugin restarts")
    if sample.up:
        return True, ""
    error = sample.error.rsplit(": ", 1)[-1]  # the NVML error, not the call that met it (no flapping)
    return False, (f"NVML cannot read this GPU ({error}); check `nvidia-smi` and the kernel log (dmesg: Xid); "
                   "it may need a GPU reset or a reboot")


def missing_cap_node(device: Device, parent_minor: int | None, mig_caps: dict[tuple[int, int, int], list[int]],
                     dev_root: str = "/dev") -> str | None:
    """The first ``nvidia-caps`` node (``<dev_root>/nvidia-caps/nvidia-cap<minor>``) that a MIG
    instance's task needs and that does not exist, or None (also for a GPU, or a MIG instance without
    an entry). ``mig_caps``: (parent GPU minor, GPU instance id, compute instance id) -> capability
    minors, from ``/proc/driver/nvidia-caps/mig-minors`` (``plugin._mig_caps``); one ``stat`` per node."""
    if device.kind != "mig" or parent_minor is None:
        return None
    key = (parent_minor, device.gpu_instance_id or 0, device.compute_instance_id or 0)
    nodes = [f"{dev_root}/nvidia-caps/nvidia-cap{m}" for m in mig_caps.get(key, [])]
    return next((n for n in nodes if not os.path.exists(n)), None)


def fingerprint(device_pb2: Any, structs: Any, collection: Collection, settings: Settings,
                previous: Snapshot | None = None, mps: dict[str, MpsShare] | None = None,
                mig_caps: dict[tuple[int, int, int], list[int]] | None = None, dev_root: str = "/dev") -> Snapshot:
    """The full device set of one collection as Fingerprint groups (sorted, so equal sets compare equal):
    GPUs and MIG instances when the ``nvidia`` collector is enabled (the plugin's ``enabled``), less
    ``settings.nomad.ignored_gpu_ids``; file devices in the ``settings.file_devices`` group.

    A group's attributes come from a device that answered NVML; when none did, from ``previous``
    (so ``${device.attr.memory}`` constraints do not flap while a GPU is lost).

    GPUs in ``mps`` (UUID → share) are offered only as replicas, never whole: group
    ``nvidia/mps/<NVML name>``, IDs ``<uuid>::<n>`` (stable across restarts), healthy while the GPU
    and its control daemon are, ``memory`` = the per-replica pinned limit, ``mps_replicas``.

    ``mig_caps`` ((parent minor, gi, ci) -> ``nvidia-caps`` minors, from ``mig-minors``): a MIG
    instance one of whose nodes does not exist under ``dev_root`` is unhealthy, with the node named —
    Nomad's exec driver and docker fail a task given a device node that does not exist
    (``drivers/shared/executor/executor_linux_cgo.go:929-933``), so the scheduler must not pick it."""
    snap = Snapshot()
    s = collection.snapshot
    ignored = set(settings.nomad.ignored_gpu_ids)
    mig_parents = {d.parent_uuid for d in s.devices if d.kind == "mig"}
    by_uuid = {d.uuid: d for d in s.devices}
    groups: dict[tuple[str, str, str], tuple[list[Any], dict[str, Any]]] = {}
    if "nvidia" in enabled_names(settings):
        for d in s.devices:
            if d.uuid in ignored or d.uuid in mig_parents or (d.kind == "mig" and d.parent_uuid in ignored):
                continue
            sample = s.samples.get(d.uuid)
            parent_sample = s.samples.get(d.parent_uuid) if d.kind == "mig" else None
            healthy, why = health(sample, parent_sample)
            share = (mps or {}).get(d.uuid)
            if share is not None and d.kind == "gpu":
                if healthy and not share.healthy:
                    healthy, why = False, f"MPS resource {share.resource!r}: {share.reason}"
                mdevices, mattrs = groups.setdefault(("nvidia", "mps", d.name), ([], {}))
                for n in range(share.replicas):
                    mdevices.append(device_pb2.DetectedDevice(
                        ID=f"{d.uuid}::{n}", healthy=healthy, health_description=why,
                        hw_locality=device_pb2.DeviceLocality(pci_bus_id=d.pci_bus_id.strip("\0").strip())))
                    snap.devices[f"{d.uuid}::{n}"] = Reservable("mps", device=d, parent_minor=d.minor, mps=share)
                if "memory" not in mattrs and sample is not None and sample.up:
                    mattrs.update(gpu_attributes(structs, d, sample, s.driver_version))
                    if share.pinned_limit_bytes is not None:
                        mattrs["memory"] = _attr(structs, share.pinned_limit_bytes // MIB, "MiB")
                    mattrs["mps_replicas"] = _attr(structs, share.replicas)
                continue
            name = d.name if d.kind == "gpu" or " MIG " in d.name else f"{d.name} MIG {d.mig_profile}"
            key = ("nvidia", "gpu", name)
            devices, attrs = groups.setdefault(key, ([], {}))
            parent = by_uuid.get(d.parent_uuid) if d.kind == "mig" else None
            if healthy and mig_caps is not None and parent is not None:
                node = missing_cap_node(d, parent.minor, mig_caps, dev_root)
                if node is not None:
                    healthy, why = False, (f"device node {node} does not exist, and a task given it does not start "
                                           "(docker, exec); create the nvidia-caps nodes (NVIDIA's nvidia-modprobe "
                                           "does): healthy at the next fingerprint")
            devices.append(device_pb2.DetectedDevice(
                ID=d.uuid, healthy=healthy, health_description=why,
                hw_locality=device_pb2.DeviceLocality(pci_bus_id=d.pci_bus_id.strip("\0").strip())))
            if (not attrs or "memory" not in attrs) and sample is not None and sample.up:
                attrs.clear()
                attrs.update(gpu_attributes(structs, d, sample, s.driver_version, parent, parent_sample))
            snap.devices[d.uuid] = Reservable(d.kind, device=d,
                                              parent_minor=parent.minor if parent is not None else d.minor)
    fd = settings.file_devices
    for f in s.file_devices:
        devices, _ = groups.setdefault((fd.vendor, fd.type, fd.name), ([], {}))
        devices.append(device_pb2.DetectedDevice(ID=f.id, healthy=f.healthy, health_description=f.health_description))
        snap.devices[f.id] = Reservable("file", file=f)
    earlier = {(g.vendor, g.device_type, g.device_name): g for g in previous.groups} if previous else {}
    for (vendor, dtype, name), (devices, attrs) in sorted(groups.items()):
        before = earlier.get((vendor, dtype, name))
        if before is not None and not attrs:
            attrs = dict(before.attributes)
        elif before is not None and _same_devices(before.devices, devices):
            attrs = dict(attrs)
            for volatile in VOLATILE_ATTRIBUTES:  # current draw and clocks: taken when the group changes
                if volatile in before.attributes:
                    attrs[volatile] = before.attributes[volatile]
        snap.groups.append(device_pb2.DeviceGroup(
            vendor=vendor, device_type=dtype, device_name=name,
            devices=sorted(devices, key=lambda x: x.ID), attributes=attrs))
    return snap


def _same_devices(before: Any, now: list[Any]) -> bool:
    """True when a group holds the same device IDs with the same health as before."""
    return sorted((d.ID, d.healthy) for d in before) == sorted((d.ID, d.healthy) for d in now)


def _stat(structs: Any, desc: str, unit: str, numerator: float | int | None = None,
          denominator: float | int | None = None) -> Any:
    """A StatValue; ``None`` numerator gives ``string_val "N/A"`` with the same unit and desc."""
    w = structs
    if numerator is None:
        from google.protobuf import wrappers_pb2

        return w.StatValue(string_val=wrappers_pb2.StringValue(value="N/A"), unit=unit, desc=desc)
    from google.protobuf import wrappers_pb2

    if isinstance(numerator, int) and (denominator is None or isinstance(denominator, int)):
        value = w.StatValue(int_numerator_val=wrappers_pb2.Int64Value(value=numerator), unit=unit, desc=desc)
        if denominator is not None:
            value.int_denominator_val.value = denominator
        return value
    value = w.StatValue(float_numerator_val=wrappers_pb2.DoubleValue(value=float(numerator)), unit=unit, desc=desc)
    if denominator is not None:
        value.float_denominator_val.value = float(denominator)
    return value


def gpu_stats(structs: Any, sample: DeviceSample | None) -> tuple[Any, Any]:
    """(summary, stats) for one GPU or MIG instance: one attribute per row of
    :data:`accelstats.catalog.NOMAD_STATS` (HashiCorp's NVIDIA plugin's names; power in watts), the
    summary its ``Memory state``; a device that did not answer gives ``N/A`` for every value."""
    s = sample if sample is not None and sample.up else DeviceSample(uuid="", up=False)
    attrs = {stat.name: _stat(structs, stat.desc, stat.unit, *stat.read(s)) for stat in catalog.NOMAD_STATS}
    summary = catalog.NOMAD_SUMMARY
    return _stat(structs, summary.desc, summary.unit, *summary.read(s)), structs.StatObject(attributes=attrs)


def file_stats(structs: Any, f: FileDevice) -> tuple[Any, Any]:
    """(summary, stats) of a file device, as Nomad's example plugin reports them."""
    import time as _time

    mtime = _time.strftime("%Y-%m-%dT%H:%M:%S%z", _time.localtime(f.modified_timestamp_seconds))
    summary = _stat(structs, "Filesize in bytes", "bytes", f.size_bytes)
    attrs = {"size": _stat(structs, "Filesize in bytes", "bytes", f.size_bytes),
             "modify_time": structs.StatValue(string_val=_wrap(mtime), desc="Modification time"),
             "mode": structs.StatValue(string_val=_wrap(f.permissions), desc="File mode")}
    return summary, structs.StatObject(attributes=attrs)


def _wrap(text: str) -> Any:
    from google.protobuf import wrappers_pb2

    return wrappers_pb2.StringValue(value=text)


def stats(device_pb2: Any, structs: Any, collection: Collection, snap: Snapshot, timestamp: Any) -> Any:
    """StatsResponse for the devices of fingerprint ``snap`` from ``collection``; every DeviceStats
    carries ``timestamp`` (Nomad drops a device's stats without one)."""
    s = collection.snapshot
    files = {f.id: f for f in s.file_devices}
    groups = []
    for g in snap.groups:
        instances = {}
        for d in g.devices:
            r = snap.devices.get(d.ID)
            if r is None:
                continue
            if r.kind == "mps" and r.device is not None:
                summary, obj = gpu_stats(structs, s.samples.get(r.device.uuid))
                instances[d.ID] = device_pb2.DeviceStats(summary=summary, stats=obj, timestamp=timestamp)
                continue
            if r.kind == "file":
                f = files.get(d.ID)
                if f is None:
                    continue
                summary, obj = file_stats(structs, f)
            else:
                summary, obj = gpu_stats(structs, s.samples.get(d.ID))
            instances[d.ID] = device_pb2.DeviceStats(summary=summary, stats=obj, timestamp=timestamp)
        groups.append(device_pb2.DeviceGroupStats(vendor=g.vendor, type=g.device_type, name=g.device_name,
                                                  instance_stats=instances))
    return device_pb2.StatsResponse(groups=groups)


#: Device IDs one Reserve may name. Nomad sends the IDs of one ``device`` block, its ``count``
#: instances (spec/nomad-plugin.md, ReserveRequest); the largest real one is every MPS replica of a
#: host (48 per GPU, 8 GPUs: 384). Past it a request is refused before any ID is looked at.
MAX_RESERVE_IDS = 1024


class ReserveError(ValueError):
    """A Reserve request that cannot be served (empty, too many IDs, unknown ID): INVALID_ARGUMENT with this text."""


def reserve_ids(ids: Sequence[str]) -> list[str]:
    """The distinct IDs of a Reserve request, in request order. A repeated ID names the same device, so
    it is collapsed, not refused: Nomad's scheduler never repeats one, and the reservation is the one
    for the ID once (nomad-device-nvidia passes repeats into ``NVIDIA_VISIBLE_DEVICES`` unchanged).
    Raises ReserveError past :data:`MAX_RESERVE_IDS` IDs, repeats counted (checked before the IDs
    are read)."""
    if len(ids) > MAX_RESERVE_IDS:
        raise ReserveError(f"too many device IDs to reserve: {len(ids)}, at most {MAX_RESERVE_IDS} "
                           "(Nomad sends the IDs of one device request)")
    return list(dict.fromkeys(ids))


def replica_count_error(replicas: Sequence[tuple[str, Reservable]]) -> str | None:
    """Why a request of these MPS replicas is refused while ``fail_requests_greater_than_one`` is on
    (the default), naming each GPU and how many of its replicas were asked; None for one replica.

    As NVIDIA's k8s-device-plugin (``api/config/v1/config.go:72-76`` makes its MPS
    ``failRequestsGreaterThanOne`` true by default, ``internal/rm/rm.go:101-104`` refuses a request of
    more than one replica): a task is one MPS client, and its limits are the control daemon's defaults —
    one replica's thread percentage and pinned memory — however many replicas it holds (a client's own
    ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` can only lower them); the others would be held and unused.
    Replicas on different GPUs count too: Nomad picks a request's instances from a Go map
    (``scheduler/feasible/device.go:130-145``, ``nomad/structs/devices.go:24``), so which GPUs a
    ``count = 2`` gets is chance, and a rule on one GPU only would pass or fail the same job by chance."""
    if len(replicas) < 2:
        return None
    per_gpu: dict[str, int] = {}
    for i, r in replicas:
        gpu = r.device.uuid if r.device is not None else i
        per_gpu[gpu] = per_gpu.get(gpu, 0) + 1
    named = ", ".join(f"{n} of GPU {gpu[:200]}" for gpu, n in per_gpu.items())
    return (f"{len(replicas)} MPS replicas in one request ({named}), at most 1: a task is one MPS client with "
            "one replica's share however many it holds; ask for count = 1, or set "
            "fail_requests_greater_than_one = false in the plugin's mps block to let a task hold several "
            "(docs/nomad.md, \"One replica per task\")")


def reserve(device_pb2: Any, snap: Snapshot, ids: list[str], mig_caps: dict[tuple[int, int, int], list[int]],
            dev_root: str = "/dev", visible_env: Sequence[str] = DEFAULT_VISIBLE_ENV,
            fail_requests_greater_than_one: bool = True) -> Any:
    """ContainerReservation for ``ids`` of the latest fingerprint ``snap`` (never touches the
    filesystem with an ID: IDs are looked up, not joined into paths).

    GPUs and MIG instances: each variable of ``visible_env`` (the ``visible_devices_env`` setting;
    ``CUDA_VISIBLE_DEVICES`` by default) = the UUIDs in request order, and device specs for
    ``/dev/nvidia<minor>``, ``nvidiactl``, ``nvidia-uvm``, ``nvidia-uvm-tools`` (when present) and a MIG
    instance's ``nvidia-caps`` nodes (``mig_caps[(parent minor, gi, ci)]`` = cap minors). Nomad's
    docker driver demands the ``nvidia`` runtime whenever the env holds ``NVIDIA_VISIBLE_DEVICES``
    (hashicorp/nomad ``drivers/docker/driver.go:1065-1073``), so that variable is set only when
    configured.

    MPS replicas (k8s-device-plugin's client layout, ``internal/plugin/mps.go:74-91``): also
    ``CUDA_VISIBLE_DEVICES`` and ``CUDA_MPS_PIPE_DIRECTORY`` = the resource's host pipe dir, which is
    mounted at that same path (raw_exec applies no mounts and still finds it: nomad
    ``drivers/rawexec/driver.go:370-380``), and the daemon's ``/dev/shm`` (the host's) at ``/dev/shm``,
    so server and clients share one ``/dev/shm``.

    File devices: a mount at ``/tmp/task-mounts/<id>``, as the example plugin does.

    Repeated IDs count once, more than :data:`MAX_RESERVE_IDS` are refused (:func:`reserve_ids`).
    Raises ReserveError for no IDs, too many, an unknown ID, replicas of two resources, replicas with whole
    GPUs, more than one replica unless ``fail_requests_greater_than_one`` is False
    (:func:`replica_count_error`; when False, the task gets the reservation of its replicas' GPUs, as one
    MPS client), and a MIG instance whose ``nvidia-caps`` node does not exist (Nomad's exec driver fails
    such a task: ``drivers/shared/executor/executor_linux_cgo.go:929-933``; docker too).
    """
    if not ids:
        raise ReserveError("no device IDs to reserve")
    chosen = []
    for i in reserve_ids(ids):
        r = snap.devices.get(i)
        if r is None:
            raise ReserveError(f'unknown device "{i[:200]}"')
        chosen.append((i, r))
    res = device_pb2.ContainerReservation()
    gpus = [(i, r) for i, r in chosen if r.kind in ("gpu", "mig", "mps")]
    if gpus:
        uuids = ",".join(dict.fromkeys(r.device.uuid if r.kind == "mps" and r.device is not None else i
                                       for i, r in gpus))
        for name in visible_env:
            res.envs[name] = uuids
        shares = list({r.mps.resource: r.mps for _, r in gpus if r.mps is not None}.values())
        if len(shares) > 1:
            raise ReserveError("MPS replicas of different resources cannot be reserved together: "
                               + ", ".join(sorted(repr(m.resource) for m in shares)))
        if shares and any(r.kind != "mps" for _, r in gpus):
            raise ReserveError("whole GPUs (or MIG instances) and MPS replicas cannot be reserved together: "
                               "a task under MPS reaches only the GPUs of its resource's control daemon")
        refused = replica_count_error(gpus) if shares and fail_requests_greater_than_one else None
        if refused is not None:
            raise ReserveError(refused)
        if shares:
            pipe = shares[0].pipe_dir
            res.envs["CUDA_MPS_PIPE_DIRECTORY"] = pipe
            # The MPS server has every GPU of its resource; CUDA_VISIBLE_DEVICES (UUIDs: NVIDIA's MPS docs
            # advise them, indices are renumbered by the server) keeps the task to the GPUs it reserved.
            res.envs["CUDA_VISIBLE_DEVICES"] = uuids
            res.mounts.append(device_pb2.Mount(task_path=pipe, host_path=pipe, read_only=False))
            res.mounts.append(device_pb2.Mount(task_path="/dev/shm", host_path=shares[0].shm_dir, read_only=False))
        nodes: list[str] = []
        for i, r in gpus:
            if r.parent_minor is not None:
                nodes.append(f"{dev_root}/nvidia{r.parent_minor}")
            d = r.device
            if d is not None and d.kind == "mig" and r.parent_minor is not None:
                key = (r.parent_minor, d.gpu_instance_id or 0, d.compute_instance_id or 0)
                missing = missing_cap_node(d, r.parent_minor, mig_caps, dev_root)
                if missing is not None:
                    raise ReserveError(
                        f"MIG instance {i[:200]}: device node {missing} does not exist, and a task given a "
                        "missing device node does not start (docker, exec); the fingerprint marks the instance "
                        "unhealthy until the nvidia-caps nodes are created (NVIDIA's nvidia-modprobe does)")
                nodes += [f"{dev_root}/nvidia-caps/nvidia-cap{m}" for m in mig_caps.get(key, [])]
        # nvidiactl exists wherever the driver is loaded; the uvm nodes only once nvidia-uvm is (a
        # device spec for a missing node fails the task): fixed paths, never built from an ID.
        nodes.append(f"{dev_root}/nvidiactl")
        nodes += [n for n in (f"{dev_root}/nvidia-uvm", f"{dev_root}/nvidia-uvm-tools") if os.path.exists(n)]
        for node in dict.fromkeys(nodes):
            res.devices.append(device_pb2.DeviceSpec(task_path=node, host_path=node, permissions="rw"))
    for i, r in chosen:
        if r.kind == "file" and r.file is not None:
            res.mounts.append(device_pb2.Mount(task_path=os.path.join(FILE_MOUNT_DIR, i),
                                               host_path=r.file.path, read_only=False))
    return res


def keep_unhealthy(device_pb2: Any, snap: Snapshot, last_gpu_groups: list[Any], previous: Snapshot,
                   reason: str) -> Snapshot:
    """``snap`` plus the GPU groups of the last fingerprint, every device unhealthy with ``reason``
    (NVML stopped answering as a whole: Nomad must see the GPUs broken, not gone)."""
    out = Snapshot(groups=list(snap.groups), devices=dict(snap.devices))
    for g in last_gpu_groups:
        devices = [device_pb2.DetectedDevice(ID=d.ID, healthy=False, health_description=reason,
                                             hw_locality=d.hw_locality) for d in g.devices]
        out.groups.append(device_pb2.DeviceGroup(vendor=g.vendor, device_type=g.device_type,
                                                 device_name=g.device_name, devices=devices,
                                                 attributes=g.attributes))
        for d in g.devices:
            if d.ID in previous.devices:
                out.devices[d.ID] = previous.devices[d.ID]
    out.groups.sort(key=lambda g: (g.vendor, g.device_type, g.device_name))
    return out
