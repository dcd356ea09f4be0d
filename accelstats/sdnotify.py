"""systemd readiness notification (``Type=notify``): a stdlib implementation of ``sd_notify(3)``.

The protocol (sd_notify(3), "Notes"): the service manager passes the address of an ``AF_UNIX``
datagram socket in ``$NOTIFY_SOCKET``; the service sends one datagram per notification whose text
is newline-separated ``VARIABLE=value`` assignments (``READY=1``, ``STOPPING=1``, ``STATUS=...``).
An address starting with ``@`` is in the Linux abstract namespace (the ``@`` stands for a leading
NUL byte); any other address must be an absolute path. systemd finds the sender's PID from the
kernel's ``SCM_CREDENTIALS`` on the socket, so with ``NotifyAccess=main`` (the default) only the
main process may notify; nothing has to be added to the datagram for that.

Outside systemd (``$NOTIFY_SOCKET`` unset) every call is a no-op that returns False. A socket that
cannot be reached (missing, refused, an address form this module does not speak such as
``vsock:``) is logged at warning level the first time and at debug level afterwards, and the call
returns False: a notification never raises into the server. Only a malformed *message* (a
programming error in the caller) raises ``ValueError``.

Typical use in ``accelstats serve``::

    sdnotify.notify("READY=1\\nSTATUS=serving http://[::]:9847/metrics")   # once listening
    sdnotify.notify("STOPPING=1")                                         # on SIGTERM
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
from collections.abc import Mapping

log = logging.getLogger(__name__)

__all__ = ["notify", "ready", "socket_address", "status", "stopping"]

# One assignment per line: an upper-case variable name (sd_notify(3) names: READY, RELOADING,
# STOPPING, STATUS, ERRNO, MAINPID, WATCHDOG, ...), "=", a value without a newline.
_ASSIGNMENT = re.compile(r"[A-Z][A-Z0-9_]*=[^\n]*")

_warned = False
_warned_lock = threading.Lock()


def socket_address(value: str) -> str | bytes:
    """Turn a ``$NOTIFY_SOCKET`` value into an ``AF_UNIX`` address for :meth:`socket.socket.sendto`.

    ``"@name"`` → ``b"\\0name"`` (abstract namespace); ``"/run/systemd/notify"`` → itself.
    Raises ``OSError`` (errno-less, with the reason) for any other form: a relative path, an empty
    value, or a ``vsock:``/other address family this module does not implement.
    """
    if value.startswith("@") and len(value) > 1:
        return b"\0" + value[1:].encode("utf-8", errors="surrogateescape")
    if value.startswith("/"):
        return value
    raise OSError(f"NOTIFY_SOCKET={value!r} is neither an absolute AF_UNIX path nor an @abstract name")


def _check(state: str) -> bytes:
    lines = state.split("\n")
    for line in lines:
        if not _ASSIGNMENT.fullmatch(line):
            raise ValueError(f"sd_notify message line {line!r} is not VARIABLE=value (state {state!r})")
    return state.encode("utf-8", errors="surrogateescape")


def _log_failure(message: str) -> None:
    global _warned
    with _warned_lock:
        first = not _warned
        _warned = True
    if first:
        log.warning("%s (readiness notifications to systemd are lost; logged once)", message)
    else:
        log.debug("%s", message)


def notify(state: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (newline-separated ``VARIABLE=value`` lines) to the service manager.

    ``environ`` defaults to ``os.environ`` (tests pass their own mapping). Returns True when the
    datagram was sent, False when ``NOTIFY_SOCKET`` is unset or empty (not run by systemd with
    ``Type=notify``) or the socket could not be reached (logged once at warning level). Raises
    ``ValueError`` only for a malformed ``state``: an empty line, a line without ``=``, a
    lower-case or empty variable name.
    """
    data = _check(state)
    env = os.environ if environ is None else environ
    target = env.get("NOTIFY_SOCKET", "")
    if not target:
        return False
    try:
        address = socket_address(target)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(data, address)
    except OSError as exc:
        _log_failure(f"sd_notify to {target!r} failed: {exc.strerror or exc}")
        return False
    return True


def status(text: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send ``STATUS=<text>`` (shown by ``systemctl status``); newlines in ``text`` become spaces."""
    return notify("STATUS=" + " ".join(text.splitlines()), environ)


def ready(status_text: str = "", environ: Mapping[str, str] | None = None) -> bool:
    """Send ``READY=1`` (and ``STATUS=<status_text>`` when given): start-up is complete."""
    extra = "\nSTATUS=" + " ".join(status_text.splitlines()) if status_text else ""
    return notify("READY=1" + extra, environ)


def stopping(environ: Mapping[str, str] | None = None) -> bool:
    """Send ``STOPPING=1``: the service is shutting down (systemd then waits for the exit)."""
    return notify("STOPPING=1", environ)
