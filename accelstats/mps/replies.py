"""Pure parsers of what an MPS control daemon says: command replies and log lines (docs/mps.md,
"Watch" and "Log lines"; replies measured on an H200 with driver 580).

They never raise on odd text, only TypeError for a non-``str`` argument; digits are ASCII and
bounded (fuzzing found the Kelvin sign matching ``K`` and 5000-digit numbers; tests/fuzz).
"""

from __future__ import annotations

import datetime as dt
import math
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class MpsLogLine:
    """One line of ``control.log`` / ``server.log``: ``[YYYY-MM-DD HH:MM:SS.mmm <Source> <pid>] <text>``.

    ``timestamp``: naive, in the host's local time as the daemon wrote it (the line has no zone);
    ``source``: ``Control``, ``Server`` or ``Other`` (seen in the H200 captures); ``pid``: the writing
    process; ``text``: the rest of the line, without the trailing newline.
    """

    timestamp: dt.datetime
    source: str
    pid: int
    text: str


# --------------------------------------------------------------------------------------------
# pure parsers


def _check_str(text: object, what: str) -> str:
    if not isinstance(text, str):
        raise TypeError(f"{what} expects str, got {type(text).__name__}")
    return text


def _pid_lines(text: str) -> list[int]:
    pids = []
    for line in text.splitlines():
        word = line.strip()
        if word.isascii() and word.isdigit() and len(word) <= 10 and int(word) > 0:  # a PID: at most 2^22
            pids.append(int(word))
    return pids


def parse_server_list(text: str) -> list[int]:
    """PIDs from a ``get_server_list`` reply: one per line (``"490"``), empty before any client.

    Lines that are not a positive decimal PID are skipped. Raises TypeError only for a non-``str``.
    """
    return _pid_lines(_check_str(text, "parse_server_list"))


def parse_client_list(text: str) -> list[int]:
    """Client PIDs (host PID namespace) from a ``get_client_list <server pid>`` reply, one per line.

    Empty when the server has no client (measured after the only client exited). Lines that are not
    a positive decimal PID are skipped. Raises TypeError only for a non-``str``.
    """
    return _pid_lines(_check_str(text, "parse_client_list"))


_DEVICE_RE = re.compile(r"\[(\d{1,4})\]", re.ASCII)
_CLIENT_CTX_RE = re.compile(r"(\d{1,10})(?:\.\d{1,10})?", re.ASCII)


def parse_device_client_list(text: str) -> dict[int, list[int]]:
    """``{device ordinal: client PIDs}`` from a ``get_device_client_list`` reply (docs/mps.md, measured
    with one client on an H200: ``[0] 00:00.0, NVIDIA H200`` then ``473.1``, i.e. a device line, then
    one ``<pid>.<context>`` line per client that enumerated it). The ordinal is the daemon's own (its
    ``CUDA_VISIBLE_DEVICES`` order). Client lines before any device line and other lines are skipped;
    a PID listed twice for a device counts once. Raises TypeError only for a non-``str``.
    """
    out: dict[int, list[int]] = {}
    device: int | None = None
    for line in _check_str(text, "parse_device_client_list").splitlines():
        word = line.strip()
        head = _DEVICE_RE.match(word)
        if head is not None:
            device = int(head.group(1))
            out.setdefault(device, [])
            continue
        client = _CLIENT_CTX_RE.fullmatch(word)
        if client is not None and device is not None:
            pid = int(client.group(1))
            if pid > 0 and pid not in out[device]:
                out[device].append(pid)
    return out


def parse_percentage(text: str) -> float | None:
    """The active-thread percentage from a reply such as ``"100.0"`` or ``"25.0"``.

    None unless the stripped reply is one finite number in 0..100. Raises TypeError only for a
    non-``str``.
    """
    word = _check_str(text, "parse_percentage").strip()
    if not re.fullmatch(r"[+]?(\d+(\.\d*)?|\.\d+)", word, re.ASCII):
        return None
    value = float(word)
    return value if math.isfinite(value) and 0.0 <= value <= 100.0 else None


_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# ASCII: with IGNORECASE alone, "K" would also match the Kelvin sign U+212A (found by fuzzing)
_SIZE_RE = re.compile(r"(\d{1,18})\s*([KMGT])(?:i?B)?", re.IGNORECASE | re.ASCII)


def parse_pinned_limit(text: str) -> int | None:
    """Bytes from a ``get_default_device_pinned_mem_limit <index>`` reply.

    The daemon takes and shows an integer with a binary qualifier (``4096M``; some drivers show a
    limit of 1 GiB or more as whole GiB, ``70G``); ``K``/``T`` and a ``B``/``iB`` suffix are accepted
    too. None for an empty reply (no limit set, as measured) or anything else (a bare number has no
    documented unit). Raises TypeError only for a non-``str``.
    """
    match = _SIZE_RE.fullmatch(_check_str(text, "parse_pinned_limit").strip())
    if match is None:
        return None
    return int(match.group(1)) * _SIZE_UNITS[match.group(2).upper()]


_LOG_RE = re.compile(
    r"\[(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\.\d{3}) +([A-Za-z]+) +(\d{1,10})\] ?(.*)", re.ASCII)


def parse_log_line(line: str) -> MpsLogLine | None:
    """Parse one MPS log line, e.g. ``[2026-11-30 10:58:36.064 Control   500] Starting control daemon…``.

    None for a line of another shape or with an impossible date. Raises TypeError only for a
    non-``str``.
    """
    # the line end is stripped first: "(.*?)[\r\n]*" under fullmatch took time quadratic in a run of \r
    match = _LOG_RE.fullmatch(_check_str(line, "parse_log_line").rstrip("\r\n"))
    if match is None:
        return None
    stamp, source, pid, text = match.groups()
    try:
        timestamp = dt.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f")
    except ValueError:
        return None
    return MpsLogLine(timestamp=timestamp, source=source, pid=int(pid), text=text)
