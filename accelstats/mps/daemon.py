"""NVIDIA MPS control daemons: start, configure, watch and stop one per shared resource.

NVIDIA's Kubernetes device plugin runs one ``nvidia-cuda-mps-control`` daemon per MPS-shared resource
(its ``mps`` package); this module does the same for Nomad and plain hosts, and also watches daemons
it did not start. Every fact below comes from docs/mps.md (measured on an H200 with
driver 580) unless it names NVIDIA's plugin.

* :class:`Root` (directory layout) and :func:`validate` (replicas, MIG, known devices) live in
  :mod:`accelstats.mps.rules`; the reply and log parsers in :mod:`accelstats.mps.replies`; process
  helpers in :mod:`accelstats.mps.proc`. All are re-exported here.
* :class:`Daemon` starts one daemon with an explicit minimal environment (``CUDA_VISIBLE_DEVICES`` is
  the resource's GPU UUIDs, where NVIDIA's plugin lets every daemon see every GPU), configures the
  pinned-memory limit per GPU (by the daemon's device ordinal) and the active-thread percentage, talks to it through the
  control binary's stdin/stdout **always with a timeout** (NVIDIA's plugin has none), checks its
  health, reads its servers and clients, and stops it: ``quit``, reap a zombie, remove the
  ``.started`` marker, the log dir and the (otherwise stale) pipe dir, restore the compute mode.
  A start and a stop of one resource hold its lock (``flock`` on ``<root>/<resource>/lock``) from
  the check for a running daemon to the end, so parallel starts and stops, in any processes, run one
  after the other: of parallel starts one starts the daemon and the others are refused with
  :class:`DaemonRunningError`, and no start's cleanup can stop another's daemon.
* :class:`Manager` starts and stops all the configured daemons, all or nothing.

Compute mode: NVIDIA's plugin sets EXCLUSIVE_PROCESS on every GPU before starting; that is a
host-wide change, so here it is an explicit opt-in (``exclusive_process``), off by default, set and
restored through :mod:`accelstats.mps.computemode` (``nvidia-smi -c``).

Nothing here imports ``accelstats`` (imports go one way) or NVML: the caller passes :class:`MpsGpu`
values it read from NVML.

This module stays above the ~400-line guide on purpose: :class:`Daemon` is one lifecycle (start,
configure, talk, watch, stop, clean up after every failure on the way) whose steps undo each other,
and reads best in one place.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelstats.mps.computemode import STATE_FILE as COMPUTE_MODE_FILE
from accelstats.mps.computemode import ComputeModeError, ComputeModeSwitch
from accelstats.mps.proc import (
    KILL_WAIT_S,
    LockBusyError,
    acquire_lock,
    alive,
    cmdline,
    kill_group,
    label_for_containers,
    read_text,
    reap,
    release_lock,
    remove_empty_parents,
    remove_path,
    wait_gone,
)
from accelstats.mps.replies import (
    MpsLogLine,
    parse_client_list,
    parse_device_client_list,
    parse_log_line,
    parse_percentage,
    parse_pinned_limit,
    parse_server_list,
)
from accelstats.mps.rules import (
    MAX_REPLICAS_PRE_VOLTA,
    MAX_REPLICAS_VOLTA_ON,
    MIN_REPLICAS,
    MpsError,
    MpsGpu,
    MpsResource,
    Root,
    active_thread_percentage,
    max_replicas,
    pinned_limit_mib,
    resource_gpus,
    validate,
)

__all__ = [  # the MPS interface of docs/mps.md, with the rules and parsers it is built on
    "DEFAULT_BINARY", "MAX_REPLICAS_PRE_VOLTA", "MAX_REPLICAS_VOLTA_ON", "MIN_REPLICAS", "Daemon", "DaemonRunningError",
    "DaemonStatus", "Manager", "MpsError", "MpsGpu", "MpsLogLine", "MpsResource", "Root", "active_thread_percentage",
    "max_replicas", "parse_client_list", "parse_device_client_list", "parse_log_line", "parse_percentage",
    "parse_pinned_limit", "parse_server_list", "pinned_limit_mib", "validate",
]

log = logging.getLogger(__name__)
DEFAULT_BINARY = "nvidia-cuda-mps-control"
#: PATH given to the daemon after the control binary's own directory: the usual system
#: directories, nothing from the caller's environment.
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: The pid file the daemon writes in its pipe dir (docs/mps.md, "Start").
PID_FILE = "nvidia-cuda-mps-control.pid"
#: The control socket the daemon creates in its pipe dir once it accepts commands.
CONTROL_FILE = "control"
#: ``<root>/<resource>/.started``, written once a start (launch and configuration) has completed
#: (k8s-device-plugin ``internal/mps/root.go:51-53``).
STARTED_MARKER = ".started"
#: The start/stop lock of a resource, in ``<root>/<resource>/`` (removed with the pipe dir by a stop).
LOCK_FILE = "lock"
#: How long a start or stop waits for another process's start or stop of the same resource:
#: ``max(LOCK_WAIT_MIN_S, LOCK_WAIT_TIMEOUTS * timeout)`` seconds. A start or stop runs about
#: 7 + 3 * GPUs commands and waits, each bounded by the timeout, when every one of them runs into it;
#: 40 covers 10 GPUs. Past it the waiter fails with "another process is starting or stopping it".
LOCK_WAIT_TIMEOUTS = 40
LOCK_WAIT_MIN_S = 60.0


class DaemonRunningError(MpsError):
    """:meth:`Daemon.start` refused: a control daemon of the resource is already running (it answers,
    or runs without answering and must be stopped first). The message names the resource, the PID
    and the pipe dir."""


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
    None when the daemon reports none; a GPU whose query failed is absent. ``device_clients``: GPU UUID →
    client PIDs that enumerated it (``get_device_client_list``, the daemon's ordinals mapped through
    the resource's devices; empty when the devices are not resolved).
    """

    healthy: bool
    reason: str
    servers: list[int] = field(default_factory=list)
    clients: dict[int, list[int]] = field(default_factory=dict)
    active_thread_percentage: float | None = None
    pinned_limits_bytes: dict[str, int | None] = field(default_factory=dict)
    device_clients: dict[str, list[int]] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# daemon


class Daemon:
    """One MPS control daemon for ``resource`` (docs/mps.md, "Interface": ``Daemon(resource, devices, root)``).

    ``gpus``: every GPU the caller knows (from NVML); :attr:`devices` are the resource's among them.
    ``binary``: the control binary, a path or a name looked up on the caller's ``PATH``.
    ``timeout``: seconds allowed for each run of the binary (AWS's ECS agent uses 3 s).
    ``exclusive_process``: the opt-in switch to EXCLUSIVE_PROCESS compute mode before the start
    (False, the default, leaves compute modes alone); ``nvidia_smi``: the tool that reads and sets
    it (:class:`accelstats.mps.computemode.ComputeModeSwitch`). Whatever a start switched is restored
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
        return resource_gpus(self.resource, self.gpus)

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
        """The daemon's ``/dev/shm`` (:data:`accelstats.mps.rules.SHM_DIR`, the host's)."""
        return self.root.shm_dir()

    @property
    def started_marker(self) -> Path:
        """``<root>/<resource>/.started`` (MpsError for a bad resource name)."""
        return self.root.started_marker(self.name)

    @property
    def lock_file(self) -> Path:
        """``<root>/<resource>/lock``: held (``flock``) by a start or stop of the resource (MpsError for a
        bad resource name)."""
        return self.root.resource_dir(self.name) / LOCK_FILE

    @property
    def lock_wait(self) -> float:
        """Seconds a start or stop waits for another process's start or stop of this resource."""
        return max(LOCK_WAIT_MIN_S, LOCK_WAIT_TIMEOUTS * self.timeout)

    @property
    def started(self) -> bool:
        """True when the ``.started`` marker exists (a completed :meth:`start`) and a pipe dir."""
        try:
            return self.started_marker.is_file() and self.pipe_dir.is_dir()
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
        if pid is None or not alive(pid):
            return False
        names = {os.path.basename(self.binary), DEFAULT_BINARY}
        return any(os.path.basename(arg) in names for arg in cmdline(pid)[:2])

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
        """The daemon's whole environment, nothing inherited (docs/mps.md, "Start").

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
                kill_group(proc)
                raise MpsError(f"MPS resource {self.name!r}: {what} did not answer within {timeout:g} s "
                               f"(the daemon may be wedged)") from None
            except BaseException:
                kill_group(proc)
                raise
            finally:
                if proc.stdin is not None:
                    with contextlib.suppress(OSError):
                        proc.stdin.close()
            return proc.returncode, read_text(out), read_text(err)

    def echo_pipe_to_control(self, command: str, timeout: float | None = None) -> str:
        """Send one ``command`` to the daemon and return its reply (stdout, surrounding whitespace stripped).

        Runs the control binary with :meth:`env_vars`, writes ``command`` and a newline to its stdin,
        closes it and reads stdout — always within ``timeout`` seconds (default :attr:`timeout`;
        docs/mps.md, "Talk"). MpsError when the command is empty or multi-line, the binary is not
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

        Both the exit status and the reply are checked (docs/mps.md, "Health"): a reply that is not a
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
        of the resource. Each failure makes the status unhealthy with its reason; after a timeout, or
        an answer that no control daemon runs, the remaining commands are skipped (a wedged daemon
        would cost a timeout each, and a missing one would repeat its reason).
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
                # a wedged daemon would cost a timeout per command, and one that is not running would
                # give the same reason for each: the first one says it
                wedged = "did not answer within" in str(exc) or "Cannot find MPS control daemon" in str(exc)
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
        devices = self.devices
        for ordinal, gpu in enumerate(devices):
            reply = ask(f"get_default_device_pinned_mem_limit {ordinal}")
            if reply is not None:
                pinned[gpu.uuid] = parse_pinned_limit(reply)
        device_clients: dict[str, list[int]] = {}
        if servers and devices:
            reply = ask("get_device_client_list")
            if reply is not None:
                for ordinal, pids in parse_device_client_list(reply).items():
                    if ordinal < len(devices) and pids:
                        device_clients[devices[ordinal].uuid] = pids
        if wedged:
            reasons.append("remaining commands skipped")
        return DaemonStatus(healthy=not reasons, reason="; ".join(reasons) or "ok", servers=servers,
                            clients=clients, active_thread_percentage=percentage, pinned_limits_bytes=pinned,
                            device_clients=device_clients)

    # ---- start

    def start(self) -> None:
        """Validate, create the dirs, launch ``<binary> -d``, configure it, write the ``.started`` marker.

        Steps (docs/mps.md, "Start" and "Configure"): :func:`validate`; find the binary (MpsError
        "... not found"); refuse when a daemon already answers in the pipe dir, else remove a stale
        pipe dir; the opt-in compute-mode switch; create the pipe and log dirs (MpsError naming
        the dir when that fails), labelled ``container_file_t`` where SELinux is enabled; run
        ``<binary> -d`` with :meth:`env_vars` within the timeout and wait for its ``control`` socket;
        then ``set_default_device_pinned_mem_limit <ordinal> <MiB>M``
        per GPU (the daemon ignored limits set by UUID) and
        ``set_default_active_thread_percentage <100 // replicas>``, whose reply must be a number.
        Everything from the check for a running daemon on is done holding the resource's lock
        (:attr:`lock_file`; waiting at most :attr:`lock_wait` s for another start or stop of it, in
        any process): a daemon another start launched meanwhile is refused with
        :class:`DaemonRunningError`, never replaced or stopped.
        The ordinal is the GPU's position in the daemon's ``CUDA_VISIBLE_DEVICES`` (the resource's
        device order), not NVML's index: NVIDIA's MPS documentation (appendix "Environment
        Variables", ``CUDA_VISIBLE_DEVICES``) says devices visible to the daemon are renumbered from 0
        by the MPS server. On the one-GPU H200 host of docs/mps.md both numbers are 0; a multi-GPU
        host is needed to measure it (docs/gpu-check.md).
        Any failure undoes what was done (quit, reap, dirs removed, compute modes restored) and
        raises MpsError (DaemonRunningError when a daemon already runs).
        """
        with self._lock:
            validate(self.resource, self.gpus)
            pipe_dir, log_dir = self.pipe_dir, self.log_dir
            self._binary_path = None
            binary = self.resolve_binary()
            lock = self._take_lock(create=True)
            if lock is None:  # cannot happen: a start creates the directory
                raise MpsError(f"MPS resource {self.name!r}: no lock file {self.lock_file}")
            try:
                self._start_locked(binary, pipe_dir, log_dir)
            finally:
                self._release_lock(lock)

    def _take_lock(self, create: bool) -> int | None:
        """Hold :attr:`lock_file` (see :func:`accelstats.mps.proc.acquire_lock`); None when ``create`` is
        False and the resource has no directory. MpsError naming the resource when it cannot be had."""
        path = self.lock_file
        try:
            return acquire_lock(path, self.lock_wait, create)
        except LockBusyError as exc:
            raise MpsError(f"MPS resource {self.name!r}: another process is starting or stopping it "
                           f"(lock {exc}); try again") from None
        except OSError as exc:
            if not create:
                raise MpsError(f"MPS resource {self.name!r}: cannot open its lock file {path}: "
                               f"{exc.strerror or exc}") from exc
            raise MpsError(f"MPS resource {self.name!r}: cannot create pipe dir {self.pipe_dir}: "
                           f"{exc.strerror or exc} (making its lock file {path})") from exc

    def _release_lock(self, fd: int) -> None:
        """Release the lock; remove the lock file (and the empty resource dirs) unless a pipe dir stays."""
        pipe_dir = self.pipe_dir
        release_lock(fd, self.lock_file, not (pipe_dir.exists() or pipe_dir.is_symlink()), self.root.path)

    def _start_locked(self, binary: str, pipe_dir: Path, log_dir: Path) -> None:
        """:meth:`start` from the check for a running daemon on, holding the resource's lock."""
        self._clear_stale(pipe_dir)
        try:
            remove_path(self.started_marker)  # of a daemon that died: this start has not completed yet
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise MpsError(f"MPS resource {self.name!r}: cannot remove {self.started_marker}: {exc}") from exc
        try:
            self._set_compute_modes()
            self._make_dirs(pipe_dir, log_dir)
            try:
                label_for_containers(pipe_dir)
            except OSError as exc:
                raise MpsError(f"MPS resource {self.name!r}: SELinux is enabled and the pipe dir {pipe_dir} "
                               f"cannot be labelled container_file_t for containerised clients: {exc}") from exc
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
            self.started_marker.write_text(f"{time.time():.3f}\n", encoding="ascii")
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
        removing its pipe dir would orphan it and its MPS server (nothing could reach or stop them).
        Both refusals are :class:`DaemonRunningError`. Called holding the resource's lock."""
        if not (pipe_dir.exists() or pipe_dir.is_symlink()):
            return
        if self.running():
            try:
                self.assert_healthy()
            except MpsError as exc:
                raise DaemonRunningError(
                    f"MPS resource {self.name!r}: already running: a control daemon (pid {self.pid()}) runs in "
                    f"{pipe_dir} but does not answer ({exc}); stop it first (accelstats mps stop)") from exc
            raise DaemonRunningError(f"MPS resource {self.name!r}: already running: a control daemon "
                                     f"(pid {self.pid()}) already answers in {pipe_dir}; stop it first")
        log.info("MPS resource %r: removing stale pipe dir %s", self.name, pipe_dir)
        try:
            remove_path(pipe_dir)
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

    def _make_dirs(self, pipe_dir: Path, log_dir: Path) -> None:
        for what, path in (("pipe dir", pipe_dir), ("log dir", log_dir)):
            try:
                path.mkdir(parents=True, exist_ok=True)
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

        ``quit -t <ceil(timeout)>`` (docs/mps.md: ``quit`` accepts ``-t <seconds>``, the time its MPS
        servers get to exit), answered within timeout plus that grace (a failure is reported, cleanup
        goes on); wait for the daemon to exit and reap it if it is our child (it was seen lingering
        as a zombie of its starter); if it still runs and its command line is the control binary's,
        SIGTERM then SIGKILL it (its pipe dir is about to go, nothing could reach it after); remove
        the ``.started`` marker, the log dir and the pipe dir (NVIDIA's plugin leaves a stale one) and
        the resource's directories left empty; restore compute modes an opt-in changed (docs/mps.md,
        "Stop"). All of it holding the resource's lock (see :meth:`start`), and the lock file goes
        with the pipe dir; a resource without a directory under the root has nothing to stop (and
        nothing is created). A lock not had within :attr:`lock_wait` s is a problem: nothing is stopped.
        """
        return self.stop_found()[1]

    def stop_found(self) -> tuple[bool, list[str]]:
        """:meth:`stop`, and whether there was anything to stop: ``(found, problems)``, ``found`` True when
        the daemon ran or its pipe dir existed once the lock was held, so a count of stopped daemons is
        true even while other processes start and stop them. Never raises."""
        with self._lock:
            found, problems = self._stop_with_lock()
        for problem in problems:
            log.warning("%s", problem)
        return found, problems

    def _stop_with_lock(self) -> tuple[bool, list[str]]:
        try:
            lock = self._take_lock(create=False)
        except MpsError as exc:
            try:
                self.root.resource_dir(self.name)
            except MpsError:  # a bad resource name: nothing of it can be on disk; _stop_locked says why
                return False, self._stop_locked()
            return False, [str(exc)]
        if lock is None:  # no directory of the resource under the root: nothing runs, nothing to clean
            self._binary_path = None
            return False, []
        try:
            pipe_dir = self.pipe_dir
            found = self.running() or pipe_dir.exists() or pipe_dir.is_symlink()
            return found, self._stop_locked()
        finally:
            self._release_lock(lock)

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
        if pid is not None and not wait_gone(pid, self.timeout):
            self._terminate(pid, problems)
        self._restore_compute_modes(problems)
        self._cleanup_dirs(pipe_dir, log_dir, problems)
        self._binary_path = None
        return problems

    def _terminate(self, pid: int, problems: list[str]) -> None:
        names = {os.path.basename(self.binary), DEFAULT_BINARY}
        if not any(os.path.basename(arg) in names for arg in cmdline(pid)[:2]):
            problems.append(f"MPS resource {self.name!r}: pid {pid} from the pid file is not {self.binary}; "
                            "left alone")
            return
        problems.append(f"MPS resource {self.name!r}: the control daemon (pid {pid}) did not exit after quit; "
                        "terminating it")
        for sig, wait in ((signal.SIGTERM, self.timeout), (signal.SIGKILL, KILL_WAIT_S)):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                reap(pid)
                return
            except OSError as exc:
                problems.append(f"MPS resource {self.name!r}: cannot signal pid {pid}: {exc}")
                return
            if wait_gone(pid, wait):
                return
        problems.append(f"MPS resource {self.name!r}: the control daemon (pid {pid}) survived SIGKILL")

    def _cleanup_dirs(self, pipe_dir: Path, log_dir: Path, problems: list[str]) -> None:
        for what, path in (("started marker", pipe_dir.parent / STARTED_MARKER), ("log dir", log_dir),
                           ("pipe dir", pipe_dir)):
            try:
                remove_path(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                problems.append(f"MPS resource {self.name!r}: cannot remove {what} {path}: {exc}")
        remove_empty_parents(pipe_dir.parent, self.root.path)


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
        return {name: problems for name, (_, problems) in self.stop_all_found().items()}

    def stop_all_found(self) -> dict[str, tuple[bool, list[str]]]:
        """Stop every daemon (reverse order); never raises. Resource name → ``(found, problems)`` of
        :meth:`Daemon.stop_found` (``found``: it ran, or left a pipe dir, when its stop held the lock)."""
        return {daemon.name: daemon.stop_found() for daemon in reversed(self._daemons)}

    def status_all(self) -> dict[str, DaemonStatus]:
        """Resource name → :meth:`Daemon.status`, in configuration order (as :meth:`daemons`); never raises."""
        return {daemon.name: daemon.status() for daemon in self._daemons}
