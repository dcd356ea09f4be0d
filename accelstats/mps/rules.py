"""What an MPS resource is, what it may ask of its GPUs, and where its directories live
(docs/mps.md, "Interface" and "Configure"): the one MPS resource validator, and its bounds.

Two steps, one set of rules:

* :func:`check_settings` — at load time, without GPUs: the ``[mps]`` table of the TOML file and the
  plugin's ``mps`` block, once decoded into :class:`accelstats.settings.MpsSettings`. Resource names
  (:func:`check_name`: a relative path of at most :data:`MAX_NAME` characters; unique, none nested in
  another, :func:`check_names`), ``replicas`` from :data:`MIN_REPLICAS` to :data:`MAX_REPLICAS_VOLTA_ON`,
  ``devices`` ``"all"`` or 1 to :data:`MAX_DEVICES` GPU UUIDs (``GPU-…``, at most :data:`MAX_DEVICE_ID`
  characters) and NVML indices, none listed twice, none listed by two resources; at most
  :data:`MAX_RESOURCES` resources; ``timeout`` from :data:`MIN_TIMEOUT` to :data:`MAX_TIMEOUT`
  seconds. Raises :class:`MpsSettingError` naming the setting.
* :func:`validate` / :func:`validate_resources` — at start, against the GPUs the caller read from
  NVML: every device known, no MIG-enabled GPU, at most 48 replicas per GPU from compute capability
  7.0 on and 16 before (NVIDIA's plugin caps Volta at 16 by mistake), at least 1 MiB of pinned memory
  per replica, and no GPU in two resources (``"all"`` and another resource, or one GPU named by UUID
  in one and by index in another, shows only here).

The bounds keep a typing mistake from being built (``replicas = 20000000`` once grew the Nomad plugin
to 4.6 GB before its first fingerprint). Replicas: NVIDIA's Multi-Process Service documentation
(docs.nvidia.com/deploy/mps, "Limitations") allows up to 48 clients per GPU from Volta on, 16 before.
Resources and devices: far more than any host has GPUs.

:class:`Root` lays out ``<root>/<resource>/pipe``, ``<root>/<resource>/log`` and
``<root>/<resource>/.started``; server and clients share the host's ``/dev/shm`` (:data:`SHM_DIR`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from accelstats.settings import MpsResourceSettings, MpsSettings

#: The ``/dev/shm`` of the control daemon and the MPS servers it starts: the host's. MPS clients must
#: share it with the server (NVIDIA's guidance for a host-run server and containerised clients is
#: ``--ipc=host``; k8s-device-plugin gives daemon and clients one tmpfs, ``internal/plugin/mps.go:86-89``),
#: so a reservation mounts it at ``/dev/shm`` and raw_exec tasks have it already (docs/mps.md).
SHM_DIR = Path("/dev/shm")
MIN_REPLICAS = 2  # MPS shares a GPU
MAX_REPLICAS_VOLTA_ON = 48  # per GPU, compute capability >= 7.0; also the bound at load time
MAX_REPLICAS_PRE_VOLTA = 16  # per GPU, compute capability < 7.0
MAX_RESOURCES = 256  # resources of one configuration
MAX_DEVICES = 256  # devices listed by one resource
MAX_NAME = 255  # characters of a resource name (a directory path under the MPS root)
MAX_DEVICE_ID = 256  # characters of a listed GPU UUID (NVML's are 40)
MIN_TIMEOUT = 0.1  # seconds allowed for one control command, at least...
MAX_TIMEOUT = 600.0  # ...and at most (ten minutes)
_MIB = 1024 * 1024


class MpsError(Exception):
    """An MPS resource is invalid, or its daemon could not be started, reached or configured.

    The message names the resource and what failed (the command, the directory, the rule).
    """


class MpsSettingError(MpsError):
    """An MPS setting breaks a rule at load time (:func:`check_settings`).

    ``field``: the setting at fault as a path in :class:`accelstats.settings.MpsSettings`:
    ``timeout``, ``resources`` (the list as a whole), ``resources[<i>].name``, ``.replicas`` or
    ``.devices``. The message names the resource, the rule and its bound; a front end prefixes the
    field in its own words (``<file>: key 'mps.resources[0].replicas'``, ``config: mps.resource[0].replicas``).
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class MpsResource:
    """One MPS-shared resource, its devices resolved.

    ``name``: the resource name, e.g. ``nvidia.com/gpu`` (``/`` makes nested directories under the
    root; see :class:`Root`). ``replicas``: how many clients share each GPU (2..48, 2..16 before
    compute capability 7.0). ``devices``: the GPU UUIDs (``GPU-…``) the daemon serves, in order.
    """

    name: str
    replicas: int
    devices: tuple[str, ...]


@dataclass(frozen=True)
class MpsGpu:
    """A GPU as the caller knows it from NVML.

    ``uuid``: ``GPU-…``; ``index``: the NVML index, used by the daemon's per-device commands (it
    ignored limits set by UUID); ``memory_total_bytes``: total framebuffer memory in bytes;
    ``compute_capability``: ``"major.minor"`` such as ``"9.0"``; ``mig_enabled``: MIG mode is on.
    """

    uuid: str
    index: int
    memory_total_bytes: int
    compute_capability: str
    mig_enabled: bool


# --------------------------------------------------------------------------------------------
# the rules, at load time


def check_name(name: str) -> None:
    """Raise MpsError unless ``name`` is a usable resource name: a non-empty relative path of at most
    :data:`MAX_NAME` characters (``/`` nests directories under the root) with no empty, ``.`` or ``..``
    part and no NUL, not under ``shm`` (earlier versions' world-writable shared-memory directory
    ``<root>/shm``, which an upgraded host may still have)."""
    shown = name[:100] if isinstance(name, str) else name
    if not isinstance(name, str) or not name:
        raise MpsError(f"{shown!r} is not a usable MPS resource name (it is empty or not a string)")
    parts = name.split("/")
    if len(name) > MAX_NAME or "\0" in name or any(part in ("", ".", "..") for part in parts):
        raise MpsError(f"{shown!r} is not a usable MPS resource name (a relative path of at most {MAX_NAME} "
                       "characters, without NUL or an empty, '.' or '..' part)")
    if parts[0] == "shm":
        raise MpsError(f"{shown!r} is not a usable MPS resource name: it would live in <root>/shm, which "
                       "earlier versions used for shared memory")


def check_names(names: Sequence[str]) -> None:
    """Raise MpsError when two resources share a name, or one's directories would nest in another's
    (``a`` and ``a/b``)."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise MpsError(f"MPS resource {name!r} is configured twice")
        seen.add(name)
    ordered = sorted(seen)  # a name nested in another sorts right after it, or after its siblings
    for i, name in enumerate(ordered):
        for other in ordered[i + 1:]:
            if not other.startswith(name):
                break
            if other.startswith(name + "/"):
                raise MpsError(f"MPS resources {name!r} and {other!r} would nest their directories")


def _replicas_problem(name: str, replicas: object, limit: int | None) -> str | None:
    """Why ``replicas`` is not a whole number from :data:`MIN_REPLICAS` to ``limit`` (None: no upper
    bound here), or None."""
    if not isinstance(replicas, int) or isinstance(replicas, bool):
        return f"MPS resource {name!r}: replicas must be a whole number, got {replicas!r}"
    if replicas < MIN_REPLICAS:
        return f"MPS resource {name!r}: replicas must be at least {MIN_REPLICAS}, got {replicas} (MPS shares a GPU)"
    if limit is not None and replicas > limit:
        return (f"MPS resource {name!r}: replicas must be at most {limit}, got {replicas} (NVIDIA MPS: up to "
                f"{limit} clients per GPU)")
    return None


def _device_problem(name: str, device: object) -> str | None:
    """Why ``device`` is neither a GPU UUID nor an NVML index, or None."""
    if isinstance(device, int) and not isinstance(device, bool):
        return None if device >= 0 else f"MPS resource {name!r}: device {device} is not an NVML index (0 or more)"
    if isinstance(device, str) and device.startswith("GPU-"):
        if len(device) > MAX_DEVICE_ID:
            return (f"MPS resource {name!r}: device {device[:100]!r}… is longer than {MAX_DEVICE_ID} characters "
                    "(not a GPU UUID)")
        return None
    shown = device[:100] if isinstance(device, str) else device
    return f"MPS resource {name!r}: device {shown!r} is neither a GPU UUID (GPU-…) nor an NVML index"


def check_timeout(seconds: float) -> None:
    """Raise MpsSettingError (field ``timeout``) unless ``seconds`` lies from :data:`MIN_TIMEOUT` to
    :data:`MAX_TIMEOUT`."""
    if not (math.isfinite(seconds) and MIN_TIMEOUT <= seconds <= MAX_TIMEOUT):
        raise MpsSettingError("timeout", f"must be from {MIN_TIMEOUT:g} s to {MAX_TIMEOUT:g} s "
                                         f"(each control command's limit), got {seconds:g} s")


def check_settings(settings: MpsSettings) -> None:
    """The load-time rules (module docstring) on the ``[mps]`` settings, no GPUs needed: raise
    :class:`MpsSettingError` for the first setting that breaks one, its ``field`` naming it."""
    check_timeout(settings.timeout)
    resources = settings.resources
    if len(resources) > MAX_RESOURCES:
        raise MpsSettingError("resources", f"at most {MAX_RESOURCES} resources, got {len(resources)}")
    owner: dict[str | int, str] = {}  # a listed device -> the resource that lists it
    for i, resource in enumerate(resources):
        _check_resource(i, resource, resources[:i], owner)


def _check_resource(i: int, resource: MpsResourceSettings, before: Sequence[MpsResourceSettings],
                    owner: dict[str | int, str]) -> None:
    """:func:`check_settings` for resource ``i``; ``before``: the resources ahead of it, ``owner``:
    their listed devices (this one's are added)."""
    field, name = f"resources[{i}]", resource.name
    try:
        check_name(name)
        check_names([*(r.name for r in before), name])
    except MpsError as exc:
        raise MpsSettingError(f"{field}.name", str(exc)) from None
    problem = _replicas_problem(name, resource.replicas, MAX_REPLICAS_VOLTA_ON)
    if problem is not None:
        raise MpsSettingError(f"{field}.replicas", problem)
    devices = resource.devices
    where = f"{field}.devices"
    if devices == "all":  # every GPU: whether another resource lists one of them shows at start
        return
    if not isinstance(devices, tuple) or not devices:
        raise MpsSettingError(where, f"MPS resource {name!r}: devices must be \"all\" or a non-empty list of "
                                     "GPU UUIDs and NVML indices")
    if len(devices) > MAX_DEVICES:
        raise MpsSettingError(where, f"MPS resource {name!r}: at most {MAX_DEVICES} devices, got {len(devices)}")
    listed: set[str | int] = set()
    for device in devices:
        problem = _device_problem(name, device)
        if problem is not None:
            raise MpsSettingError(where, problem)
        if device in listed:
            raise MpsSettingError(where, f"MPS resource {name!r}: device {device!r} is listed twice")
        if device in owner:
            raise MpsSettingError(where, f"MPS resources {owner[device]!r} and {name!r} both list GPU {device}")
        listed.add(device)
    owner.update((d, name) for d in devices)


# --------------------------------------------------------------------------------------------
# the rules, at start


def _parse_compute_capability(gpu: MpsGpu, resource: str | None) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)\.(\d+)", str(gpu.compute_capability).strip())
    if match is None:
        where = f"MPS resource {resource!r}: " if resource is not None else "MPS: "
        raise MpsError(f"{where}GPU {gpu.uuid} has an unreadable compute capability "
                       f"{gpu.compute_capability!r} (expected 'major.minor', e.g. '9.0')")
    return int(match.group(1)), int(match.group(2))


def max_replicas(gpu: MpsGpu) -> int:
    """The most MPS clients a GPU takes: 48 from compute capability 7.0 (Volta) on, 16 before.

    Raises MpsError when the compute capability is not ``"major.minor"``.
    """
    major, _ = _parse_compute_capability(gpu, None)
    return MAX_REPLICAS_VOLTA_ON if major >= 7 else MAX_REPLICAS_PRE_VOLTA


def pinned_limit_mib(gpu: MpsGpu, replicas: int) -> int:
    """The per-client pinned-memory limit in MiB: total bytes // replicas // 2**20 (docs/mps.md)."""
    return gpu.memory_total_bytes // replicas // _MIB


def active_thread_percentage(replicas: int) -> int:
    """The default active-thread percentage for ``replicas`` clients: 100 // replicas (docs/mps.md)."""
    return 100 // replicas


def resource_gpus(resource: MpsResource, gpus: Iterable[MpsGpu]) -> tuple[MpsGpu, ...]:
    """The resource's GPUs among ``gpus``, in the resource's device order (which is the daemon's
    ``CUDA_VISIBLE_DEVICES`` order, hence its device ordinals); UUIDs not among ``gpus`` are left out."""
    by_uuid = {gpu.uuid: gpu for gpu in gpus}
    return tuple(by_uuid[uuid] for uuid in resource.devices if uuid in by_uuid)


def validate(resource: MpsResource, gpus: Sequence[MpsGpu]) -> None:
    """Check one resolved ``resource`` against the GPUs the caller knows; raise MpsError naming it and the rule.

    Rules (docs/mps.md, "Configure"): a usable name (:func:`check_name`), at least one device, no
    device listed twice, every device one of ``gpus`` (by UUID), no MIG-enabled GPU (MPS is not
    allowed there), ``replicas`` a whole number ≥ 2 and at most 48 per GPU from compute capability
    7.0 on, 16 before (NVIDIA's plugin wrongly caps Volta at 16), and a memory size that leaves every
    replica at least 1 MiB of pinned memory.
    """
    name = resource.name
    check_name(name)
    if not resource.devices:
        raise MpsError(f"MPS resource {name!r}: no devices (at least one GPU UUID is needed)")
    seen: set[str] = set()
    for uuid in resource.devices:
        if uuid in seen:
            raise MpsError(f"MPS resource {name!r}: device {uuid} is listed twice")
        seen.add(uuid)
    known = {gpu.uuid: gpu for gpu in gpus}
    unknown = [uuid for uuid in resource.devices if uuid not in known]
    if unknown:
        raise MpsError(f"MPS resource {name!r}: unknown device(s) {', '.join(unknown)} "
                       f"(not among the {len(known)} GPU(s) found)")
    problem = _replicas_problem(name, resource.replicas, None)  # the upper bound is per GPU, below
    if problem is not None:
        raise MpsError(problem)
    replicas = resource.replicas
    for uuid in resource.devices:
        gpu = known[uuid]
        if gpu.mig_enabled:
            raise MpsError(f"MPS resource {name!r}: GPU {gpu.index} ({uuid}) has MIG enabled; "
                           "MPS is not allowed on MIG-enabled GPUs")
        major, minor = _parse_compute_capability(gpu, name)
        limit = MAX_REPLICAS_VOLTA_ON if major >= 7 else MAX_REPLICAS_PRE_VOLTA
        if replicas > limit:
            raise MpsError(f"MPS resource {name!r}: replicas {replicas} exceeds the maximum of {limit} per GPU "
                           f"for GPU {gpu.index} ({uuid}, compute capability {major}.{minor})")
        if pinned_limit_mib(gpu, replicas) < 1:
            raise MpsError(f"MPS resource {name!r}: GPU {gpu.index} ({uuid}) has {gpu.memory_total_bytes} bytes, "
                           f"too little for {replicas} replicas of at least 1 MiB")


def validate_resources(resources: Sequence[MpsResource], gpus: Sequence[MpsGpu]) -> dict[str, MpsError]:
    """Check a configuration's resolved resources at start: :func:`validate` each, and no GPU in two
    of them (the earlier resource keeps it). Returns resource name -> its error, for those that fail
    (the others are usable); never raises. Names are checked apart (:func:`check_names`)."""
    errors: dict[str, MpsError] = {}
    owner: dict[str, str] = {}
    for resource in resources:
        try:
            validate(resource, gpus)
            clash = next((uuid for uuid in resource.devices if uuid in owner), None)
            if clash is not None:
                raise MpsError(f"MPS resources {owner[clash]!r} and {resource.name!r} both list GPU {clash}")
        except MpsError as exc:
            errors[resource.name] = exc
            continue
        owner.update((uuid, resource.name) for uuid in resource.devices)
    return errors


# --------------------------------------------------------------------------------------------
# directories


class Root:
    """The MPS root directory (made absolute: the daemon changes directory when it daemonises).

    ``pipe_dir(r)`` = ``<root>/<r>/pipe``, ``log_dir(r)`` = ``<root>/<r>/log``,
    ``started_marker(r)`` = ``<root>/<r>/.started`` (where k8s-device-plugin keeps it,
    ``internal/mps/root.go:51-53``), ``shm_dir()`` = :data:`SHM_DIR`. A resource name that
    :func:`check_name` refuses has no directory: MpsError.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(os.path.abspath(os.fspath(path)))

    def __repr__(self) -> str:
        return f"Root({str(self.path)!r})"

    def resource_dir(self, resource: str) -> Path:
        """``<root>/<resource>``, after :func:`check_name` (MpsError)."""
        check_name(resource)
        return self.path.joinpath(*resource.split("/"))

    def pipe_dir(self, resource: str) -> Path:
        """``<root>/<resource>/pipe``: the daemon's ``CUDA_MPS_PIPE_DIRECTORY``."""
        return self.resource_dir(resource) / "pipe"

    def log_dir(self, resource: str) -> Path:
        """``<root>/<resource>/log``: the daemon's ``CUDA_MPS_LOG_DIRECTORY``."""
        return self.resource_dir(resource) / "log"

    def started_marker(self, resource: str) -> Path:
        """``<root>/<resource>/.started``: written once a start has completed."""
        return self.resource_dir(resource) / ".started"

    def shm_dir(self) -> Path:
        """:data:`SHM_DIR`, the daemon's ``/dev/shm``, mounted at ``/dev/shm`` in clients."""
        return SHM_DIR
