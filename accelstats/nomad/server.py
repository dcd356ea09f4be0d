"""``nomad-device-accelstats``: the go-plugin process a Nomad client launches from its plugin_dir.

Start-up (docs/nomad.md; hashicorp/go-plugin ``server.go``; Nomad ``plugins/base/plugin.go``):

1. refuse to run unless ``NOMAD_PLUGIN_MAGIC_COOKIE`` holds Nomad's cookie (exit 1, a message on stderr);
2. bind a unix socket (in ``PLUGIN_UNIX_SOCKET_DIR`` when set, else a private temp dir);
3. serve BasePlugin, DevicePlugin, ``plugin.GRPCController`` (Shutdown), ``plugin.GRPCStdio`` and
   the gRPC health service (``plugin`` = SERVING) from one server;
4. print exactly one line, ``1|2|unix|<path>|grpc``, on stdout and flush — nothing before it;
5. log to stderr as hclog JSON lines, uncaught exceptions of any thread included (one line at
   ``error`` level: go-plugin logs a stderr line that is not hclog JSON at DEBUG, ``client.go:1226-1249``,
   so a bare traceback would be invisible at the agent's default INFO level);
6. ignore SIGINT (go-plugin's server does, ``server.go:460-473``); stop cleanly on Shutdown within
   2 s; **die** on SIGTERM, as a Go plugin does (neither go-plugin nor Nomad's device ``Serve``
   handles it): the streams then fail with UNAVAILABLE, which Nomad reads as "the plugin died" and
   relaunches it (``client/devicemanager/instance.go:371-374``), whereas a clean end of the
   Fingerprint stream would mean "shut down gracefully" and take the plugin's devices off the node
   until the agent restarts (``:358-361, 390-409``). MPS control daemons are not touched by either.

The import path is kept light: Nomad launches this binary three times per agent start.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from concurrent import futures
from typing import Any

MAX_RPCS = 48
#: Largest request accepted (gRPC's default, set here so an upgrade cannot lift it): the largest valid
#: SetConfig (256 MPS resources of 256 device IDs) is about 2.7 MB; past it gRPC answers RESOURCE_EXHAUSTED
#: before the plugin sees the message.
MAX_REQUEST_BYTES = 4 * 2**20
MAGIC_COOKIE_KEY = "NOMAD_PLUGIN_MAGIC_COOKIE"
MAGIC_COOKIE_VALUE = "e4327c2e01eabfd75a8a67adb114fb34a757d57eee7728d857a8cec6e91a7255"
CORE_PROTOCOL_VERSION = 1  # go-plugin's
APP_PROTOCOL_VERSION = 2  # Nomad's plugins/base/plugin.go Handshake.ProtocolVersion (1 in older copies)
HCLOG_LEVELS = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warn", logging.ERROR: "error",
                logging.CRITICAL: "error"}
_STD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class HclogFormatter(logging.Formatter):
    """One hclog JSON record per line: ``@level``, ``@message``, ``@timestamp`` (6 fraction digits and
    a numeric offset, as Nomad parses it), ``@module``, plus the record's extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created).astimezone()
        out: dict[str, Any] = {"@level": HCLOG_LEVELS.get(record.levelno, "info"),
                               "@message": record.getMessage(),
                               "@timestamp": ts.strftime("%Y-%m-%dT%H:%M:%S.%f") + ts.strftime("%z")[:3] + ":"
                               + ts.strftime("%z")[3:],
                               "@module": record.name}
        for key, value in vars(record).items():
            if key not in _STD_ATTRS and not key.startswith("_"):
                out[key] = value if isinstance(value, (str, int, float, bool)) else str(value)
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def _logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(HclogFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    level = os.environ.get("ACCELSTATS_LOG_LEVEL", "INFO").upper()
    root.setLevel(level if level in ("DEBUG", "INFO", "WARNING", "ERROR") else "INFO")  # never fail the start


def install_excepthooks() -> None:
    """Make an uncaught exception, in the main thread or any other, one hclog JSON record at error
    level (``@message`` names the exception, ``error`` holds the traceback) instead of a traceback on
    stderr, which Nomad would log at DEBUG (see module docstring, step 5)."""
    crash = logging.getLogger("accelstats.nomad")

    def main_hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        crash.error("plugin crashed: %s: %s", kind.__name__, value, exc_info=(kind, value, tb))

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread is not None else "?"
        crash.error("uncaught exception in thread %s: %s: %s", name, args.exc_type.__name__, args.exc_value,
                    exc_info=(args.exc_type, args.exc_value or args.exc_type(), args.exc_traceback))

    sys.excepthook = main_hook
    threading.excepthook = thread_hook


def _die_on_sigterm(private: list[str]) -> None:
    """SIGTERM: remove the socket directory, then die of the signal (exit status -15, non-zero), as a
    Go plugin does (see module docstring, step 6)."""
    def handler(signum: int, frame: Any) -> None:
        logging.getLogger("accelstats.nomad").warning(
            "SIGTERM: exiting at once, as a Go plugin does; Nomad relaunches the plugin (MPS daemons keep running)")
        for path in private:
            shutil.rmtree(path, ignore_errors=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)


def main() -> None:
    """The plugin process (see module docstring). Exit status 0 after Shutdown, killed by SIGTERM
    (-15) on SIGTERM, 1 without the cookie or after a crash."""
    if os.environ.get(MAGIC_COOKIE_KEY) != MAGIC_COOKIE_VALUE:
        sys.stderr.write(
            "This binary is a plugin for HashiCorp Nomad (a device plugin of accelstats). It is not\n"
            "meant to be run directly: put it in the Nomad client's plugin_dir and configure it with a\n"
            '`plugin "nomad-device-accelstats" { config { ... } }` block. For the exporter, run `accelstats`.\n')
        sys.exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _logging()
    install_excepthooks()
    stop = threading.Event()
    private_dirs: list[str] = []
    _die_on_sigterm(private_dirs)

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from accelstats.nomad import plugin
    from accelstats.nomad.proto import (
        base_pb2_grpc,
        device_pb2_grpc,
        grpc_controller_pb2,
        grpc_controller_pb2_grpc,
        grpc_stdio_pb2_grpc,
    )

    class Controller(grpc_controller_pb2_grpc.GRPCControllerServicer):  # type: ignore[misc]
        def Shutdown(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
            log.info("shutdown requested by Nomad")
            stop.set()
            return grpc_controller_pb2.Empty()

    class Stdio(grpc_stdio_pb2_grpc.GRPCStdioServicer):  # type: ignore[misc]
        def StreamStdio(self, request: Any, context: Any) -> Any:  # noqa: N802
            # Logs go to stderr (which Nomad reads); hold the stream open until cancelled.
            while context.is_active() and not stop.wait(0.5):
                pass
            return
            yield  # a generator that sends nothing

    log = logging.getLogger("accelstats.nomad")
    state = plugin.DevicePluginState(stop)
    # Fingerprint, Stats and StreamStdio each hold a worker for the process lifetime; Reserve and the
    # unary calls come on top.
    # Streams give their worker back at once when cancelled (DevicePluginState.sleep); past
    # MAX_RPCS concurrent calls gRPC answers RESOURCE_EXHAUSTED at once instead of queueing forever.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=MAX_RPCS + 8, thread_name_prefix="nomad-rpc"),
                         maximum_concurrent_rpcs=MAX_RPCS,
                         options=[("grpc.max_receive_message_length", MAX_REQUEST_BYTES)])
    base_pb2_grpc.add_BasePluginServicer_to_server(plugin.BasePluginServicer(state), server)
    device_pb2_grpc.add_DevicePluginServicer_to_server(plugin.DevicePluginServicer(state), server)
    grpc_controller_pb2_grpc.add_GRPCControllerServicer_to_server(Controller(), server)
    grpc_stdio_pb2_grpc.add_GRPCStdioServicer_to_server(Stdio(), server)
    health_servicer = health.HealthServicer()
    health_servicer.set("plugin", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)

    socket_dir = os.environ.get("PLUGIN_UNIX_SOCKET_DIR") or None
    private = tempfile.mkdtemp(prefix="plugin", dir=socket_dir)
    private_dirs.append(private)
    path = os.path.join(private, "accelstats.sock")
    server.add_insecure_port(f"unix:{path}")
    server.start()
    sys.stdout.write(f"{CORE_PROTOCOL_VERSION}|{APP_PROTOCOL_VERSION}|unix|{path}|grpc\n")
    sys.stdout.flush()
    log.info("plugin started", extra={"socket": path, "pid": os.getpid()})
    try:
        # A timed wait: a process-directed SIGTERM the kernel gives to a gRPC thread only sets Python's
        # flag, and a main thread asleep in an untimed wait would not run the handler until woken.
        while not stop.wait(0.2):
            pass
    finally:
        # Nomad kills the plugin 2 s after Shutdown: whatever is still running at 1.8 s is abandoned.
        threading.Timer(1.8, os._exit, args=(0,)).start()
        state.wake_all()
        health_servicer.enter_graceful_shutdown()
        server.stop(grace=0.3).wait(0.6)
        state.close()
        shutil.rmtree(private, ignore_errors=True)
        log.info("plugin stopped")
    os._exit(0)  # daemon threads (NVML worker, HTTP) must not delay Nomad's 2 s budget


if __name__ == "__main__":  # pragma: no cover
    main()
