"""A Nomad-faithful client for an external device plugin, for tests and by hand.

``python -m support.nomadclient.launcher <binary> [config.json]`` drives a plugin binary the way a
Nomad client does at agent start (spec/nomad-plugin.md §1 and §3) and prints a JSON report; it
exits 1 when anything Nomad would refuse, or a user would notice, turned up. It plays the role of
Nomad's own ``nomad-plugin-launcher`` (hashicorp/nomad ``plugins/shared/cmd/launcher``).

Sources of each behaviour:

* launch and handshake — hashicorp/go-plugin ``client.go`` ``Start``: the parent's environment
  plus ``NOMAD_PLUGIN_MAGIC_COOKIE`` (Nomad's ``plugins/base/plugin.go`` ``Handshake``),
  ``PLUGIN_MIN_PORT=10000``, ``PLUGIN_MAX_PORT=25000``, ``PLUGIN_PROTOCOL_VERSIONS=2``; the first
  stdout line, trimmed and split on ``|`` (at most 6 fields), within ``StartTimeout`` (1 minute);
  core version 1, app version 2, network ``unix``/``tcp``, protocol ``grpc`` (Nomad's
  ``AllowedProtocols``; a missing 5th field means ``netrpc``). Later stdout is discarded.
* stderr — go-plugin ``client.go`` ``logStderr`` and ``log_entry.go`` ``parseJSON``: lines of at
  most 64 KiB; a JSON object is an hclog record (``@message``, ``@level``, ``@timestamp`` parsed
  with layout ``2006-01-02T15:04:05.000000Z07:00``; other keys are fields); anything else is
  logged verbatim with the level of a ``[TRACE]``…``[ERROR]`` prefix, else DEBUG.
* connection — go-plugin ``grpc_client.go``: insecure gRPC (no AutoMTLS in Nomad), blocking dial;
  ``GRPCStdio/StreamStdio`` opened and held (optional: Unimplemented only disables stdio sync);
  health ``grpc.health.v1.Health/Check`` with service ``plugin`` (``GRPCClient.Ping``).
* stop — go-plugin ``Client.Kill``: ``plugin.GRPCController/Shutdown``, close the connection,
  wait 2 s for the process to exit, then SIGKILL.
* the three processes — hashicorp/nomad ``helper/pluginutils/loader/init.go``
  (``fingerprintPlugin``: A = PluginInfo, ConfigSchema; ``validatePluginConfig``: B = SetConfig
  twice, once in ``Dispense``, once directly) and ``client/devicemanager/instance.go`` (C =
  SetConfig with the agent's config, Fingerprint kept open, Stats after the first fingerprint,
  Reserve per task).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import IO, Any, Literal

import grpc  # type: ignore[import-untyped, unused-ignore]
from google.protobuf import duration_pb2, empty_pb2, json_format  # type: ignore[import-untyped, unused-ignore]
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped, unused-ignore]

from support.nomadclient import ctymsgpack, validate

MAGIC_COOKIE_KEY = "NOMAD_PLUGIN_MAGIC_COOKIE"
MAGIC_COOKIE_VALUE = "e4327c2e01eabfd75a8a67adb114fb34a757d57eee7728d857a8cec6e91a7255"
PLUGIN_MIN_PORT = 10000
PLUGIN_MAX_PORT = 25000
CORE_PROTOCOL_VERSION = 1  # go-plugin CoreProtocolVersion
APP_PROTOCOL_VERSIONS: tuple[int, ...] = (2,)  # Nomad plugins/base/plugin.go Handshake.ProtocolVersion
ALLOWED_PROTOCOLS: tuple[str, ...] = ("grpc",)  # Nomad's AllowedProtocols
START_TIMEOUT = 60.0  # go-plugin ClientConfig.StartTimeout default
KILL_GRACE = 2.0  # go-plugin Client.Kill
STDERR_BUFFER = 64 * 1024  # go-plugin stdErrBufferSize
HEALTH_SERVICE = "plugin"  # go-plugin GRPCServiceName
CLIENT_MIN_PORT = 14000  # Nomad client config defaults sent in process C's NomadConfig
CLIENT_MAX_PORT = 14512
NOMAD_FIRST_FINGERPRINT_WAIT = 50.0  # client/client.go: the node waits this long for devices

_LEVELS = ("trace", "debug", "info", "warn", "error")
_TIMESTAMP = re.compile(r"(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})\.(\d{6})(Z|[+-]\d{2}:\d{2})")
_GO_INT = re.compile(r"[+-]?[0-9]+")

# --------------------------------------------------------------------------- handshake


class PluginStartError(RuntimeError):
    """The plugin could not be started as Nomad starts it (Nomad: the agent fails to start)."""

    def __init__(self, message: str, stderr_tail: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.stderr_tail = list(stderr_tail)


class HandshakeError(PluginStartError):
    """The first stdout line is not a handshake go-plugin accepts from a Nomad plugin."""


@dataclass(frozen=True)
class Handshake:
    """A parsed go-plugin handshake line ``CORE|APP|NETWORK|ADDRESS|PROTOCOL[|CERT]``."""

    core_version: int
    app_version: int
    network: str
    address: str
    protocol: str
    raw: str

    @property
    def grpc_target(self) -> str:
        """Target for ``grpc.insecure_channel``: ``unix://<path>`` or ``host:port``."""
        return f"unix://{self.address}" if self.network == "unix" else self.address


def parse_handshake(
    line: str,
    *,
    app_versions: Sequence[int] = APP_PROTOCOL_VERSIONS,
    allowed_protocols: Sequence[str] = ALLOWED_PROTOCOLS,
) -> Handshake:
    """Parse a handshake line in go-plugin ``Client.Start``'s order, raising :class:`HandshakeError`
    with go-plugin's message: fewer than 4 fields → "Unrecognized remote plugin message"; core
    version not an int / not 1; app version not an int / not offered; network neither ``tcp``
    nor ``unix`` ("Unknown address type"); a bad tcp address; protocol (``netrpc`` when the 5th
    field is missing) not allowed; a 6th field over 50 characters is an AutoMTLS server
    certificate, which Nomad never asked for (go-plugin would dereference a nil TLS config)."""
    text = line.strip()
    parts = text.split("|", 5)
    if len(parts) < 4:
        raise HandshakeError(
            f"Unrecognized remote plugin message: {text}\nThis usually means the plugin printed something on stdout "
            "before its handshake, or failed to negotiate the initial go-plugin protocol handshake"
        )
    if not _GO_INT.fullmatch(parts[0]):
        raise HandshakeError(f'Error parsing core protocol version: strconv.Atoi: parsing "{parts[0]}": invalid syntax')
    if int(parts[0]) != CORE_PROTOCOL_VERSION:
        raise HandshakeError(
            f"Incompatible core API version with plugin. Plugin version: {parts[0]}, "
            f"Core version: {CORE_PROTOCOL_VERSION}"
        )
    if not _GO_INT.fullmatch(parts[1]):
        raise HandshakeError(f'Error parsing protocol version "{parts[1]}": invalid syntax')
    app = int(parts[1])
    if app not in app_versions:
        raise HandshakeError(
            f"Incompatible API version with plugin. Plugin version: {app}, Client versions: {list(app_versions)}"
        )
    network, address = parts[2], parts[3]
    if network == "tcp":
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit() or int(port) > 65535:
            raise HandshakeError(f"address {address}: missing or invalid port in tcp address")
        del host
    elif network == "unix":
        if not address:
            raise HandshakeError("empty unix socket address")
    else:
        raise HandshakeError(f"Unknown address type: {address}")
    protocol = parts[4] if len(parts) >= 5 else "netrpc"
    if protocol not in allowed_protocols:
        raise HandshakeError(f'Unsupported plugin protocol "{protocol}". Supported: [{" ".join(allowed_protocols)}]')
    if len(parts) >= 6 and len(parts[5]) > 50:
        raise HandshakeError(
            "the plugin sent an AutoMTLS server certificate in its handshake, but Nomad does not enable AutoMTLS "
            "(go-plugin would use a nil TLS config)"
        )
    return Handshake(CORE_PROTOCOL_VERSION, app, network, address, protocol, text)


# --------------------------------------------------------------------------- hclog


@dataclass
class LogRecord:
    """One stderr line as go-plugin logs it. ``structured``: parsed as an hclog JSON record;
    ``problem``: why a line meant as JSON is not a valid hclog record (None when fine)."""

    level: str
    message: str
    raw: str
    structured: bool = False
    timestamp: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None


def _prefix_level(line: str) -> str:
    for level in _LEVELS:
        if line.startswith(f"[{level.upper()}]"):
            return level
    return "debug"


def _timestamp_problem(value: str) -> str | None:
    """None when Go's ``time.Parse("2006-01-02T15:04:05.000000Z07:00", value)`` succeeds."""
    m = _TIMESTAMP.fullmatch(value)
    if m is None:
        return f"@timestamp {value!r} is not YYYY-MM-DDTHH:MM:SS.ffffff±hh:mm (exactly 6 fraction digits)"
    try:
        year, month, day, hour, minute, second = (int(m.group(i)) for i in range(1, 7))
        datetime.datetime(year, month, day, hour, minute, second)
    except ValueError as exc:
        return f"@timestamp {value!r}: {exc}"
    if m.group(8) != "Z" and (int(m.group(8)[1:3]) > 23 or int(m.group(8)[4:6]) > 59):
        return f"@timestamp {value!r}: bad zone offset"
    return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_log_line(line: str) -> LogRecord:
    """Parse one stderr line as go-plugin's ``logStderr`` does. A JSON object becomes a structured
    record when its ``@message``/``@level``/``@timestamp`` are strings, the timestamp parses and
    the level is trace/debug/info/warn/error (any case); a non-string ``@message``/``@level``/
    ``@timestamp`` would panic go-plugin's type assertion (a crash of the Nomad client's log
    goroutine). Other lines keep their text with the level of their ``[LEVEL]`` prefix, or debug.
    Lines longer than 64 KiB are split by go-plugin and never parsed as JSON."""
    raw = line.rstrip("\r\n")
    record = LogRecord(level=_prefix_level(raw), message=raw, raw=raw)
    if len(raw.encode()) > STDERR_BUFFER:
        if raw.lstrip().startswith("{"):
            record.problem = f"line of {len(raw.encode())} bytes exceeds go-plugin's 64 KiB stderr buffer"
        return record
    try:
        obj = json.loads(raw, parse_constant=_reject_constant)
    except ValueError:
        if raw.lstrip().startswith("{"):
            record.problem = "line starts like a JSON record but is not valid JSON"
        return record
    if obj is None:  # json.Unmarshal of null into a map: no error, no level → verbatim at debug
        record.problem = "JSON null is not an hclog record"
        return record
    if not isinstance(obj, dict):
        if raw.lstrip().startswith(("{", "[")):
            record.problem = "JSON value is not an object"
        return record
    for key in ("@message", "@level", "@timestamp"):
        if key in obj and not isinstance(obj[key], str):
            record.problem = f"{key} is a {type(obj[key]).__name__}, not a string: go-plugin's parseJSON would panic"
            return record
    missing = [key for key in ("@level", "@message", "@timestamp") if key not in obj]
    if "@timestamp" in obj:
        ts_problem = _timestamp_problem(obj["@timestamp"])
        if ts_problem:  # go-plugin: parseJSON fails, the line is logged verbatim by prefix
            record.problem = ts_problem
            return record
    level = str(obj.get("@level", "")).strip().lower()
    record.structured = True
    record.message = str(obj.get("@message", ""))
    record.timestamp = obj.get("@timestamp")
    record.fields = {k: v for k, v in obj.items() if k not in ("@message", "@level", "@timestamp")}
    if level in _LEVELS:
        record.level = level
    else:  # go-plugin: "no log level … output it verbatim" at debug
        record.level = "debug"
        record.message = raw
        record.problem = f"@level {obj.get('@level')!r} is not one of {', '.join(_LEVELS)}"
        return record
    if missing:
        record.problem = f"hclog record lacks {', '.join(missing)}"
    return record


# --------------------------------------------------------------------------- streams


class StreamTimeoutError(TimeoutError):
    """No message arrived on a server stream within the timeout."""


class StreamEndedError(RuntimeError):
    """The plugin ended a server stream cleanly (Nomad: Fingerprint → devices cleared and plugin
    killed for good; Stats → stats stop for good)."""


class StreamFailedError(RuntimeError):
    """A server stream ended with a gRPC error."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


@dataclass
class TaskDevices:
    """The devices part of a task's environment after every Reserve of its ``device`` blocks."""

    envs: dict[str, str] = field(default_factory=dict)
    mounts: list[tuple[str, str, bool]] = field(default_factory=list)  # (task path, host path, read-only)
    devices: list[tuple[str, str, str]] = field(default_factory=list)  # (task path, host path, permissions)


RELAUNCH = "relaunched: the plugin died (ErrPluginShutdown)"
GONE = "devices cleared, plugin not relaunched until the agent restarts"
RETRY = "error reported, the stream is opened again"


def nomad_reaction(stream: str, outcome: StreamEndedError | StreamFailedError) -> str:
    """What a Nomad client's device manager does when a plugin's Fingerprint or Stats stream stops
    (hashicorp/nomad ``client/devicemanager/instance.go``). UNAVAILABLE — what a plugin process that
    died gives (``ErrPluginShutdown`` when the process has exited within 3 s,
    ``helper/pluginutils/grpcutils/utils.go:32-55``) — relaunches the plugin (``:371-374``). On
    Fingerprint, a clean end (io.EOF: "shut down gracefully", ``:358-361``) and any other error
    (``handleFingerprintError``, ``:390-409``) clear the plugin's devices, and it is not relaunched
    until the agent restarts. On Stats, a clean end stops stats for good (``:478-481``) and another
    error is logged and the stream opened again."""
    if isinstance(outcome, StreamFailedError) and outcome.code == "UNAVAILABLE":
        return RELAUNCH
    if "cancelled by the client" in str(outcome):
        return RETRY
    if stream == "Fingerprint":
        return GONE
    return RETRY if isinstance(outcome, StreamFailedError) else "stats stopped for good"



def _code_name(err: Any) -> str:
    try:
        return str(err.code().name)
    except Exception:  # noqa: BLE001 - any RpcError-like object
        return "UNKNOWN"


def _details(err: Any) -> str:
    try:
        return str(err.details())
    except Exception:  # noqa: BLE001
        return str(err)


class StreamHandle:
    """A server-streaming call read by a background thread, as Nomad's device client turns the
    stream into a channel (``plugins/device/client.go`` ``handleFingerprint``). :meth:`read`
    returns the next message or raises :class:`StreamTimeoutError`, :class:`StreamEndedError` or
    :class:`StreamFailedError`; :meth:`cancel` cancels the call (Nomad cancels its context)."""

    def __init__(self, call: Any, name: str) -> None:
        self.name = name
        self._call = call
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.received: list[Any] = []
        self.ended = False
        self.cancelled = False
        self.error: StreamFailedError | None = None
        self._thread = threading.Thread(target=self._pump, name=f"stream-{name}", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        try:
            for message in self._call:
                self._queue.put(("message", message))
        except grpc.RpcError as err:
            if self.cancelled:
                self._queue.put(("cancelled", None))
            else:
                self.error = StreamFailedError(_code_name(err), _details(err))
                self._queue.put(("error", self.error))
            return
        except Exception as exc:  # noqa: BLE001 - report, never lose the reader thread silently
            self.error = StreamFailedError("CLIENT", repr(exc))
            self._queue.put(("error", self.error))
            return
        self.ended = True
        self._queue.put(("end", None))

    def read(self, timeout: float) -> Any:
        """The next message, within ``timeout`` seconds."""
        try:
            kind, value = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise StreamTimeoutError(f"{self.name}: no message within {timeout:g} s") from None
        if kind == "message":
            self.received.append(value)
            return value
        self._queue.put((kind, value))  # keep the terminal state for later reads
        if kind == "end":
            raise StreamEndedError(f"{self.name}: the plugin ended the stream")
        if kind == "cancelled":
            raise StreamEndedError(f"{self.name}: cancelled by the client")
        assert isinstance(value, StreamFailedError)
        raise value

    @property
    def open(self) -> bool:
        """True while the stream has neither ended, failed nor been cancelled."""
        return self._thread.is_alive()

    def cancel(self) -> None:
        """Cancel the call and wait (briefly) for the reader thread."""
        if self._thread.is_alive():
            self.cancelled = True
            self._call.cancel()
            self._thread.join(timeout=5)


# --------------------------------------------------------------------------- the process


@dataclass
class ShutdownResult:
    """How the plugin stopped: ``exited_by_itself`` within the 2 s grace after Shutdown, else
    ``killed`` with SIGKILL, as go-plugin's ``Client.Kill`` does."""

    rpc_error: str | None
    exited_by_itself: bool
    killed: bool
    returncode: int | None
    seconds: float


def _proto(name: str) -> Any:
    """A generated module of ``accelstats.nomad.proto`` (imported on first use)."""
    import importlib

    return importlib.import_module(f"accelstats.nomad.proto.{name}")


class PluginProcess:
    """One plugin process launched as a Nomad client launches it (go-plugin ``Client.Start`` +
    ``Client.Client``). Use as a context manager; leaving it shuts the plugin down like
    ``Client.Kill``.

    ``argv``: the binary (Nomad: ``exec.Command(path, args...)``). ``socket_dir``: None leaves
    ``PLUGIN_UNIX_SOCKET_DIR`` unset (Nomad's cmdrunner); True sets it to a fresh temp dir; a path
    sets it to that path. ``env`` replaces the inherited environment (default: ``os.environ``);
    Nomad's variables are always added on top.
    """

    def __init__(
        self,
        argv: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        socket_dir: str | bool | None = None,
        start_timeout: float = START_TIMEOUT,
        connect_timeout: float = 10.0,
        stdio: bool = True,
        health_check: bool = True,
    ) -> None:
        self.argv = [argv] if isinstance(argv, str) else list(argv)
        self._base_env = dict(os.environ if env is None else env)
        self._socket_dir_arg = socket_dir
        self.socket_dir: str | None = None
        self._own_socket_dir = False
        self.start_timeout = start_timeout
        self.connect_timeout = connect_timeout
        self._want_stdio = stdio
        self._want_health = health_check
        self.proc: subprocess.Popen[bytes] | None = None
        self.handshake: Handshake | None = None
        self.handshake_seconds: float | None = None
        self.channel: Any = None
        self.logs: list[LogRecord] = []
        self.stdout_after_handshake: list[str] = []
        self.stdio_available: bool | None = None
        self.stdio_data: list[tuple[int, bytes]] = []
        self.health_status: str | None = None
        self.problems: list[str] = []
        self.shutdown_result: ShutdownResult | None = None
        self._lock = threading.Lock()
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._streams: list[StreamHandle] = []
        self._stdio_call: Any = None
        self._stdio_cancelled = False
        self._stdio_thread: threading.Thread | None = None
        self._stubs: dict[str, Any] = {}

    # ----------------------------------------------------------------- start

    def environment(self) -> dict[str, str]:
        """The environment the plugin gets: the parent's plus go-plugin's four variables."""
        env = dict(self._base_env)
        env[MAGIC_COOKIE_KEY] = MAGIC_COOKIE_VALUE
        env["PLUGIN_MIN_PORT"] = str(PLUGIN_MIN_PORT)
        env["PLUGIN_MAX_PORT"] = str(PLUGIN_MAX_PORT)
        env["PLUGIN_PROTOCOL_VERSIONS"] = ",".join(str(v) for v in APP_PROTOCOL_VERSIONS)
        if self.socket_dir is not None:
            env["PLUGIN_UNIX_SOCKET_DIR"] = self.socket_dir
        return env

    def __enter__(self) -> PluginProcess:
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def stderr_tail(self, n: int = 20) -> list[str]:
        with self._lock:
            return [r.raw for r in self.logs[-n:]]

    def start(self) -> PluginProcess:
        """Launch, read the handshake, connect, open StreamStdio, health-check. Raises
        :class:`HandshakeError` / :class:`PluginStartError` (the process is killed then)."""
        if self._socket_dir_arg is True:
            self.socket_dir = tempfile.mkdtemp(prefix="plugin-sock-")
            self._own_socket_dir = True
        elif isinstance(self._socket_dir_arg, str):
            self.socket_dir = self._socket_dir_arg
        t0 = time.monotonic()
        try:
            self.proc = subprocess.Popen(
                self.argv, env=self.environment(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, close_fds=True,
            )
        except OSError as exc:
            raise PluginStartError(f"failed to start plugin {self.argv[0]}: {exc}") from exc
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._spawn(self._read_stdout, self.proc.stdout, "stdout")
        self._spawn(self._read_stderr, self.proc.stderr, "stderr")
        try:
            line = self._wait_handshake_line(t0)
            self.handshake = parse_handshake(line)
            self.handshake_seconds = time.monotonic() - t0
            if self.handshake.network == "tcp":
                port = int(self.handshake.address.rpartition(":")[2])
                if not PLUGIN_MIN_PORT <= port <= PLUGIN_MAX_PORT:
                    self.problems.append(f"tcp port {port} outside PLUGIN_MIN_PORT..PLUGIN_MAX_PORT")
            self._connect()
        except PluginStartError as exc:
            self._kill()
            exc.stderr_tail = self.stderr_tail()
            raise
        return self

    def _spawn(self, target: Any, stream: IO[bytes], name: str) -> None:
        thread = threading.Thread(target=target, args=(stream,), name=f"plugin-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _read_stdout(self, stream: IO[bytes]) -> None:
        first = True
        for raw in iter(stream.readline, b""):
            text = raw.decode("utf-8", "replace").rstrip("\n").removesuffix("\r")
            if first:
                self._lines.put(text)
                first = False
            else:
                with self._lock:
                    self.stdout_after_handshake.append(text)
        if first:
            self._lines.put(None)

    def _read_stderr(self, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            record = parse_log_line(raw.decode("utf-8", "replace"))
            with self._lock:
                self.logs.append(record)

    def _wait_handshake_line(self, t0: float) -> str:
        assert self.proc is not None
        deadline = t0 + self.start_timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, min(0.1, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise PluginStartError("timeout while waiting for plugin to start") from None
                if self.proc.poll() is not None and self._lines.empty():
                    self._join_readers(1.0)
                    if self._lines.empty():
                        raise PluginStartError(
                            f"plugin exited before we could connect (exit status {self.proc.returncode})"
                        ) from None
                continue
            if line is None:
                try:
                    self.proc.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    raise HandshakeError(
                        "Unrecognized remote plugin message: \nFailed to read any lines from plugin's stdout"
                    ) from None
                self._join_readers(1.0)
                raise PluginStartError(f"plugin exited before we could connect (exit status {self.proc.returncode})")
            return line

    def _connect(self) -> None:
        assert self.handshake is not None
        options = [("grpc.max_receive_message_length", 2**31 - 1), ("grpc.max_send_message_length", 2**31 - 1)]
        self.channel = grpc.insecure_channel(self.handshake.grpc_target, options=options)
        try:
            grpc.channel_ready_future(self.channel).result(timeout=self.connect_timeout)
        except grpc.FutureTimeoutError:
            raise PluginStartError(
                f"could not connect to {self.handshake.grpc_target} within {self.connect_timeout:g} s"
            ) from None
        if self._want_stdio:
            self._open_stdio()
        if self._want_health:
            try:
                self.health_status = self.health()
            except grpc.RpcError as err:
                self.health_status = f"{_code_name(err)}: {_details(err)}"
            if self.health_status != "SERVING":
                self.problems.append(f'health check of service "{HEALTH_SERVICE}": {self.health_status}')

    def _open_stdio(self) -> None:
        """go-plugin ``newGRPCStdioClient``: open ``StreamStdio``; Unavailable/Unimplemented only
        disable stdout/stderr syncing. The plugin holds the stream for the process lifetime."""
        stub = _proto("grpc_stdio_pb2_grpc").GRPCStdioStub(self.channel)
        call = stub.StreamStdio(empty_pb2.Empty())

        def pump() -> None:
            try:
                for chunk in call:
                    with self._lock:
                        self.stdio_data.append((int(chunk.channel), bytes(chunk.data)))
            except grpc.RpcError as err:
                code = _code_name(err)
                with self._lock:
                    if code == "CANCELLED" and self._stdio_cancelled:
                        self.stdio_available = True  # held open until we cancelled it
                    elif code == "UNIMPLEMENTED":
                        self.stdio_available = False
                    elif self.stdio_available is None:
                        self.stdio_available = bool(self.stdio_data)
                return
            with self._lock:  # ended by the plugin: served, but not held open as go-plugin expects
                self.stdio_available = bool(self.stdio_data)

        self._stdio_call = call
        self._stdio_thread = threading.Thread(target=pump, name="plugin-stdio", daemon=True)
        self._stdio_thread.start()

    # ----------------------------------------------------------------- stubs

    def _stub(self, name: str) -> Any:
        if self.channel is None:
            raise RuntimeError("plugin not started")
        if name not in self._stubs:
            module, cls = {
                "base": ("base_pb2_grpc", "BasePluginStub"),
                "device": ("device_pb2_grpc", "DevicePluginStub"),
                "controller": ("grpc_controller_pb2_grpc", "GRPCControllerStub"),
            }[name]
            self._stubs[name] = getattr(_proto(module), cls)(self.channel)
        return self._stubs[name]

    def health(self, timeout: float = 5.0) -> str:
        """``grpc.health.v1.Health/Check`` for service ``plugin``: the status name (``SERVING``)."""
        resp = health_pb2_grpc.HealthStub(self.channel).Check(
            health_pb2.HealthCheckRequest(service=HEALTH_SERVICE), timeout=timeout
        )
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))

    def plugin_info(self, timeout: float = 10.0) -> Any:
        """``BasePlugin/PluginInfo`` → PluginInfoResponse."""
        return self._stub("base").PluginInfo(_proto("base_pb2").PluginInfoRequest(), timeout=timeout)

    def config_schema(self, timeout: float = 10.0) -> Any:
        """``BasePlugin/ConfigSchema`` → ConfigSchemaResponse (``.spec`` is an hclspec Spec)."""
        return self._stub("base").ConfigSchema(_proto("base_pb2").ConfigSchemaRequest(), timeout=timeout)

    def set_config(
        self,
        msgpack_config: bytes,
        api_version: str = validate.NOMAD_DEVICE_API_VERSION,
        nomad_config: Any | None = None,
        timeout: float = 10.0,
    ) -> Any:
        """``BasePlugin/SetConfig`` with the msgpack bytes, the negotiated API version and (process C
        only) the agent's NomadConfig (see :func:`agent_nomad_config`)."""
        request = _proto("base_pb2").SetConfigRequest(msgpack_config=msgpack_config, plugin_api_version=api_version)
        if nomad_config is not None:
            request.nomad_config.CopyFrom(nomad_config)
        return self._stub("base").SetConfig(request, timeout=timeout)

    def fingerprint(self) -> StreamHandle:
        """``DevicePlugin/Fingerprint`` as a :class:`StreamHandle` (kept open, as Nomad keeps it)."""
        call = self._stub("device").Fingerprint(_proto("device_pb2").FingerprintRequest())
        handle = StreamHandle(call, "Fingerprint")
        self._streams.append(handle)
        return handle

    def stats(self, interval: float = 1.0) -> StreamHandle:
        """``DevicePlugin/Stats`` with ``collection_interval`` = ``interval`` seconds."""
        duration = duration_pb2.Duration()
        duration.FromNanoseconds(round(interval * 1e9))
        call = self._stub("device").Stats(_proto("device_pb2").StatsRequest(collection_interval=duration))
        handle = StreamHandle(call, "Stats")
        self._streams.append(handle)
        return handle

    def reserve(self, device_ids: Sequence[str], timeout: float | None = 30.0) -> Any:
        """``DevicePlugin/Reserve`` → ReserveResponse. Nomad sets no deadline (a hang blocks the
        task); ``timeout`` turns a hang into DEADLINE_EXCEEDED here."""
        request = _proto("device_pb2").ReserveRequest(device_ids=list(device_ids))
        return self._stub("device").Reserve(request, timeout=timeout)

    def reserve_task(self, blocks: Sequence[Sequence[str]], timeout: float | None = 30.0) -> TaskDevices:
        """What a task with one ``device`` block per entry of ``blocks`` gets: Nomad's device hook
        calls Reserve once per block, in order, and merges the answers — env maps with the last one
        winning, mounts and devices appended (hashicorp/nomad
        ``client/allocrunner/taskrunner/device_hook.go:50-68``). A plugin never sees two blocks of
        one task in one call. Raises grpc.RpcError as the first failing Reserve does (the task fails)."""
        out = TaskDevices()
        for ids in blocks:
            res = self.reserve(ids, timeout=timeout).container_res
            out.envs.update(res.envs)
            out.mounts += [(m.task_path, m.host_path, m.read_only) for m in res.mounts]
            out.devices += [(d.task_path, d.host_path, d.permissions) for d in res.devices]
        return out

    # ----------------------------------------------------------------- logs

    def hclog_problems(self) -> list[str]:
        """One entry per stderr line meant as an hclog JSON record that Nomad would not read as one
        (see :func:`parse_log_line`)."""
        with self._lock:
            return [f"stderr line {i + 1}: {r.problem}: {r.raw[:200]}" for i, r in enumerate(self.logs) if r.problem]

    # ----------------------------------------------------------------- stop

    def shutdown(self, grace: float = KILL_GRACE) -> ShutdownResult:
        """go-plugin ``Client.Kill``: cancel open streams (Nomad cancels their context first),
        ``GRPCController/Shutdown``, close the connection, wait ``grace`` (2 s) for the process to
        exit, else SIGKILL. Idempotent."""
        if self.shutdown_result is not None:
            return self.shutdown_result
        if self.proc is None:
            raise RuntimeError("plugin not started")
        if self.proc.poll() is not None:
            self.problems.append(f"plugin process exited before Shutdown (exit status {self.proc.returncode}): "
                                 "Nomad relaunches it")
        for handle in self._streams:
            handle.cancel()
        if self._stdio_call is not None:
            self._stdio_cancelled = True
            self._stdio_call.cancel()
            if self._stdio_thread is not None:
                self._stdio_thread.join(timeout=2)
        t0 = time.monotonic()
        rpc_error: str | None = None
        if self.channel is not None and self.proc.poll() is None:
            try:
                self._stub("controller").Shutdown(_proto("grpc_controller_pb2").Empty(), timeout=grace)
            except grpc.RpcError as err:
                rpc_error = f"{_code_name(err)}: {_details(err)}"
        if self.channel is not None:
            self.channel.close()
        try:  # go-plugin: time.After(2 * time.Second) once the controller call has returned
            self.proc.wait(timeout=grace)
            exited, killed = True, False
        except subprocess.TimeoutExpired:
            exited, killed = False, True
            self._kill()
        seconds = time.monotonic() - t0
        self._join_readers(5.0)
        self.shutdown_result = ShutdownResult(rpc_error, exited, killed, self.proc.returncode, seconds)
        if rpc_error and rpc_error.startswith(("UNIMPLEMENTED", "DEADLINE_EXCEEDED")):
            self.problems.append(f"GRPCController/Shutdown: {rpc_error}")
        if not exited:
            self.problems.append(f"plugin did not exit within {grace:g} s of Shutdown: killed with SIGKILL")
        self._cleanup()
        return self.shutdown_result

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        if self.channel is not None:
            self.channel.close()
        self._join_readers(2.0)

    def _join_readers(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _cleanup(self) -> None:
        if self._own_socket_dir and self.socket_dir:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
            self._own_socket_dir = False

    def close(self) -> None:
        """Shut down if running (as Nomad's deferred ``client.Kill()``), else just clean up."""
        if self.proc is not None and self.shutdown_result is None and self.proc.poll() is None:
            self.shutdown()
        else:
            self._kill()
            self._cleanup()


# --------------------------------------------------------------------------- lifecycle


def agent_nomad_config() -> Any:
    """The NomadConfig a Nomad client passes to process C's SetConfig
    (``client/config.NomadPluginConfig``): the client's port range (defaults 14000 to 14512) and a
    one-node topology with this machine's cores."""
    base_pb2 = _proto("base_pb2")
    cores = [
        base_pb2.ClientTopologyCore(
            socket_id=0, node_id=0, core_id=i, base_speed=2000, max_speed=3000, guess_speed=2000
        )
        for i in range(min(os.cpu_count() or 1, 256))
    ]
    topology = base_pb2.ClientTopology(
        node_ids=[0], distances=base_pb2.ClientTopologySLIT(dimension=1, values=[10]), cores=cores
    )
    return base_pb2.NomadConfig(
        driver=base_pb2.NomadDriverConfig(
            ClientMaxPort=CLIENT_MAX_PORT, ClientMinPort=CLIENT_MIN_PORT, Topology=topology
        )
    )


def message_dict(message: Any) -> dict[str, Any]:
    """A protobuf message as JSON-ready data (proto field names)."""
    result: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return result


@dataclass
class CallRecord:
    """One RPC or stream read: what, how long, and its error (None when fine)."""

    call: str
    seconds: float
    error: str | None = None


@dataclass
class ProcessReport:
    """What happened in one of the three plugin processes."""

    name: str
    pid: int | None = None
    handshake: str | None = None
    exec_to_handshake_s: float | None = None
    health: str | None = None
    stdio_available: bool | None = None
    calls: list[CallRecord] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    shutdown: dict[str, Any] | None = None
    log_levels: dict[str, int] = field(default_factory=dict)
    logs: list[dict[str, Any]] = field(default_factory=list)
    stdout_after_handshake: list[str] = field(default_factory=list)
    stderr_tail: list[str] = field(default_factory=list)


@dataclass
class LifecycleReport:
    """The whole agent-start sequence: processes A, B, C, and every problem found (each prefixed
    with its process). ``ok`` is True when there is none."""

    argv: list[str]
    user_config: dict[str, Any]
    api_version: str | None = None
    msgpack_config_hex: str | None = None
    processes: list[ProcessReport] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def process(self, name: str) -> ProcessReport:
        """The report of process ``"A"``, ``"B"`` or ``"C"``."""
        for proc in self.processes:
            if proc.name == name:
                return proc
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        return out


class _Recorder:
    """Wraps a PluginProcess for one ProcessReport: times calls, records messages and problems."""

    def __init__(self, report: ProcessReport, plugin: PluginProcess) -> None:
        self.report = report
        self.plugin = plugin

    def problem(self, text: str) -> None:
        self.report.problems.append(text)

    def call(self, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.monotonic()
        try:
            result = fn(*args, **kwargs)
        except grpc.RpcError as err:
            code = _code_name(err)
            text = f"{code}: {_details(err)}"
            self.report.calls.append(CallRecord(name, time.monotonic() - t0, text))
            hint = ""
            if code in ("UNAVAILABLE", "CANCELLED"):
                hint = " (Nomad reads UNAVAILABLE/CANCELLED as 'plugin died')"
            hint += " (the call hung)" if code == "DEADLINE_EXCEEDED" else ""
            self.problem(f"{name} failed: {text}{hint}")
            return None
        self.report.calls.append(CallRecord(name, time.monotonic() - t0))
        return result

    def read(self, handle: StreamHandle, timeout: float, label: str) -> Any:
        t0 = time.monotonic()
        try:
            message = handle.read(timeout)
        except (StreamTimeoutError, StreamEndedError, StreamFailedError) as exc:
            self.report.calls.append(CallRecord(label, time.monotonic() - t0, str(exc)))
            return exc
        self.report.calls.append(CallRecord(label, time.monotonic() - t0))
        self.report.messages.append({"call": label, "message": message_dict(message)})
        return message

    def record(self, label: str, message: Any) -> None:
        self.report.messages.append({"call": label, "message": message_dict(message)})

    def finish(self) -> None:
        plugin = self.plugin
        if plugin.proc is not None:
            result = plugin.shutdown()
            self.report.shutdown = asdict(result)
        self.report.problems.extend(plugin.problems)
        self.report.problems.extend(plugin.hclog_problems())
        self.report.health = plugin.health_status
        self.report.stdio_available = plugin.stdio_available
        self.report.stdout_after_handshake = list(plugin.stdout_after_handshake)
        self.report.stderr_tail = plugin.stderr_tail()
        levels: dict[str, int] = {}
        for record in plugin.logs:
            levels[record.level] = levels.get(record.level, 0) + 1
        self.report.log_levels = levels
        self.report.logs = [
            {"level": r.level, "message": r.message, "timestamp": r.timestamp, "fields": r.fields}
            for r in plugin.logs
        ]


@contextlib.contextmanager
def _process(
    name: str, argv: list[str], report: LifecycleReport, **kwargs: Any
) -> Iterator[_Recorder | None]:
    proc_report = ProcessReport(name)
    report.processes.append(proc_report)
    plugin = PluginProcess(argv, **kwargs)
    try:
        plugin.start()
    except PluginStartError as exc:
        proc_report.problems.append(f"start failed: {exc}")
        proc_report.stderr_tail = list(exc.stderr_tail)
        proc_report.pid = plugin.pid
        report.problems.extend(f"{name}: {p}" for p in proc_report.problems)
        yield None
        return
    proc_report.pid = plugin.pid
    proc_report.handshake = plugin.handshake.raw if plugin.handshake else None
    proc_report.exec_to_handshake_s = plugin.handshake_seconds
    recorder = _Recorder(proc_report, plugin)
    try:
        yield recorder
    finally:
        recorder.finish()
        report.problems.extend(f"{name}: {p}" for p in proc_report.problems)


def _fingerprint_ids(fingerprint: Any) -> list[str]:
    for group in fingerprint.device_group:
        ids = [d.ID for d in group.devices]
        if ids:
            return ids
    return []


def run_lifecycle(
    binary: str | Sequence[str],
    user_config: Mapping[str, Any],
    *,
    fingerprints: int = 1,
    stats_messages: int = 1,
    reserve_ids: Sequence[str] | Literal["fingerprinted"] | None = None,
    stats_interval: float = 1.0,
    fingerprint_timeout: float = NOMAD_FIRST_FINGERPRINT_WAIT,
    stats_timeout: float = 15.0,
    number_mode: ctymsgpack.NumberMode = "cty",
    socket_dir: str | bool | None = None,
    env: Mapping[str, str] | None = None,
    start_timeout: float = START_TIMEOUT,
) -> LifecycleReport:
    """Drive ``binary`` through a Nomad agent start and return a :class:`LifecycleReport`.

    * A: handshake → PluginInfo (validated) → ConfigSchema → Shutdown;
    * B: handshake → SetConfig twice with ``msgpack_config`` built from the schema and
      ``user_config`` as Nomad builds it (:func:`ctymsgpack.encode_for_spec`) and the API version
      Nomad negotiated → Shutdown;
    * C: handshake → SetConfig (with the agent's NomadConfig) → Fingerprint: ``fingerprints``
      messages, each within ``fingerprint_timeout`` (Nomad waits 50 s for the first) and validated
      → Stats(``stats_interval``): ``stats_messages`` messages, each within ``stats_timeout`` →
      Reserve(``reserve_ids``; ``"fingerprinted"`` = the IDs of the first non-empty group of the
      latest fingerprint) → Fingerprint must still be open → Shutdown (exit within 2 s).

    Every process must have valid hclog JSON on stderr and stop by itself after Shutdown. A step
    that fails the way Nomad would stop at (start, PluginInfo, SetConfig) ends the run there.
    """
    argv = [binary] if isinstance(binary, str) else list(binary)
    report = LifecycleReport(argv=argv, user_config=dict(user_config))
    kwargs: dict[str, Any] = {"socket_dir": socket_dir, "env": env, "start_timeout": start_timeout}

    # Process A (loader.fingerprintPlugin): any failure here fails the agent start.
    schema: Any = None
    with _process("A", argv, report, **kwargs) as rec:
        if rec is None:
            return report
        info = rec.call("PluginInfo", rec.plugin.plugin_info)
        if info is None:
            return report
        rec.record("PluginInfo", info)
        info_problems = validate.validate_plugin_info(info)
        rec.report.problems.extend(f"PluginInfo: {p}" for p in info_problems)
        report.api_version = validate.select_api_version(info)
        if info_problems:
            return report
        resp = rec.call("ConfigSchema", rec.plugin.config_schema)
        if resp is None:
            return report
        rec.record("ConfigSchema", resp)
        schema = resp.spec if resp.HasField("spec") else None
    api_version = report.api_version or validate.NOMAD_DEVICE_API_VERSION

    # loader.validatePluginConfig: decode the agent's config block against the schema.
    if schema is None:
        if user_config:
            report.problems.append("config: configuration not allowed but config passed (the plugin has no schema)")
            return report
        config_bytes = b""
    else:
        try:
            config_bytes = ctymsgpack.encode_for_spec(schema, user_config, number_mode=number_mode)
        except ctymsgpack.ConfigError as exc:
            report.problems.append(f"config: failed parsing config: {exc}")
            return report
    report.msgpack_config_hex = config_bytes.hex()

    # Process B (loader.Dispense + validatePluginConfig): SetConfig twice; an error fails the agent.
    with _process("B", argv, report, **kwargs) as rec:
        if rec is None:
            return report
        for i in (1, 2):
            if rec.call(f"SetConfig#{i}", rec.plugin.set_config, config_bytes, api_version) is None:
                return report

    # Process C (devicemanager instanceManager): lives on.
    with _process("C", argv, report, **kwargs) as rec:
        if rec is None:
            return report
        if rec.call("SetConfig", rec.plugin.set_config, config_bytes, api_version, agent_nomad_config()) is None:
            return report
        fp_stream = rec.plugin.fingerprint()
        latest: Any = None
        fp_closed_reported = False
        for i in range(max(1, fingerprints)):
            message = rec.read(fp_stream, fingerprint_timeout, f"Fingerprint#{i + 1}")
            if isinstance(message, Exception):
                closed = isinstance(message, (StreamEndedError, StreamFailedError))
                fp_closed_reported = closed
                rec.problem(f"Fingerprint message {i + 1}: {message}"
                            + (" (Nomad clears the devices and kills the plugin, no retry)" if closed else ""))
                break
            fp_problems = validate.validate_fingerprint(message)
            rec.report.problems.extend(f"Fingerprint#{i + 1}: {p}" for p in fp_problems)
            if fp_problems:  # instance.go handleFingerprintError: devices cleared, plugin killed, no stats
                latest = None
                fp_closed_reported = True
                break
            latest = message
        if latest is not None and stats_messages > 0:
            st_stream = rec.plugin.stats(stats_interval)
            for i in range(stats_messages):
                message = rec.read(st_stream, stats_timeout, f"Stats#{i + 1}")
                if isinstance(message, Exception):
                    rec.problem(f"Stats message {i + 1}: {message}")
                    break
                rec.report.problems.extend(f"Stats#{i + 1}: {p}" for p in validate.validate_stats(message, latest))
        if latest is not None and reserve_ids is not None:
            ids = _fingerprint_ids(latest) if reserve_ids == "fingerprinted" else list(reserve_ids)
            if ids:
                reserved = rec.call("Reserve", rec.plugin.reserve, ids)
                if reserved is not None:
                    rec.record("Reserve", reserved)
                    rec.report.problems.extend(f"Reserve: {p}" for p in validate.validate_reserve(reserved))
            else:
                rec.report.calls.append(CallRecord("Reserve", 0.0, "skipped: the fingerprint holds no device"))
        if not fp_closed_reported and not fp_stream.open:
            state = fp_stream.error or "ended by the plugin"
            rec.problem(f"Fingerprint stream closed before shutdown ({state}): Nomad clears the devices for good")
    return report


# --------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m support.nomadclient.launcher BINARY [CONFIG.json]``: run :func:`run_lifecycle`, print
    the JSON report, exit 1 on any problem (2 on bad usage)."""
    parser = argparse.ArgumentParser(
        prog="python -m support.nomadclient.launcher",
        description="Launch a Nomad device plugin as a Nomad client does and check every answer.",
    )
    parser.add_argument("binary", help="plugin executable")
    parser.add_argument("config", nargs="?", help="JSON file: the plugin's config block (default {})")
    parser.add_argument("--arg", action="append", default=[], help="argument for the binary (Nomad's plugin args)")
    parser.add_argument("--fingerprints", type=int, default=1, help="fingerprint messages to read (default 1)")
    parser.add_argument("--stats", type=int, default=1, help="stats messages to read (default 1)")
    parser.add_argument("--stats-interval", type=float, default=1.0, help="collection_interval in seconds")
    parser.add_argument("--reserve", help="comma-separated device IDs, or 'fingerprinted'")
    parser.add_argument("--socket-dir", action="store_true", help="set PLUGIN_UNIX_SOCKET_DIR to a temp dir")
    parser.add_argument("--numbers", choices=("cty", "float", "string"), default="cty",
                        help="how to encode non-integral numbers in msgpack_config (default: as go-cty)")
    parser.add_argument("--fingerprint-timeout", type=float, default=NOMAD_FIRST_FINGERPRINT_WAIT)
    parser.add_argument("--stats-timeout", type=float, default=15.0)
    parser.add_argument("--quiet-logs", action="store_true", help="leave plugin log records out of the report")
    args = parser.parse_args(argv)

    user: dict[str, Any] = {}
    if args.config:
        try:
            with open(args.config, encoding="utf-8") as fh:
                loaded = json.load(fh)
        except (OSError, ValueError) as exc:
            parser.error(f"cannot read {args.config}: {exc}")
        if not isinstance(loaded, dict):
            parser.error(f"{args.config}: the config must be a JSON object")
        user = loaded
    reserve: Sequence[str] | Literal["fingerprinted"] | None = None
    if args.reserve == "fingerprinted":
        reserve = "fingerprinted"
    elif args.reserve:
        reserve = [s for s in args.reserve.split(",") if s]

    report = run_lifecycle(
        [args.binary, *args.arg], user, fingerprints=args.fingerprints, stats_messages=args.stats,
        reserve_ids=reserve, stats_interval=args.stats_interval, fingerprint_timeout=args.fingerprint_timeout,
        stats_timeout=args.stats_timeout, number_mode=args.numbers, socket_dir=True if args.socket_dir else None,
    )
    out = report.to_dict()
    if args.quiet_logs:
        for proc in out["processes"]:
            proc.pop("logs", None)
    json.dump(out, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
