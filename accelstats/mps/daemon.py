"""Starting and stopping one NVIDIA MPS control daemon per shared resource.

NVIDIA's Kubernetes device plugin runs one ``nvidia-cuda-mps-control`` daemon per MPS-shared resource
(its ``mps`` package); :class:`Daemon` does the same for Nomad and plain hosts. Every fact below comes
from docs/mps.md (measured on an H200 with driver 580) unless it names NVIDIA's plugin.

:class:`Daemon` is a :class:`accelstats.mps.control.DaemonChannel` (directories, PID, commands,
health, status) that also starts the daemon, with an explicit minimal environment
(``CUDA_VISIBLE_DEVICES`` is the resource's GPU UUIDs, where NVIDIA's plugin lets every daemon see
every GPU), configures the pinned-memory limit per GPU (by the daemon's device ordinal) and the
active-thread percentage, and stops it: ``quit``, reap a zombie, remove the ``.started`` marker, the
log dir and the (otherwise stale) pipe dir, restore the compute mode. Each step undoes the ones before
it when it fails. A start and a stop of one resource hold its lock (``flock`` on
``<root>/<resource>/lock``) from the check for a running daemon to the end, so parallel starts and
stops, in any processes, run one after the other: of parallel starts one starts the daemon and the
others are refused with :class:`DaemonRunningError`, and no start's cleanup can stop another's daemon.

Compute mode: NVIDIA's plugin sets EXCLUSIVE_PROCESS on every GPU before starting; that is a
host-wide change, so here it is an explicit opt-in (``exclusive_process``), off by default, set and
restored through :mod:`accelstats.mps.computemode` (``nvidia-smi -c``).

Nothing here imports NVML: the caller passes :class:`accelstats.mps.rules.MpsGpu` values it read
from NVML.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from accelstats.mps.computemode import STATE_FILE as COMPUTE_MODE_FILE
from accelstats.mps.computemode import ComputeModeError, ComputeModeSwitch
from accelstats.mps.control import CONTROL_FILE, DEFAULT_BINARY, PID_FILE, DaemonChannel, DaemonProcess
from accelstats.mps.proc import (
    KILL_WAIT_S,
    LockBusyError,
    acquire_lock,
    alive,
    label_for_containers,
    reap,
    release_lock,
    remove_empty_parents,
    remove_path,
    signal_process,
    start_ticks,
)
from accelstats.mps.replies import parse_percentage
from accelstats.mps.rules import (
    MpsError,
    MpsGpu,
    MpsResource,
    Root,
    active_thread_percentage,
    pinned_limit_mib,
    validate,
)

log = logging.getLogger(__name__)
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


class Daemon(DaemonChannel):
    """One MPS control daemon for ``resource`` (docs/mps.md, "Interface": ``Daemon(resource, devices, root)``).

    ``gpus``, ``root``, ``binary``, ``timeout``: as :class:`accelstats.mps.control.DaemonChannel`.
    ``exclusive_process``: the opt-in switch to EXCLUSIVE_PROCESS compute mode before the start
    (False, the default, leaves compute modes alone); ``nvidia_smi``: the tool that reads and sets
    it (:class:`accelstats.mps.computemode.ComputeModeSwitch`). Whatever a start switched is restored
    by :meth:`stop`, in this process or another. The constructor never raises; :meth:`start` validates.
    """

    def __init__(self, resource: MpsResource, gpus: Sequence[MpsGpu], root: Root, *,
                 binary: str = DEFAULT_BINARY, timeout: float = 3.0,
                 exclusive_process: bool = False, nvidia_smi: str = "nvidia-smi") -> None:
        super().__init__(resource, gpus, root, binary=binary, timeout=timeout)
        self.exclusive_process = exclusive_process
        self.nvidia_smi = nvidia_smi
        self._lock = threading.RLock()

    @property
    def lock_file(self) -> Path:
        """``<root>/<resource>/lock``: held (``flock``) by a start or stop of the resource (MpsError for a
        bad resource name)."""
        return self.root.resource_dir(self.name) / LOCK_FILE

    @property
    def lock_wait(self) -> float:
        """Seconds a start or stop waits for another process's start or stop of this resource."""
        return max(LOCK_WAIT_MIN_S, LOCK_WAIT_TIMEOUTS * self.timeout)

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
        Whatever the pid file says (a task can empty it or write any PID or text there), the control
        socket is asked before the dir is removed. Both refusals are :class:`DaemonRunningError`.
        Called holding the resource's lock."""
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
        if (pipe_dir / CONTROL_FILE).exists():
            # the pid file names no daemon of this resource, but one may still serve the pipe dir
            try:
                self.assert_healthy()
            except MpsError:
                pass  # nothing answers there: stale, removed below
            else:
                pid = self.pid()
                said = ("names no PID (missing, empty or not a plain number)" if pid is None else
                        f"names pid {pid}, which is not it ({self.not_this_daemon(pid)})")
                raise DaemonRunningError(
                    f"MPS resource {self.name!r}: already running: a control daemon answers in {pipe_dir}, "
                    f"though its pid file {said}; stop it first (accelstats mps stop)")
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
        as a zombie of its starter); if it still runs, SIGTERM then SIGKILL it (its pipe dir is about to
        go, nothing could reach it after). Only a PID checked to be this resource's daemon
        (:meth:`not_this_daemon`: the pid file is in a dir tasks can write) is waited for or signalled,
        and only the process checked (pidfd and start time); any other PID the pid file names is a
        problem "... is not this resource's control daemon (why); nothing signalled". Then remove
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
        process = self.daemon_process()
        if pid is not None and process is None and alive(pid):
            problems.append(f"MPS resource {self.name!r}: the pid file {pipe_dir / PID_FILE} names pid {pid}, "
                            f"which is not this resource's control daemon ({self.not_this_daemon(pid)}); "
                            "nothing signalled")
        if pipe_dir.is_dir() and (pid is not None or (pipe_dir / CONTROL_FILE).exists()):
            grace = max(1, math.ceil(self.timeout))  # servers get this long to exit before the daemon ends them
            try:
                self.echo_pipe_to_control(f"quit -t {grace}", timeout=self.timeout + grace)
            except MpsError as exc:
                problems.append(f"{exc} (cleaning up anyway)")
        if process is not None and not self._gone(process, self.timeout):
            self._terminate(process, problems)
        self._restore_compute_modes(problems)
        self._cleanup_dirs(pipe_dir, log_dir, problems)
        self._binary_path = None
        return problems

    @staticmethod
    def _gone(process: DaemonProcess, timeout: float) -> bool:
        """Wait up to ``timeout`` s for ``process`` to exit; True when it did (or its PID is another's now)."""
        deadline = time.monotonic() + timeout
        while start_ticks(process.pid) == process.start_ticks and alive(process.pid):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        reap(process.pid)
        return True

    def _terminate(self, process: DaemonProcess, problems: list[str]) -> None:
        """SIGTERM, then SIGKILL, the daemon :meth:`daemon_process` found: only that process (a pidfd and
        its start time: :func:`accelstats.mps.proc.signal_process`), never whatever has its PID now."""
        pid = process.pid
        problems.append(f"MPS resource {self.name!r}: the control daemon (pid {pid}) did not exit after quit; "
                        "terminating it")
        for sig, wait in ((signal.SIGTERM, self.timeout), (signal.SIGKILL, KILL_WAIT_S)):
            try:
                if not signal_process(pid, process.start_ticks, sig):
                    reap(pid)
                    return
            except OSError as exc:
                problems.append(f"MPS resource {self.name!r}: cannot signal pid {pid}: {exc}")
                return
            if self._gone(process, wait):
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
