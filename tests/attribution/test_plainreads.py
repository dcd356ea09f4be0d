"""Plain reads of cgroupfs (issue 29): a hierarchy's control files are read with one ``open`` only where
the mount table says every file under it is on cgroupfs (kernfs makes no FIFO, device node or symbolic
link); anywhere else the checked read is kept (tests/attribution/test_devices_list_hostile.py and the
other hostile-tree tests run on temporary directories: that path).

| mounts (point, type) | hierarchy | plain reads |
|---|---|---|
| the v1 host of this suite's CI: tmpfs at /sys/fs/cgroup, cgroup at …/devices | /sys/fs/cgroup/devices | yes |
| the same | /sys/fs/cgroup (tmpfs) | no |
| cgroup2 at /sys/fs/cgroup | /sys/fs/cgroup | yes |
| cgroup2, and a tmpfs mounted below the hierarchy | /sys/fs/cgroup | no |
| cgroup2, and a cgroup bind mount below it | /sys/fs/cgroup | yes |
| a cgroup mount that another filesystem hides (the hierarchy's mount is the hider) | /sys/fs/cgroup/devices | no |
| no line for the hierarchy's mount (another mount namespace's, named through ``/proc/<pid>/root``) | any | no |
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import in_ci

from accelstats.cgroups.mode import parse_mountinfo
from accelstats.cgroups.plainreads import PlainReads, all_cgroupfs
from collectors.fsread import read_plain
from tests.support.runc_harness import _devices_mount, _unified_mount, cgroup_mounts

V1_HOST = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
23 27 0:22 / /sys rw,relatime - sysfs sysfs rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
36 31 0:33 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V2_HOST = """\
23 27 0:22 / /sys rw,relatime - sysfs sysfs rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
31 23 0:27 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate
"""
TMPFS_BELOW = V2_HOST + "90 31 0:50 / /sys/fs/cgroup/system.slice/evil rw,relatime - tmpfs tmpfs rw\n"
BIND_BELOW = V2_HOST + "91 31 0:27 /kubepods /sys/fs/cgroup/kubepods rw,relatime - cgroup2 cgroup2 rw\n"
HIDDEN = V1_HOST + "92 31 0:51 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw\n"

CASES = [
    (V1_HOST, "/sys/fs/cgroup/devices", 36, True),
    (V1_HOST, "/sys/fs/cgroup", 31, False),
    (V2_HOST, "/sys/fs/cgroup", 31, True),
    (TMPFS_BELOW, "/sys/fs/cgroup", 31, False),
    (BIND_BELOW, "/sys/fs/cgroup", 31, True),
    (HIDDEN, "/sys/fs/cgroup/devices", 92, False),  # the path resolves into the hider
    (V2_HOST, "/sys/fs/cgroup", 99, False),  # a mount this table does not hold: another namespace's
]


@pytest.mark.parametrize(("mountinfo", "hierarchy", "mount_id", "plain"), CASES)
def test_plain_reads_only_where_every_file_is_on_cgroupfs(mountinfo: str, hierarchy: str, mount_id: int,
                                                         plain: bool) -> None:
    assert all_cgroupfs(parse_mountinfo(mountinfo), hierarchy, mount_id) is plain


def test_a_tmpfs_below_a_hierarchy_whose_path_has_a_space_is_seen() -> None:
    """Mount points come unescaped (``\\040`` is a space) from the project's mountinfo parser, so a tmpfs
    below ``/host cg`` is found below it."""
    text = ("27 1 254:0 / / rw - ext4 /dev/vda rw\n"
            "60 27 0:27 / /host\\040cg rw - cgroup2 cgroup2 rw\n"
            "61 60 0:61 / /host\\040cg/x rw - tmpfs tmpfs rw\n")
    assert all_cgroupfs(parse_mountinfo(text), "/host cg", 60) is False
    assert all_cgroupfs(parse_mountinfo(text.rsplit("61 60", 1)[0]), "/host cg", 60) is True


def test_a_missing_hierarchy_answers_no(tmp_path: Path) -> None:
    assert PlainReads(tmp_path / "absent").check() is False


def test_read_plain_reads_to_the_end_or_the_limit_and_never_raises(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x" * 20000)
    assert read_plain(str(f), 65536) == b"x" * 20000
    assert read_plain(str(f), 100) == b"x" * 100
    assert read_plain(str(tmp_path), 100) is None  # a directory: EISDIR
    assert read_plain(str(tmp_path / "absent"), 100) is None
    assert read_plain("bad\0name", 100) is None


def _hierarchy() -> Path:
    mounts = cgroup_mounts()
    mount = _devices_mount(mounts) or _unified_mount(mounts)
    if mount is None:
        why = "no cgroup v1 devices or cgroup2 hierarchy mounted"
        if in_ci():
            pytest.fail(f"{why}: CI must have one", pytrace=False)
        pytest.skip(why)
    return mount.mountpoint


@pytest.fixture
def cgroup() -> Iterator[Path]:
    """A cgroup of its own in a real hierarchy (v1 devices, else cgroup2), removed after."""
    made = _hierarchy() / f"accelstats-plain-{secrets.token_hex(4)}"
    made.mkdir()
    try:
        yield made
    finally:
        made.rmdir()


def in_own_mount_namespace(script: str, cgroup: Path) -> None:
    """Run ``script`` (Python; ``cgroup`` is its ``CGROUP``, ``tmpfs_on`` mounts a tmpfs for a ``with``
    body) in a mount namespace of its own (``unshare -m``, private propagation): its mounts never reach
    the other tests' view of the hierarchy, nor theirs (a runtime's, a FUSE test's) its mount table, so
    "not read again" is about its own table alone."""
    prelude = textwrap.dedent(f"""
        import contextlib, os, subprocess
        from pathlib import Path
        from accelstats.cgroups.plainreads import PlainReads
        CGROUP = Path({str(cgroup)!r})

        @contextlib.contextmanager
        def tmpfs_on(directory):
            subprocess.run(["mount", "-t", "tmpfs", "accelstats-test", str(directory)], check=True)
            try:
                yield
            finally:
                subprocess.run(["umount", str(directory)], check=True)
        """)
    done = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c",
                           prelude + textwrap.dedent(script)], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr


@pytest.mark.root  # mkdir in a real cgroup hierarchy, unshare(1), mount(8)
def test_a_mount_below_the_hierarchy_is_seen_at_the_next_check_and_its_removal_too(cgroup: Path) -> None:
    """The mount table is read again only when the kernel signals a change (``POLLPRI``)."""
    in_own_mount_namespace("""
        plain = PlainReads(CGROUP.parent)
        assert plain.check() is True
        reads = plain.rereads
        assert plain.check() is True and plain.rereads == reads  # nothing changed: not read again
        with tmpfs_on(CGROUP):
            assert plain.check() is False  # a tmpfs below: a FIFO or a device could be planted there
            assert plain.rereads == reads + 1
        assert plain.check() is True
        assert plain.rereads == reads + 2
        """, cgroup)


@pytest.mark.root
def test_plain_and_checked_reads_of_a_real_cgroup_agree(cgroup: Path) -> None:
    from collectors.fsread import read_regular

    for name in os.listdir(cgroup):
        path = str(cgroup / name)
        checked = read_regular(path, 65536, past_limit="truncate").data
        assert read_plain(path, 65536) == checked, name  # None for write-only files, both ways


@pytest.mark.root  # unshare(1) of a mount namespace
def test_a_hierarchy_named_through_another_namespaces_root_is_read_checked() -> None:
    """``/proc/<pid>/root/sys/fs/cgroup/…`` resolves in another mount namespace, whose mounts (a tmpfs
    with a FIFO planted below the hierarchy, say) this process's table does not list: its mount is not
    in this table, so no plain reads (found by review: a ``realpath`` of the name looked like our own)."""
    hierarchy = _hierarchy()
    holder = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sleep", "60"])
    try:
        other = Path(f"/proc/{holder.pid}/root") / hierarchy.relative_to("/")
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{holder.pid}/ns/mnt") == os.readlink("/proc/self/ns/mnt"):
            assert time.monotonic() < deadline, "unshare did not enter a mount namespace of its own"
            time.sleep(0.01)
        assert PlainReads(hierarchy).check() is True
        assert PlainReads(other).check() is False
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.root
def test_a_kept_descriptor_closed_behind_its_back_is_opened_again(cgroup: Path) -> None:
    """``POLLNVAL`` (the descriptor is not open any more) is a change: the table is read afresh."""
    in_own_mount_namespace("""
        plain = PlainReads(CGROUP.parent)
        assert plain.check() is True
        assert plain._fd is not None
        os.close(plain._fd)
        with tmpfs_on(CGROUP):
            assert plain.check() is False
        assert plain.check() is True
        """, cgroup)


@pytest.mark.root
def test_a_devices_list_longer_than_a_page_comes_whole_in_one_read() -> None:
    """``devices.list`` is one seq_file record (``devcgroup_seq_show``, kernfs' single-record start), so the
    one read :func:`read_plain` makes with ``one_record`` holds all of it, however long: here 600 rules,
    about 7 KiB, beyond the 4 KiB page seq_file starts with; the reading to the end agrees."""
    mount = _devices_mount(cgroup_mounts())
    if mount is None:  # not a missing setup: on a cgroup v2 host there is no devices.list to read
        pytest.skip("no cgroup v1 devices hierarchy: devices.list exists only there")
    made = mount.mountpoint / f"accelstats-plain-{secrets.token_hex(4)}"
    made.mkdir()
    try:
        (made / "devices.deny").write_text("a")
        for minor in range(600):
            (made / "devices.allow").write_text(f"c 1:{1000 + minor} rw")
        path = str(made / "devices.list")
        whole = read_plain(path, 65536)
        assert whole is not None and len(whole) > 4096 and whole.count(b"\n") == 600
        assert read_plain(path, 65536, one_record=True) == whole
        fd = os.open(path, os.O_RDONLY)
        try:
            assert os.read(fd, 65536) == whole  # what one_record relies on, asked of the kernel directly
        finally:
            os.close(fd)
    finally:
        made.rmdir()
