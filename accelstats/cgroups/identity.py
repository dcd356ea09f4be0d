"""Container identity from a cgroup path, and ``/proc/<pid>/cgroup`` parsing (pure functions).

The rules are the table of docs/containers.md (docker, containerd/Kubernetes, CRI-O, podman, Nomad,
LXC, systemd-nspawn).  They are applied to the path's components from the last one upwards: the
deepest component a rule recognises names the container, so sub-cgroups a container creates below
its own (podman/crun's trailing ``container``, systemd running inside the container, nested
runtimes) belong to it.  A path whose last component ends in ``.mount`` is never a container (the
docker overlay mount units look like container ids).  Nothing here touches the filesystem and no
function raises on any input string.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

_HEX64 = r"[0-9a-f]{64}"
_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_POD_UID = r"[0-9a-fA-F][0-9a-fA-F_-]*"

RUNTIMES = ("docker", "containerd", "cri-o", "podman", "nomad", "lxc", "systemd-nspawn")
"""Every value :attr:`ContainerIdentity.runtime` takes."""

# Prefix of a systemd scope (or of the runc "slice:prefix:id" form) -> runtime.
_PREFIX_RUNTIME = {
    "docker": "docker",
    "cri-containerd": "containerd",
    "crio": "cri-o",
    "libpod": "podman",
    "nerdctl": "containerd",
}
_PREFIXES = "|".join(re.escape(p) for p in _PREFIX_RUNTIME)

# docker-<id>.scope, cri-containerd-<id>.scope, crio-<id>.scope, libpod-<id>.scope (systemd driver).
# crio-conmon-<id>.scope and libpod-conmon-<id>.scope never match: "conmon-…" is not 64 hex.
_SCOPE_RE = re.compile(rf"({_PREFIXES})-({_HEX64})\.scope")
# runc's cgroupfs driver given a systemd-style cgroupsPath: "<slice>:cri-containerd:<id>".
_COLON_RE = re.compile(rf"([^:]*):({_PREFIXES}):({_HEX64})")
# Kubernetes, cgroupfs driver: the container directory under pod<uid>, bare or runtime-prefixed.
_KUBE_CGROUPFS_RE = re.compile(rf"(?:(docker|cri-containerd|crio)-)?({_HEX64})")
_HEX64_RE = re.compile(_HEX64)
_PODMAN_CGROUPFS_RE = re.compile(rf"libpod-({_HEX64})")
_NOMAD_V2_RE = re.compile(rf"({_UUID})\.(.+)\.scope")
_NOMAD_V1_RE = re.compile(rf"({_UUID})\.(.+)")
_LXC_PAYLOAD_RE = re.compile(r"lxc\.payload\.(.+)")
_NSPAWN_RE = re.compile(r"systemd-nspawn@(.+)\.service")
_POD_CGROUPFS_RE = re.compile(rf"pod({_POD_UID})")
_POD_SLICE_RE = re.compile(rf"kubepods(?:-[a-z]+)*-pod({_POD_UID})\.slice")
_SYSTEMD_ESCAPE_RE = re.compile(r"(?:\\x[0-9a-fA-F]{2})+")
_DELETED_SUFFIX = " (deleted)"


@dataclass(frozen=True)
class ContainerIdentity:
    """Who a cgroup belongs to.

    ``runtime`` is one of :data:`RUNTIMES` (``containerd`` also covers Kubernetes via CRI).  ``id``
    is the runtime's container id (64 hex) or, for LXC and systemd-nspawn, the container name, and
    for Nomad ``<alloc id>.<task>``.  ``pod_uid`` is the Kubernetes pod UID with dashes (or, for
    podman, the pod ID: libpod keeps pod names only in its database), ``alloc_id``/``task`` the
    Nomad allocation and task, ``name`` the LXC/nspawn name; each is ``""`` when the path does not
    say.
    """

    runtime: str
    id: str
    pod_uid: str = ""  # the Kubernetes pod UID, or the podman pod ID
    alloc_id: str = ""
    task: str = ""
    name: str = ""
    how: str = field(default="", compare=False)
    """What identified it, for ``--log-level debug`` and ``accelstats containers --json``
    (``identified_by``): ``"path rule: …"`` or ``"runtime state: …"``; not part of equality."""
    state_namespace: str = field(default="", compare=False)
    """The containerd namespace whose tasks hold it, when the runtime state says (the same ID may
    exist in two namespaces); not part of equality."""
    owner: str = ""
    """A rootless container's owner, the uid (decimal) whose ``user@<uid>.service`` holds its cgroup
    and whose own runtime state names it (:mod:`accelstats.attribution.rootless`); ``""`` for a
    container of the system's runtimes.  Part of equality: a rootless container never equals a
    system one."""


KnownLookup = Callable[[str, str], "tuple[str, str, str, str] | None"]
"""``known(candidate id, parent component) -> (runtime, id, where, namespace) | None``: whether a
container runtime's own state on this host knows ``candidate`` (``where`` names the state, for
:attr:`ContainerIdentity.how`; ``namespace`` the containerd namespace, else ``""``).
:class:`accelstats.attribution.runtimes.RuntimeState` provides it."""


def _pod_uid(ancestors: list[str]) -> str:
    """The Kubernetes pod UID named by the nearest ancestor pod cgroup, ``_`` turned into ``-``."""
    for comp in reversed(ancestors):
        match = _POD_CGROUPFS_RE.fullmatch(comp) or _POD_SLICE_RE.fullmatch(comp)
        if match is not None:
            return match.group(1).replace("_", "-")
    return ""


_PODMAN_POD_SLICE_RE = re.compile(rf"machine-libpod_pod_({_HEX64})\.slice")


def _podman_pod(ancestors: list[str]) -> str:
    """The podman pod ID of a container whose parent cgroup is its pod's: ``<64 hex>`` under
    ``libpod_parent`` (cgroupfs) or ``machine-libpod_pod_<64 hex>.slice`` (systemd); else ``""``."""
    parent = ancestors[-1] if ancestors else ""
    match = _PODMAN_POD_SLICE_RE.fullmatch(parent)
    if match is not None:
        return match.group(1)
    if _HEX64_RE.fullmatch(parent) and len(ancestors) >= 2 and ancestors[-2] == "libpod_parent":
        return parent
    return ""


def _systemd_unescape(text: str) -> str:
    """Undo systemd unit-name escaping (``\\x2d`` -> ``-``), as ``systemd-escape --unescape``.

    systemd escapes each byte of a UTF-8 character on its own (``¡`` is ``\\xc2\\xa1``), so a run
    of escapes is turned back into bytes and decoded as one; bytes that are not UTF-8 keep their
    ``\\xNN`` spelling.
    """
    return _SYSTEMD_ESCAPE_RE.sub(
        lambda m: bytes.fromhex(m.group(0).replace("\\x", "")).decode("utf-8", "backslashreplace"), text)


def _runtime_scope(comp: str, ancestors: list[str]) -> ContainerIdentity | None:
    match = _SCOPE_RE.fullmatch(comp)
    if match is not None:
        runtime = _PREFIX_RUNTIME[match.group(1)]
        pod = _podman_pod(ancestors) if runtime == "podman" else _pod_uid(ancestors)
        return ContainerIdentity(runtime, match.group(2), pod)
    match = _COLON_RE.fullmatch(comp)
    if match is not None:
        pod = _pod_uid([*ancestors, match.group(1)])
        return ContainerIdentity(_PREFIX_RUNTIME[match.group(2)], match.group(3), pod)
    return None


def _cgroupfs(comp: str, ancestors: list[str]) -> ContainerIdentity | None:
    parent = ancestors[-1] if ancestors else ""
    if _POD_CGROUPFS_RE.fullmatch(parent):
        match = _KUBE_CGROUPFS_RE.fullmatch(comp)
        if match is not None:
            runtime = _PREFIX_RUNTIME[match.group(1)] if match.group(1) else "containerd"
            return ContainerIdentity(runtime, match.group(2), _pod_uid(ancestors))
    if parent == "docker" and _HEX64_RE.fullmatch(comp):
        return ContainerIdentity("docker", comp)
    if parent == "libpod_parent" or _podman_pod(ancestors):
        match = _PODMAN_CGROUPFS_RE.fullmatch(comp)
        if match is not None:
            return ContainerIdentity("podman", match.group(1), _podman_pod(ancestors))
    return None


def _nomad(comp: str, ancestors: list[str]) -> ContainerIdentity | None:
    parent = ancestors[-1] if ancestors else ""
    match = _NOMAD_V2_RE.fullmatch(comp)
    if match is not None and parent.endswith(".slice"):
        alloc, task = match.groups()
    else:
        match = _NOMAD_V1_RE.fullmatch(comp)
        grandparent = ancestors[-2] if len(ancestors) >= 2 else ""
        in_nomad_v1 = parent == "nomad" or (
            parent in ("share", "shared", "reserve", "reserved") and grandparent == "nomad"
        )
        if match is None or not in_nomad_v1:
            return None
        alloc, task = match.groups()
    return ContainerIdentity("nomad", f"{alloc}.{task}", alloc_id=alloc, task=task)


def _named(comp: str, ancestors: list[str]) -> ContainerIdentity | None:
    match = _LXC_PAYLOAD_RE.fullmatch(comp)
    name = match.group(1) if match is not None else (comp if ancestors and ancestors[-1] == "lxc" else "")
    if name:
        return ContainerIdentity("lxc", name, name=name)
    match = _NSPAWN_RE.fullmatch(comp)
    if match is not None:
        name = _systemd_unescape(match.group(1))
        return ContainerIdentity("systemd-nspawn", name, name=name)
    return None


_RULES = (_runtime_scope, _cgroupfs, _nomad, _named)
_RULE_NAMES = {_runtime_scope: "systemd scope or <slice>:<prefix>:<id>", _cgroupfs: "cgroupfs parent",
               _nomad: "Nomad <alloc>.<task>", _named: "LXC or systemd-nspawn name"}

# A runtime's prefix on a container id in a cgroup name: docker-, libpod-, crio-, cri-containerd-,
# nerdctl- (systemd scopes and the cgroupfs forms); "conmon-<hex>" never passes the id check.
_KNOWN_PREFIX_RE = re.compile(rf"(?:{_PREFIXES})-(.+)")
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # containerd's identifier rules, and 64 hex


def id_candidates(comp: str) -> list[str]:
    """The container ids a cgroup name can stand for: the name itself, without ``.scope``, without a
    runtime prefix (``docker-``, ``libpod-``, ``crio-``, ``cri-containerd-``, ``nerdctl-``), the part
    after the last ``:`` (``<slice>:cri-containerd:<id>``), and a Nomad ``<alloc uuid>.<task>``'s
    allocation id.  Only strings that are valid ids (at most 128 of ``[A-Za-z0-9_.-]``).  Pure."""
    base = comp.removesuffix(".scope")
    out = [comp, base]
    if ":" in base:
        out.append(base.rsplit(":", 1)[1])
    match = _KNOWN_PREFIX_RE.fullmatch(base)
    if match is not None:
        out.append(match.group(1))
    nomad = _NOMAD_V1_RE.fullmatch(base)
    if nomad is not None:
        out.append(nomad.group(1))
    seen: list[str] = []
    for c in out:
        if c not in seen and _ID_RE.fullmatch(c):
            seen.append(c)
    return seen


def _known(comp: str, ancestors: list[str], known: KnownLookup) -> ContainerIdentity | None:
    parent = ancestors[-1] if ancestors else ""
    for candidate in id_candidates(comp):
        found = known(candidate, parent)
        if found is None:
            continue
        runtime, cid, where, namespace = found
        how = f"runtime state: {where}"
        if runtime == "nomad":
            nomad = _NOMAD_V1_RE.fullmatch(comp.removesuffix(".scope"))
            task = nomad.group(2) if nomad is not None else ""
            return ContainerIdentity("nomad", f"{cid}.{task}" if task else cid, alloc_id=cid, task=task, how=how)
        pod = _podman_pod(ancestors) if runtime == "podman" else _pod_uid(ancestors)
        return ContainerIdentity(runtime, cid, pod, how=how, state_namespace=namespace)
    return None


def identify(cgroup_path: str, known: KnownLookup | None = None) -> ContainerIdentity | None:
    """The container a cgroup path belongs to, or ``None`` for a host process / non-container.

    ``cgroup_path`` is a path as ``/proc/<pid>/cgroup`` names it (``/docker/<64 hex>``,
    ``/kubepods.slice/…/cri-containerd-<id>.scope``, …); empty components, trailing slashes,
    surrounding whitespace and the kernel's `` (deleted)`` suffix are tolerated.  Implements every
    row of docs/containers.md; with ``known``, a component that names a container a runtime's state
    knows identifies it on any path (spec §6).  See the module docstring for how nested cgroups are
    handled.  Never raises (unless ``known`` does).
    """
    found = identify_with_root(cgroup_path, known)
    return None if found is None else found[1]


_MAX_DEPTH = 64  # real container cgroups are < 10 deep; bounding it keeps the rule loop linear


def identify_with_root(cgroup_path: str, known: KnownLookup | None = None) -> tuple[str, ContainerIdentity] | None:
    """Like :func:`identify`, also giving the container's own cgroup path (the path up to the
    component that was recognised): ``/docker/<id>/init.scope`` → ``("/docker/<id>", docker <id>)``.

    Components are tried from the last one up; at each, first ``known`` (the runtimes' state: an id
    the runtime knows, whatever the path around it, e.g. ``/gpujobs/<docker id>``,
    ``/<containerd namespace>/<id>``, ``/libpod_parent/<pod id>/libpod-<id>``), then the path rules.
    :attr:`ContainerIdentity.how` says which.  Never raises (unless ``known`` does)."""
    path = cgroup_path.strip()
    if path.endswith(_DELETED_SUFFIX):
        path = path[: -len(_DELETED_SUFFIX)]
    comps = [c for c in path.split("/") if c]
    if not comps or comps[-1].endswith(".mount") or len(comps) > _MAX_DEPTH:
        return None
    for index in range(len(comps) - 1, -1, -1):
        ancestors = comps[:index]
        comp = comps[index]
        if known is not None and not comp.endswith(".mount"):
            found = _known(comp, ancestors, known)
            if found is not None:
                return "/" + "/".join(comps[: index + 1]), found
        for rule in _RULES:
            found = rule(comp, ancestors)
            if found is not None:
                found = ContainerIdentity(found.runtime, found.id, found.pod_uid, found.alloc_id, found.task,
                                          found.name, how=f"path rule: {_RULE_NAMES[rule]}")
                return "/" + "/".join(comps[: index + 1]), found
    return None


_CONMON_RE = re.compile(rf"(?:libpod|crio)-conmon-{_HEX64}\.scope")


def is_host_cgroup(cgroup_path: str) -> bool:
    """True for cgroups of host processes rather than of some container: the root ``/``, systemd
    services, mounts, sockets, slices, ``init.scope``, transient scopes in ``system.slice`` /
    ``user.slice`` (login sessions, ``systemd-run --scope``) — docs/containers.md, last row — and the
    container monitors podman and CRI-O run beside each container (``conmon`` under
    ``libpod_parent``, ``libpod-conmon-<id>.scope``, ``crio-conmon-<id>.scope``). A path
    for which this is False and :func:`identify` finds nothing is a container no rule recognises
    (``runtime="unknown"``). Never raises."""
    comps = [c for c in cgroup_path.strip().split("/") if c]
    if not comps:
        return True
    last = comps[-1]
    if last.endswith((".service", ".mount", ".slice", ".socket", ".swap")) or last == "init.scope":
        return True
    if last == "conmon" or _CONMON_RE.fullmatch(last):  # podman's and CRI-O's container monitors
        return True
    # Transient scopes systemd makes for host programs (systemd-run --scope, login sessions, desktop
    # apps: run-r….scope, session-3.scope, app-….scope) live in system.slice and user.slice; a
    # container runtime's scope there is recognised by identify() before this is asked.
    return last.endswith(".scope") and comps[0] in ("system.slice", "user.slice")


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """Parse ``/proc/<pid>/cgroup`` into ``{controller: path}``.

    Each line is ``hierarchy-id:controllers:path`` (``man 7 cgroups``).  A v1 line's
    comma-separated controllers (``cpu,cpuacct``, ``name=systemd``) each become a key; the v2 line
    ``0::/path`` has the key ``""``.  Paths may contain ``:`` (the ``<slice>:cri-containerd:<id>``
    form).  Malformed lines are ignored; the first line for a key wins.  Never raises.
    """
    parsed: dict[str, str] = {}
    for line in text.splitlines():
        fields = line.strip().split(":", 2)
        if len(fields) != 3 or not fields[0].isdigit() or not fields[2].startswith("/"):
            continue
        hierarchy, controllers, path = fields
        keys = [""] if hierarchy == "0" and not controllers else controllers.split(",")
        for key in keys:
            parsed.setdefault(key, path)
    return parsed


def cgroup_path_for(parsed: Mapping[str, str], prefer: str = "devices") -> str | None:
    """The path that decides attribution: the ``prefer`` controller's (v1), else the v2 line's.

    One process can sit in different cgroups per v1 controller (Nomad ≤ 1.6 puts ``cpuset`` under
    ``/nomad/reserved/…`` while ``devices`` points at the driver's ``/docker/<id>``; spec §3), so
    the devices controller's line is the one to read.  ``None`` when neither line exists.
    """
    if prefer in parsed:
        return parsed[prefer]
    return parsed.get("")
