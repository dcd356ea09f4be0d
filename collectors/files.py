"""File devices, as Nomad's example device plugin (``example-fs-device``) models them.

Every regular file (not a directory, not a symlink to one) directly in ``directory`` is a device
whose ID is the file name. It is unhealthy when its 10-character permission string
(``stat.filemode``, e.g. ``-rwxrwxrwx``) equals ``unhealthy_perm``; the description then reads
``Device has bad permissions "<perm>"`` like the example plugin's (spec/nomad-plugin.md §4).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from collectors.model import DeviceSnapshot, FileDevice

log = logging.getLogger(__name__)


class FileDevicesError(Exception):
    """The file-devices directory is missing or not a directory (a start-up error: exit code 2)."""


def scan_file_devices(directory: Path, *, unhealthy_perm: str = "-rwxrwxrwx", vendor: str = "nomad",
                      device_type: str = "file", name: str = "mock") -> list[FileDevice]:
    """List the file devices in ``directory``, sorted by ID.

    Raises FileNotFoundError / NotADirectoryError / PermissionError when the directory itself cannot
    be listed; a file that vanishes between listing and ``stat`` is skipped.
    """
    devices = []
    with os.scandir(directory) as entries:
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=True)
            except OSError:
                continue  # vanished or dangling link: not a device
            if not stat.S_ISREG(st.st_mode):
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

    def check(self) -> None:
        """Raise FileDevicesError naming the directory when it does not exist or is not a directory."""
        if not self.directory.exists():
            raise FileDevicesError(f"file-devices directory {self.directory} does not exist")
        if not self.directory.is_dir():
            raise FileDevicesError(f"file-devices path {self.directory} is not a directory")

    def update(self, snapshot: DeviceSnapshot) -> None:
        """Add the directory's file devices to ``snapshot.file_devices``.

        Raises OSError when the directory cannot be listed (then no file devices are reported).
        """
        try:
            found = scan_file_devices(self.directory, unhealthy_perm=self.unhealthy_perm, vendor=self.vendor,
                                      device_type=self.device_type, name=self.device_name)
        except OSError as exc:
            if not self._missing_logged:
                log.warning("file devices: cannot list %s: %s", self.directory, exc.strerror or exc)
                self._missing_logged = True
            raise
        if self._missing_logged:
            log.info("file devices: %s is readable again", self.directory)
            self._missing_logged = False
        snapshot.file_devices.extend(found)
