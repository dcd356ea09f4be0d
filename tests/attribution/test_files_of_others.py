"""Files accelstats reads on behalf of others (issue 24, rows 6 and 12): a container's ``devices.list``
in a cgroup tree and the runtimes' state files, where whoever controls the tree can put a symbolic
link to a device node or to a root-only file.

===================================  ==========================================  ======================
planted                              before (dbbc921)                            now
===================================  ==========================================  ======================
``devices.list`` -> a device node    the device opened as root, then refused     never opened
``config.v2.json`` (and the other    the device opened as root, then refused     never opened
state files) -> a device node
``devices.list`` -> a root-only      its lines written to the WARNING log        not read (a link)
file
``devices.list`` holding a secret    its lines written to the WARNING log        counted, never logged
(a regular file: a hard link, a
copy in a mounted tree)
===================================  ==========================================  ======================

"Opened" is observed, not assumed: inotify reports every real ``open`` of a device node the test
made itself (``mknod`` of ``/dev/null``'s numbers, 1:3, in ``tmp_path``: nothing else opens it).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import in_ci

from accelstats.attribution.metadata import MetadataReader
from accelstats.attribution.runtimes import RuntimeState
from accelstats.cgroups.identity import ContainerIdentity
from accelstats.manager import AcceleratorManager, Collection
from accelstats.settings import RuntimeRoots, Settings
from collectors.replay.lib import open_replay

CID = "c" * 64
IN_OPEN = 0x20  # <sys/inotify.h>
SECRET = "root:$6$Zx9q1Lw0$Wm6kQpT0bS1r3yV8dHcJ2fE5aG7iK4nP9uR0tX2zB6vD8:19700:0:99999:7:::"


def _need_root(what: str) -> None:
    if os.geteuid() != 0:
        if in_ci():
            pytest.fail(f"{what} needs root, and CI runs as root", pytrace=False)
        pytest.skip(f"{what} needs root")


@pytest.fixture
def device(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A private char device node (1:3, what /dev/null is) and an inotify descriptor that reports
    each open of it."""
    _need_root("mknod")
    node = tmp_path / "watched-device"
    os.mknod(node, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    assert fd >= 0, os.strerror(ctypes.get_errno())
    assert libc.inotify_add_watch(fd, os.fsencode(node), IN_OPEN) >= 0, os.strerror(ctypes.get_errno())
    try:
        yield node, fd
    finally:
        os.close(fd)


def opens(watch: int) -> int:
    """Bytes of inotify events pending (0: nobody opened the node since the last call)."""
    try:
        return len(os.read(watch, 4096))
    except BlockingIOError:
        return 0


def v1_tree(tmp_path: Path, fixtures_dir: Path, devices_list: Path | str) -> Settings:
    """A cgroup v1 devices hierarchy under ``--cgroup-root`` with one docker container whose
    ``devices.list`` is ``devices_list`` (a link to it when it is a Path, else that text)."""
    devices = tmp_path / "cgroup" / "devices"
    container = devices / "docker" / CID
    container.mkdir(parents=True)
    (devices / "devices.list").write_text("a *:* rwm\n")
    if isinstance(devices_list, Path):
        (container / "devices.list").symlink_to(devices_list)
    else:
        (container / "devices.list").write_text(devices_list)
    (container / "cgroup.procs").write_text("")
    (tmp_path / "proc").mkdir()
    replay = fixtures_dir / "h200" / "nvidia-smi-q.xml"
    return Settings(nvml_replay=replay, cgroup_root=tmp_path / "cgroup", proc_root=tmp_path / "proc",
                    rootfs=tmp_path, collectors=("nvidia",))


def collect(settings: Settings, times: int = 1) -> Collection:
    assert settings.nvml_replay is not None
    with AcceleratorManager(settings, open_replay(settings.nvml_replay)) as manager:
        for _ in range(times):
            c = manager.collect()
    return c


# -- row 6: a link to a device is never opened ---------------------------------------------------

def test_a_devices_list_linked_to_a_device_never_opens_it(tmp_path: Path, fixtures_dir: Path,
                                                          device: tuple[Path, int]) -> None:
    node, watch = device
    c = collect(v1_tree(tmp_path, fixtures_dir, node), times=2)
    (row,) = [s for s in c.containers if s.cgroup == f"/docker/{CID}"]
    assert row.devices_cgroup == "unreadable"
    assert c.attribution_skipped["devices_list_unreadable"] >= 1
    assert opens(watch) == 0, "the attribution opened the device devices.list links to"
    os.close(os.open(node, os.O_RDONLY))  # the observation works: a real open is seen
    assert opens(watch) > 0


STATE_FILES = {  # runtime -> its state file, as metadata.py's table lays them out under rootfs
    "docker": f"var/lib/docker/containers/{CID}/config.v2.json",
    "containerd": f"run/containerd/io.containerd.runtime.v2.task/k8s.io/{CID}/config.json",
    "cri-o": f"var/lib/containers/storage/overlay-containers/{CID}/userdata/config.json",
    "podman": "var/lib/containers/storage/overlay-containers/containers.json",
}


@pytest.mark.parametrize("runtime", sorted(STATE_FILES))
def test_a_state_file_linked_to_a_device_never_opens_it(tmp_path: Path, device: tuple[Path, int],
                                                        runtime: str) -> None:
    node, watch = device
    planted = tmp_path / STATE_FILES[runtime]
    planted.parent.mkdir(parents=True)
    planted.symlink_to(node)
    state = RuntimeState(tmp_path, RuntimeRoots())
    state.refresh()
    meta = MetadataReader(tmp_path, runtimes=state).lookup(ContainerIdentity(runtime=runtime, id=CID))
    assert (meta.name, meta.image) == ("", "")
    assert opens(watch) == 0, f"the {runtime} metadata reader opened the device {planted.name} links to"
    os.close(os.open(planted, os.O_RDONLY))  # the observation works, through the same link
    assert opens(watch) > 0


# -- row 12: a file's content is never logged ----------------------------------------------------

def test_a_devices_list_linked_to_a_root_only_file_is_not_read(tmp_path: Path, fixtures_dir: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    shadow = tmp_path / "shadow"
    shadow.write_text(f"{SECRET}\n")
    shadow.chmod(0o600)
    caplog.set_level(logging.DEBUG)
    c = collect(v1_tree(tmp_path, fixtures_dir, shadow))
    (row,) = [s for s in c.containers if s.cgroup == f"/docker/{CID}"]
    assert row.devices_cgroup == "unreadable"
    assert c.devices_list_skipped_lines_total == 0  # not read at all
    assert SECRET not in caplog.text and "Wm6kQpT0" not in caplog.text


def test_a_devices_list_holding_a_secret_is_counted_never_logged(tmp_path: Path, fixtures_dir: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A regular file (a hard link to a root-only file, or a copy, in a mounted tree): its rules are
    used, the other lines counted once each, and no line's text reaches the log, the reasons or the
    metrics."""
    caplog.set_level(logging.DEBUG)
    c = collect(v1_tree(tmp_path, fixtures_dir, f"c 195:* rw\n{SECRET}\nbin:x:1:1::/bin:/usr/sbin/nologin\n"),
                times=2)
    (row,) = [s for s in c.containers if s.cgroup == f"/docker/{CID}"]
    assert row.devices_cgroup == "restricted"
    assert c.devices_list_skipped_lines_total == 2
    assert "devices.list of /docker/" in caplog.text  # the warning is there, without the line
    for text in (caplog.text, row.reason, json.dumps([r.getMessage() for r in caplog.records])):
        assert "Wm6kQpT0" not in text and "nologin" not in text


def test_a_state_file_that_is_not_json_is_named_without_its_bytes(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Not UTF-8 (UnicodeDecodeError's message quotes the byte: dbbc921 logged it) and not JSON (the
    parser's message gives the position): warned once with the path and why, never a byte."""
    caplog.set_level(logging.DEBUG)
    for cid, data in ((CID, b'{"Name": "\xe9t\xe9"}'), ("d" * 64, b'{"Name": "x", oops-secret}')):
        path = tmp_path / STATE_FILES["docker"].replace(CID, cid)
        path.parent.mkdir(parents=True)
        path.write_bytes(data)
    reader = MetadataReader(tmp_path)
    for cid in (CID, "d" * 64):
        assert reader.lookup(ContainerIdentity(runtime="docker", id=cid)).name == ""
    assert reader.errors == 2
    assert "UnicodeDecodeError" in caplog.text and "line 1 column" in caplog.text
    assert "0xe9" not in caplog.text and "oops" not in caplog.text
