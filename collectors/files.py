"""File devices, as Nomad's example device plugin (``example-fs-device``) models them.

Every entry directly in ``directory`` that is not a directory is a device whose ID is the file
name; entries are ``lstat``-ed, as the example plugin's ``ioutil.ReadDir`` does, so a symlink is a
device of its own and is never followed (a link to ``/etc/passwd`` does not expose that file's size).
A name that is not valid UTF-8 cannot be a device ID (Nomad IDs and Prometheus labels are UTF-8): it
is skipped, logged once and counted (``accelstats_file_devices_skipped_total``). A device is
unhealthy when its 10-character permission string (``stat.filemode``, e.g. ``-rwxrwxrwx``) equals
``unhealthy_perm``; the description then reads ``Device has bad permissions "<perm>"`` like the
example plugin's (docs/nomad.md).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from collectors.model import DeviceSnapshot, FileDevice, NoDataError

log = logging.getLogger(__name__)


class FileDevicesError(Exception):
    """The file-devices directory is missing or not a directory (a start-up error: exit code 2)."""


def scan_file_devices(directory: Path, *, unhealthy_perm: str = "-rwxrwxrwx", vendor: str = "nomad",
                      device_type: str = "file", name: str = "mock",
                      skipped: list[str] | None = None) -> list[FileDevice]:
    """List the file devices in ``directory``, sorted by ID.

    Names that are not valid UTF-8 are appended to ``skipped`` (as ``os.fsdecode`` gives them)
    instead. Raises FileNotFoundError / NotADirectoryError / PermissionError when the directory
    itself cannot be listed; an entry that vanishes between listing and ``lstat`` is skipped.
    """
    devices = []
    with os.scandir(directory) as entries:
        for entry in entries:
            try:
                entry.name.encode("utf-8")
            except UnicodeEncodeError:
                if skipped is not None:
                    skipped.append(entry.name)
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # vanished meanwhile
            if stat.S_ISDIR(st.st_mode):
                continue
            perm = stat.filemode(st.st_mode)
            healthy = perm != unhealthy_perm
            devices.append(FileDevice(
                id=entry.name, path=str(Path(directory).resolve() / entry.name), vendor=vendor,
                type=device_type, name=name, healthy=healthy,
                health_description="" if healthy else f'Device has bad permissions "{perm}"',
                size_bytes=st.st_size, modified_timestamp_seconds=st.st_mtime,
                mode=stat.S_IMODE(st.st_mode), permissions=perm,
            ))
    devices.sort(key=lambda d: d.id)
    return devices


class FileDevices:
    """The ``files`` collector: scans ``directory`` on every collection.

    ``check()`` is the start-up validation (raises FileDevicesError). Later, when the directory
    disappears, ``update`` reports no devices and logs once; it never raises past the runner except
    as the collector's failure.
    """

    name = "files"

    def __init__(self, directory: Path, *, unhealthy_perm: str = "-rwxrwxrwx", vendor: str = "nomad",
                 device_type: str = "file", name: str = "mock") -> None:
        self.directory = Path(directory)
        self.unhealthy_perm = unhealthy_perm
        self.vendor = vendor
        self.device_type = device_type
        self.device_name = name
        self._missing_logged = False
        self._skipped_names: set[str] = set()

    @property
    def skipped_total(self) -> int:
        """Distinct directory entries skipped so far because their names are not UTF-8."""
        return len(self._skipped_names)

    def check(self) -> None:
        """Raise FileDevicesError naming the directory when it does not exist or is not a directory."""
        if not self.directory.exists():
            raise FileDevicesError(f"file-devices directory {self.directory} does not exist")
        if not self.directory.is_dir():
            raise FileDevicesError(f"file-devices path {self.directory} is not a directory")

    def update(self, snapshot: DeviceSnapshot) -> None:
        """Add the directory's file devices to ``snapshot.file_devices``.

        Raises NoDataError when the directory cannot be listed (then no file devices are reported;
        the reason is logged once at warning level).
        """
        skipped: list[str] = []
        try:
            found = scan_file_devices(self.directory, unhealthy_perm=self.unhealthy_perm, vendor=self.vendor,
                                      device_type=self.device_type, name=self.device_name, skipped=skipped)
        except OSError as exc:
            if not self._missing_logged:
                log.warning("file devices: cannot list %s: %s", self.directory, exc.strerror or exc)
                self._missing_logged = True
            raise NoDataError(f"cannot list {self.directory}: {exc.strerror or exc}") from exc
        for bad in skipped:
            if bad not in self._skipped_names:
                self._skipped_names.add(bad)
                log.warning("file devices: skipped %r in %s: the name is not UTF-8", bad, self.directory)
        snapshot.file_devices_skipped_total = self.skipped_total
        if self._missing_logged:
            log.info("file devices: %s is readable again", self.directory)
            self._missing_logged = False
        snapshot.file_devices.extend(found)
