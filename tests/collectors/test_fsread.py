"""The one bounded, non-following, regular-file-only read (:mod:`collectors.fsread`), on real files,
FIFOs, symbolic links and device nodes.

"Never opened" is observed, not assumed: a writer blocked in ``open(fifo, O_WRONLY)`` returns as soon
as anyone opens the FIFO for reading, and inotify reports every real open of a device node (an
``O_PATH`` descriptor is not one).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import in_ci

from collectors.fsread import MISSING, NOT_REGULAR, TOO_LARGE, UNREADABLE, FileRead, read_regular, read_small

REPO = Path(__file__).resolve().parents[2]
IN_OPEN = 0x20  # <sys/inotify.h>


def _need_root(what: str) -> None:
    if os.geteuid() != 0:
        if in_ci():
            pytest.fail(f"{what} needs root, and CI runs as root", pytrace=False)
        pytest.skip(f"{what} needs root")


def test_a_regular_file_is_read_whole() -> None:
    got = read_regular("/proc/self/status", 1 << 20, past_limit="refuse")  # procfs: st_size 0
    assert got.reason == "" and got.data is not None and got.data.startswith(b"Name:")


@pytest.mark.parametrize("size", [0, 1, 99_999, 100_000, 100_001, 300_000])
def test_past_the_limit_a_file_is_cut_or_refused_as_the_caller_says(tmp_path: Path, size: int) -> None:
    limit = 100_000  # more than one 64 KiB chunk
    path = tmp_path / "f"
    content = bytes(i % 251 for i in range(size))
    path.write_bytes(content)
    assert read_regular(path, limit, past_limit="truncate") == FileRead(content[:limit])
    refused = read_regular(path, limit, past_limit="refuse")
    if size <= limit:
        assert refused == FileRead(content)
    else:
        assert refused == FileRead(None, TOO_LARGE, "larger than 100000 bytes")
        with pytest.raises(ValueError, match=r"^larger than 100000 bytes$"):
            refused.data_or_raise()


def test_missing_and_unreadable_say_why(tmp_path: Path) -> None:
    missing = read_regular(tmp_path / "nothing", 10, past_limit="refuse")
    assert (missing.data, missing.reason, missing.errno) == (None, MISSING, errno.ENOENT)
    assert missing.detail == os.strerror(errno.ENOENT)
    with pytest.raises(FileNotFoundError):
        missing.data_or_raise()
    (tmp_path / "file").write_text("x")
    under_a_file = read_regular(tmp_path / "file" / "below", 10, past_limit="refuse")
    assert (under_a_file.reason, under_a_file.errno) == (UNREADABLE, errno.ENOTDIR)
    nul = read_regular(f"{tmp_path}/a\0b", 10, past_limit="refuse")
    assert (nul.reason, nul.detail) == (UNREADABLE, "the name holds a NUL character")
    with pytest.raises(ValueError, match="NUL"):
        nul.data_or_raise()


def test_a_process_that_exited_is_missing() -> None:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    got = read_regular(f"/proc/{proc.stdout.strip()}/cgroup", 4096, past_limit="truncate")
    assert got.reason == MISSING


def test_a_directory_is_not_regular(tmp_path: Path) -> None:
    got = read_regular(tmp_path, 10, past_limit="refuse", follow_symlinks=True)
    assert got == FileRead(None, NOT_REGULAR, "not a regular file")
    with pytest.raises(ValueError, match=r"^not a regular file$"):
        got.data_or_raise()


def test_a_symlink_is_refused_unless_the_caller_follows_it(tmp_path: Path) -> None:
    (tmp_path / "real").write_bytes(b"0x10de\n")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert read_regular(tmp_path / "link", 64, past_limit="truncate").reason == NOT_REGULAR
    assert read_small(tmp_path / "link") is None
    assert read_regular(tmp_path / "link", 64, past_limit="truncate", follow_symlinks=True).data == b"0x10de\n"
    # a link earlier in the path is followed either way (sysfs's bus/pci/devices/<address>, /proc/self)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "vendor").write_bytes(b"0x10de\n")
    (tmp_path / "address").symlink_to(tmp_path / "dir")
    assert read_small(tmp_path / "address" / "vendor") == b"0x10de\n"


@pytest.fixture
def fifo_with_waiting_writer(tmp_path: Path) -> Iterator[tuple[Path, threading.Event]]:
    """A FIFO and an event set once a writer's blocking ``open`` of it returns, i.e. once anyone opened
    it for reading. Teardown opens it itself to release the writer."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    opened = threading.Event()

    def writer() -> None:
        fd = os.open(fifo, os.O_WRONLY)  # blocks until a reader opens the FIFO
        opened.set()
        os.close(fd)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    yield fifo, opened
    if not opened.is_set():
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
    thread.join(5)
    assert not thread.is_alive()


@pytest.mark.parametrize("follow", [False, True])
@pytest.mark.parametrize("through_link", [False, True])
def test_a_fifo_is_refused_without_being_opened(fifo_with_waiting_writer: tuple[Path, threading.Event],
                                                 follow: bool, through_link: bool) -> None:
    fifo, opened = fifo_with_waiting_writer
    path = fifo
    if through_link:
        path = fifo.with_name("link")
        path.symlink_to(fifo)
    got = read_regular(path, 4096, past_limit="truncate", follow_symlinks=follow)
    assert got == FileRead(None, NOT_REGULAR, "not a regular file")
    assert not opened.wait(0.3), "read_regular opened the FIFO"
    # the observation works: a plain open, as the readers did before, releases the writer
    os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
    assert opened.wait(5)


def _inotify_opens(path: Path) -> tuple[int, int]:
    """An inotify descriptor watching ``path`` for IN_OPEN, and its watch."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    assert fd >= 0, os.strerror(ctypes.get_errno())
    wd = libc.inotify_add_watch(fd, os.fsencode(path), IN_OPEN)
    assert wd >= 0, os.strerror(ctypes.get_errno())
    return fd, wd


def _pending(fd: int) -> int:
    try:
        return len(os.read(fd, 4096))
    except BlockingIOError:
        return 0


@pytest.mark.parametrize("follow", [False, True])
def test_a_device_is_refused_without_being_opened(tmp_path: Path, follow: bool) -> None:
    """A private node of /dev/null (char 1:3), read directly and through a symlink: inotify sees no
    open of it (and sees the one a plain open makes)."""
    _need_root("mknod")
    node = tmp_path / "null"
    os.mknod(node, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    (tmp_path / "link").symlink_to(node)
    watch, _ = _inotify_opens(node)
    try:
        for path in (node, tmp_path / "link"):
            assert read_regular(path, 64, past_limit="truncate", follow_symlinks=follow).reason == NOT_REGULAR
        assert _pending(watch) == 0, "read_regular opened the device"
        os.close(os.open(node, os.O_RDONLY))
        assert _pending(watch) > 0
    finally:
        os.close(watch)


def test_a_link_to_dev_urandom_is_refused(tmp_path: Path) -> None:
    (tmp_path / "devices.list").symlink_to("/dev/urandom")
    for follow in (False, True):
        got = read_regular(tmp_path / "devices.list", 1 << 30, past_limit="truncate", follow_symlinks=follow)
        assert got.reason == NOT_REGULAR


def test_no_descriptor_is_left_open(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x" * 10)
    (tmp_path / "link").symlink_to(tmp_path / "f")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        read_regular(tmp_path / "f", 5, past_limit="refuse")  # too large
        read_regular(tmp_path / "f", 50, past_limit="refuse")
        read_regular(tmp_path / "link", 50, past_limit="refuse")  # a link, not followed
        read_regular(tmp_path, 50, past_limit="refuse")  # a directory
        read_regular(tmp_path / "none", 50, past_limit="refuse")
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_callers_mistake_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="limit 0"):
        read_regular(tmp_path, 0, past_limit="truncate")
    with pytest.raises(ValueError, match="past_limit 'cut'"):
        read_regular(tmp_path, 1, past_limit="cut")  # type: ignore[arg-type]


def test_without_proc_the_path_is_opened_again_and_checked(tmp_path: Path) -> None:
    """Where /proc is not mounted (a new mount namespace without it), the inode cannot be reopened
    through /proc/self/fd: the path is opened again, and the same rules hold."""
    _need_root("unshare --mount")
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) missing", pytrace=False)
    (tmp_path / "f").write_bytes(b"hello")
    (tmp_path / "link").symlink_to(tmp_path / "f")
    os.mkfifo(tmp_path / "fifo")
    script = (
        "import os, sys\n"
        "from collectors.fsread import read_regular\n"
        "assert not os.path.isdir('/proc/self/fd')\n"
        "d = sys.argv[1]\n"
        "print(read_regular(d + '/f', 10, past_limit='refuse').data,"
        " read_regular(d + '/f', 3, past_limit='refuse').reason,"
        " read_regular(d + '/link', 10, past_limit='refuse').reason,"
        " read_regular(d + '/link', 10, past_limit='refuse', follow_symlinks=True).data,"
        " read_regular(d + '/fifo', 10, past_limit='refuse', follow_symlinks=True).reason)\n"
    )
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           'umount -l /proc && exec "$0" -c "$1" "$2"', sys.executable, script, str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["b'hello'", "too_large", "not_regular", "b'hello'", "not_regular"]
