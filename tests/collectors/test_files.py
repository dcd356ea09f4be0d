"""File devices as Nomad's example plugin models them (spec/nomad-plugin.md §4)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from collectors.files import FileDevices, FileDevicesError, scan_file_devices
from collectors.model import DeviceSnapshot, NoDataError


def test_every_entry_but_directories_is_a_device_and_links_are_not_followed(tmp_path: Path) -> None:
    """As the example plugin (ioutil.ReadDir = lstat): a symlink is a device of its own, never followed."""
    (tmp_path / "b").write_bytes(b"12345")
    (tmp_path / "a").write_bytes(b"")
    (tmp_path / "subdir").mkdir()
    (tmp_path / "link-to-dir").symlink_to(tmp_path / "subdir")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    os.chmod(tmp_path / "a", 0o640)
    os.utime(tmp_path / "b", (1_700_000_000, 1_700_000_000))
    devices = scan_file_devices(tmp_path)
    assert [d.id for d in devices] == ["a", "b", "dangling", "link-to-dir"]
    a, b, dangling, link = devices
    assert link.permissions.startswith("l") and link.size_bytes == len(str(tmp_path / "subdir"))
    assert dangling.permissions.startswith("l")
    assert (a.mode, a.permissions, a.size_bytes, a.healthy) == (0o640, "-rw-r-----", 0, True)
    assert (b.size_bytes, b.modified_timestamp_seconds) == (5, 1_700_000_000)
    assert b.path == str(tmp_path.resolve() / "b")
    assert (b.vendor, b.type, b.name) == ("nomad", "file", "mock")


def test_names_that_are_not_utf8_are_skipped_counted_and_logged_once(tmp_path: Path) -> None:
    (tmp_path / "ok").write_text("")
    os.close(os.open(os.fsencode(tmp_path) + b"/bad\xff", os.O_CREAT | os.O_WRONLY))
    collector = FileDevices(tmp_path)
    for _ in range(2):
        snap = DeviceSnapshot()
        collector.update(snap)
        assert [f.id for f in snap.file_devices] == ["ok"]
        assert snap.file_devices_skipped_total == 1


def test_unhealthy_when_permissions_match(tmp_path: Path) -> None:
    (tmp_path / "bad").write_text("x")
    os.chmod(tmp_path / "bad", 0o777)
    (tmp_path / "good").write_text("x")
    bad, good = scan_file_devices(tmp_path, unhealthy_perm="-rwxrwxrwx")
    assert not bad.healthy
    assert bad.health_description == 'Device has bad permissions "-rwxrwxrwx"'
    assert good.healthy and good.health_description == ""


def test_empty_directory_has_no_devices(tmp_path: Path) -> None:
    assert scan_file_devices(tmp_path) == []


def test_missing_directory_is_a_startup_error(tmp_path: Path) -> None:
    with pytest.raises(FileDevicesError, match="does not exist"):
        FileDevices(tmp_path / "absent").check()
    (tmp_path / "file").write_text("")
    with pytest.raises(FileDevicesError, match="not a directory"):
        FileDevices(tmp_path / "file").check()


def test_directory_that_disappears_later_then_returns(tmp_path: Path) -> None:
    d = tmp_path / "devs"
    d.mkdir()
    (d / "dev0").write_text("")
    collector = FileDevices(d)
    collector.check()
    snap = DeviceSnapshot()
    collector.update(snap)
    assert [f.id for f in snap.file_devices] == ["dev0"]
    (d / "dev0").unlink()
    d.rmdir()
    snap = DeviceSnapshot()
    with pytest.raises(NoDataError, match="cannot list"):
        collector.update(snap)  # the runner reports collector success 0; devices are gone
    assert snap.file_devices == []
    d.mkdir()
    (d / "dev1").write_text("")
    snap = DeviceSnapshot()
    collector.update(snap)
    assert [f.id for f in snap.file_devices] == ["dev1"]
