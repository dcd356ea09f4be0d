"""Open-fd evidence (DESIGN.md "Attribution", spec/cgroups.md §2 and §4): fake /proc trees, one real /proc check.

The fake trees hold real char device nodes made with ``mknod`` in ``tmp_path`` (never under /dev):
``<proc>/<pid>/fd/<n>`` are symlinks to them, so ``os.stat`` on an fd entry sees a real char
device exactly as it does through /proc's magic links.  ``mknod`` needs ``CAP_MKNOD``; without it
those tests skip (and fail under ``CI=true``); the /dev/null-based test covers the scan without it.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

import accelstats.attribution.openfds as openfds
from accelstats.attribution.openfds import (
    OpenFdScanner,
    char_major,
    nvidia_caps_major,
    nvidia_uvm_major,
    pids_in_cgroup,
    process_start_time,
)

NVIDIA = 195


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def stat_line(pid: int, start: int, comm: str = "python3") -> str:
    """A proc(5) ``stat`` line: field 22 (starttime) is ``start``, 52 fields like Linux ≥ 3.5."""
    after_comm = ["S", "1", str(pid), str(pid), "0", "-1", "4194560"] + ["0"] * 12 + [str(start)] + ["0"] * 30
    return f"{pid} ({comm}) {' '.join(after_comm)}\n"


class FakeProc:
    """A /proc-like tree in tmp_path with real device nodes to point fd symlinks at."""

    def __init__(self, root: Path, dev: Path) -> None:
        self.root = root
        self.dev = dev

    def node(self, name: str, major: int, minor: int) -> Path:
        path = self.dev / name
        if not path.exists():
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(major, minor))
        return path

    def gpu(self, minor: int) -> Path:
        return self.node(f"nvidia{minor}", NVIDIA, minor)

    def add(self, pid: int, start: int, fds: Sequence[Path | str] = (), comm: str = "python3") -> Path:
        pdir = self.root / str(pid)
        (pdir / "fd").mkdir(parents=True, exist_ok=True)
        for old in (pdir / "fd").iterdir():
            old.unlink()
        (pdir / "stat").write_text(stat_line(pid, start, comm))
        for n, target in enumerate(fds):
            os.symlink(target, pdir / "fd" / str(n))
        return pdir

    def restart(self, pid: int, start: int) -> None:
        (self.root / str(pid) / "stat").write_text(stat_line(pid, start))


@pytest.fixture
def fake(tmp_path: Path) -> FakeProc:
    dev = tmp_path / "dev"
    dev.mkdir()
    try:
        os.mknod(dev / "probe", stat.S_IFCHR | 0o600, os.makedev(NVIDIA, 0))
    except PermissionError as e:
        if _in_ci():
            pytest.fail(f"mknod needs CAP_MKNOD: {e}", pytrace=False)
        pytest.skip(f"mknod needs CAP_MKNOD: {e}")
    (dev / "probe").unlink()
    proc = tmp_path / "proc"
    proc.mkdir()
    return FakeProc(proc, dev)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------------------------------
# process_start_time


@pytest.mark.parametrize(
    "comm",
    ["python3", "a) b) c", "x (y) z", "))", "(", "a\nb", " ", "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19"],
)
def test_start_time_comm_with_parentheses_spaces_newlines(tmp_path: Path, comm: str) -> None:
    (tmp_path / "123").mkdir()
    (tmp_path / "123" / "stat").write_text(stat_line(123, 987654, comm))
    assert process_start_time(tmp_path, 123) == 987654


def test_start_time_brief_example(tmp_path: Path) -> None:
    (tmp_path / "123").mkdir()
    fields = " ".join(str(10 * k) for k in range(4, 53))  # field k (k >= 4) holds 10 * k
    (tmp_path / "123" / "stat").write_text(f"123 (a) b) c) S {fields}\n")
    assert process_start_time(tmp_path, 123) == 220


@pytest.mark.parametrize(
    "content",
    [
        "",
        "123 python3 S 1 2 3\n",  # no ')'
        "123 (x) S " + " ".join(["0"] * 18) + "\n",  # 20 fields: starttime missing
        "123 (x) S " + " ".join(["0"] * 18) + " -5 0\n",  # not a tick count
        "123 (x) S " + " ".join(["0"] * 18) + " 1e3 0\n",
    ],
)
def test_start_time_malformed_is_none(tmp_path: Path, content: str) -> None:
    (tmp_path / "123").mkdir()
    (tmp_path / "123" / "stat").write_text(content)
    assert process_start_time(tmp_path, 123) is None


def test_start_time_gone_or_unreadable_is_none(tmp_path: Path) -> None:
    assert process_start_time(tmp_path, 4242) is None
    assert process_start_time(tmp_path / "missing", 1) is None
    (tmp_path / "7" / "stat").mkdir(parents=True)  # EISDIR
    assert process_start_time(tmp_path, 7) is None


# ---------------------------------------------------------------------------------------------
# OpenFdScanner on fake trees


def test_scan_reports_all_minors_of_the_major_and_nothing_else(fake: FakeProc, tmp_path: Path) -> None:
    regular = tmp_path / "data.bin"
    regular.write_bytes(b"x")
    sock_path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(os.fspath(sock_path))
        fake.add(
            100,
            5000,
            [
                fake.gpu(0),
                fake.gpu(3),
                fake.gpu(3),  # the same node open twice
                fake.node("nvidiactl", NVIDIA, 255),
                fake.node("nvidia-modeset", NVIDIA, 254),
                fake.node("null", 1, 3),  # another major
                fake.node("uvm", 508, 0),
                fake.gpu(9),
                regular,
                tmp_path,  # a directory
                sock_path,
                tmp_path / "dangling",
            ],
        )
        # a block device with the NVIDIA major must not count: only S_ISCHR does
        os.mknod(fake.dev / "blk", stat.S_IFBLK | 0o600, os.makedev(NVIDIA, 77))
        os.symlink(fake.dev / "blk", fake.root / "100" / "fd" / "99")
        fake.add(101, 5001, [regular])
        scanner = OpenFdScanner(fake.root)
        assert scanner.scan([100, 101]) == {100: frozenset({0, 3, 9, 254, 255}), 101: frozenset()}
    assert (scanner.scans, scanner.cache_hits, scanner.vanished, scanner.unreadable) == (2, 0, 0, 0)


def test_scan_other_major(fake: FakeProc) -> None:
    fake.add(100, 1, [fake.gpu(0), fake.node("null", 1, 3), fake.node("zero", 1, 5)])
    assert OpenFdScanner(fake.root, nvidia_major=1).scan([100]) == {100: frozenset({3, 5})}


def test_scan_without_mknod_uses_dev_null(tmp_path: Path) -> None:
    """Runs without CAP_MKNOD: /dev/null (1:3) and /dev/zero (1:5) are read, never written."""
    proc = FakeProc(tmp_path, tmp_path)
    proc.add(100, 1, ["/dev/null", "/dev/zero", "/dev/null", os.fspath(tmp_path)])
    assert OpenFdScanner(tmp_path, nvidia_major=1).scan([100]) == {100: frozenset({3, 5})}
    assert OpenFdScanner(tmp_path).scan([100]) == {100: frozenset()}


def test_second_scan_with_same_start_times_scans_no_fd_directory(fake: FakeProc) -> None:
    fake.add(100, 5000, [fake.gpu(1)])
    fake.add(200, 6000, [fake.gpu(2), fake.gpu(5)])
    scanner = OpenFdScanner(fake.root, clock=Clock())
    first = scanner.scan([100, 200])
    assert scanner.scans == 2
    # the process opened another node, but the cache (same start time, within ttl) answers
    fake.add(100, 5000, [fake.gpu(1), fake.gpu(6)])
    assert scanner.scan([100, 200]) == first == {100: frozenset({1}), 200: frozenset({2, 5})}
    assert (scanner.scans, scanner.cache_hits) == (2, 2)


def test_reused_pid_is_rescanned(fake: FakeProc) -> None:
    """A PID that left the listing (its process exited) and comes back is a new process: rescanned."""
    fake.add(100, 5000, [fake.gpu(1)])
    scanner = OpenFdScanner(fake.root, clock=Clock())
    assert scanner.scan([100]) == {100: frozenset({1})}
    assert scanner.scan([]) == {}  # gone from every container's cgroup.procs
    fake.add(100, 5001, [fake.gpu(4)])  # pid 100 now belongs to a new process
    assert scanner.scan([100]) == {100: frozenset({4})}
    assert (scanner.scans, scanner.cache_hits) == (2, 0)
    assert scanner.scan([100]) == {100: frozenset({4})}
    assert (scanner.scans, scanner.cache_hits) == (2, 1)


def test_a_cache_hit_reads_nothing_from_proc(fake: FakeProc, monkeypatch: pytest.MonkeyPatch) -> None:
    fake.add(100, 5000, [fake.gpu(1)])
    scanner = OpenFdScanner(fake.root, clock=Clock())
    scanner.scan([100])
    monkeypatch.setattr(openfds, "process_start_time", lambda *a: pytest.fail("read /proc on a hit"))
    assert scanner.scan([100]) == {100: frozenset({1})}


def test_ttl_expiry_with_injected_clock(fake: FakeProc) -> None:
    clock = Clock()
    fake.add(100, 5000, [fake.gpu(1)])
    scanner = OpenFdScanner(fake.root, ttl=300.0, clock=clock)
    scanner.scan([100])
    fake.add(100, 5000, [fake.gpu(1), fake.gpu(2)])
    lifetime = scanner._lifetime(100)  # ttl spread by PID over [ttl/2, ttl)
    assert 150.0 <= lifetime < 300.0
    clock.now += lifetime - 0.1
    assert scanner.scan([100]) == {100: frozenset({1})}
    assert scanner.scans == 1
    clock.now += 0.2  # the entry is past its lifetime: rescan
    assert scanner.scan([100]) == {100: frozenset({1, 2})}
    assert scanner.scans == 2
    clock.now += 100  # the rescan restarted the entry's age
    scanner.scan([100])
    assert scanner.scans == 2


def test_lifetimes_are_spread_so_rescans_do_not_come_all_at_once(fake: FakeProc) -> None:
    clock = Clock()
    for pid in range(100, 200):
        fake.add(pid, pid * 10, [])
    scanner = OpenFdScanner(fake.root, ttl=300.0, clock=clock)
    scanner.scan(range(100, 200))
    clock.now += 225  # three quarters of ttl: some entries expired, not all
    scanner.scan(range(100, 200))
    assert 100 < scanner.scans < 200


def test_ttl_zero_always_rescans(fake: FakeProc) -> None:
    fake.add(100, 5000, [fake.gpu(1)])
    scanner = OpenFdScanner(fake.root, ttl=0, clock=Clock())
    for _ in range(3):
        scanner.scan([100])
    assert (scanner.scans, scanner.cache_hits) == (3, 0)


@pytest.mark.parametrize("ttl", [-1.0, float("nan")])
def test_bad_ttl_rejected(ttl: float) -> None:
    with pytest.raises(ValueError, match="ttl"):
        OpenFdScanner(ttl=ttl)


def test_pids_not_asked_for_are_dropped(fake: FakeProc) -> None:
    fake.add(100, 5000, [fake.gpu(1)])
    fake.add(200, 6000, [fake.gpu(2)])
    scanner = OpenFdScanner(fake.root, clock=Clock())
    scanner.scan([100, 200])
    assert scanner.cache_size == 2
    assert scanner.scan([100]) == {100: frozenset({1})}
    assert scanner.cache_size == 1
    assert scanner.scan([200]) == {200: frozenset({2})}  # evicted: scanned again
    assert (scanner.scans, scanner.cache_hits, scanner.cache_size) == (3, 1, 1)
    assert scanner.scan([]) == {}
    assert scanner.cache_size == 0


def test_duplicate_pids_scanned_once(fake: FakeProc) -> None:
    fake.add(100, 5000, [fake.gpu(1)])
    scanner = OpenFdScanner(fake.root)
    assert scanner.scan(iter([100, 100, 100])) == {100: frozenset({1})}
    assert (scanner.scans, scanner.cache_hits) == (1, 0)


def test_vanished_pids_are_counted_not_raised(fake: FakeProc) -> None:
    fake.add(100, 5000, [fake.gpu(1)])
    fake.add(300, 7000, [fake.gpu(3)])
    for entry in (fake.root / "300" / "fd").iterdir():
        entry.unlink()
    (fake.root / "300" / "fd").rmdir()  # stat still readable, fd dir gone: exited in between
    scanner = OpenFdScanner(fake.root, clock=Clock())
    assert scanner.scan([100, 200, 300]) == {100: frozenset({1})}
    assert (scanner.scans, scanner.vanished, scanner.unreadable) == (1, 2, 0)
    assert scanner.cache_size == 1
    # a cached pid that exits leaves cgroup.procs: not asked for, dropped
    assert scanner.scan([]) == {}
    assert scanner.cache_size == 0


def test_pid_reused_during_fd_listing_is_not_attributed(fake: FakeProc, monkeypatch: pytest.MonkeyPatch) -> None:
    fake.add(100, 5000, [fake.gpu(1)])
    real = openfds.process_start_time
    calls: list[int] = []

    def racing(proc_root: Path, pid: int) -> int | None:
        calls.append(pid)
        value = real(proc_root, pid)
        if len(calls) == 1:
            fake.restart(pid, 5001)  # the process exits and a new one takes the pid mid-scan
        return value

    monkeypatch.setattr(openfds, "process_start_time", racing)
    scanner = OpenFdScanner(fake.root, clock=Clock())
    assert scanner.scan([100]) == {}
    assert (scanner.scans, scanner.vanished, scanner.cache_size) == (1, 1, 0)
    assert scanner.scan([100]) == {100: frozenset({1})}  # the new process, scanned afresh


def test_unreadable_fd_directory_is_counted_and_skipped(fake: FakeProc, monkeypatch: pytest.MonkeyPatch) -> None:
    fake.add(100, 5000, [fake.gpu(1)])
    fake.add(200, 6000, [fake.gpu(2)])
    fake.add(300, 7000, [fake.gpu(3)])
    # pid 300: "fd" is not a directory (ENOTDIR) -- a real failure, no monkeypatch needed
    for entry in (fake.root / "300" / "fd").iterdir():
        entry.unlink()
    (fake.root / "300" / "fd").rmdir()
    (fake.root / "300" / "fd").write_text("")
    # pid 200: EACCES, as for another user's process without CAP_SYS_PTRACE (we are root here)
    denied = os.fspath(fake.root / "200" / "fd")
    real_scandir = os.scandir

    def scandir(path: str) -> Iterator[os.DirEntry[str]]:
        if os.fspath(path) == denied:
            raise PermissionError(13, "Permission denied", path)
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    scanner = OpenFdScanner(fake.root, clock=Clock())
    assert scanner.scan([100, 200, 300]) == {100: frozenset({1})}
    assert (scanner.scans, scanner.unreadable, scanner.vanished) == (1, 2, 0)
    # failures are cached as "holds nothing": counted once per lifetime, not every scrape
    assert scanner.scan([100, 200, 300]) == {100: frozenset({1}), 200: frozenset(), 300: frozenset()}
    assert (scanner.scans, scanner.cache_hits, scanner.unreadable) == (1, 3, 2)


def test_fd_entry_stat_errors_skip_only_that_fd(fake: FakeProc, monkeypatch: pytest.MonkeyPatch) -> None:
    from accelstats.attribution import openfds
    fake.add(100, 5000, [fake.gpu(1), fake.gpu(2)])
    bad = os.fspath(fake.root / "100" / "fd" / "0")
    real = openfds.char_device

    def flaky(path: str) -> tuple[int, int] | None:
        if os.fspath(path) == bad:
            raise PermissionError(13, "Permission denied", path)
        return real(path)

    monkeypatch.setattr(openfds, "char_device", flaky)
    assert OpenFdScanner(fake.root).scan([100]) == {100: frozenset({2})}


def test_missing_proc_root_never_raises(tmp_path: Path) -> None:
    scanner = OpenFdScanner(tmp_path / "nope")
    assert scanner.scan([1, 2, 3]) == {}
    assert scanner.vanished == 3


# ---------------------------------------------------------------------------------------------
# pids_in_cgroup


def _procs(directory: Path, *pids: int | str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
    return directory


def test_pids_in_cgroup_walks_sub_cgroups(tmp_path: Path) -> None:
    root = _procs(tmp_path / "pod", 10)
    _procs(root / "ctr-a", 30, 20, 20)  # v1 does not promise sorted or unique
    _procs(root / "ctr-a" / "init.scope", 40)
    _procs(root / "ctr-b")  # empty: no processes
    _procs(tmp_path / "elsewhere", 99)
    os.symlink(tmp_path / "elsewhere", root / "link")  # never followed
    (root / "memory.max").write_text("max\n")
    assert pids_in_cgroup(root) == ([10, 20, 30, 40], 0)


def test_pids_in_cgroup_ignores_garbage_lines(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.procs").write_bytes(b"12\n\n-3\nabc\n 7 \n4.5\n\xff\n")
    assert pids_in_cgroup(root) == ([7, 12], 0)


def test_pids_in_cgroup_depth_bound(tmp_path: Path) -> None:
    d = _procs(tmp_path / "cg", 0)
    for depth in range(1, 12):
        d = _procs(d / f"l{depth}", depth)
    assert pids_in_cgroup(tmp_path / "cg") == (list(range(9)), 0)  # depth 0..8
    assert pids_in_cgroup(tmp_path / "cg", max_depth=0) == ([0], 0)
    assert pids_in_cgroup(tmp_path / "cg", max_depth=20) == (list(range(12)), 0)
    with pytest.raises(ValueError, match="max_depth"):
        pids_in_cgroup(tmp_path / "cg", max_depth=-1)


def test_pids_in_cgroup_counts_vanished_and_unreadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert pids_in_cgroup(tmp_path / "gone") == ([], 1)
    root = _procs(tmp_path / "cg", 1)
    (root / "removed").mkdir()  # a sub-cgroup removed between listing and reading: no cgroup.procs
    _procs(root / "denied", 2)
    _procs(root / "denied" / "child", 3)
    _procs(root / "ok", 4)
    (root / "threaded").mkdir()
    (tmp_path / "adir").mkdir()
    os.symlink(tmp_path / "adir", root / "threaded" / "cgroup.procs")  # EISDIR stands in for EOPNOTSUPP
    denied = os.fspath(root / "denied")
    real_scandir = os.scandir

    def scandir(path: str) -> Iterator[os.DirEntry[str]]:
        if os.fspath(path) == denied:
            raise PermissionError(13, "Permission denied", path)
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    # 'denied' still yields its own cgroup.procs but its listing fails (counted once, child unseen)
    assert pids_in_cgroup(root) == ([1, 2, 4], 3)


def test_pids_in_cgroup_real_own_cgroup() -> None:
    """This test process is in its own cgroup's ``cgroup.procs`` (v1 or v2, whichever is mounted)."""
    candidates = list(_own_cgroup_dirs())
    if not candidates:
        if _in_ci():
            pytest.fail("no cgroup hierarchy of this process is mounted under CI=true", pytrace=False)
        pytest.skip("no cgroup hierarchy of this process is mounted here")
    for directory in candidates:
        pids, failed = pids_in_cgroup(directory, max_depth=0)
        assert os.getpid() in pids, directory
        assert failed == 0


def _own_cgroup_dirs() -> Iterator[Path]:
    """Directories of this process's cgroups, from /proc/self/cgroup and /proc/self/mountinfo."""
    try:
        cgroup_lines = Path("/proc/self/cgroup").read_text().splitlines()
        mountinfo = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return
    mounts: list[tuple[str, str, str, set[str]]] = []  # (fstype, root, mountpoint, super options)
    for line in mountinfo:
        pre, _, post = line.partition(" - ")
        fields, post_fields = pre.split(), post.split()
        if len(fields) >= 5 and len(post_fields) >= 3 and post_fields[0] in ("cgroup", "cgroup2"):
            mounts.append((post_fields[0], fields[3], fields[4], set(post_fields[2].split(","))))
    for line in cgroup_lines:
        hid, controllers, path = line.split(":", 2)
        for fstype, mroot, mpoint, opts in mounts:
            v2_match = hid == "0" and fstype == "cgroup2"
            v1_match = fstype == "cgroup" and bool(controllers) and set(controllers.split(",")) <= opts
            if not (v2_match or v1_match):
                continue
            if path != mroot and not path.startswith(mroot.rstrip("/") + "/"):
                continue
            directory = Path(mpoint) / os.path.relpath(path, mroot)
            if (directory / "cgroup.procs").exists():
                yield directory
            break


# ---------------------------------------------------------------------------------------------
# /proc/devices

PROC_DEVICES = """\
Character devices:
  1 mem
  4 /dev/vc/0
  4 tty
 10 misc
195 nvidia-frontend
195 nvidia
226 drm
238 nvidia-uvm
241 nvidia-caps
508 nvidia-caps-imex-channels

Block devices:
  7 loop
  8 sd
259 blkext
 42 nvidia-blockonly
"""


@pytest.fixture
def devices_root(tmp_path: Path) -> Path:
    (tmp_path / "devices").write_text(PROC_DEVICES)
    return tmp_path


def test_char_major_exact_names(devices_root: Path) -> None:
    assert char_major(devices_root, "nvidia") == 195
    assert char_major(devices_root, "nvidia-frontend") == 195
    assert nvidia_uvm_major(devices_root) == 238
    assert nvidia_caps_major(devices_root) == 241
    assert char_major(devices_root, "nvidia-caps-imex-channels") == 508
    assert char_major(devices_root, "/dev/vc/0") == 4
    assert char_major(devices_root, "nvidia-cap") is None
    assert char_major(devices_root, "loop") is None  # block section is not searched
    assert char_major(devices_root, "nvidia-blockonly") is None


def test_char_major_without_driver_or_file(tmp_path: Path) -> None:
    assert nvidia_caps_major(tmp_path) is None  # no file
    (tmp_path / "devices").write_text("Character devices:\n  1 mem\n\nBlock devices:\n  7 loop\n")
    assert nvidia_caps_major(tmp_path) is None
    assert nvidia_uvm_major(tmp_path) is None
    assert char_major(tmp_path, "mem") == 1
    (tmp_path / "devices").write_text("garbage\n195 nvidia\n")  # no section header
    assert char_major(tmp_path, "nvidia") is None


# ---------------------------------------------------------------------------------------------
# the real /proc

_HOLDER = textwrap.dedent(
    """
    import os, sys
    fd = os.open(sys.argv[1], os.O_PATH)  # O_PATH: no driver call, so no ENXIO without NVIDIA
    print(fd, flush=True)
    sys.stdin.read()
    """
)


def test_real_proc_child_holding_a_195_node(fake: FakeProc) -> None:
    assert char_major(Path("/proc"), "mem") == 1  # the real /proc/devices parses
    node = fake.gpu(7)
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, os.fspath(node)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip().isdigit(), "child failed to open the node"
        proc = Path("/proc")
        start = process_start_time(proc, child.pid)
        assert start is not None and start >= process_start_time(proc, os.getpid())  # type: ignore[operator]
        scanner = OpenFdScanner(proc)
        assert scanner.scan([child.pid, os.getpid()]) == {child.pid: frozenset({7}), os.getpid(): frozenset()}
        assert scanner.scan([child.pid]) == {child.pid: frozenset({7})}
        assert (scanner.scans, scanner.cache_hits, scanner.unreadable) == (2, 1, 0)
        child.stdin.close()
        assert child.wait(timeout=30) == 0
        assert process_start_time(proc, child.pid) is None  # reaped: gone
        scanner.scan([])  # it left the listing
        assert scanner.scan([child.pid]) == {}  # asked again: not cached any more, found gone
        assert scanner.vanished == 1
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_unreadable_pids_are_forgotten_once_gone(fake: FakeProc, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PID whose fd directory could not be read is remembered (to count it once) only while it is
    asked about: the set no longer grows with every short-lived process of another user."""
    real_scandir = os.scandir

    def scandir(path: str) -> object:
        if os.fspath(path).endswith("/fd"):
            raise PermissionError(13, "Permission denied", path)
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    scanner = OpenFdScanner(fake.root, clock=Clock())
    for pid in range(100, 150):
        fake.add(pid, 5000 + pid, [])
        scanner.scan([pid])  # each process seen once, then gone from the containers
    assert scanner.scan([]) == {}
    assert len(scanner._unreadable_now) == 0 and scanner.unreadable == 50
