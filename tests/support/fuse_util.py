"""A real FUSE filesystem whose server stops answering: what a dead s3fs, gcsfuse or NFS server does to
the processes that touch it.

:class:`HangingFuse` opens ``/dev/fuse``, mounts it (root; ``mount -i -t fuse`` with ``fd=``: ``-i``
keeps util-linux from handing the mount to ``/sbin/mount.fuse``, which Debian's ``fuse3`` installs and
which would run the source name as a FUSE server program, exit 127), and answers
the kernel's requests on a thread with the FUSE wire protocol (``include/uapi/linux/fuse.h``): INIT, a
root directory holding one directory ``d`` and one regular file ``f``, LOOKUP, GETATTR, OPEN,
OPENDIR, READDIR (empty), FLUSH, RELEASE; everything else gets ENOSYS. Attributes and entries are
never cached (``attr_valid = entry_valid = 0``), so every ``stat`` is a GETATTR that reaches the
server. After :meth:`hang`, the server stops reading requests: any process touching the mount, in
the kernel, waits for an answer that never comes. :meth:`close` closes the server's ``/dev/fuse``
descriptor, which aborts the connection (``fuse_dev_release``): the waiting requests fail with
ENOTCONN and whatever was stuck returns; then it unmounts.
"""

from __future__ import annotations

import contextlib
import os
import select
import struct
import subprocess
import tempfile
import threading
from pathlib import Path
from types import TracebackType

_IN_HEADER = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, total_extlen, padding
_OUT_HEADER = struct.Struct("<IiQ")  # len, error, unique
# fuse_attr: ino size blocks atime mtime ctime, 3 nsec, mode nlink uid gid rdev blksize flags
_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
LOOKUP, FORGET, GETATTR, OPEN, RELEASE, INIT, FLUSH, OPENDIR, READDIR, RELEASEDIR = 1, 2, 3, 14, 18, 26, 25, 27, 28, 29
ROOT, DIR, FILE = 1, 2, 3
ENOENT, ENOSYS = 2, 38


def _attr(node: int) -> bytes:
    mode = {ROOT: 0o040755, DIR: 0o040755, FILE: 0o100644}[node]
    return _ATTR.pack(node, 4096 if node != FILE else 5, 8, 0, 0, 0, 0, 0, 0, mode, 2 if node != FILE else 1,
                      0, 0, 0, 4096, 0)


class HangingFuse:
    """A FUSE mount at :attr:`mountpoint` (a fresh temporary directory) served until :meth:`hang`."""

    def __init__(self) -> None:
        self.mountpoint = Path(tempfile.mkdtemp(prefix="accelstats-fuse-"))
        self._fd = -1
        self._hang = threading.Event()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> HangingFuse:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def start(self) -> None:
        """Open ``/dev/fuse``, start answering, mount, and wait until the mount answers a ``stat``."""
        self._fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        opts = f"fd={self._fd},rootmode=40000,user_id=0,group_id=0"
        # -i (--internal-only): mount(2) itself, never a /sbin/mount.fuse helper (fuse3's would exec the source)
        cmd = ["mount", "-i", "-t", "fuse", "-o", opts, "accelstats-hang", str(self.mountpoint)]
        done = subprocess.run(cmd, pass_fds=(self._fd,), capture_output=True, text=True, timeout=30, check=False)
        if done.returncode != 0:
            raise OSError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()}")
        # only now: /dev/fuse cannot be read before it is mounted (the read fails, the thread would end)
        self._thread = threading.Thread(target=self._serve, name="hanging-fuse", daemon=True)
        self._thread.start()
        (self.mountpoint / "f").stat()

    def hang(self) -> None:
        """Stop answering: every request from now on waits until :meth:`close`."""
        self._hang.set()

    def _reply(self, unique: int, error: int = 0, body: bytes = b"") -> None:
        os.write(self._fd, _OUT_HEADER.pack(_OUT_HEADER.size + len(body), -error, unique) + body)

    def _serve(self) -> None:
        """Answer requests until :meth:`hang`; then wait for :meth:`close` and close the descriptor
        (this thread holds the only reference to it: closing it aborts the connection)."""
        try:
            while not self._closing.is_set():
                if self._hang.is_set():
                    self._closing.wait()
                    break
                ready, _, _ = select.select([self._fd], [], [], 0.05)
                if not ready or self._hang.is_set():
                    continue
                data = os.read(self._fd, 1 << 20)
                length, opcode, unique, node = _IN_HEADER.unpack_from(data)[:4]
                self._handle(opcode, unique, node, data[_IN_HEADER.size:length])
        except OSError:
            pass  # the connection was aborted or unmounted
        finally:
            with contextlib.suppress(OSError):
                os.close(self._fd)

    def _handle(self, opcode: int, unique: int, node: int, arg: bytes) -> None:
        if opcode == INIT:
            out = struct.pack("<IIIIHHIIHHI", 7, 31, 65536, 0, 12, 9, 65536, 1, 32, 0, 0).ljust(64, b"\0")
            self._reply(unique, body=out)
        elif opcode == LOOKUP:
            name = arg.split(b"\0", 1)[0]
            child = {b"d": DIR, b"f": FILE}.get(name) if node == ROOT else None
            if child is None:
                self._reply(unique, ENOENT)
            else:
                self._reply(unique, body=struct.pack("<QQQQII", child, 0, 0, 0, 0, 0) + _attr(child))
        elif opcode == GETATTR:
            self._reply(unique, body=struct.pack("<QII", 0, 0, 0) + _attr(node))
        elif opcode in (OPEN, OPENDIR):
            self._reply(unique, body=struct.pack("<QII", 1, 0, 0))
        elif opcode == READDIR:
            self._reply(unique)  # no entries
        elif opcode in (FLUSH, RELEASE, RELEASEDIR):
            self._reply(unique)
        elif opcode == FORGET:
            return  # no reply
        else:
            self._reply(unique, ENOSYS)

    def close(self) -> None:
        """Abort the connection (stuck requests fail with ENOTCONN), unmount, remove the directory."""
        self._hang.set()
        self._closing.set()
        if self._thread is not None:
            self._thread.join(10)
        elif self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
        subprocess.run(["umount", "-l", str(self.mountpoint)], capture_output=True, check=False, timeout=30)
        with contextlib.suppress(OSError):
            self.mountpoint.rmdir()
