"""What an MPS resource is, what it may ask of its GPUs, and where its directories live
(docs/mps.md, "Interface" and "Configure").

:func:`validate` checks a resource against the GPUs the caller read from NVML: replicas ≥ 2, at most
48 per GPU from compute capability 7.0 on and 16 before (NVIDIA's plugin caps Volta at 16 by
mistake), no MIG-enabled GPU, every device known. :class:`Root` lays out ``<root>/<resource>/pipe``,
``<root>/<resource>/log`` and ``<root>/<resource>/.started``; server and clients share the host's
``/dev/shm`` (:data:`SHM_DIR`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

#: The ``/dev/shm`` of the control daemon and the MPS servers it starts: the host's. MPS clients must
#: share it with the server (NVIDIA's guidance for a host-run server and containerised clients is
#: ``--ipc=host``; k8s-device-plugin gives daemon and clients one tmpfs, ``internal/plugin/mps.go:86-89``),
#: so a reservation mounts it at ``/dev/shm`` and raw_exec tasks have it already (docs/mps.md).
SHM_DIR = Path("/dev/shm")
MIN_REPLICAS = 2
MAX_REPLICAS_VOLTA_ON = 48  # per GPU, compute capability >= 7.0
MAX_REPLICAS_PRE_VOLTA = 16  # per GPU, compute capability < 7.0
_MIB = 1024 * 1024


class MpsError(Exception):
    """An MPS resource is invalid, or its daemon could not be started, reached or configured.

    The message names the resource and what failed (the command, the directory, the rule).
    """


@dataclass(frozen=True)
class MpsResource:
    """One MPS-shared resource.

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
# validation


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
    """Check ``resource`` against the GPUs the caller knows; raise MpsError naming it and the rule.

    Rules (docs/mps.md, "Configure"): at least one device, no device listed twice, every device one
    of ``gpus`` (by UUID), no MIG-enabled GPU (MPS is not allowed there), ``replicas`` an int ≥ 2 and
    at most 48 per GPU from compute capability 7.0 on, 16 before (NVIDIA's plugin wrongly caps Volta
    at 16), and a memory size that leaves every replica at least 1 MiB of pinned memory.
    """
    name = resource.name
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
    replicas = resource.replicas
    if not isinstance(replicas, int) or isinstance(replicas, bool):
        raise MpsError(f"MPS resource {name!r}: replicas must be an integer, got {replicas!r}")
    if replicas < MIN_REPLICAS:
        raise MpsError(f"MPS resource {name!r}: replicas must be at least {MIN_REPLICAS}, got {replicas}")
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


# --------------------------------------------------------------------------------------------
# directories


class Root:
    """The MPS root directory (made absolute: the daemon changes directory when it daemonises).

    ``pipe_dir(r)`` = ``<root>/<r>/pipe``, ``log_dir(r)`` = ``<root>/<r>/log``,
    ``started_marker(r)`` = ``<root>/<r>/.started`` (where k8s-device-plugin keeps it,
    ``internal/mps/root.go:51-53``), ``shm_dir()`` = :data:`SHM_DIR`. A resource name may contain
    ``/`` (``nvidia.com/gpu`` → nested directories) but no empty, ``.`` or ``..`` part, no leading
    ``/``, no NUL, and may not start with ``shm`` (earlier versions' world-writable shared-memory
    directory, which an upgraded host may still have): MpsError.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(os.path.abspath(os.fspath(path)))

    def __repr__(self) -> str:
        return f"Root({str(self.path)!r})"

    def resource_dir(self, resource: str) -> Path:
        """``<root>/<resource>``, after checking the name (see the class docstring)."""
        if not isinstance(resource, str) or not resource:
            raise MpsError(f"MPS resource name {resource!r} is empty or not a string")
        if "\0" in resource or resource.startswith("/"):
            raise MpsError(f"MPS resource name {resource!r} must be a relative path without NUL")
        parts = resource.split("/")
        if any(part in ("", ".", "..") for part in parts):
            raise MpsError(f"MPS resource name {resource!r} has an empty, '.' or '..' part")
        if parts[0] == "shm":  # earlier versions kept a world-writable <root>/shm there; it may remain
            raise MpsError(f"MPS resource name {resource!r} would live in <root>/shm, which earlier versions "
                           "used for shared memory")
        return self.path.joinpath(*parts)

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
