"""Start real containers with ``runc`` so tests can read what the kernel shows for them.

The acceptance tests of accelstats need containers whose cgroups look exactly like the ones docker
creates (``spec/cgroups.md`` §2-§3): a devices cgroup at ``/docker/<64 hex>`` (cgroupfs driver) or
``/system.slice/docker-<64 hex>.scope`` (systemd driver) holding a given ``devices.list``, and a
process whose ``/proc/<pid>/cgroup`` names that path.  Docker itself is not needed: ``runc`` (the
runtime docker uses) builds those cgroups from an OCI bundle, and a static busybox is a whole
root filesystem.

Usage::

    spec = ContainerSpec(name="gpu0", cgroups_path=docker_cgroupfs_path(),
                         devices=[("c", 195, 0, "rw")])
    with RuncContainer(spec) as ctr:
        print(ctr.pid, ctr.devices_cgroup_dir.joinpath("devices.list").read_text())
        ctr.exec_in(["cat", "/proc/self/cgroup"])

or, in a test, the ``runc_container`` factory fixture of ``conftest.py``.

Prerequisites (``runc_available()`` says which one is missing): root, ``runc`` on ``PATH``, a
static ``/bin/busybox`` (Debian ``busybox-static``; the dynamic ``busybox`` package cannot run in
an empty root filesystem), a cgroup v1 ``devices`` hierarchy, and the right to create a cgroup.

What the harness does
---------------------
* Bundle: a temporary directory with ``rootfs/bin/busybox`` (a copy) and applet symlinks
  (``sh``, ``sleep``, ``cat``, ...), and a ``config.json`` from ``runc spec`` edited in Python:
  ``process.terminal = false``, ``process.args``, ``linux.cgroupsPath`` and
  ``linux.resources.devices`` = deny-all ``{"allow": false, "access": "rwm"}`` followed by the allow
  rules of the spec (privileged: the single rule ``a *:* rwm``, as docker does).  runc appends its
  own default device rules (``c *:* m``, ``b *:* m``, ``c 1:3 rwm``, ``c 136:* rwm``, ...), as it
  does under docker, so ``devices.list`` looks like a real container's.
* Start: ``runc --root <state dir> run -d <name>`` with stdin from ``/dev/null`` and stdout/stderr
  to a file in the bundle directory (a regular file, not a pipe: the detached container inherits
  those descriptors and a pipe would never reach end of file).  The host PID comes from
  ``runc state``.
* Stop (always, also when the ``with`` body raised): ``runc kill <name> KILL``, wait until the PID
  is dead, ``runc delete -f <name>``, then ``rmdir`` (leaf first) every cgroup directory on the
  container's path, in every mounted cgroup hierarchy, that did not exist before the container
  started: runc removes the container's own directory but leaves parents such as
  ``/sys/fs/cgroup/<controller>/docker`` behind.  Directories that existed before are never
  touched, and only empty directories can be removed (``rmdir``), so a parent that another
  container (or another test run) still uses stays.  Finally the bundle is deleted.
* Concurrent test runs: the directories harness runs create are listed in ``CGROUP_REGISTRY``
  (``/run/accelstats-runc-harness.cgroups``), and ``flock`` on that file serialises "look which
  directories exist + ``runc run``" against "rmdir".  So when run A created ``/docker`` and run B
  put a container under it too, A's cleanup leaves ``/docker`` (B still uses it) and B's cleanup,
  seeing it listed, removes it; a directory no harness run created is never removed.

The unified hierarchy on a hybrid host
--------------------------------------
Measured with runc 1.1.5 (Debian 12) on a hybrid host (v1 controllers under
``/sys/fs/cgroup/<controller>``, cgroup2 at ``/sys/fs/cgroup/unified``): runc's cgroupfs manager
creates ``/sys/fs/cgroup/unified/<cgroupsPath>`` itself and puts the container's init process there,
so ``/proc/<pid>/cgroup`` reads ``0::<cgroupsPath>`` as well as ``<n>:devices:<cgroupsPath>``;
``runc delete`` removes that directory like the v1 ones.  Should some runc not do so, the harness
moves the PID itself (creates the directory and writes the PID into its ``cgroup.procs``;
``RuncContainer.unified_moved_by_harness`` is then true) and removes the directory at cleanup.

A cgroup v2 container on a hybrid host
--------------------------------------
With ``ContainerSpec.unified``, every runc command runs in a private mount namespace
(``unshare -m --propagation private``) where ``cgroup2`` is mounted at ``/sys/fs/cgroup``: runc
(1.1.5) then works in unified mode, creates ``<cgroupsPath>`` in the cgroup2 hierarchy only (visible
outside the namespace under ``/sys/fs/cgroup/unified``) and attaches a ``BPF_CGROUP_DEVICE`` program
built from the device rules, exactly as on a cgroup v2 host (spec/cgroups.md §5).

Names: every runc container name starts with ``SESSION_PREFIX`` (``accelstats-test-<pid>``) plus a
counter, and the docker ids are ``secrets.token_hex(32)``, so parallel test runs do not collide.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import itertools
import json
import os
import secrets
import shutil
import struct
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = [
    "BUSYBOX",
    "SESSION_PREFIX",
    "ContainerSpec",
    "DeviceRule",
    "HarnessError",
    "RuncContainer",
    "RuncFactory",
    "cgroup_mounts",
    "docker_cgroupfs_path",
    "docker_id",
    "docker_systemd_path",
    "pid_alive",
    "read_proc_cgroup",
    "runc_available",
    "runc_list",
]

#: ``(type, major, minor, access)``: type ``"a"``, ``"c"`` or ``"b"``; ``None`` major/minor = ``*``.
DeviceRule = tuple[str, int | None, int | None, str]

#: The static busybox of Debian's ``busybox-static`` package.
BUSYBOX = Path("/bin/busybox")

#: Prefix of every container name this process starts.
SESSION_PREFIX = f"accelstats-test-{os.getpid()}"

#: Busybox applets linked into the container's ``/bin``.
APPLETS = ("sh", "sleep", "cat", "ls", "echo", "true", "false", "grep", "ps", "mkdir", "env")

_V1_CONTROLLERS = frozenset(
    {
        "cpu",
        "cpuacct",
        "cpuset",
        "memory",
        "devices",
        "freezer",
        "net_cls",
        "blkio",
        "perf_event",
        "net_prio",
        "hugetlb",
        "pids",
        "rdma",
        "misc",
    }
)
#: Host-wide list of the cgroup directories that harness runs created (one path a line); ``flock`` on
#: it serialises creating and removing them between concurrent test runs.
CGROUP_REGISTRY = Path("/run" if Path("/run").is_dir() else tempfile.gettempdir()) / "accelstats-runc-harness.cgroups"

_COMMAND_TIMEOUT_S = 30.0
_counter = itertools.count(1)


class HarnessError(RuntimeError):
    """A runc command or a cgroup operation of the harness failed."""


def docker_id() -> str:
    """A random 64-hex container id, as docker makes them."""
    return secrets.token_hex(32)


def docker_cgroupfs_path(cid: str | None = None) -> str:
    """``/docker/<64 hex>``: docker's cgroup path with the cgroupfs driver."""
    return f"/docker/{cid or docker_id()}"


def docker_systemd_path(cid: str | None = None) -> str:
    """``/system.slice/docker-<64 hex>.scope``: docker's cgroup path with the systemd driver."""
    return f"/system.slice/docker-{cid or docker_id()}.scope"


@dataclass
class ContainerSpec:
    """What to start.

    ``name`` is a label: the runc container name is ``<SESSION_PREFIX>-<n>-<name>``.
    ``devices`` are the allowed device rules after a deny-all rule; ``privileged`` replaces all of
    them with ``a *:* rwm`` (do not give both).  ``unified``: run runc as on a cgroup v2 host (see
    "A cgroup v2 container on a hybrid host" in the module docstring): the devices cgroup is then a
    BPF program runc attaches, and the container's cgroup exists only in the cgroup2 hierarchy.
    ``mounts`` are OCI mount objects appended to the bundle's mounts; ``extra`` is deep-merged into
    ``config.json`` last (dicts merge, anything else replaces).
    """

    name: str
    cgroups_path: str
    devices: list[DeviceRule] = field(default_factory=list)
    privileged: bool = False
    unified: bool = False
    args: list[str] = field(default_factory=lambda: ["sleep", "600"])
    mounts: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def device_cgroup_rules(self) -> list[dict[str, Any]]:
        """``linux.resources.devices`` for ``config.json``."""
        if self.privileged:
            if self.devices:
                raise ValueError(f"{self.name}: privileged containers take no device rules")
            return [{"allow": True, "type": "a", "access": "rwm"}]
        rules: list[dict[str, Any]] = [{"allow": False, "access": "rwm"}]
        for dtype, major, minor, access in self.devices:
            if dtype not in ("a", "c", "b"):
                raise ValueError(f"{self.name}: device type must be a, c or b, not {dtype!r}")
            if not access or set(access) - set("rwm"):
                raise ValueError(f"{self.name}: device access must be a subset of rwm, not {access!r}")
            rule: dict[str, Any] = {"allow": True, "type": dtype, "access": access}
            if major is not None:
                rule["major"] = major
            if minor is not None:
                rule["minor"] = minor
            rules.append(rule)
        return rules


# --------------------------------------------------------------------------------------------
# cgroup and process helpers


@dataclass(frozen=True)
class CgroupMount:
    """One mounted cgroup hierarchy: v1 (``controllers`` as in ``/proc/<pid>/cgroup``) or v2."""

    mountpoint: Path
    root: str
    version: int
    controllers: str

    def dir_for(self, cgroups_path: str) -> Path:
        """The directory of absolute cgroup path ``cgroups_path`` in this hierarchy."""
        rel = cgroups_path
        if self.root != "/" and (rel == self.root or rel.startswith(self.root + "/")):
            rel = rel[len(self.root) :]
        return self.mountpoint / rel.lstrip("/")


def _unescape_mountinfo(field_text: str) -> str:
    return field_text.encode().decode("unicode_escape") if "\\" in field_text else field_text


def cgroup_mounts(mountinfo: Path = Path("/proc/self/mountinfo")) -> list[CgroupMount]:
    """Every cgroup (v1) and cgroup2 mount of this process, one per mount point."""
    mounts: list[CgroupMount] = []
    seen: set[Path] = set()
    for line in mountinfo.read_text().splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        lf, rf = left.split(), right.split()
        if len(lf) < 5 or len(rf) < 3 or rf[0] not in ("cgroup", "cgroup2"):
            continue
        mountpoint = Path(_unescape_mountinfo(lf[4]))
        if mountpoint in seen:
            continue
        seen.add(mountpoint)
        if rf[0] == "cgroup2":
            mounts.append(CgroupMount(mountpoint, _unescape_mountinfo(lf[3]), 2, ""))
            continue
        ctrls = [o for o in rf[2].split(",") if o in _V1_CONTROLLERS or o.startswith("name=")]
        mounts.append(CgroupMount(mountpoint, _unescape_mountinfo(lf[3]), 1, ",".join(ctrls)))
    return mounts


def _devices_mount(mounts: Sequence[CgroupMount]) -> CgroupMount | None:
    for m in mounts:
        if m.version == 1 and "devices" in m.controllers.split(","):
            return m
    return None


def _unified_mount(mounts: Sequence[CgroupMount]) -> CgroupMount | None:
    for m in mounts:
        if m.version == 2:
            return m
    return None


def read_proc_cgroup(pid: int) -> dict[str, str]:
    """``/proc/<pid>/cgroup`` as {controllers: path}; the v2 line is under key ``""``."""
    out: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _hid, _, rest = line.partition(":")
        ctrls, _, path = rest.partition(":")
        out[ctrls] = path
    return out


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a PID, or None if there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[19])


def pid_alive(pid: int, start_time: int | None = None) -> bool:
    """True if ``pid`` is a live (not zombie) process, and the same one if ``start_time`` is given."""
    st = _proc_stat(pid)
    if st is None or st[0] in ("Z", "X", "x"):
        return False
    return start_time is None or st[1] == start_time


def _elf_is_static(path: Path) -> bool:
    """True if ``path`` is an ELF executable without a ``PT_INTERP`` (dynamic loader) header."""
    with path.open("rb") as f:
        ident = f.read(16)
        if len(ident) < 16 or ident[:4] != b"\x7fELF":
            return False
        is64, endian = ident[4] == 2, "<" if ident[5] == 1 else ">"
        if is64:
            f.seek(0x20)
            (phoff,) = struct.unpack(endian + "Q", f.read(8))
            f.seek(0x36)
        else:
            f.seek(0x1C)
            (phoff,) = struct.unpack(endian + "I", f.read(4))
            f.seek(0x2A)
        phentsize, phnum = struct.unpack(endian + "HH", f.read(4))
        for i in range(phnum):
            f.seek(phoff + i * phentsize)
            (p_type,) = struct.unpack(endian + "I", f.read(4))
            if p_type == 3:  # PT_INTERP
                return False
    return True


def _runc_binary() -> str | None:
    return shutil.which("runc")


def runc_available(busybox: Path = BUSYBOX) -> str | None:
    """Why containers cannot be started here, or None if they can.

    Checks root, ``runc``, a static busybox, a v1 devices hierarchy, and creates and removes a
    probe cgroup in it.
    """
    if os.geteuid() != 0:
        return f"not root (euid {os.geteuid()}): runc containers need root"
    if _runc_binary() is None:
        return "runc not found on PATH (apt-get install runc)"
    if not busybox.is_file():
        return f"{busybox} missing (apt-get install busybox-static)"
    try:
        if not _elf_is_static(busybox):
            return f"{busybox} is dynamically linked (apt-get install busybox-static)"
    except OSError as exc:
        return f"cannot read {busybox}: {exc}"
    try:
        mounts = cgroup_mounts()
    except OSError as exc:
        return f"cannot read /proc/self/mountinfo: {exc}"
    dev = _devices_mount(mounts)
    if dev is None:
        return "no cgroup v1 devices hierarchy mounted (a cgroup v2-only host has no devices.list)"
    probe = dev.mountpoint / f"{SESSION_PREFIX}-probe-{secrets.token_hex(4)}"
    try:
        probe.mkdir()
    except OSError as exc:
        return f"cannot create a cgroup under {dev.mountpoint}: {exc}"
    try:
        probe.rmdir()
    except OSError as exc:
        return f"cannot remove probe cgroup {probe}: {exc}"
    return None


def runc_list(state_root: Path) -> list[dict[str, Any]]:
    """``runc --root <state_root> list`` as a list of container objects."""
    runc = _runc_binary() or "runc"
    res = subprocess.run(
        [runc, "--root", str(state_root), "list", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=_COMMAND_TIMEOUT_S,
        check=False,
    )
    if res.returncode != 0:
        raise HarnessError(f"runc list failed ({res.returncode}): {res.stderr.strip()}")
    data = json.loads(res.stdout or "null")
    return list(data) if data else []


@contextlib.contextmanager
def _cgroup_registry() -> Iterator[set[Path]]:
    """Lock ``CGROUP_REGISTRY`` and yield its entries; changes to the set are written back."""
    with CGROUP_REGISTRY.open("a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        entries = {Path(line) for line in f.read().splitlines() if line.strip()}
        before = set(entries)
        try:
            yield entries
        finally:
            if entries != before:
                f.seek(0)
                f.truncate()
                f.write("".join(f"{p}\n" for p in sorted(entries)))
                f.flush()


def _deep_merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _deep_merge(dst[key], value)
        else:
            dst[key] = copy.deepcopy(value)


# --------------------------------------------------------------------------------------------
# the container


class RuncContainer:
    """One running runc container; a context manager that always stops and removes it.

    ``state_root`` is runc's ``--root``; by default a private directory inside the container's
    temporary directory (share one between containers to ``runc list`` them together).
    """

    def __init__(
        self,
        spec: ContainerSpec,
        state_root: Path | None = None,
        *,
        busybox: Path = BUSYBOX,
        stop_timeout_s: float = 10.0,
    ) -> None:
        self.spec = spec
        self.name = f"{SESSION_PREFIX}-{next(_counter)}-{spec.name}"
        self.cgroups_path = spec.cgroups_path
        self._busybox = busybox
        self._stop_timeout_s = stop_timeout_s
        self._workdir: Path | None = None
        self._own_state_root = state_root is None
        self._state_root = state_root
        self._pid: int | None = None
        self._start_time: int | None = None
        self._created_dirs: list[Path] = []
        self._started = False
        self._cleaned = False
        #: True if the harness (not runc) moved the PID into the unified hierarchy.
        self.unified_moved_by_harness = False
        mounts = cgroup_mounts()
        dev = _devices_mount(mounts)
        if dev is None:
            raise HarnessError("no cgroup v1 devices hierarchy mounted")
        self._mounts = mounts
        #: The container's cgroup directory in the v1 devices hierarchy.
        self.devices_cgroup_dir = dev.dir_for(self.cgroups_path)
        unified = _unified_mount(mounts)
        #: The container's cgroup directory in the cgroup2 hierarchy (None if none is mounted).
        self.unified_cgroup_dir = unified.dir_for(self.cgroups_path) if unified else None

    # -- properties

    @property
    def pid(self) -> int:
        """Host PID of the container's init process."""
        if self._pid is None:
            raise HarnessError(f"{self.name} is not running")
        return self._pid

    @property
    def start_time(self) -> int | None:
        """Start time (clock ticks since boot) of the init process, to tell a reused PID apart."""
        return self._start_time

    @property
    def state_root(self) -> Path:
        """runc's ``--root`` for this container."""
        if self._state_root is None:
            raise HarnessError(f"{self.name} has not been started")
        return self._state_root

    @property
    def bundle_dir(self) -> Path:
        """The OCI bundle (``config.json`` and ``rootfs/``)."""
        if self._workdir is None:
            raise HarnessError(f"{self.name} has not been started")
        return self._workdir / "bundle"

    @property
    def cgroup_dirs(self) -> list[Path]:
        """The container's cgroup directory in every mounted hierarchy (v1 and v2)."""
        return [m.dir_for(self.cgroups_path) for m in self._mounts]

    @property
    def created_cgroup_dirs(self) -> list[Path]:
        """Directories (the container's and its parents) that did not exist before the start."""
        return list(self._created_dirs)

    def devices_list(self) -> str:
        """The kernel's ``devices.list`` of the container."""
        return (self.devices_cgroup_dir / "devices.list").read_text()

    # -- context manager

    def __enter__(self) -> RuncContainer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup(raise_errors=exc is None)

    # -- lifecycle

    def _runc(self) -> list[str]:
        """The runc command line prefix: in unified mode, inside a private mount namespace whose
        ``/sys/fs/cgroup`` is a cgroup2 mount."""
        runc = _runc_binary()
        if runc is None:
            raise HarnessError("runc not found on PATH")
        base = [runc, "--root", str(self.state_root)]
        if not self.spec.unified:
            return base
        return ["unshare", "-m", "--propagation", "private", "sh", "-c",
                'mount -t cgroup2 none /sys/fs/cgroup && exec "$0" "$@"', *base]

    def _run(self, args: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        cmd = [*self._runc(), *args]
        kwargs.setdefault("capture_output", True)
        return subprocess.run(cmd, text=True, timeout=_COMMAND_TIMEOUT_S, check=False, **kwargs)

    def _build_bundle(self) -> Path:
        bundle = self.bundle_dir
        bindir = bundle / "rootfs" / "bin"
        bindir.mkdir(parents=True)
        shutil.copy2(self._busybox, bindir / "busybox")
        for applet in APPLETS:
            (bindir / applet).symlink_to("busybox")
        res = self._run(["spec", "--bundle", str(bundle)], cwd=bundle)
        if res.returncode != 0:
            raise HarnessError(f"runc spec failed ({res.returncode}): {res.stderr.strip()}")
        config_path = bundle / "config.json"
        config: dict[str, Any] = json.loads(config_path.read_text())
        config["process"]["terminal"] = False
        config["process"]["args"] = list(self.spec.args)
        linux = config.setdefault("linux", {})
        linux["cgroupsPath"] = self.cgroups_path
        linux.setdefault("resources", {})["devices"] = self.spec.device_cgroup_rules()
        config.setdefault("mounts", []).extend(copy.deepcopy(self.spec.mounts))
        _deep_merge(config, self.spec.extra)
        config_path.write_text(json.dumps(config, indent=2))
        return bundle

    def _path_dirs(self) -> list[Path]:
        """The container's directory and all its parents, in every hierarchy, deepest first."""
        parts = [p for p in self.cgroups_path.split("/") if p]
        if not parts:
            raise HarnessError("cgroups_path must not be the root cgroup")
        dirs = [m.dir_for("/" + "/".join(parts[:depth])) for m in self._mounts for depth in range(1, len(parts) + 1)]
        return sorted(dirs, key=lambda p: len(p.parts), reverse=True)

    def start(self) -> None:
        """Build the bundle and start the container (``runc run -d``)."""
        if self._started:
            raise HarnessError(f"{self.name} was already started")
        self._started = True
        try:
            self._workdir = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
            if self._state_root is None:
                self._state_root = self._workdir / "state"
            self._build_bundle()
            # Under the registry lock: no concurrent harness run can remove a parent directory
            # between our look and runc's use of it.
            with _cgroup_registry() as registry:
                self._created_dirs = [d for d in self._path_dirs() if not d.exists()]
                registry.update(self._created_dirs)
                self._run_detached()
                state = self._state()
                self._pid = int(state["pid"])
                st = _proc_stat(self._pid)
                self._start_time = st[1] if st else None
                self._join_unified()
        except BaseException:
            self.cleanup(raise_errors=False)
            raise

    def _run_detached(self) -> None:
        assert self._workdir is not None
        log = self._workdir / "run.log"
        with open(os.devnull, "rb") as devnull, log.open("wb") as out:
            res = self._run(
                ["run", "-d", self.name],
                cwd=self.bundle_dir,
                stdin=devnull,
                stdout=out,
                stderr=out,
                capture_output=False,
            )
        if res.returncode != 0:
            raise HarnessError(
                f"runc run {self.name} failed ({res.returncode}): {log.read_text(errors='replace').strip()}"
            )

    def _state(self) -> dict[str, Any]:
        res = self._run(["state", self.name])
        if res.returncode != 0:
            raise HarnessError(f"runc state {self.name} failed ({res.returncode}): {res.stderr.strip()}")
        state: dict[str, Any] = json.loads(res.stdout)
        return state

    def _join_unified(self) -> None:
        """Put the PID into ``<unified>/<cgroupsPath>`` if runc did not (see module docstring)."""
        if self.unified_cgroup_dir is None:
            return
        if read_proc_cgroup(self.pid).get("") == self.cgroups_path:
            return
        self.unified_cgroup_dir.mkdir(parents=True, exist_ok=True)
        (self.unified_cgroup_dir / "cgroup.procs").write_text(f"{self.pid}\n")
        self.unified_moved_by_harness = True

    def exec_in(
        self, args: Sequence[str], *, check: bool = True, timeout: float = _COMMAND_TIMEOUT_S
    ) -> subprocess.CompletedProcess[str]:
        """Run ``args`` in the container (``runc exec``); raises HarnessError if ``check`` and rc != 0."""
        res = subprocess.run(
            [*self._runc(), "exec", self.name, *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and res.returncode != 0:
            raise HarnessError(f"runc exec {self.name} {list(args)} failed ({res.returncode}): {res.stderr.strip()}")
        return res

    def _wait_dead(self) -> bool:
        if self._pid is None:
            return True
        deadline = time.monotonic() + self._stop_timeout_s
        while pid_alive(self._pid, self._start_time):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def _rmdir_with_retry(self, d: Path) -> OSError | None:
        deadline = time.monotonic() + 2.0
        while True:
            try:
                d.rmdir()
                return None
            except FileNotFoundError:
                return None
            except OSError as exc:
                # A parent still used by someone else stays (ENOTEMPTY/EBUSY); a just-killed
                # container's own directory may need a moment before the kernel lets it go.
                if d not in self.cgroup_dirs:
                    return None
                if time.monotonic() > deadline:
                    return exc
                time.sleep(0.02)

    def _remove_cgroup_dirs(self, errors: list[str]) -> None:
        """rmdir, leaf first, the directories this container created or another harness run did.

        A parent that another harness run created and still uses when it stops stays behind for
        that run; ``CGROUP_REGISTRY`` lets whichever run stops last remove it.  Directories that
        no harness run created are never touched.
        """
        with _cgroup_registry() as registry:
            mine = set(self._created_dirs)
            for d in self._path_dirs():
                if d not in mine and d not in registry:
                    continue
                err = self._rmdir_with_retry(d)
                if err is not None:
                    errors.append(f"rmdir {d}: {err}")
                elif not d.exists():
                    registry.discard(d)

    def cleanup(self, raise_errors: bool = True) -> None:
        """Stop and delete the container, its new cgroup directories and the bundle. Idempotent.

        Every step runs even if an earlier one failed; the failures are raised together as a
        HarnessError if ``raise_errors``, else issued as a warning (so that an exception from the
        ``with`` body is not hidden).
        """
        if self._cleaned:
            return
        self._cleaned = True
        errors: list[str] = []
        if self._state_root is not None and _runc_binary() is not None:
            try:
                if self._pid is not None:
                    self._run(["kill", self.name, "KILL"])
                    if not self._wait_dead():
                        errors.append(f"PID {self._pid} still alive {self._stop_timeout_s}s after SIGKILL")
                res = self._run(["delete", "-f", self.name])
                if res.returncode != 0 and "does not exist" not in res.stderr:
                    errors.append(f"runc delete -f failed ({res.returncode}): {res.stderr.strip()}")
            except (OSError, subprocess.SubprocessError) as exc:
                errors.append(f"stopping {self.name}: {exc}")
        if self._started:
            try:
                self._remove_cgroup_dirs(errors)
            except OSError as exc:
                errors.append(f"removing cgroup directories: {exc}")
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
        if self._own_state_root is False and self._state_root is not None:
            shutil.rmtree(self._state_root / self.name, ignore_errors=True)
        if errors:
            msg = f"cleanup of container {self.name}: " + "; ".join(errors)
            if raise_errors:
                raise HarnessError(msg)
            warnings.warn(msg, stacklevel=2)


#: What the ``runc_container`` fixture returns: start a spec, get the running container.
RuncFactory = Callable[[ContainerSpec], RuncContainer]
