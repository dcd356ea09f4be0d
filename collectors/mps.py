"""NVIDIA MPS control daemons: start, configure, watch and stop one per shared resource.

NVIDIA's Kubernetes device plugin runs one ``nvidia-cuda-mps-control`` daemon per MPS-shared resource
(its ``mps`` package); this module does the same for Nomad and plain hosts, and also watches daemons
it did not start. Every fact below comes from ``spec/mps.md`` ("Facts", measured on an H200 with
driver 580) unless it names NVIDIA's plugin.

* :class:`Root` lays out the directories: ``<root>/<resource>/pipe``, ``<root>/<resource>/log`` and
  one ``<root>/shm`` for all resources (spec/mps.md, "Interface").
* :func:`validate` checks a resource against the GPUs the caller knows (from NVML): replicas ≥ 2,
  at most 48 per GPU from compute capability 7.0 on and 16 before (NVIDIA's plugin caps Volta at 16
  by mistake), no MIG-enabled GPU, every device known.
* :class:`Daemon` starts one daemon with an explicit minimal environment (``CUDA_VISIBLE_DEVICES`` is
  the resource's GPU UUIDs, where NVIDIA's plugin lets every daemon see every GPU), configures the
  pinned-memory limit per GPU **index** and the active-thread percentage, talks to it through the
  control binary's stdin/stdout **always with a timeout** (NVIDIA's plugin has none), checks its
  health, reads its servers and clients, and stops it: ``quit``, reap a zombie, remove the
  ``.started`` marker, the log dir and the (otherwise stale) pipe dir, restore the compute mode.
* :class:`Manager` starts and stops all the configured daemons, all or nothing.
* The pure parsers (:func:`parse_server_list`, :func:`parse_client_list`, :func:`parse_percentage`,
  :func:`parse_pinned_limit`, :func:`parse_log_line`) read the daemon's replies and log lines; they
  never raise on odd text (only on a non-``str`` argument).

Compute mode: NVIDIA's plugin sets EXCLUSIVE_PROCESS on every GPU before starting; that is a
host-wide change, so here it is an explicit opt-in (``exclusive_process``), off by default, set and
restored through :mod:`collectors.computemode` (``nvidia-smi -c``).

Nothing here imports ``accelstats`` (imports go one way) or NVML: the caller passes :class:`MpsGpu`
values it read from NVML.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from collectors.computemode import STATE_FILE as COMPUTE_MODE_FILE
from collectors.computemode import ComputeModeError, ComputeModeSwitch

log = logging.getLogger(__name__)

DEFAULT_BINARY = "nvidia-cuda-mps-control"
#: PATH given to the daemon after the control binary's own directory: the usual system
#: directories, nothing from the caller's environment.
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: The pid file the daemon writes in its pipe dir (spec/mps.md, "Start").
PID_FILE = "nvidia-cuda-mps-control.pid"
#: The control socket the daemon creates in its pipe dir once it accepts commands.
CONTROL_FILE = "control"
#: Written in the pipe dir once a start (launch and configuration) has completed (NVIDIA's plugin).
STARTED_MARKER = ".started"
MIN_REPLICAS = 2
MAX_REPLICAS_VOLTA_ON = 48  # per GPU, compute capability >= 7.0
MAX_REPLICAS_PRE_VOLTA = 16  # per GPU, compute capability < 7.0
_MIB = 1024 * 1024
_KILL_WAIT_S = 1.0  # after SIGKILL, how long to wait for a process to be gone

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




@dataclass(frozen=True)
class DaemonStatus:
    """What one daemon answered; see :meth:`Daemon.status`.

    ``healthy``: every command answered in time and the active-thread percentage is a number;
    ``reason``: ``"ok"`` or why not (the failed commands, ``"; "``-joined). ``servers``: MPS server
    PIDs (``get_server_list``; empty before the first client connects); ``clients``: server PID →
    client PIDs in the host PID namespace (``get_client_list <pid>``); ``active_thread_percentage``:
    the default percentage (``get_default_active_thread_percentage``), None when unknown;
    ``pinned_limits_bytes``: GPU UUID → default pinned-memory limit in bytes
    (``get_default_device_pinned_mem_limit <ordinal>``, see :meth:`Daemon.start` for the ordinal),
    None when the daemon reports none; a GPU whose query failed is absent.
    """

    healthy: bool
    reason: str
    servers: list[int] = field(default_factory=list)
    clients: dict[int, list[int]] = field(default_factory=dict)
    active_thread_percentage: float | None = None
    pinned_limits_bytes: dict[str, int | None] = field(default_factory=dict)


@dataclass(frozen=True)
class MpsLogLine:
    """One line of ``control.log`` / ``server.log``: ``[YYYY-MM-DD HH:MM:SS.mmm <Source> <pid>] <text>``.

    ``timestamp``: naive, in the host's local time as the daemon wrote it (the line has no zone);
    ``source``: ``Control``, ``Server`` or ``Other`` (seen in the H200 captures); ``pid``: the writing
    process; ``text``: the rest of the line, without the trailing newline.
    """

    timestamp: dt.datetime
    source: str
    pid: int
    text: str


# --------------------------------------------------------------------------------------------
# pure parsers


def _check_str(text: object, what: str) -> str:
    if not isinstance(text, str):
        raise TypeError(f"{what} expects str, got {type(text).__name__}")
    return text


def _pid_lines(text: str) -> list[int]:
    pids = []
    for line in text.splitlines():
        word = line.strip()
        if word.isascii() and word.isdigit() and len(word) <= 10 and int(word) > 0:  # a PID: at most 2^22
            pids.append(int(word))
    return pids


def parse_server_list(text: str) -> list[int]:
    """PIDs from a ``get_server_list`` reply: one per line (``"490"``), empty before any client.

    Lines that are not a positive decimal PID are skipped. Raises TypeError only for a non-``str``.
    """
    return _pid_lines(_check_str(text, "parse_server_list"))


def parse_client_list(text: str) -> list[int]:
    """Client PIDs (host PID namespace) from a ``get_client_list <server pid>`` reply, one per line.

    Empty when the server has no client (measured after the only client exited). Lines that are not
    a positive decimal PID are skipped. Raises TypeError only for a non-``str``.
    """
    return _pid_lines(_check_str(text, "parse_client_list"))


def parse_percentage(text: str) -> float | None:
    """The active-thread percentage from a reply such as ``"100.0"`` or ``"25.0"``.

    None unless the stripped reply is one finite number in 0..100. Raises TypeError only for a
    non-``str``.
    """
    word = _check_str(text, "parse_percentage").strip()
    if not re.fullmatch(r"[+]?(\d+(\.\d*)?|\.\d+)", word, re.ASCII):
        return None
    value = float(word)
    return value if math.isfinite(value) and 0.0 <= value <= 100.0 else None


_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# ASCII: with IGNORECASE alone, "K" would also match the Kelvin sign U+212A (found by fuzzing)
_SIZE_RE = re.compile(r"(\d{1,18})\s*([KMGT])(?:i?B)?", re.IGNORECASE | re.ASCII)


def parse_pinned_limit(text: str) -> int | None:
    """Bytes from a ``get_default_device_pinned_mem_limit <index>`` reply.

    The daemon takes and shows an integer with a binary qualifier (``4096M``; some drivers show a
    limit of 1 GiB or more as whole GiB, ``70G``); ``K``/``T`` and a ``B``/``iB`` suffix are accepted
    too. None for an empty reply (no limit set, as measured) or anything else (a bare number has no
    documented unit). Raises TypeError only for a non-``str``.
    """
    match = _SIZE_RE.fullmatch(_check_str(text, "parse_pinned_limit").strip())
    if match is None:
        return None
    return int(match.group(1)) * _SIZE_UNITS[match.group(2).upper()]


_LOG_RE = re.compile(
    r"\[(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\.\d{3}) +([A-Za-z]+) +(\d{1,10})\] ?(.*?)[\r\n]*", re.ASCII)


def parse_log_line(line: str) -> MpsLogLine | None:
    """Parse one MPS log line, e.g. ``[2026-11-30 10:58:36.064 Control   500] Starting control daemon…``.

    None for a line of another shape or with an impossible date. Raises TypeError only for a
    non-``str``.
    """
    match = _LOG_RE.fullmatch(_check_str(line, "parse_log_line"))
    if match is None:
        return None
    stamp, source, pid, text = match.groups()
    try:
        timestamp = dt.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f")
    except ValueError:
        return None
    return MpsLogLine(timestamp=timestamp, source=source, pid=int(pid), text=text)


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
    """The per-client pinned-memory limit in MiB: total bytes // replicas // 2**20 (spec/mps.md)."""
    return gpu.memory_total_bytes // replicas // _MIB


def active_thread_percentage(replicas: int) -> int:
    """The default active-thread percentage for ``replicas`` clients: 100 // replicas (spec/mps.md)."""
    return 100 // replicas


def _resource_gpus(resource: MpsResource, gpus: Iterable[MpsGpu]) -> tuple[MpsGpu, ...]:
    by_uuid = {gpu.uuid: gpu for gpu in gpus}
    return tuple(by_uuid[uuid] for uuid in resource.devices if uuid in by_uuid)


def validate(resource: MpsResource, gpus: Sequence[MpsGpu]) -> None:
    """Check ``resource`` against the GPUs the caller knows; raise MpsError naming it and the rule.

    Rules (spec/mps.md, "Configure"): at least one device, no device listed twice, every device one
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

    ``pipe_dir(r)`` = ``<root>/<r>/pipe``, ``log_dir(r)`` = ``<root>/<r>/log``, ``shm_dir()`` =
    ``<root>/shm`` (one for all resources; clients mount it at ``/dev/shm``). A resource name may
    contain ``/`` (``nvidia.com/gpu`` → nested directories) but no empty, ``.`` or ``..`` part, no
    leading ``/``, no NUL, and may not start with ``shm`` (that directory is shared): MpsError.
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
        if parts[0] == "shm":
            raise MpsError(f"MPS resource name {resource!r} would live inside the shared shm dir")
        return self.path.joinpath(*parts)

    def pipe_dir(self, resource: str) -> Path:
        """``<root>/<resource>/pipe``: the daemon's ``CUDA_MPS_PIPE_DIRECTORY``."""
        return self.resource_dir(resource) / "pipe"

    def log_dir(self, resource: str) -> Path:
        """``<root>/<resource>/log``: the daemon's ``CUDA_MPS_LOG_DIRECTORY``."""
        return self.resource_dir(resource) / "log"

    def shm_dir(self) -> Path:
        """``<root>/shm``: shared by all resources, mounted at ``/dev/shm`` in clients."""
        return self.path / "shm"


# --------------------------------------------------------------------------------------------
# processes


def _proc_state(pid: int) -> str | None:
    """The process state letter from ``/proc/<pid>/stat`` (``Z`` for a zombie); None when gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            stat = handle.read()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return "?"
        return "?"
    fields = stat[stat.rfind(")") + 2:].split()
    return fields[0] if fields else "?"


def _reap(pid: int) -> bool:
    """Reap ``pid`` if it is our exited child; True when it was reaped now or is not our child."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    except OSError:
        return True
    return done == pid


def _alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie is reaped when it is our child and counts as gone either way."""
    state = _proc_state(pid)
    if state is None:
        return False
    if state == "Z":
        _reap(pid)
        return False
    return True


def _wait_gone(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` s for ``pid`` to exit (reaping it if it is our child); True when gone."""
    deadline = time.monotonic() + timeout
    while True:
        if not _alive(pid):
            _reap(pid)
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            raw = handle.read()
    except OSError:
        return []
    return [os.fsdecode(arg) for arg in raw.split(b"\0") if arg]


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's process group (it was started in a session of its own) and reap the child.

    The reaping waits at most :data:`_KILL_WAIT_S`: a child stuck in the kernel (a wedged driver)
    cannot die yet, and is left for ``subprocess`` to reap later rather than block the caller.
    """
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        proc.kill()
    try:
        proc.wait(timeout=_KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        log.warning("pid %d (%s) did not die within %g s of SIGKILL", proc.pid, proc.args, _KILL_WAIT_S)


def _read_text(handle: IO[bytes]) -> str:
    handle.seek(0)
    return handle.read().decode("utf-8", errors="replace")


def _remove_path(path: Path) -> None:
    """Remove a file, link or directory tree; raise OSError when it stays."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _remove_empty_parents(path: Path, stop: Path) -> None:
    """Remove ``path`` and its parents while they are empty directories strictly below ``stop``."""
    current = path
    while current != stop and stop in current.parents:
        try:
            current.rmdir()
        except OSError:
            return
        current = current.parent


# --------------------------------------------------------------------------------------------
# daemon


class Daemon:
    """One MPS control daemon for ``resource`` (spec/mps.md, "Interface": ``Daemon(resource, devices, root)``).

    ``gpus``: every GPU the caller knows (from NVML); :attr:`devices` are the resource's among them.
    ``binary``: the control binary, a path or a name looked up on the caller's ``PATH``.
    ``timeout``: seconds allowed for each run of the binary (AWS's ECS agent uses 3 s).
    ``exclusive_process``: the opt-in switch to EXCLUSIVE_PROCESS compute mode before the start
    (False, the default, leaves compute modes alone); ``nvidia_smi``: the tool that reads and sets
    it (:class:`collectors.computemode.ComputeModeSwitch`). Whatever a start switched is restored
    by :meth:`stop`, in this process or another. The constructor never raises; :meth:`start` validates.
    """

    def __init__(self, resource: MpsResource, gpus: Sequence[MpsGpu], root: Root, *,
                 binary: str = DEFAULT_BINARY, timeout: float = 3.0,
                 exclusive_process: bool = False, nvidia_smi: str = "nvidia-smi") -> None:
        self.resource = resource
        self.gpus = tuple(gpus)
        self.root = root
        self.binary = binary
        self.timeout = float(timeout)
        self.exclusive_process = exclusive_process
        self.nvidia_smi = nvidia_smi
        self._binary_path: str | None = None  # resolved by start(), kept until stop() is done
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"Daemon({self.name!r}, root={self.root!r})"

    @property
    def name(self) -> str:
        """The resource name."""
        return self.resource.name

    @property
    def devices(self) -> tuple[MpsGpu, ...]:
        """The resource's GPUs in the resource's order (unknown UUIDs are left out; :meth:`start` refuses them)."""
        return _resource_gpus(self.resource, self.gpus)

    @property
    def pipe_dir(self) -> Path:
        """``<root>/<resource>/pipe`` (MpsError for a bad resource name)."""
        return self.root.pipe_dir(self.name)

    @property
    def log_dir(self) -> Path:
        """``<root>/<resource>/log`` (MpsError for a bad resource name)."""
        return self.root.log_dir(self.name)

    @property
    def shm_dir(self) -> Path:
        """``<root>/shm``."""
        return self.root.shm_dir()

    @property
    def started(self) -> bool:
        """True when the ``.started`` marker is in the pipe dir (a completed :meth:`start`)."""
        try:
            return (self.pipe_dir / STARTED_MARKER).is_file()
        except MpsError:
            return False

    def pid(self) -> int | None:
        """The daemon's PID from ``nvidia-cuda-mps-control.pid`` in the pipe dir; None when absent or unreadable."""
        try:
            text = (self.pipe_dir / PID_FILE).read_text(encoding="ascii", errors="replace").strip()
        except (OSError, MpsError):
            return None
        return int(text) if text.isascii() and text.isdigit() and int(text) > 0 else None

    def running(self) -> bool:
        """True when the pid file names a live process whose command line is the control binary's
        (a recycled PID is not the daemon)."""
        pid = self.pid()
        if pid is None or not _alive(pid):
            return False
        names = {os.path.basename(self.binary), DEFAULT_BINARY}
        return any(os.path.basename(arg) in names for arg in _cmdline(pid)[:2])

    def visible_devices(self) -> tuple[str, ...] | None:
        """The running daemon's ``CUDA_VISIBLE_DEVICES`` (``/proc/<pid>/environ``), split on commas; None
        when no daemon runs or its environment cannot be read."""
        pid = self.pid()
        if pid is None or not self.running():
            return None
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            return None
        for var in environ.split(b"\0"):
            if var.startswith(b"CUDA_VISIBLE_DEVICES="):
                value = var.split(b"=", 1)[1].decode("utf-8", "replace")
                return tuple(v for v in value.split(",") if v)
        return ()

    # ---- environment and commands

    def resolve_binary(self) -> str:
        """The control binary's path: ``binary`` itself when it has a ``/``, else found on the caller's PATH.

        From :meth:`start` until :meth:`stop` has cleaned up, the path found at start is kept (the
        daemon is talked to and stopped with the binary that started it). Raises MpsError
        "... not found" when there is no such executable.
        """
        if self._binary_path is not None:
            return self._binary_path
        if "/" in self.binary:
            if os.path.isfile(self.binary) and os.access(self.binary, os.X_OK):
                return os.path.abspath(self.binary)
            raise MpsError(f"MPS resource {self.name!r}: control binary {self.binary} not found (or not executable)")
        found = shutil.which(self.binary)
        if found is None:
            raise MpsError(f"MPS resource {self.name!r}: control binary {self.binary} not found on PATH")
        return os.path.abspath(found)

    def env_vars(self) -> dict[str, str]:
        """The daemon's whole environment, nothing inherited (spec/mps.md, "Start").

        ``PATH``: the control binary's directory, then :data:`SAFE_PATH` (so a binary installed
        elsewhere, and the ``nvidia-cuda-mps-server`` the daemon launches beside it, can be found —
        how the daemon locates the server is not measured); ``CUDA_MPS_PIPE_DIRECTORY`` /
        ``CUDA_MPS_LOG_DIRECTORY``: the resource's pipe and log dirs; ``CUDA_VISIBLE_DEVICES``: the
        resource's GPU UUIDs, comma-separated (NVIDIA's plugin leaves every GPU visible to every daemon). MpsError for a
        bad resource name.
        """
        path_dirs = SAFE_PATH.split(":")
        try:
            bin_dir = os.path.dirname(self.resolve_binary())
        except MpsError:
            bin_dir = ""
        if bin_dir and bin_dir not in path_dirs:
            path_dirs.insert(0, bin_dir)
        return {
            "PATH": ":".join(path_dirs),
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
            "CUDA_VISIBLE_DEVICES": ",".join(self.resource.devices),
        }

    def _run(self, args: list[str], stdin_text: str | None, timeout: float, what: str) -> tuple[int, str, str]:
        """Run the binary with ``args`` and the minimal env; (exit status, stdout, stderr).

        Output goes to temporary files, not pipes, so a daemonised grandchild that keeps them open
        cannot stall the read. Past ``timeout`` the child's process group is killed: MpsError.
        """
        binary = self.resolve_binary()
        env = self.env_vars()
        deadline = time.monotonic() + timeout
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.Popen(
                    [binary, *args], stdin=subprocess.PIPE if stdin_text is not None else subprocess.DEVNULL,
                    stdout=out, stderr=err, env=env, cwd="/", close_fds=True, start_new_session=True)
            except FileNotFoundError as exc:
                raise MpsError(f"MPS resource {self.name!r}: control binary {binary} not found: {exc}") from exc
            except OSError as exc:
                raise MpsError(f"MPS resource {self.name!r}: cannot run {binary} for {what}: {exc}") from exc
            try:
                if proc.stdin is not None:
                    try:
                        proc.stdin.write((stdin_text or "").encode())
                        proc.stdin.close()
                    except BrokenPipeError:
                        pass  # it exited without reading: its status and stderr say why
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                raise MpsError(f"MPS resource {self.name!r}: {what} did not answer within {timeout:g} s "
                               f"(the daemon may be wedged)") from None
            except BaseException:
                _kill_group(proc)
                raise
            finally:
                if proc.stdin is not None:
                    with contextlib.suppress(OSError):
                        proc.stdin.close()
            return proc.returncode, _read_text(out), _read_text(err)

    def echo_pipe_to_control(self, command: str, timeout: float | None = None) -> str:
        """Send one ``command`` to the daemon and return its reply (stdout, surrounding whitespace stripped).

        Runs the control binary with :meth:`env_vars`, writes ``command`` and a newline to its stdin,
        closes it and reads stdout — always within ``timeout`` seconds (default :attr:`timeout`;
        spec/mps.md, "Talk"). MpsError when the command is empty or multi-line, the binary is not
        found, it "did not answer within N s" (the child is killed), or it exits nonzero (the
        message carries its stderr, else its stdout).
        """
        command = command.strip()
        if not command or "\n" in command or "\r" in command:
            raise MpsError(f"MPS resource {self.name!r}: command {command!r} must be one non-empty line")
        limit = self.timeout if timeout is None else float(timeout)
        status, out, err = self._run([], command + "\n", limit, f"command {command!r}")
        if status != 0:
            detail = (err.strip() or out.strip() or "no output")
            raise MpsError(f"MPS resource {self.name!r}: command {command!r} failed with exit status {status}: "
                           f"{detail}")
        return out.strip()

    # ---- health and status

    def assert_healthy(self) -> None:
        """Raise MpsError unless ``get_default_active_thread_percentage`` answers in time with a number.

        Both the exit status and the reply are checked (spec/mps.md, "Health"): a reply that is not a
        percentage (e.g. an error printed with status 0) is unhealthy too.
        """
        reply = self.echo_pipe_to_control("get_default_active_thread_percentage")
        if parse_percentage(reply) is None:
            raise MpsError(f"MPS resource {self.name!r}: get_default_active_thread_percentage answered "
                           f"{reply!r}, not a percentage")

    def status(self) -> DaemonStatus:
        """Ask the daemon for its health, servers, clients and limits; never raises.

        Commands: ``get_default_active_thread_percentage``, ``get_server_list``,
        ``get_client_list <pid>`` per server, ``get_default_device_pinned_mem_limit <index>`` per GPU
        of the resource. Each failure makes the status unhealthy with its reason; after a timeout the
        remaining commands are skipped (a wedged daemon would cost a timeout each).
        """
        reasons: list[str] = []
        servers: list[int] = []
        clients: dict[int, list[int]] = {}
        pinned: dict[str, int | None] = {}
        percentage: float | None = None
        wedged = False

        def ask(command: str) -> str | None:
            nonlocal wedged
            if wedged:
                return None
            try:
                return self.echo_pipe_to_control(command)
            except MpsError as exc:
                reasons.append(str(exc))
                wedged = "did not answer within" in str(exc)
                return None
            except Exception as exc:  # noqa: BLE001 - status() reports, it never raises
                reasons.append(f"MPS resource {self.name!r}: command {command!r} failed: {exc!r}")
                return None

        reply = ask("get_default_active_thread_percentage")
        if reply is not None:
            percentage = parse_percentage(reply)
            if percentage is None:
                reasons.append(f"MPS resource {self.name!r}: get_default_active_thread_percentage answered "
                               f"{reply!r}, not a percentage")
        reply = ask("get_server_list")
        if reply is not None:
            servers = parse_server_list(reply)
        for server in servers:
            reply = ask(f"get_client_list {server}")
            if reply is not None:
                clients[server] = parse_client_list(reply)
        for ordinal, gpu in enumerate(self.devices):
            reply = ask(f"get_default_device_pinned_mem_limit {ordinal}")
            if reply is not None:
                pinned[gpu.uuid] = parse_pinned_limit(reply)
        if wedged:
            reasons.append("remaining commands skipped")
        return DaemonStatus(healthy=not reasons, reason="; ".join(reasons) or "ok", servers=servers,
                            clients=clients, active_thread_percentage=percentage, pinned_limits_bytes=pinned)

    # ---- start

    def start(self) -> None:
        """Validate, create the dirs, launch ``<binary> -d``, configure it, write the ``.started`` marker.

        Steps (spec/mps.md, "Start" and "Configure"): :func:`validate`; find the binary (MpsError
        "... not found"); refuse when a daemon already answers in the pipe dir, else remove a stale
        pipe dir; the opt-in compute-mode switch; create the pipe, log and shm dirs (MpsError naming
        the dir when that fails); run ``<binary> -d`` with :meth:`env_vars` within the timeout and
        wait for its ``control`` socket; then ``set_default_device_pinned_mem_limit <ordinal> <MiB>M``
        per GPU (the daemon ignored limits set by UUID) and
        ``set_default_active_thread_percentage <100 // replicas>``, whose reply must be a number.
        The ordinal is the GPU's position in the daemon's ``CUDA_VISIBLE_DEVICES`` (the resource's
        device order), not NVML's index: NVIDIA's MPS documentation (appendix "Environment
        Variables", ``CUDA_VISIBLE_DEVICES``) says devices visible to the daemon are renumbered from 0
        by the MPS server. On the one-GPU H200 host of spec/mps.md both numbers are 0; a multi-GPU
        host is needed to measure it (docs/gpu-check.md).
        Any failure undoes what was done (quit, reap, dirs removed, compute modes restored) and
        raises MpsError.
        """
        with self._lock:
            validate(self.resource, self.gpus)
            pipe_dir, log_dir, shm_dir = self.pipe_dir, self.log_dir, self.shm_dir
            self._binary_path = None
            binary = self.resolve_binary()
            self._clear_stale(pipe_dir)
            try:
                self._set_compute_modes()
                self._make_dirs(pipe_dir, log_dir, shm_dir)
            except BaseException:
                problems: list[str] = []
                self._restore_compute_modes(problems)
                self._cleanup_dirs(pipe_dir, log_dir, problems)
                for problem in problems:
                    log.warning("%s (cleanup after a failed start)", problem)
                raise
            self._binary_path = binary
            try:
                self._launch(pipe_dir)
                self.configure()
                (pipe_dir / STARTED_MARKER).write_text(f"{time.time():.3f}\n", encoding="ascii")
            except BaseException as exc:
                for problem in self._stop_locked():
                    log.warning("%s (cleanup after a failed start)", problem)
                if isinstance(exc, OSError):
                    raise MpsError(f"MPS resource {self.name!r}: start failed: {exc}") from exc
                raise
            log.info("MPS resource %r: control daemon started (pid %s, devices %s)", self.name, self.pid(),
                     ",".join(self.resource.devices))

    def _clear_stale(self, pipe_dir: Path) -> None:
        """Remove a pipe dir no live daemon serves. A live control daemon there is never replaced: one
        that answers is refused as already running; one that does not answer is refused too, because
        removing its pipe dir would orphan it and its MPS server (nothing could reach or stop them)."""
        if not (pipe_dir.exists() or pipe_dir.is_symlink()):
            return
        if self.running():
            try:
                self.assert_healthy()
            except MpsError as exc:
                raise MpsError(f"MPS resource {self.name!r}: a control daemon (pid {self.pid()}) runs in {pipe_dir} "
                               f"but does not answer ({exc}); stop it first (accelstats mps stop)") from exc
            raise MpsError(f"MPS resource {self.name!r}: a control daemon (pid {self.pid()}) already answers in "
                           f"{pipe_dir}; stop it first")
        log.info("MPS resource %r: removing stale pipe dir %s", self.name, pipe_dir)
        try:
            _remove_path(pipe_dir)
        except OSError as exc:
            raise MpsError(f"MPS resource {self.name!r}: cannot remove stale pipe dir {pipe_dir}: {exc}") from exc

    def _compute_modes(self) -> ComputeModeSwitch:
        return ComputeModeSwitch(self.root.resource_dir(self.name) / COMPUTE_MODE_FILE, self.nvidia_smi,
                                 self.timeout)

    def _set_compute_modes(self) -> None:
        if not self.exclusive_process:
            return
        try:
            self._compute_modes().set_exclusive(self.resource.devices)
        except ComputeModeError as exc:
            raise MpsError(f"MPS resource {self.name!r}: {exc}") from exc

    def _restore_compute_modes(self, problems: list[str]) -> None:
        try:
            switch = self._compute_modes()
        except MpsError as exc:
            problems.append(str(exc))
            return
        if switch.state_file.exists():
            problems.extend(f"MPS resource {self.name!r}: {p}" for p in switch.restore())

    def _make_dirs(self, pipe_dir: Path, log_dir: Path, shm_dir: Path) -> None:
        for what, path in (("pipe dir", pipe_dir), ("log dir", log_dir), ("shm dir", shm_dir)):
            existed = path.is_dir()
            try:
                path.mkdir(parents=True, exist_ok=True)
                if what == "shm dir" and not existed:
                    path.chmod(0o1777)  # like /dev/shm, which clients mount it as
            except OSError as exc:
                raise MpsError(f"MPS resource {self.name!r}: cannot create {what} {path}: "
                               f"{exc.strerror or exc}") from exc
            if not os.access(path, os.W_OK | os.X_OK):
                raise MpsError(f"MPS resource {self.name!r}: {what} {path} is not writable")

    def _launch(self, pipe_dir: Path) -> None:
        status, out, err = self._run(["-d"], None, self.timeout, "starting the control daemon (-d)")
        if status != 0:
            detail = err.strip() or out.strip() or "no output"
            raise MpsError(f"MPS resource {self.name!r}: {self.binary} -d failed with exit status {status}: {detail}")
        deadline = time.monotonic() + self.timeout
        while not (pipe_dir / CONTROL_FILE).exists():
            if time.monotonic() >= deadline:
                raise MpsError(f"MPS resource {self.name!r}: the control daemon did not create "
                               f"{pipe_dir / CONTROL_FILE} within {self.timeout:g} s")
            time.sleep(0.02)

    def configure(self) -> None:
        """Set the default pinned-memory limit per GPU and the active-thread percentage from the replica
        count (see :meth:`start`); they apply to the MPS servers the daemon spawns from now on. MpsError
        when a command fails or the percentage reply is not a number."""
        replicas = self.resource.replicas
        for ordinal, gpu in enumerate(self.devices):
            self.echo_pipe_to_control(f"set_default_device_pinned_mem_limit {ordinal} "
                                      f"{pinned_limit_mib(gpu, replicas)}M")
        command = f"set_default_active_thread_percentage {active_thread_percentage(replicas)}"
        reply = self.echo_pipe_to_control(command)
        if parse_percentage(reply) is None:
            raise MpsError(f"MPS resource {self.name!r}: {command!r} answered {reply!r}, not a percentage")

    # ---- stop

    def stop(self) -> list[str]:
        """Stop the daemon and clean up; never raises. Returns the problems met (also logged), [] when clean.

        ``quit -t <ceil(timeout)>`` (spec/mps.md: ``quit`` accepts ``-t <seconds>``, the time its MPS
        servers get to exit), answered within timeout plus that grace (a failure is reported, cleanup
        goes on); wait for the daemon to exit and reap it if it is our child (it was seen lingering
        as a zombie of its starter); if it still runs and its command line is the control binary's,
        SIGTERM then SIGKILL it (its pipe dir is about to go, nothing could reach it after); remove
        the ``.started`` marker, the log dir and the pipe dir (NVIDIA's plugin leaves a stale one) and
        the resource's directories left empty; restore compute modes an opt-in changed (spec/mps.md,
        "Stop").
        """
        with self._lock:
            problems = self._stop_locked()
        for problem in problems:
            log.warning("%s", problem)
        return problems

    def _stop_locked(self) -> list[str]:
        problems: list[str] = []
        try:
            pipe_dir, log_dir = self.pipe_dir, self.log_dir
        except MpsError as exc:
            self._restore_compute_modes(problems)
            return [str(exc), *problems]
        pid = self.pid()
        if pipe_dir.is_dir() and (pid is not None or (pipe_dir / CONTROL_FILE).exists()):
            grace = max(1, math.ceil(self.timeout))  # servers get this long to exit before the daemon ends them
            try:
                self.echo_pipe_to_control(f"quit -t {grace}", timeout=self.timeout + grace)
            except MpsError as exc:
                problems.append(f"{exc} (cleaning up anyway)")
        if pid is not None and not _wait_gone(pid, self.timeout):
            self._terminate(pid, problems)
        self._restore_compute_modes(problems)
        self._cleanup_dirs(pipe_dir, log_dir, problems)
        self._binary_path = None
        return problems

    def _terminate(self, pid: int, problems: list[str]) -> None:
        names = {os.path.basename(self.binary), DEFAULT_BINARY}
        if not any(os.path.basename(arg) in names for arg in _cmdline(pid)[:2]):
            problems.append(f"MPS resource {self.name!r}: pid {pid} from the pid file is not {self.binary}; "
                            "left alone")
            return
        problems.append(f"MPS resource {self.name!r}: the control daemon (pid {pid}) did not exit after quit; "
                        "terminating it")
        for sig, wait in ((signal.SIGTERM, self.timeout), (signal.SIGKILL, _KILL_WAIT_S)):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                _reap(pid)
                return
            except OSError as exc:
                problems.append(f"MPS resource {self.name!r}: cannot signal pid {pid}: {exc}")
                return
            if _wait_gone(pid, wait):
                return
        problems.append(f"MPS resource {self.name!r}: the control daemon (pid {pid}) survived SIGKILL")

    def _cleanup_dirs(self, pipe_dir: Path, log_dir: Path, problems: list[str]) -> None:
        for what, path in (("started marker", pipe_dir / STARTED_MARKER), ("log dir", log_dir),
                           ("pipe dir", pipe_dir)):
            try:
                _remove_path(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                problems.append(f"MPS resource {self.name!r}: cannot remove {what} {path}: {exc}")
        _remove_empty_parents(pipe_dir.parent, self.root.path)


# --------------------------------------------------------------------------------------------
# manager


class Manager:
    """The daemons the configuration asks for: one per resource, none when MPS is not configured.

    ``daemon_kwargs`` go to every :class:`Daemon` (``binary``, ``timeout``, ``exclusive_process``, ``nvidia_smi``).
    Raises MpsError when two resources share a name or one's directories would nest in another's.
    """

    def __init__(self, resources: Sequence[MpsResource], gpus: Sequence[MpsGpu], root: Root,
                 **daemon_kwargs: Any) -> None:
        names = [resource.name for resource in resources]
        for i, name in enumerate(names):
            for other in names[i + 1:]:
                if name == other:
                    raise MpsError(f"MPS resource {name!r} is configured twice")
                if other.startswith(name + "/") or name.startswith(other + "/"):
                    raise MpsError(f"MPS resources {name!r} and {other!r} would nest their directories")
        self.root = root
        self._daemons = [Daemon(resource, gpus, root, **daemon_kwargs) for resource in resources]

    def daemons(self) -> list[Daemon]:
        """The daemons, in configuration order (empty when no resource is configured)."""
        return list(self._daemons)

    def validate_all(self) -> None:
        """:func:`validate` every resource and its directory names, and refuse a GPU shared by two resources."""
        owner: dict[str, str] = {}
        for daemon in self._daemons:
            validate(daemon.resource, daemon.gpus)
            daemon.root.resource_dir(daemon.name)
            for uuid in daemon.resource.devices:
                if uuid in owner:
                    raise MpsError(f"MPS resources {owner[uuid]!r} and {daemon.name!r} both list GPU {uuid}")
                owner[uuid] = daemon.name

    def start_all(self) -> None:
        """Start every daemon, all or nothing.

        Everything is validated first; when a start fails, the daemons already started are stopped
        (in reverse order) and MpsError names the resource that failed.
        """
        self.validate_all()
        started: list[Daemon] = []
        for daemon in self._daemons:
            try:
                daemon.start()
            except MpsError as exc:
                for done in reversed(started):
                    done.stop()
                raise MpsError(f"MPS: starting resource {daemon.name!r} failed, "
                               f"{len(started)} started daemon(s) stopped again: {exc}") from exc
            started.append(daemon)

    def stop_all(self) -> dict[str, list[str]]:
        """Stop every daemon (reverse order); never raises. Resource name → problems met ([] when clean)."""
        return {daemon.name: daemon.stop() for daemon in reversed(self._daemons)}

    def status_all(self) -> dict[str, DaemonStatus]:
        """Resource name → :meth:`Daemon.status`, in configuration order (as :meth:`daemons`); never raises."""
        return {daemon.name: daemon.status() for daemon in self._daemons}
