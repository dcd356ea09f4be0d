"""DRA claim devices resolved to a GPU or MIG instance through the host's CDI spec files.

The kubelet's pod-resources API names a DRA claim's devices by their fully qualified CDI names
(``ClaimResource.cdi_devices``: ``nvidia.com/gpu=0``). What such a name gives a container is written in
the host's CDI spec files (cncf-tags/container-device-interface ``SPEC.md``; ``pkg/cdi/spec-dirs.go``):

* the files are the ``*.json`` and ``*.yaml`` files directly in ``/etc/cdi`` and ``/var/run/cdi``
  (no subdirectories); a device in a later directory replaces one of the same name in an earlier one, two
  of the same name in one directory are a conflict and neither is used (``pkg/cdi/cache.go``);
* a spec has ``kind`` (``vendor.com/class``) and ``devices[]`` with ``name``; the qualified name is
  ``<kind>=<name>``; ``devices[].containerEdits`` and the spec-level ``containerEdits`` (applied with any
  device of the spec) hold ``deviceNodes[]`` (``path``, and ``hostPath`` where the host's node differs) and
  ``env``.

NVIDIA's ``nvidia-ctk cdi generate`` writes kind ``nvidia.com/gpu`` with devices ``0`` (``/dev/nvidia0``),
``GPU-<uuid>`` (``--device-name-strategy=uuid``), MIG ``0:1`` (``/dev/nvidia0`` and the instance's
``/dev/nvidia-caps/nvidia-cap<N>`` nodes) and ``all`` (every GPU node), with ``/dev/nvidiactl``,
``/dev/nvidia-uvm`` … in the spec-level edits.

Resolution: the device nodes a name adds (its own and the spec-level ones, host paths) name the device:
``/dev/nvidia<N>`` is the GPU with minor ``N`` (``Device.minor``); ``/dev/nvidia-caps/nvidia-cap<M>`` are
looked up in ``/proc/driver/nvidia-caps/mig-minors`` (``parse_mig_minors``): a compute instance's
``access`` capability with its GPU instance's, on a GPU node also added, is that MIG instance. Nodes that
name no GPU (``nvidiactl``, ``nvidia-uvm``) are ignored. A name whose nodes name nothing (no nodes) is
looked up as a ``GPU-``/``MIG-`` UUID. Nodes naming several devices (``all``) are ambiguous: unresolved.

Files are read as the project reads files others may write (docs/security.md, ``collectors/fsread.py``):
regular files only, at most :data:`MAX_FILE_BYTES` each and :data:`MAX_FILES` per directory, a symbolic link
only to a file inside one of the spec directories; a bad file is skipped with one warning line that names
it and the reason, never its content.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from accelstats.cgroups.devices_list import MigCap
from collectors.fsread import read_regular
from collectors.model import Device

log = logging.getLogger(__name__)

SPEC_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))
"""The CDI spec directories, lowest priority first (``pkg/cdi/spec-dirs.go`` ``DefaultSpecDirs``)."""
MAX_FILE_BYTES = 1024 * 1024
"""Largest spec file read (a generated spec for 8 GPUs with MIG is tens of KiB); larger ones are skipped."""
MAX_FILES = 256
"""Spec files read per directory (in name order); the rest are skipped with one line."""
MAX_NAME = 512  # a qualified name longer than this is refused without a lookup

_KIND = re.compile(r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?/[a-zA-Z0-9]([a-zA-Z0-9_.-]{0,61}[a-zA-Z0-9])?")
_DEVICE_NAME = re.compile(r"[a-zA-Z0-9]([a-zA-Z0-9_.:-]*[a-zA-Z0-9])?")
_GPU_NODE = re.compile(r"/dev/nvidia([0-9]{1,3})")
_CAP_NODE = re.compile(r"/dev/nvidia-caps/nvidia-cap([0-9]{1,10})")
_UUID = re.compile(r"(GPU|MIG)-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


@dataclass(frozen=True)
class CdiDevice:
    """One CDI device: ``nodes`` the host paths of the device nodes it adds (its own, then the spec-level
    ones), ``env`` its ``VAR=value`` edits (likewise), ``spec`` the file it came from."""

    name: str
    nodes: tuple[str, ...]
    env: tuple[str, ...]
    spec: Path


@dataclass(frozen=True)
class CdiSpecs:
    """The host's CDI devices by qualified name (``nvidia.com/gpu=0``), and ``problems``: one line per
    file skipped or device dropped (the same lines were logged)."""

    devices: Mapping[str, CdiDevice]
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class CdiResolved:
    """A CDI name resolved to one device of this host: ``uuid`` (``GPU-…``/``MIG-…``), ``index`` the NVML
    index (a MIG instance's parent's), ``kind`` ``"gpu"``/``"mig"``, ``via`` how: ``"device-node"`` (its
    ``/dev`` nodes) or ``"name-uuid"`` (its name is the UUID)."""

    name: str
    uuid: str
    index: int
    kind: Literal["gpu", "mig"]
    via: Literal["device-node", "name-uuid"]


@dataclass(frozen=True)
class CdiUnresolved:
    """A CDI name that names no single device of this host: ``reason`` is one line saying why."""

    name: str
    reason: str


@dataclass
class _Loading:
    devices: dict[str, CdiDevice] = field(default_factory=dict)
    priority: dict[str, int] = field(default_factory=dict)
    conflicts: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)

    def skip(self, line: str) -> None:
        log.warning("CDI: %s", line)
        self.problems.append(line)


def load_specs(dirs: Sequence[Path] = SPEC_DIRS) -> CdiSpecs:
    """Read the CDI spec files in ``dirs`` (lowest priority first). Never raises: a missing directory is
    no devices, a bad file or a conflicting device is skipped with one warning line (also in
    ``problems``)."""
    state = _Loading()
    roots = [os.path.realpath(d) for d in dirs]
    for priority, directory in enumerate(dirs):
        for path in _spec_files(directory, state):
            spec = _read_spec(path, roots, state)
            if spec is not None:
                _add(spec, path, priority, state)
    for name in sorted(state.conflicts):
        state.devices.pop(name, None)
    return CdiSpecs(devices=dict(state.devices), problems=tuple(state.problems))


def _spec_files(directory: Path, state: _Loading) -> list[Path]:
    """The ``.json``/``.yaml`` entries of ``directory`` in name order, at most :data:`MAX_FILES`."""
    try:
        with os.scandir(directory) as entries:
            names = sorted(e.name for e in entries if e.name.endswith((".json", ".yaml")))
    except FileNotFoundError:
        return []
    except OSError as exc:
        state.skip(f"{directory}: not read ({exc.strerror})")
        return []
    if len(names) > MAX_FILES:
        state.skip(f"{directory}: {len(names)} spec files, only the first {MAX_FILES} read")
    return [directory / n for n in names[:MAX_FILES]]


def _read_spec(path: Path, roots: Sequence[str], state: _Loading) -> dict[str, Any] | None:
    """The parsed spec in ``path``, or None (skipped with one line)."""
    target = path
    if path.is_symlink():
        real = os.path.realpath(path)
        if not any(os.path.dirname(real) == root for root in roots):
            state.skip(f"{path}: skipped: a symbolic link to a file outside the CDI spec directories")
            return None
        target = Path(real)
    if target.is_dir():
        return None  # a directory named *.json: not a spec, as for the CDI library
    got = read_regular(target, MAX_FILE_BYTES, past_limit="refuse")
    if got.data is None:
        state.skip(f"{path}: skipped: {got.detail}")
        return None
    try:
        text = got.data.decode("utf-8")
        doc = json.loads(text) if path.suffix == ".json" else yaml.load(text, Loader=_NoAliasLoader)
    except UnicodeDecodeError:
        state.skip(f"{path}: skipped: not UTF-8")
        return None
    except json.JSONDecodeError as exc:
        state.skip(f"{path}: skipped: not JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}")
        return None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        state.skip(f"{path}: skipped: not YAML: {getattr(exc, 'problem', None) or type(exc).__name__}{where}")
        return None
    problem = _spec_problem(doc)
    if problem:
        state.skip(f"{path}: skipped: {problem}")
        return None
    assert isinstance(doc, dict)
    return doc


class _NoAliasLoader(yaml.SafeLoader):
    """SafeLoader that refuses YAML aliases (no alias bomb; generated CDI specs have none)."""

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            raise yaml.composer.ComposerError(None, None, "aliases are not read in CDI specs", event.start_mark)
        return super().compose_node(parent, index)


def _spec_problem(doc: object) -> str:
    """Why ``doc`` is not a CDI spec this module can use ("" when it is)."""
    if not isinstance(doc, dict):
        return "not a mapping"
    kind = doc.get("kind")
    if not isinstance(kind, str) or not _KIND.fullmatch(kind):
        return "'kind' is not vendor.com/class"
    devices = doc.get("devices")
    if not isinstance(devices, list) or not devices:
        return "'devices' is not a non-empty list"
    for i, dev in enumerate(devices):
        if not isinstance(dev, dict) or not isinstance(dev.get("name"), str) or not _DEVICE_NAME.fullmatch(dev["name"]):
            return f"devices[{i}] has no valid 'name'"
        if problem := _edits_problem(dev.get("containerEdits")):
            return f"devices[{i}].containerEdits: {problem}"
    if problem := _edits_problem(doc.get("containerEdits")):
        return f"containerEdits: {problem}"
    return ""


def _edits_problem(edits: object) -> str:
    if edits is None:
        return ""
    if not isinstance(edits, dict):
        return "not a mapping"
    nodes, env = edits.get("deviceNodes") or [], edits.get("env") or []
    if not isinstance(nodes, list) or not all(isinstance(n, dict) and isinstance(n.get("path"), str)
                                              and isinstance(n.get("hostPath", ""), str) for n in nodes):
        return "'deviceNodes' is not a list of entries with a 'path'"
    if not isinstance(env, list) or not all(isinstance(e, str) for e in env):
        return "'env' is not a list of strings"
    return ""


def _nodes_env(edits: dict[str, Any] | None) -> tuple[list[str], list[str]]:
    if not edits:
        return [], []
    nodes = [n.get("hostPath") or n["path"] for n in edits.get("deviceNodes") or []]
    return nodes, list(edits.get("env") or [])


def _add(spec: dict[str, Any], path: Path, priority: int, state: _Loading) -> None:
    """Add ``spec``'s devices; a name seen at the same priority becomes a conflict, a lower one is replaced."""
    common_nodes, common_env = _nodes_env(spec.get("containerEdits"))
    for dev in spec["devices"]:
        name = f"{spec['kind']}={dev['name']}"
        nodes, env = _nodes_env(dev.get("containerEdits"))
        old = state.priority.get(name)
        if old == priority:
            state.skip(f"conflicting device {name} (specs {state.devices[name].spec}, {path}): neither used")
            state.conflicts.add(name)
            continue
        state.conflicts.discard(name)  # a higher-priority directory settles it
        state.priority[name] = priority
        state.devices[name] = CdiDevice(name, tuple(dict.fromkeys(nodes + common_nodes)),
                                        tuple(env + common_env), path)


def resolve_cdi(name: str, specs: CdiSpecs, devices: Sequence[Device],
                mig_caps: Mapping[int, MigCap]) -> CdiResolved | CdiUnresolved:
    """Resolve the qualified CDI name ``name`` (``vendor.com/class=device``, as in
    ``ClaimAllocation.cdi_devices``) through ``specs`` to one of ``devices`` (this host's GPUs and MIG
    instances). ``mig_caps`` is ``parse_mig_minors`` of ``/proc/driver/nvidia-caps/mig-minors`` (empty
    without MIG). Never raises: anything else is ``CdiUnresolved`` with a one-line reason."""
    if len(name) > MAX_NAME:
        return CdiUnresolved(name[:MAX_NAME] + "…", f"CDI name longer than {MAX_NAME} characters")
    kind, sep, short = name.partition("=")
    if not sep or not _KIND.fullmatch(kind) or not _DEVICE_NAME.fullmatch(short):
        return CdiUnresolved(name, "not a qualified CDI device name (vendor.com/class=name)")
    dev = specs.devices.get(name)
    if dev is None:
        return CdiUnresolved(name, "no CDI spec on this host names this device")
    found = _by_nodes(dev, devices, mig_caps)
    if isinstance(found, Device):
        return CdiResolved(name, found.uuid, found.index, found.kind, "device-node")
    if found is None and _UUID.fullmatch(short):
        match = next((d for d in devices if d.uuid.lower() == short.lower()), None)
        if match is not None:
            return CdiResolved(name, match.uuid, match.index, match.kind, "name-uuid")
        return CdiUnresolved(name, f"no device with UUID {short} on this host")
    return CdiUnresolved(name, found or f"its device nodes ({', '.join(dev.nodes[:8]) or 'none'}) name no GPU")


def _by_nodes(dev: CdiDevice, devices: Sequence[Device], mig_caps: Mapping[int, MigCap]) -> Device | str | None:
    """The one device ``dev``'s nodes name; a reason when they name none on this host or several; None
    when they name no GPU node at all."""
    gpu_minors = sorted({int(m[1]) for n in dev.nodes if (m := _GPU_NODE.fullmatch(n))})
    cap_minors = [int(m[1]) for n in dev.nodes if (m := _CAP_NODE.fullmatch(n))]
    if not gpu_minors:
        return None
    caps = [mig_caps[m] for m in cap_minors if m in mig_caps]
    gi_access = {(c.gpu_minor, c.gi) for c in caps if c.kind == "access" and c.ci is None}
    instances = sorted({(c.gpu_minor, c.gi, c.ci) for c in caps if c.kind == "access" and c.ci is not None
                        and c.gpu_minor in gpu_minors and (c.gpu_minor, c.gi) in gi_access},
                       key=lambda t: (t[0] or 0, t[1] or 0, t[2] or 0))
    if cap_minors and not instances:
        return (f"its {len(cap_minors)} MIG capability nodes name no MIG instance in mig-minors on this host "
                "(an instance needs its compute and GPU instance access capabilities)")
    if len(instances) > 1:
        return f"its device nodes name {len(instances)} MIG instances: ambiguous"
    if len(gpu_minors) > 1:
        return f"its device nodes name {len(gpu_minors)} GPUs (/dev/nvidia{gpu_minors[0]} …): ambiguous"
    gpu = next((d for d in devices if d.kind == "gpu" and d.minor == gpu_minors[0]), None)
    if gpu is None:
        return f"no GPU behind /dev/nvidia{gpu_minors[0]} on this host"
    if not instances:
        return gpu
    _, gi, ci = instances[0]
    mig = next((d for d in devices if d.kind == "mig" and d.parent_uuid.lower() == gpu.uuid.lower()
                and d.gpu_instance_id == gi and d.compute_instance_id == ci), None)
    return mig or f"no MIG instance GPU instance {gi} compute instance {ci} on /dev/nvidia{gpu_minors[0]} on this host"
