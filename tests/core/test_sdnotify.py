"""accelstats.sdnotify against real AF_UNIX datagram sockets (sd_notify(3) protocol).

| NOTIFY_SOCKET | call | result | the receiver gets |
|---|---|---|---|
| unset or "" | notify("READY=1") | False | nothing (no socket created) |
| /abs/path of a bound socket | notify("READY=1") | True | b"READY=1" |
| @name (abstract) | ready("serving") | True | b"READY=1\\nSTATUS=serving" |
| /abs/path | stopping() | True | b"STOPPING=1" |
| /abs/path | status("a\\nb") | True | b"STATUS=a b" (no second assignment smuggled in) |
| missing path, relative path, vsock:… | notify(...) | False, one warning over repeated calls | — |
| any | notify("not an assignment") | ValueError | — |
"""

from __future__ import annotations

import array
import logging
import os
import socket
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from accelstats import sdnotify


@pytest.fixture(autouse=True)
def _fresh_warning_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sdnotify, "_warned", False)


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A bound AF_UNIX datagram socket on a file path, as systemd's /run/systemd/notify is."""
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    try:
        yield sock, path
    finally:
        sock.close()


def _no_datagram(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        sock.recv(4096)
    except BlockingIOError:
        return True
    return False


@pytest.mark.parametrize("env", [{}, {"NOTIFY_SOCKET": ""}])
def test_without_notify_socket_nothing_is_sent(env: dict[str, str], receiver: tuple[socket.socket, str]) -> None:
    sock, _ = receiver
    assert sdnotify.notify("READY=1", env) is False
    assert _no_datagram(sock)


def test_ready_reaches_a_path_socket(receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    assert sdnotify.notify("READY=1", {"NOTIFY_SOCKET": path}) is True
    assert sock.recv(4096) == b"READY=1"


def test_abstract_namespace_address() -> None:
    name = f"accelstats-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(5)
        assert sdnotify.ready("serving", {"NOTIFY_SOCKET": "@" + name}) is True
        assert sock.recv(4096) == b"READY=1\nSTATUS=serving"


def test_stopping_and_status(receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    env = {"NOTIFY_SOCKET": path}
    assert sdnotify.stopping(env) is True
    assert sock.recv(4096) == b"STOPPING=1"
    assert sdnotify.status("NVML unavailable:\nno driver", env) is True
    assert sock.recv(4096) == b"STATUS=NVML unavailable: no driver"


def test_sender_credentials_name_this_process(receiver: tuple[socket.socket, str]) -> None:
    """systemd attributes a notification by the kernel's SCM_CREDENTIALS (NotifyAccess=main): the
    datagram must come from this process, not from a helper."""
    sock, path = receiver
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    assert sdnotify.notify("READY=1", {"NOTIFY_SOCKET": path}) is True
    data, ancillary, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(struct.calcsize("3i")))
    assert data == b"READY=1"
    creds = [d for level, kind, d in ancillary if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS]
    assert len(creds) == 1
    pid, uid, gid = array.array("i", creds[0][: struct.calcsize("3i")])
    assert (pid, uid, gid) == (os.getpid(), os.getuid(), os.getgid())


@pytest.mark.parametrize("target", ["/nonexistent/accelstats/notify", "run/systemd/notify", "vsock:2:1234", "@"])
def test_unreachable_socket_returns_false_and_warns_once(
        target: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="accelstats.sdnotify")
    env = {"NOTIFY_SOCKET": target}
    assert sdnotify.notify("READY=1", env) is False
    assert sdnotify.notify("STOPPING=1", env) is False
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert repr(target) in warnings[0].getMessage()
    assert sum(1 for r in caplog.records if r.levelno == logging.DEBUG) == 1


def test_socket_that_is_gone_returns_false(receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    sock.close()
    os.unlink(path)
    assert sdnotify.notify("READY=1", {"NOTIFY_SOCKET": path}) is False


@pytest.mark.parametrize("state", ["", "READY", "ready=1", "READY=1\n", "READY=1\n\nSTATUS=x", "=1"])
def test_malformed_message_is_a_value_error(state: str, receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    with pytest.raises(ValueError, match="VARIABLE=value"):
        sdnotify.notify(state, {"NOTIFY_SOCKET": path})
    assert _no_datagram(sock)


def test_socket_address_forms() -> None:
    assert sdnotify.socket_address("/run/systemd/notify") == "/run/systemd/notify"
    assert sdnotify.socket_address("@/org/freedesktop/systemd1/notify/1") == b"\0/org/freedesktop/systemd1/notify/1"
    with pytest.raises(OSError, match="neither an absolute"):
        sdnotify.socket_address("notify")
