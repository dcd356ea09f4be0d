"""accelstats.mps (control, daemon, rules, replies, host.MpsDaemons) against the test double
``tests/support/mps_double/nvidia-cuda-mps-control`` and the H200 logs.

The double speaks the real binary's protocol (``-d`` daemonises; otherwise one command on stdin, the
reply on stdout) and logs in the real format; its behaviour switches are files in the pipe dir
(``double.hang``, ``double.fail``, ``double.fail_quit``, ``double.clients``). Every test stops what
it started, and the ``make_daemon`` fixture kills any process still serving a pipe dir under the
test's root, so no daemon outlives a test.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.faultmatrix_util import wait_until
from support.mps_util import (
    DOUBLE,
    DOUBLE_DIR,
    GPU0,
    GPU1,
    GPUS,
    H200_BYTES,
    UUID0,
    UUID1,
    UUID2,
    gone,
    our_zombies,
    proc_state,
    serving,
)
from support.paths import FIXTURES

from accelstats.mps.control import DaemonStatus
from accelstats.mps.daemon import Daemon
from accelstats.mps.host import MpsDaemons
from accelstats.mps.replies import (
    parse_client_list,
    parse_device_client_list,
    parse_log_line,
    parse_percentage,
    parse_pinned_limit,
    parse_server_list,
)
from accelstats.mps.rules import MpsError, MpsGpu, MpsResource, Root, validate

REPO_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 2.0



# --------------------------------------------------------------------------------------------
# helpers










def control_commands(daemon: Daemon) -> list[str]:
    """The ``Cmd:`` lines of the double's control.log, read with the module's own parser."""
    lines = (daemon.log_dir / "control.log").read_text().splitlines()
    parsed = [parse_log_line(line) for line in lines]
    assert all(p is not None for p in parsed), lines
    return [p.text[len("Cmd:"):] for p in parsed if p is not None and p.text.startswith("Cmd:")]


def double_state(daemon: Daemon) -> dict[str, Any]:
    state: dict[str, Any] = json.loads((daemon.pipe_dir / "double.state.json").read_text())
    return state


def without_locale_coercion(env: dict[str, str]) -> dict[str, str]:
    """The double is Python: with no locale set, the interpreter itself adds LC_CTYPE=C.UTF-8 (PEP 538)."""
    env = dict(env)
    if env.get("LC_CTYPE") == "C.UTF-8":
        del env["LC_CTYPE"]
    return env


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "mps"


@pytest.fixture(autouse=True)
def no_leftovers(root: Path) -> Iterator[None]:
    """Kill whatever still serves a pipe dir under ``root`` after the test (a failed test's daemons)."""
    yield
    for pid in serving(root):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture
def make_daemon(root: Path) -> Iterator[Callable[..., Daemon]]:
    """Factory for Daemons under ``root`` using the double; stops them at teardown."""
    made: list[Daemon] = []

    def make(resource: MpsResource | None = None, **kwargs: Any) -> Daemon:
        kwargs.setdefault("binary", str(DOUBLE))
        kwargs.setdefault("timeout", TIMEOUT)
        daemon = Daemon(resource or MpsResource("nvidia.com/gpu", 4, (UUID0, UUID1)), GPUS, Root(root), **kwargs)
        made.append(daemon)
        return daemon

    yield make
    for daemon in made:
        for name in ("double.hang", "double.fail", "double.fail_quit"):
            with contextlib.suppress(OSError, MpsError):
                (daemon.pipe_dir / name).unlink()
        daemon.stop()


# --------------------------------------------------------------------------------------------
# start, configure, health


def test_start_uses_minimal_env_and_configures_by_ordinal(make_daemon: Callable[..., Daemon], root: Path) -> None:
    daemon = make_daemon(MpsResource("nvidia.com/gpu", 4, (UUID1, UUID0)))
    daemon.start()
    expected = {
        "PATH": f"{DOUBLE_DIR}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "CUDA_MPS_PIPE_DIRECTORY": str(root / "nvidia.com" / "gpu" / "pipe"),
        "CUDA_MPS_LOG_DIRECTORY": str(root / "nvidia.com" / "gpu" / "log"),
        "CUDA_VISIBLE_DEVICES": f"{UUID1},{UUID0}",
    }
    assert daemon.env_vars() == expected
    state = double_state(daemon)
    assert without_locale_coercion(state["env"]) == expected  # exactly this, nothing inherited
    assert without_locale_coercion(state["last_command_env"]) == expected

    mib = H200_BYTES // 4 // 1024 // 1024
    assert mib == 35942
    # ordinals follow CUDA_VISIBLE_DEVICES (UUID1 is the daemon's device 0), not NVML's indices
    assert control_commands(daemon) == [
        f"set_default_device_pinned_mem_limit 0 {mib}M",
        f"set_default_device_pinned_mem_limit 1 {mib}M",
        "set_default_active_thread_percentage 25",
    ]
    names = {p.name for p in daemon.pipe_dir.iterdir()}
    assert {"control", "control_privileged", "control_lock", "log", "nvidia-cuda-mps-control.pid"} <= names
    # the marker beside the pipe dir, where k8s-device-plugin keeps it (internal/mps/root.go:51-53)
    assert ".started" not in names and (daemon.pipe_dir.parent / ".started").is_file()
    assert {"control.log", "server.log"} <= {p.name for p in daemon.log_dir.iterdir()}
    # server and clients share the host's /dev/shm: no directory of the root stands in for it
    assert daemon.shm_dir == Path("/dev/shm") and not (root / "shm").exists()
    assert daemon.started
    pid = daemon.pid()
    assert pid is not None and proc_state(pid) not in (None, "Z")
    assert daemon.devices == (GPU1, GPU0)


def test_the_pid_file_counts_only_as_a_regular_file(make_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """The pipe dir is mounted read-write into tasks: a pid file that is a link (to another resource's
    pid file), a FIFO or not a plain number names no daemon; the link is not followed, the FIFO never
    opened (a read of it would block ``mps stop`` and the plugin's health checks)."""
    daemon = make_daemon()
    daemon.pipe_dir.mkdir(parents=True, exist_ok=True)
    pid_file = daemon.pipe_dir / "nvidia-cuda-mps-control.pid"
    other = tmp_path / "other-resource.pid"
    other.write_text(f"{os.getpid()}\n")
    pid_file.write_text(f"{os.getpid()}\n")
    assert daemon.pid() == os.getpid()
    pid_file.unlink()
    pid_file.symlink_to(other)
    assert daemon.pid() is None
    for text in ("12x\n", "0\n", "\u0661\u0662\n", ""):
        pid_file.unlink()
        pid_file.write_text(text)
        assert daemon.pid() is None, text
    pid_file.unlink()
    os.mkfifo(pid_file)
    assert daemon.pid() is None


def test_stop_never_signals_another_resources_daemon_named_in_its_pid_file(
        make_daemon: Callable[..., Daemon]) -> None:
    """security.md, MPS pid file: a task of resource ``a`` (its pipe dir is mounted read-write) writes
    resource ``b``'s daemon PID into ``a``'s pid file. ``a`` does not count it as running, and a stop
    of ``a`` says the PID is not its daemon and signals nothing: ``b`` lives on and still answers."""
    a = make_daemon(MpsResource("example.com/a", 2, (UUID0,)))
    b = make_daemon(MpsResource("example.com/b", 2, (UUID1,)))
    a.start()
    b.start()
    b_pid = b.pid()
    assert b_pid is not None and b.running()
    (a.pipe_dir / "nvidia-cuda-mps-control.pid").write_text(f"{b_pid}\n")  # what the task writes
    assert a.pid() == b_pid and not a.running() and a.visible_devices() is None
    assert f"its CUDA_MPS_PIPE_DIRECTORY is {str(b.pipe_dir)!r}, not {a.pipe_dir}" == a.not_this_daemon(b_pid)
    problems = a.stop()
    assert any(f"names pid {b_pid}, which is not this resource's control daemon" in p and "nothing signalled" in p
               for p in problems), problems
    assert not any("terminating" in p for p in problems), problems
    assert not gone(b_pid, wait=0.0) and b.running()
    b.assert_healthy()
    assert not a.pipe_dir.exists()


def dead_pid() -> int:
    """The PID of a process that has exited and been reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


# what a task of resource ``a`` (its pipe dir mounted read-write) writes into a's pid file
PID_FILE_TAMPERING = {
    "b's daemon": lambda b_pid: f"{b_pid}\n",
    "empty": lambda b_pid: "",
    "a dead PID": lambda b_pid: f"{dead_pid()}\n",
    "not decimal": lambda b_pid: "12x\n",
}


@pytest.mark.parametrize("tampering", PID_FILE_TAMPERING, ids=list(PID_FILE_TAMPERING))
def test_a_start_never_removes_a_pipe_dir_a_daemon_answers_in_whatever_its_pid_file_says(
        make_daemon: Callable[..., Daemon], tampering: str) -> None:
    """security.md, MPS pid file: whatever a task writes in ``a``'s pid file (another resource's daemon
    PID, nothing, a dead PID, text), ``a``'s daemon, which still answers on its control socket, is
    neither replaced nor orphaned by a start of ``a``: the start is refused as already running and
    the pipe dir is left alone, the daemon still answering there."""
    a = make_daemon(MpsResource("example.com/a", 2, (UUID0,)))
    b = make_daemon(MpsResource("example.com/b", 2, (UUID1,)))
    a.start()
    b.start()
    b_pid, a_pid = b.pid(), a.pid()
    assert b_pid is not None and a_pid is not None
    (a.pipe_dir / "nvidia-cuda-mps-control.pid").write_text(PID_FILE_TAMPERING[tampering](b_pid))
    assert not a.running()
    said = rf"pid {b_pid}, which is not it" if tampering == "b's daemon" else "names no PID" \
        if tampering != "a dead PID" else r"names pid \d+, which is not it \(no such process\)"
    with pytest.raises(MpsError, match=rf"already running: a control daemon answers in .*{said}"):
        a.start()
    assert (a.pipe_dir / "control").exists() and not gone(a_pid, wait=0.0) and b.running()
    a.assert_healthy()


def test_a_task_set_environment_value_is_shown_escaped() -> None:
    """The environment ``not_this_daemon`` quotes is another process's (a task's): shown with repr,
    cut to 200 bytes, so it cannot forge lines in a log or a terminal."""
    daemon = Daemon(MpsResource("example.com/a", 2, (UUID0,)), GPUS, Root(Path("/nonexistent-mps")),
                    binary=str(DOUBLE))
    forged = "/x\n[2026-01-01 00:00:00.000 Control 1] forged\x1b[31m" + "y" * 500
    env = {"PATH": os.environ["PATH"], "CUDA_MPS_PIPE_DIRECTORY": forged}
    # argv[0] set at the exec (a `bash -c "exec -a …"` names it in bash's own arguments before the exec:
    # read then, it is bash's). Popen returns when the exec closes its close-on-exec pipe, which the kernel
    # does before it publishes the new image's arguments (load_elf_binary: begin_new_exec, then
    # create_elf_tables): /proc/<pid>/cmdline reads empty for that moment (a CI run saw it), so wait for it.
    task = subprocess.Popen(["nvidia-cuda-mps-control", "30"], executable=shutil.which("sleep"), env=env)
    try:
        wait_until(lambda: Path(f"/proc/{task.pid}/cmdline").read_bytes() != b"", timeout=5.0, step=0.01)
        assert Path(f"/proc/{task.pid}/cmdline").read_bytes().startswith(b"nvidia-cuda-mps-control\0")
        why = daemon.not_this_daemon(task.pid)
        assert why is not None and "\n" not in why and "\x1b" not in why, why
        assert why.startswith("its CUDA_MPS_PIPE_DIRECTORY is '/x\\n[2026") and "\\x1b[31m" in why, why
        assert "y" * 100 in why and "y" * 500 not in why, why
    finally:
        task.kill()
        task.wait()


def test_a_recycled_pid_is_not_signalled(make_daemon: Callable[..., Daemon]) -> None:
    """The daemon a stop found is signalled through a pidfd after its start time is checked: a process
    that has its PID now (another start time) is left alone."""
    from accelstats.mps.proc import signal_process, start_ticks
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        ticks = start_ticks(sleeper.pid)
        assert ticks is not None
        assert not signal_process(sleeper.pid, ticks - 1, signal.SIGKILL)
        assert sleeper.poll() is None
        assert signal_process(sleeper.pid, ticks, signal.SIGKILL)
        assert sleeper.wait(timeout=5) == -signal.SIGKILL
    finally:
        sleeper.kill()
        sleeper.wait()


def test_healthy_daemon(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon()
    daemon.start()
    daemon.assert_healthy()
    assert daemon.echo_pipe_to_control("get_default_active_thread_percentage") == "25.0"
    assert daemon.echo_pipe_to_control("get_default_device_pinned_mem_limit 0") == "35942M"
    # the daemon ignores a limit set by UUID (measured on the H200); the double does too
    assert daemon.echo_pipe_to_control(f"set_default_device_pinned_mem_limit {UUID0} 1G") == ""
    assert daemon.echo_pipe_to_control("get_default_device_pinned_mem_limit 0") == "35942M"


def test_health_needs_a_number(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon()
    daemon.start()
    (daemon.pipe_dir / "double.garbage").write_text("Error: busy\n")  # printed with exit status 0
    with pytest.raises(MpsError, match=r"'nvidia.com/gpu'.*answered 'Error: busy', not a percentage"):
        daemon.assert_healthy()
    status = daemon.status()
    assert not status.healthy and "not a percentage" in status.reason
    (daemon.pipe_dir / "double.garbage").unlink()
    daemon.assert_healthy()


def test_status_lists_servers_and_clients(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon()
    daemon.start()
    before = daemon.status()
    assert before == DaemonStatus(healthy=True, reason="ok", servers=[], clients={}, active_thread_percentage=25.0,
                                  pinned_limits_bytes={UUID0: 35942 * 2**20, UUID1: 35942 * 2**20})
    (daemon.pipe_dir / "double.clients").write_text(json.dumps({"490": [473], "531": [514, 515], "600": []}))
    status = daemon.status()
    assert status.healthy, status.reason
    assert status.servers == [490, 531, 600]
    assert status.clients == {490: [473], 531: [514, 515], 600: []}
    assert daemon.echo_pipe_to_control("get_device_client_list").splitlines()[0] == "[0] 00:00.0, NVIDIA H200"


@pytest.mark.slow  # more than ~5 s: real daemons, deadlines or a soak
def test_hang_honours_the_timeout(make_daemon: Callable[..., Daemon], root: Path) -> None:
    daemon = make_daemon(timeout=1.0)
    daemon.start()
    pid = daemon.pid()
    assert pid is not None
    (daemon.pipe_dir / "double.hang").touch()

    start = time.monotonic()
    with pytest.raises(MpsError, match=r"'nvidia.com/gpu'.*get_server_list.*did not answer within 1 s"):
        daemon.echo_pipe_to_control("get_server_list")
    assert time.monotonic() - start < 1.0 + 1.0
    assert serving(root) == [pid]  # the hung command was killed: only the daemon serves the pipe dir

    start = time.monotonic()
    with pytest.raises(MpsError, match="did not answer within"):
        daemon.assert_healthy()
    assert time.monotonic() - start < 1.0 + 1.0

    start = time.monotonic()
    status = daemon.status()
    assert time.monotonic() - start < 1.0 + 1.0  # the first timeout skips the other commands
    assert not status.healthy
    assert "did not answer within 1 s" in status.reason and "skipped" in status.reason

    start = time.monotonic()
    with pytest.raises(MpsError, match=r"did not answer within 0\.3 s"):
        daemon.echo_pipe_to_control("get_server_list", timeout=0.3)
    assert time.monotonic() - start < 0.3 + 1.0

    problems = daemon.stop()  # quit hangs too: the daemon is terminated, everything is removed
    assert any("'quit -t" in p and "did not answer" in p for p in problems)
    assert any("terminating it" in p for p in problems)
    assert gone(pid)
    assert not daemon.pipe_dir.exists() and not daemon.log_dir.exists()
    assert serving(root) == []
    assert our_zombies() == []


def test_failing_command(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon()
    daemon.start()
    (daemon.pipe_dir / "double.fail").touch()
    with pytest.raises(MpsError,
                       match=r"'nvidia.com/gpu'.*'get_server_list' failed with exit status 1.*forced failure"):
        daemon.echo_pipe_to_control("get_server_list")
    with pytest.raises(MpsError, match="exit status 1"):
        daemon.assert_healthy()
    status = daemon.status()
    assert not status.healthy
    assert "get_default_active_thread_percentage" in status.reason and "get_server_list" in status.reason
    assert status.active_thread_percentage is None and status.servers == [] and status.pinned_limits_bytes == {}


def test_unknown_command_and_bad_input(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon()
    daemon.start()
    with pytest.raises(MpsError, match="Unknown command"):
        daemon.echo_pipe_to_control("frobnicate")
    with pytest.raises(MpsError, match="one non-empty line"):
        daemon.echo_pipe_to_control("get_server_list\nquit")
    with pytest.raises(MpsError, match="one non-empty line"):
        daemon.echo_pipe_to_control("   ")
    assert daemon.pid() is not None  # nothing reached the daemon: it still runs


def test_status_without_daemon_never_raises(make_daemon: Callable[..., Daemon]) -> None:
    status = make_daemon().status()
    assert not status.healthy
    assert "Cannot find MPS control daemon process" in status.reason
    bad = make_daemon(MpsResource("../escape", 2, (UUID0,))).status()
    assert not bad.healthy and "'..'" in bad.reason


# --------------------------------------------------------------------------------------------
# stop


def test_stop_removes_everything(make_daemon: Callable[..., Daemon], root: Path) -> None:
    daemon = make_daemon()
    daemon.start()
    pid = daemon.pid()
    assert pid is not None
    assert daemon.stop() == []
    assert gone(pid)
    assert our_zombies() == []
    assert serving(root) == []
    assert not (root / "nvidia.com").exists()  # marker, log dir, stale pipe dir, empty resource dirs
    assert list(root.iterdir()) == []
    assert daemon.stop() == []  # nothing left to stop: quiet
    assert not daemon.started


def test_quit_is_sent_and_logged(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon()
    daemon.start()
    log_text: list[str] = []
    sent: list[str] = []
    real = daemon.echo_pipe_to_control

    def spy(command: str, timeout: float | None = None) -> str:
        reply = real(command, timeout)
        if command.startswith("quit"):
            sent.append(command)
            log_text.extend((daemon.log_dir / "control.log").read_text().splitlines())
        return reply

    daemon.echo_pipe_to_control = spy  # type: ignore[method-assign]
    assert daemon.stop() == []
    texts = [p.text for p in map(parse_log_line, log_text) if p is not None]
    assert sent == ["quit -t 2"]  # servers get ceil(timeout) seconds to exit (TIMEOUT = 2.0)
    assert any(t.startswith("Cmd:quit") for t in texts) and texts[-1] == "Exit with status 0"


def test_failed_quit_still_cleans_up(make_daemon: Callable[..., Daemon], root: Path) -> None:
    daemon = make_daemon(timeout=1.0)
    daemon.start()
    pid = daemon.pid()
    assert pid is not None
    (daemon.pipe_dir / "double.fail_quit").touch()
    problems = daemon.stop()
    assert any("'quit -t 1' failed with exit status 1" in p and "cleaning up anyway" in p for p in problems)
    assert any("terminating it" in p for p in problems)
    assert gone(pid)
    assert our_zombies() == []
    assert serving(root) == []
    assert not daemon.pipe_dir.exists() and not daemon.log_dir.exists()


def test_stop_reaps_a_zombie_daemon(tmp_path: Path) -> None:
    """A starter that is a child subreaper (as a container's PID 1 is) inherits the daemon: stop() reaps it."""
    script = textwrap.dedent(f"""
        import ctypes, json, os, sys
        from accelstats.mps.daemon import Daemon
        from accelstats.mps.rules import MpsGpu, MpsResource, Root
        PR_SET_CHILD_SUBREAPER = 36
        assert ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
        gpu = MpsGpu({UUID0!r}, 0, {H200_BYTES}, "9.0", False)
        daemon = Daemon(MpsResource("gpu", 2, ({UUID0!r},)), [gpu], Root({str(tmp_path / "mps")!r}),
                        binary={str(DOUBLE)!r}, timeout={TIMEOUT})
        daemon.start()
        pid = daemon.pid()
        parent = int(open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()[1])
        problems = daemon.stop()
        try:
            leftover = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            leftover = None
        print(json.dumps({{"parent_is_me": parent == os.getpid(), "problems": problems,
                          "exists": os.path.exists(f"/proc/{{pid}}"), "leftover": leftover}}))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=30,
                            cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"parent_is_me": True, "problems": [], "exists": False, "leftover": None}


# --------------------------------------------------------------------------------------------
# start failures: nothing half-created


def test_binary_missing(make_daemon: Callable[..., Daemon], root: Path, tmp_path: Path,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(MpsError, match=r"'nvidia.com/gpu'.*not found"):
        make_daemon(binary=str(tmp_path / "nowhere" / "nvidia-cuda-mps-control")).start()
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(MpsError, match="nvidia-cuda-mps-control not found on PATH"):
        make_daemon(binary="nvidia-cuda-mps-control").start()
    assert not root.exists()


def test_binary_found_on_path(make_daemon: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{DOUBLE_DIR}:{os.environ.get('PATH', '')}")
    daemon = make_daemon(binary="nvidia-cuda-mps-control")
    daemon.start()
    daemon.assert_healthy()
    assert daemon.env_vars()["PATH"].split(":")[0] == str(DOUBLE_DIR)
    monkeypatch.setenv("PATH", "/nonexistent")  # the binary found at start is kept until stopped
    daemon.assert_healthy()
    assert daemon.stop() == []


def test_pipe_dir_not_creatable(make_daemon: Callable[..., Daemon], root: Path) -> None:
    root.write_text("a file, not a directory\n")  # root may write anywhere: make creation impossible
    with pytest.raises(MpsError, match=r"'nvidia.com/gpu': cannot create pipe dir .*/nvidia.com/gpu/pipe"):
        make_daemon().start()
    assert root.read_text() == "a file, not a directory\n"


def test_pipe_dir_not_writable(root: Path, tmp_path: Path) -> None:
    """A root on a read-only mount (a real one: ``unshare --mount`` and a read-only bind mount, which stops
    root too, where chmod would not): a clear error naming the directory, nothing left running."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        reason = "needs root and unshare (util-linux) for a read-only bind mount"
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail(f"cannot run under CI=true: {reason}")
        pytest.skip(reason)
    readonly = tmp_path / "ro"
    readonly.mkdir()
    code = (f"from accelstats.mps.daemon import Daemon; from accelstats.mps.rules import MpsResource, Root; "
            f"from support.mps_util import GPUS, UUID0; "
            f"Daemon(MpsResource('nvidia.com/gpu', 2, (UUID0,)), GPUS, Root({str(readonly)!r}), "
            f"binary={str(DOUBLE)!r}).start()")
    script = f"mount --bind {readonly} {readonly} && mount -o remount,bind,ro {readonly} && exec \"$@\""
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                           sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": f"{REPO_ROOT}:{REPO_ROOT / 'tests'}"})
    assert proc.returncode != 0
    assert "MpsError: MPS resource 'nvidia.com/gpu': cannot create pipe dir" in proc.stderr, proc.stderr
    assert "Read-only file system" in proc.stderr
    assert not (readonly / "nvidia.com").exists() and serving(readonly) == []


def test_launch_failure(make_daemon: Callable[..., Daemon], root: Path, tmp_path: Path) -> None:
    broken = tmp_path / "bin" / "nvidia-cuda-mps-control"
    broken.parent.mkdir()
    broken.write_text("#!/bin/sh\necho 'cannot open /dev/nvidiactl' >&2\nexit 1\n")
    broken.chmod(0o755)
    with pytest.raises(MpsError, match=r"-d failed with exit status 1: cannot open /dev/nvidiactl"):
        make_daemon(binary=str(broken)).start()
    assert not (root / "nvidia.com").exists()


def test_launch_hang(make_daemon: Callable[..., Daemon], root: Path, tmp_path: Path) -> None:
    wedged = tmp_path / "bin" / "nvidia-cuda-mps-control"
    wedged.parent.mkdir()
    wedged.write_text("#!/bin/sh\nexec sleep 60\n")
    wedged.chmod(0o755)
    start = time.monotonic()
    with pytest.raises(MpsError, match=r"starting the control daemon \(-d\) did not answer within 0\.5 s"):
        make_daemon(binary=str(wedged), timeout=0.5).start()
    assert time.monotonic() - start < 0.5 + 1.0
    assert serving(root) == []  # the launcher was killed
    assert not (root / "nvidia.com").exists()


def test_configure_failure_stops_the_daemon(make_daemon: Callable[..., Daemon], root: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    daemon = make_daemon()
    real = daemon.echo_pipe_to_control
    pids: list[int | None] = []

    def failing(command: str, timeout: float | None = None) -> str:
        if command.startswith("set_default_active_thread_percentage"):
            pids.append(daemon.pid())
            raise MpsError("injected failure")
        return real(command, timeout)

    monkeypatch.setattr(daemon, "echo_pipe_to_control", failing)
    with pytest.raises(MpsError, match="injected failure"):
        daemon.start()
    pid = pids[0]
    assert pid is not None and gone(pid)
    assert serving(root) == []
    assert not (root / "nvidia.com").exists()


def test_already_running_and_stale_pipe_dir(make_daemon: Callable[..., Daemon], root: Path) -> None:
    first = make_daemon()
    first.start()
    with pytest.raises(MpsError, match="already answers"):
        make_daemon().start()
    first.assert_healthy()  # untouched
    assert first.stop() == []

    stale = first.pipe_dir
    stale.mkdir(parents=True)
    (stale / "nvidia-cuda-mps-control.pid").write_text("999999999\n")
    (stale / "control").touch()
    (stale / "junk").touch()
    second = make_daemon()
    second.start()
    assert not (stale / "junk").exists()
    second.assert_healthy()


def test_a_wedged_daemon_is_never_replaced_by_a_start(make_daemon: Callable[..., Daemon], root: Path) -> None:
    """Removing the pipe dir of a daemon that runs but does not answer would orphan it and its server
    (the real binary is not known to quit when its pipe dir goes, as the double does): start refuses."""
    first = make_daemon(timeout=0.5)
    first.start()
    pid = first.pid()
    (first.pipe_dir / "double.hang").touch()
    with pytest.raises(MpsError, match=r"runs in .* but does not answer.*stop it first"):
        make_daemon(timeout=0.5).start()
    assert first.pid() == pid and first.running() and (first.pipe_dir / "control").exists()  # untouched
    (first.pipe_dir / "double.hang").unlink()
    assert first.stop() == []


@pytest.fixture
def smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., dict[str, Any]]:
    """The nvidia-smi double's state file: ``smi(modes=…, refuse=…)`` writes it, ``smi()`` reads it."""
    state = tmp_path / "smi.json"
    monkeypatch.setenv("NVIDIA_SMI_DOUBLE_STATE", str(state))

    def access(**values: Any) -> dict[str, Any]:
        if values:
            state.write_text(json.dumps(values))
        return dict(json.loads(state.read_text()))
    return access


SMI = str(DOUBLE_DIR / "nvidia-smi")


def test_compute_mode_opt_in_set_and_restored(make_daemon: Callable[..., Daemon], root: Path,
                                              smi: Callable[..., dict[str, Any]]) -> None:
    smi(modes={UUID0: "Default", UUID1: "Prohibited"})
    daemon = make_daemon(exclusive_process=True, nvidia_smi=SMI)
    daemon.start()
    assert smi()["modes"] == {UUID0: "Exclusive_Process", UUID1: "Exclusive_Process"}
    record = root / "nvidia.com" / "gpu" / "compute-modes.json"
    assert json.loads(record.read_text()) == {UUID0: "DEFAULT", UUID1: "PROHIBITED"}
    # stopped by another process (accelstats mps stop): a fresh Daemon finds the record
    assert make_daemon(exclusive_process=True, nvidia_smi=SMI).stop() == []
    assert smi()["modes"] == {UUID0: "Default", UUID1: "Prohibited"}
    assert not record.exists() and not (root / "nvidia.com").exists()


def test_compute_mode_already_exclusive_is_not_touched(make_daemon: Callable[..., Daemon],
                                                       smi: Callable[..., dict[str, Any]]) -> None:
    smi(modes={UUID0: "Exclusive_Process", UUID1: "Exclusive_Process"})
    daemon = make_daemon(exclusive_process=True, nvidia_smi=SMI)
    daemon.start()
    assert daemon.stop() == []
    assert [c for c in smi()["calls"] if "-c" in c] == []  # read twice each, never set


def test_compute_mode_refused_undoes_everything(make_daemon: Callable[..., Daemon], root: Path,
                                                smi: Callable[..., dict[str, Any]]) -> None:
    smi(modes={UUID0: "Default", UUID1: "Default"}, refuse=[UUID1])
    with pytest.raises(MpsError, match=rf"EXCLUSIVE_PROCESS on GPU {UUID1}.*Insufficient Permissions"):
        make_daemon(exclusive_process=True, nvidia_smi=SMI).start()
    assert smi()["modes"] == {UUID0: "Default", UUID1: "Default"}  # GPU 0 put back
    assert serving(root) == [] and not (root / "nvidia.com").exists()


def test_compute_mode_without_nvidia_smi(make_daemon: Callable[..., Daemon], root: Path) -> None:
    with pytest.raises(MpsError, match=r"not found .*exclusive_process"):
        make_daemon(exclusive_process=True, nvidia_smi=str(root / "no-nvidia-smi")).start()
    assert serving(root) == []


def test_compute_mode_left_alone_by_default(make_daemon: Callable[..., Daemon],
                                            smi: Callable[..., dict[str, Any]]) -> None:
    smi(modes={UUID0: "Default", UUID1: "Default"})
    daemon = make_daemon(nvidia_smi=SMI)
    assert daemon.exclusive_process is False
    daemon.start()
    assert daemon.stop() == []
    assert smi().get("calls", []) == []  # nvidia-smi never ran


# --------------------------------------------------------------------------------------------
# validation and layout


@pytest.mark.parametrize(("replicas", "capability", "message"), [
    (1, "9.0", "replicas must be at least 2, got 1"),
    (0, "9.0", "replicas must be at least 2"),
    (49, "9.0", "replicas 49 exceeds the maximum of 48 per GPU"),
    (17, "6.0", "replicas 17 exceeds the maximum of 16 per GPU"),
    (17, "6.1", r"replicas 17 exceeds the maximum of 16 per GPU for GPU 0 .*compute capability 6\.1"),
])
def test_replicas_out_of_range(replicas: int, capability: str, message: str) -> None:
    gpu = MpsGpu(UUID0, 0, H200_BYTES, capability, False)
    with pytest.raises(MpsError, match=rf"MPS resource 'nvidia.com/gpu': {message}"):
        validate(MpsResource("nvidia.com/gpu", replicas, (UUID0,)), [gpu])


@pytest.mark.parametrize(("replicas", "capability"), [(2, "9.0"), (48, "9.0"), (48, "7.0"), (16, "6.0")])
def test_replicas_in_range(replicas: int, capability: str) -> None:
    validate(MpsResource("r", replicas, (UUID0,)), [MpsGpu(UUID0, 0, H200_BYTES, capability, False)])


def test_mig_unknown_and_empty_devices() -> None:
    mig = MpsGpu(UUID2, 2, H200_BYTES, "9.0", True)
    with pytest.raises(MpsError, match=rf"'r': GPU 2 \({UUID2}\) has MIG enabled"):
        validate(MpsResource("r", 2, (UUID0, UUID2)), [GPU0, mig])
    with pytest.raises(MpsError, match=r"'r': unknown device\(s\) GPU-nope"):
        validate(MpsResource("r", 2, (UUID0, "GPU-nope")), GPUS)
    with pytest.raises(MpsError, match="'r': no devices"):
        validate(MpsResource("r", 2, ()), GPUS)
    with pytest.raises(MpsError, match="listed twice"):
        validate(MpsResource("r", 2, (UUID0, UUID0)), GPUS)
    with pytest.raises(MpsError, match="compute capability"):
        validate(MpsResource("r", 2, (UUID0,)), [MpsGpu(UUID0, 0, H200_BYTES, "Hopper", False)])
    with pytest.raises(MpsError, match="too little"):
        validate(MpsResource("r", 2, (UUID0,)), [MpsGpu(UUID0, 0, 2**20, "9.0", False)])


def test_start_validates_before_touching_anything(make_daemon: Callable[..., Daemon], root: Path) -> None:
    with pytest.raises(MpsError, match="MIG enabled"):
        Daemon(MpsResource("r", 2, (UUID0,)), [MpsGpu(UUID0, 0, H200_BYTES, "9.0", True)], Root(root),
               binary=str(DOUBLE)).start()
    with pytest.raises(MpsError, match="unknown device"):
        make_daemon(MpsResource("r", 2, ("GPU-nope",))).start()
    assert not root.exists()


def test_root_layout(tmp_path: Path) -> None:
    root = Root(tmp_path)
    assert root.pipe_dir("nvidia.com/gpu") == tmp_path / "nvidia.com" / "gpu" / "pipe"
    assert root.log_dir("nvidia.com/gpu") == tmp_path / "nvidia.com" / "gpu" / "log"
    assert root.started_marker("nvidia.com/gpu") == tmp_path / "nvidia.com" / "gpu" / ".started"
    assert root.shm_dir() == Path("/dev/shm")
    for bad in ("../etc", "a/../../b", "/abs", "", "a//b", "a/./b", "shm", "shm/x", "a\0b"):
        with pytest.raises(MpsError, match="MPS resource name"):
            root.pipe_dir(bad)
    assert Root("relative").path.is_absolute()


# --------------------------------------------------------------------------------------------
# all daemons of a configuration (MpsDaemons)


def test_daemons_start_all_status_all_stop_all(root: Path) -> None:
    resources = [MpsResource("nvidia.com/gpu", 2, (UUID0,)), MpsResource("nvidia.com/gpu.shared", 4, (UUID1, UUID2))]
    daemons = MpsDaemons(resources, GPUS, Root(root), binary=str(DOUBLE), timeout=TIMEOUT)
    try:
        assert [d.name for d in daemons.daemons()] == ["nvidia.com/gpu", "nvidia.com/gpu.shared"]
        daemons.start_all()
        statuses = daemons.status_all()
        assert statuses["nvidia.com/gpu"].active_thread_percentage == 50.0
        assert statuses["nvidia.com/gpu"].pinned_limits_bytes == {UUID0: H200_BYTES // 2 // 2**20 * 2**20}
        assert statuses["nvidia.com/gpu.shared"].active_thread_percentage == 25.0
        assert set(statuses["nvidia.com/gpu.shared"].pinned_limits_bytes) == {UUID1, UUID2}
        assert all(s.healthy for s in statuses.values())
        pids = [d.pid() for d in daemons.daemons()]
    finally:
        problems = daemons.stop_all()
    assert problems == {"nvidia.com/gpu": [], "nvidia.com/gpu.shared": []}
    assert all(pid is not None and gone(pid) for pid in pids)
    assert serving(root) == []
    assert sorted(p.name for p in root.iterdir()) == []


def test_daemons_all_or_nothing(root: Path) -> None:
    resources = [MpsResource("first", 2, (UUID0,)), MpsResource("second", 2, (UUID1,))]
    daemons = MpsDaemons(resources, GPUS, Root(root), binary=str(DOUBLE), timeout=TIMEOUT)
    root.mkdir()
    (root / "second").write_text("in the way\n")  # the second start fails after the first one ran
    with pytest.raises(MpsError, match=r"starting resource 'second' failed, 1 started daemon\(s\) stopped again"):
        daemons.start_all()
    assert serving(root) == []
    assert sorted(p.name for p in root.iterdir()) == ["second"]

    bad = MpsDaemons([MpsResource("first", 2, (UUID0,)), MpsResource("third", 49, (UUID2,))], GPUS, Root(root),
                  binary=str(DOUBLE), timeout=TIMEOUT)
    with pytest.raises(MpsError, match="replicas 49 exceeds"):
        bad.start_all()  # validated before anything starts
    assert not (root / "first").exists()

    shared = MpsDaemons([MpsResource("a", 2, (UUID0,)), MpsResource("b", 2, (UUID0,))], GPUS, Root(root))
    with pytest.raises(MpsError, match="both list GPU"):
        shared.start_all()


def test_daemons_configuration_errors(root: Path) -> None:
    assert MpsDaemons([], GPUS, Root(root)).daemons() == []
    assert MpsDaemons([], GPUS, Root(root)).status_all() == {}
    with pytest.raises(MpsError, match="configured twice"):
        MpsDaemons([MpsResource("a", 2, (UUID0,)), MpsResource("a", 2, (UUID1,))], GPUS, Root(root))
    with pytest.raises(MpsError, match="nest"):
        MpsDaemons([MpsResource("a", 2, (UUID0,)), MpsResource("a/b", 2, (UUID1,))], GPUS, Root(root))


# --------------------------------------------------------------------------------------------
# parsers, against the H200 captures


def fixture_lines(name: str) -> list[str]:
    return (FIXTURES / "h200" / name).read_text().splitlines()


def test_parse_log_line_real_captures() -> None:
    control = [parse_log_line(line) for line in fixture_lines("mps-control.log")]
    server = [parse_log_line(line) for line in fixture_lines("mps-server.log")]
    assert all(p is not None for p in control + server)
    first = control[0]
    assert first is not None
    assert first.timestamp.isoformat() == "2026-11-30T10:58:36.064000"
    assert (first.source, first.pid) == ("Control", 500)
    assert first.text == "Starting control daemon using socket /tmp/mps/pipe/control"
    assert {p.source for p in control if p is not None} == {"Control"}
    assert {p.source for p in server if p is not None} == {"Other", "Server"}
    assert {p.pid for p in control if p is not None} == {500, 531}  # the forked server announces itself
    last = control[-1]
    assert last is not None and last.text == "Exit with status 0"


def test_parse_replies_from_real_log() -> None:
    """The reply lines the daemon logged after each command are what the parsers read."""
    texts = [p.text for p in map(parse_log_line, fixture_lines("mps-control.log")) if p is not None]
    replies: dict[str, list[str]] = {}
    for i, text in enumerate(texts):
        if text.startswith("Cmd:"):
            end = next((j for j in range(i + 1, len(texts)) if texts[j] in ("UI closed", "Accepting connection...")),
                       len(texts))
            replies.setdefault(text[4:], []).append("\n".join(texts[i + 1:end]))
    assert [parse_percentage(r) for r in replies["get_default_active_thread_percentage"]] == [100.0]
    assert [parse_server_list(r) for r in replies["get_server_list"]] == [[], [531], [531], [531]]
    assert [parse_client_list(r) for r in replies["get_client_list 531"]] == [[]]  # the client had exited
    assert replies["quit"] == ["Try shutting down server 531, backoff is disabled\nServer 531 exited with status 0\n"
                               "Exit with status 0"]


def test_parse_log_line_odd_input() -> None:
    assert parse_log_line("") is None
    assert parse_log_line("garbage") is None
    assert parse_log_line("[2026-13-30 10:58:36.064 Control   500] bad month") is None
    assert parse_log_line("[2026-11-30 10:58:36 Control   500] no millis") is None
    line = parse_log_line("[2024-04-23 06:04:59.389 Control    72] Cmd:set_default_device_pinned_mem_limit 0 4096M\n")
    assert line is not None and (line.pid, line.text) == (72, "Cmd:set_default_device_pinned_mem_limit 0 4096M")
    empty = parse_log_line("[2026-11-30 10:58:36.064 Control   500]")
    assert empty is not None and empty.text == ""
    with pytest.raises(TypeError):
        parse_log_line(b"[2026-11-30 10:58:36.064 Control   500] x")  # type: ignore[arg-type]


def test_parse_percentage() -> None:
    assert parse_percentage("100.0") == 100.0
    assert parse_percentage(" 25.0\n") == 25.0
    assert parse_percentage("50") == 50.0
    for odd in ("", "abc", "nan", "inf", "150.0", "-1", "1e2", "25.0 extra", "Error: busy"):
        assert parse_percentage(odd) is None, odd
    with pytest.raises(TypeError):
        parse_percentage(None)  # type: ignore[arg-type]


def test_parse_pinned_limit() -> None:
    assert parse_pinned_limit("") is None  # measured: nothing set
    assert parse_pinned_limit("4096M\n") == 4096 * 2**20
    assert parse_pinned_limit("70G") == 70 * 2**30
    assert parse_pinned_limit("512MB") == 512 * 2**20
    assert parse_pinned_limit("1GiB") == 2**30
    for odd in ("1024", "M", "-5M", "1.5G", "lots"):
        assert parse_pinned_limit(odd) is None, odd
    with pytest.raises(TypeError):
        parse_pinned_limit(4096)  # type: ignore[arg-type]


def test_parse_pid_lists() -> None:
    assert parse_server_list("") == []
    assert parse_server_list("490\n") == [490]
    assert parse_server_list("490\n\n 531 \nfoo\n-3\n0\n") == [490, 531]
    assert parse_client_list("473\n474\n") == [473, 474]
    assert parse_client_list("[0] 00:00.0, NVIDIA H200\n473.1\n") == []
    with pytest.raises(TypeError):
        parse_client_list(["473"])  # type: ignore[arg-type]


@pytest.mark.parametrize(("reply", "expected"), [
    ("[0] 00:00.0, NVIDIA H200\n473.1\n", {0: [473]}),  # spec/mps.md, measured with one client on the H200
    ("", {}),
    ("[0] 00:00.0, NVIDIA H200\n[1] 00:01.0, NVIDIA H200\n514.1\n515.2\n515.3\n", {0: [], 1: [514, 515]}),
    ("473.1\n[0] x\n", {0: []}),  # a client line before any device line is skipped
    ("[0] x\nnot a pid\n0.1\n" + "9" * 11 + ".1\n", {0: []}),
])
def test_parse_device_client_list(reply: str, expected: dict[int, list[int]]) -> None:

    assert parse_device_client_list(reply) == expected


def test_mps_clients_nvml_already_lists_are_not_added_twice() -> None:
    from accelstats.attribution.attributor import mps_clients_not_listed
    from collectors.model import DeviceSample, DeviceSnapshot, MpsDaemonReading, ProcessUsage

    snapshot = DeviceSnapshot()
    snapshot.samples[UUID0] = DeviceSample(uuid=UUID0, up=True, processes=(ProcessUsage(473, "mps", 786 << 20),))
    snapshot.mps.append(MpsDaemonReading("r", True, device_clients=((UUID0, 473), (UUID0, 474), (UUID0, 474),
                                                                    ("GPU-not-here", 475))))
    assert mps_clients_not_listed(snapshot) == {UUID0: [ProcessUsage(474, "mps")]}
