"""Request heads as the HTTP server (:mod:`accelstats.web.server`) reads them: pure functions.

RFC 9112 rules kept strictly, since a lenient parser is what request smuggling uses: a request line
of three parts with a token method and ``HTTP/1.0`` or ``HTTP/1.1`` (another ``HTTP/x.y`` gets
``505``), header lines ``token: value`` with no folding and no space before the colon, no CR or NUL
in a value, one ``Content-Length`` of ASCII digits; at most :data:`MAX_EMPTY_LINE_BYTES` of empty
lines before a request (RFC 9112 §2.2 asks a server to ignore at least one; a stream of them is an
attack); at most :data:`MAX_HEADERS` header lines (``431``) in at most :data:`MAX_HEAD_BYTES` bytes.
Keep-alive is HTTP/1.1's default and HTTP/1.0's ``Connection: keep-alive``; a request that announces
a body is answered and its connection closed (no GET or HEAD needs one, and an unread body must not
be taken for the next request).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from email.utils import formatdate
from urllib.parse import urlsplit

TEXT = "text/plain; charset=utf-8"
MAX_HEAD_BYTES = 32768
MAX_HEADERS = 100
MAX_EMPTY_LINE_BYTES = 64  # CR and LF bytes ignored before one request; more is not a client's mistake
_DIGITS = re.compile(r"[0-9]+")
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


@dataclass(frozen=True)
class Request:
    """One parsed request head: method, target and version as sent, headers in order (name, value:
    latin-1 decoded), whether the connection may serve another request after this one, and the
    target's path (still percent-encoded) and query (an absolute-form target, ``http://host/path``,
    reduced to them: RFC 9112 §3.2.2)."""

    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]
    keep_alive: bool
    path: str = "/"
    query: str = ""


class BadRequestError(Exception):
    """A request head this server does not accept: ``status`` is the answer's status line
    (``400``, ``431`` or ``505``), the message the reason sent in its body."""

    def __init__(self, status: str, why: str) -> None:
        super().__init__(why)
        self.status = status


def parse_head(head: bytes) -> Request:
    """A request head (request line and header lines, CRLF or LF, without the blank line) → request;
    raises :class:`BadRequestError` (status, reason) when it is not one this server accepts."""
    lines = [line[:-1] if line.endswith(b"\r") else line for line in head.split(b"\n")]
    parts = lines[0].split(b" ")
    if len(parts) != 3:
        raise BadRequestError("400 Bad Request", "malformed request line")
    method, target, version = parts
    if not _TOKEN.fullmatch(method):
        raise BadRequestError("400 Bad Request", "bad method")
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        if re.fullmatch(rb"HTTP/\d\.\d", version):
            raise BadRequestError("505 HTTP Version Not Supported", "HTTP version")
        raise BadRequestError("400 Bad Request", "bad HTTP version")
    if not target or any(b < 0x21 or b == 0x7F for b in target):
        raise BadRequestError("400 Bad Request", "bad request target")
    if len(lines) - 1 > MAX_HEADERS:
        raise BadRequestError("431 Request Header Fields Too Large", "too many header lines")
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN.fullmatch(name):  # also folded lines and "Name :" (smuggling)
            raise BadRequestError("400 Bad Request", "malformed header line")
        value = value.strip(b" \t")
        if b"\r" in value or b"\x00" in value:
            raise BadRequestError("400 Bad Request", "control character in a header value")
        headers.append((name.decode("ascii"), value.decode("latin-1")))
    tokens = {t.strip().lower() for n, v in headers if n.lower() == "connection" for t in v.split(",")}
    keep_alive = "close" not in tokens if version == b"HTTP/1.1" else "keep-alive" in tokens
    lengths = {v.strip() for n, v in headers if n.lower() == "content-length"}
    if len(lengths) > 1 or any(not _DIGITS.fullmatch(v) for v in lengths):  # not str.isdigit: "²" is one
        raise BadRequestError("400 Bad Request", "bad Content-Length")
    if any(n.lower() == "transfer-encoding" for n, _ in headers) or lengths - {"0"}:
        keep_alive = False  # a body we do not read: answer, then close
    text = target.decode("latin-1")
    path, query = split_target(text)
    return Request(method.decode("ascii"), text, version.decode("ascii"), headers, keep_alive, path, query)


def split_target(target: str) -> tuple[str, str]:
    """``(path, query)`` of a request target in origin form (``/metrics?x``) or absolute form
    (``http://host:port/metrics?x``, path ``/`` when empty); raises :class:`BadRequestError` (400)
    for an absolute form ``urlsplit`` refuses (e.g. ``http://[::1/metrics``: an unclosed IPv6
    literal)."""
    if target.lower().startswith(("http://", "https://")):
        try:
            parts = urlsplit(target)
            parts.port  # noqa: B018 - raises ValueError for a port that is not a number
        except ValueError as exc:
            raise BadRequestError("400 Bad Request", "bad request target") from exc
        return parts.path or "/", parts.query
    path, _, query = target.partition("?")
    return path, query


def strip_empty_lines(buf: bytearray) -> int:
    """Drop the empty lines before a request (RFC 9112 §2.2: a server ignores at least one); returns
    how many bytes were dropped, which the caller bounds (:data:`MAX_EMPTY_LINE_BYTES`)."""
    dropped = len(buf) - len(buf.lstrip(b"\r\n"))
    del buf[:dropped]
    return dropped


def head_end(buf: bytearray) -> int:
    """Index just past the blank line that ends the head in ``buf``, or -1."""
    ends = [i + 3 for i in (buf.find(b"\n\r\n"),) if i >= 0] + [i + 2 for i in (buf.find(b"\n\n"),) if i >= 0]
    return min(ends) if ends else -1


def simple_answer(status: str, body: bytes, extra: Sequence[tuple[str, str]] = ()) -> bytes:
    """A complete answer that closes its connection (errors the event loop answers itself)."""
    head = [f"HTTP/1.1 {status}", f"Content-Type: {TEXT}", f"Content-Length: {len(body)}",
            f"Date: {formatdate(usegmt=True)}", "Connection: close", *(f"{n}: {v}" for n, v in extra)]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
