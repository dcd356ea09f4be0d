"""Talking to one MPS control daemon: where it lives, whether it runs, its commands, health and status.

:class:`DaemonChannel` is all that watching a daemon needs (``accelstats mps status``, the ``mps``
collector, the Nomad plugin's health checks): the resource's directories under the root, the PID the
daemon wrote, the explicit minimal environment, and one command at a time through the control
binary's stdin/stdout, **always with a timeout** (NVIDIA's plugin has none; a wedged daemon would
block its caller forever). :class:`accelstats.mps.daemon.Daemon` adds starting and stopping.
Facts from docs/mps.md (measured on an H200 with driver 580) unless they name NVIDIA's plugin.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from accelstats.mps.proc import alive, cmdline, environ, kill_group, read_text, start_ticks
from accelstats.mps.replies import (
    parse_client_list,
    parse_device_client_list,
    parse_percentage,
    parse_pinned_limit,
    parse_server_list,
)
from accelstats.mps.rules import MpsError, MpsGpu, MpsResource, Root, resource_gpus
from collectors.fsread import ascii_int, read_small

DEFAULT_BINARY = "nvidia-cuda-mps-control"
#: PATH given to the daemon after the control binary's own directory: the usual system
#: directories, nothing from the caller's environment.
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: The pid file the daemon writes in its pipe dir (docs/mps.md, "Start").
PID_FILE = "nvidia-cuda-mps-control.pid"
#: The control socket the daemon creates in its pipe dir once it accepts commands.
CONTROL_FILE = "control"
#: At most this many bytes of another process's environment value are shown in a message.
SHOWN_BYTES = 200


class NoControlBinaryError(MpsError):
    """The control binary cannot be found or run: every command would fail the same way, so a status
    query stops at the first (its reason is said once)."""


@dataclass(frozen=True)
class DaemonStatus:
    """What one daemon answered; see :meth:`DaemonChannel.status`.

    ``healthy``: every command answered in time and the active-thread percentage is a number;
    ``reason``: ``"ok"`` or why not (the failed commands, ``"; "``-joined). ``servers``: MPS server
    PIDs (``get_server_list``; empty before the first client connects); ``clients``: server PID →
    client PIDs in the host PID namespace (``get_client_list <pid>``); ``active_thread_percentage``:
    the default percentage (``get_default_active_thread_percentage``), None when unknown;
    ``pinned_limits_bytes``: GPU UUID → default pinned-memory limit in bytes
    (``get_default_device_pinned_mem_limit <ordinal>``, the GPU's position in the resource's devices:
    see :meth:`accelstats.mps.daemon.Daemon.start`), None when the daemon reports none; a GPU whose
    query failed is absent. ``device_clients``: GPU UUID →
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


@dataclass(frozen=True)
class DaemonProcess:
    """A process checked to be one resource's control daemon (:meth:`DaemonChannel.daemon_process`):
    its ``pid`` and when it started (``start_ticks``, :func:`accelstats.mps.proc.start_ticks`), which
    names it across a PID's reuse."""

    pid: int
    start_ticks: int


class DaemonChannel:
    """The way to one resource's MPS control daemon (docs/mps.md, "Talk", "Health", "Watch").

    ``resource``: the resource, its devices resolved; ``gpus``: every GPU the caller knows (from
    NVML), :attr:`devices` are the resource's among them; ``root``: the MPS root. ``binary``: the
    control binary, a path or a name looked up on the caller's ``PATH``. ``timeout``: seconds allowed
    for each run of the binary (AWS's ECS agent uses 3 s). The constructor never raises.
    """

    def __init__(self, resource: MpsResource, gpus: Sequence[MpsGpu], root: Root, *,
                 binary: str = DEFAULT_BINARY, timeout: float = 3.0) -> None:
        self.resource = resource
        self.gpus = tuple(gpus)
        self.root = root
        self.binary = binary
        self.timeout = float(timeout)
        self._binary_path: str | None = None  # the binary a start found, kept until its stop is done

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, root={self.root!r})"

    @property
    def name(self) -> str:
        """The resource name."""
        return self.resource.name

    @property
    def devices(self) -> tuple[MpsGpu, ...]:
        """The resource's GPUs in the resource's order (unknown UUIDs are left out; a start refuses them)."""
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
    def started(self) -> bool:
        """True when the ``.started`` marker exists (a completed start) and a pipe dir."""
        try:
            return self.started_marker.is_file() and self.pipe_dir.is_dir()
        except MpsError:
            return False

    def pid(self) -> int | None:
        """The daemon's PID from ``nvidia-cuda-mps-control.pid`` in the pipe dir; None when absent, unreadable,
        not a regular file (a link or FIFO a task put in its read-write pipe dir is not followed or opened:
        :func:`collectors.fsread.read_small`) or not a plain decimal above 0."""
        try:
            data = read_small(self.pipe_dir / PID_FILE, 32)
        except MpsError:
            return None
        pid = ascii_int(data.strip()) if data is not None else None
        return pid if pid is not None and pid > 0 else None

    def not_this_daemon(self, pid: int) -> str | None:
        """Why ``pid`` is not this resource's control daemon; None when it is.

        The pid file lies in the pipe dir, which tasks get read-write: a PID read from it is only
        believed when the process is alive, its command line is the control binary's
        (``nvidia-cuda-mps-control`` or :attr:`binary`, its first or second argument, so a script run
        by an interpreter counts) and its environment (``/proc/<pid>/environ``, as :meth:`env_vars`
        gave it at start) names this resource's pipe and log dirs. Another resource's daemon, whose PID
        a task wrote there, fails the last check.
        """
        if not alive(pid):
            return "no such process"
        names = {os.path.basename(self.binary), DEFAULT_BINARY}
        args = cmdline(pid)
        if not any(os.path.basename(arg) in names for arg in args[:2]):
            return f"its command line {' '.join(args[:2])!r} is not {DEFAULT_BINARY}'s"
        env = environ(pid)
        if env is None:
            return "its environment cannot be read"
        for var, want in (("CUDA_MPS_PIPE_DIRECTORY", self.pipe_dir), ("CUDA_MPS_LOG_DIRECTORY", self.log_dir)):
            have = env.get(var.encode())
            if have != os.fsencode(want):
                # the value comes from the other process's environment (a task's): cut and escaped
                shown = repr(os.fsdecode(have[:SHOWN_BYTES])) if have is not None else "unset"
                return f"its {var} is {shown}, not {want}"
        return None

    def daemon_process(self) -> DaemonProcess | None:
        """The process the pid file names when it is this resource's control daemon
        (:meth:`not_this_daemon`), with its start time; None otherwise (never raises)."""
        pid = self.pid()
        if pid is None:
            return None
        ticks = start_ticks(pid)
        try:
            if ticks is None or self.not_this_daemon(pid) is not None:
                return None
        except MpsError:
            return None
        return DaemonProcess(pid, ticks) if start_ticks(pid) == ticks else None

    def running(self) -> bool:
        """True when the pid file names a live process that is this resource's control daemon
        (:meth:`not_this_daemon`: a recycled PID, or another resource's daemon, is not)."""
        return self.daemon_process() is not None

    def visible_devices(self) -> tuple[str, ...] | None:
        """The running daemon's ``CUDA_VISIBLE_DEVICES`` (``/proc/<pid>/environ``), split on commas; None
        when no daemon of this resource runs or its environment cannot be read."""
        process = self.daemon_process()
        env = environ(process.pid) if process is not None else None
        if env is None:
            return None
        value = env.get(b"CUDA_VISIBLE_DEVICES", b"").decode("utf-8", "replace")
        return tuple(v for v in value.split(",") if v)

    # ---- environment and commands

    def resolve_binary(self) -> str:
        """The control binary's path: ``binary`` itself when it has a ``/``, else found on the caller's PATH.

        From a start until its stop has cleaned up, the path found at start is kept (the
        daemon is talked to and stopped with the binary that started it). Raises MpsError
        "... not found" when there is no such executable.
        """
        if self._binary_path is not None:
            return self._binary_path
        if "/" in self.binary:
            if os.path.isfile(self.binary) and os.access(self.binary, os.X_OK):
                return os.path.abspath(self.binary)
            raise NoControlBinaryError(f"MPS resource {self.name!r}: control binary {self.binary} not found (or not "
                                  "executable)")
        found = shutil.which(self.binary)
        if found is None:
            raise NoControlBinaryError(f"MPS resource {self.name!r}: control binary {self.binary} not found on PATH")
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
                raise NoControlBinaryError(f"MPS resource {self.name!r}: control binary {binary} not found: {exc}") \
                    from exc
            except OSError as exc:
                raise NoControlBinaryError(f"MPS resource {self.name!r}: cannot run {binary} for {what}: {exc}") \
                    from exc
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
                # a wedged daemon would cost a timeout per command, and one that is not running (or a
                # control binary that is missing) would give the same reason for each: the first says it
                wedged = isinstance(exc, NoControlBinaryError) or "did not answer within" in str(exc) \
                    or "Cannot find MPS control daemon" in str(exc)
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
