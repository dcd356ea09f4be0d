"""The BasePlugin and DevicePlugin servicers: Nomad's side of accelstats.

One :class:`DevicePluginState` per process holds the settings from SetConfig, the
:class:`~accelstats.manager.AcceleratorManager` (one NVML session, shared with ``/metrics`` when
``metrics_listen`` is set), and the latest fingerprint (Reserve answers from it). Stream rules from
spec/nomad-plugin.md §3: Fingerprint sends a first message at once (even empty), then a full snapshot
whenever anything changes, and never ends on purpose; Stats sends at ``collection_interval`` (0 → 1 s)
with a timestamp on every DeviceStats; errors use INVALID_ARGUMENT / FAILED_PRECONDITION, never
UNAVAILABLE or CANCELLED (Nomad reads those as "plugin died").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from accelstats import __version__
from accelstats.config import ConfigError, FileDevicesSettings, Settings
from accelstats.manager import AcceleratorManager, Collection
from accelstats.nomad import config as plugin_config
from accelstats.nomad import devices
from accelstats.nomad.proto import base_pb2, base_pb2_grpc, device_pb2, device_pb2_grpc, hclspec_pb2, structs_pb2

log = logging.getLogger("accelstats.nomad")

PLUGIN_NAME = "accelstats"
API_VERSIONS = ["v0.1.0"]  # Nomad's device plugin API versions (plugins/base: DeviceApiVersion010)
HEALTH_PERIOD = 5.0  # seconds: health changes reach Fingerprint well within fingerprint_period


class DevicePluginState:
    """Settings, manager and latest fingerprint of one plugin process. Thread-safe."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        self.config = plugin_config.PluginConfig()
        self.manager: AcceleratorManager | None = None
        self.snapshot = devices.Snapshot()
        self.configured = threading.Event()
        self._lock = threading.Lock()
        self._raw_config: bytes | None = None
        self._metrics_server: Any = None

    def set_config(self, data: bytes) -> None:
        """Apply SetConfig; idempotent (the same bytes twice change nothing). Raises ConfigError."""
        with self._lock:
            if data == self._raw_config and self.manager is not None:
                return
            cfg = plugin_config.decode(data)
            settings = Settings(
                nvml_replay=cfg.nvml_replay, cgroup_root=cfg.cgroup_root, proc_root=cfg.proc_root,
                collectors=("nvidia", "files") if cfg.file_devices.dir is not None else ("nvidia",),
                file_devices=FileDevicesSettings(
                    dir=cfg.file_devices.dir, unhealthy_perm=cfg.file_devices.unhealthy_perm,
                    vendor=cfg.file_devices.vendor, type=cfg.file_devices.type, name=cfg.file_devices.name),
                open_fd_scan=False)
            manager = _manager(settings)
            old = self.manager
            self.config, self.manager, self._raw_config = cfg, manager, data
            if old is not None:
                old.destroy()
            self._serve_metrics(cfg)
            self.configured.set()

    def _serve_metrics(self, cfg: plugin_config.PluginConfig) -> None:
        """``metrics_listen``: /metrics from this process's manager (one NVML session, not two)."""
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None
        if cfg.metrics_listen and self.manager is not None:
            from accelstats.config import parse_listen
            from accelstats.exporter import serve

            host, port = parse_listen(cfg.metrics_listen)
            try:
                self._metrics_server, _ = serve(self.manager, host, port)
            except OSError as exc:
                raise ConfigError(f"config: metrics_listen: cannot listen on {cfg.metrics_listen}: "
                                  f"{exc.strerror or exc}") from exc
            log.info("serving /metrics", extra={"listen": cfg.metrics_listen})

    def collect(self) -> Collection | None:
        """One (shared) collection, or None before SetConfig."""
        manager = self.manager
        return manager.collect() if manager is not None else None

    def fingerprint(self) -> devices.Snapshot:
        """A fingerprint from a fresh collection; kept as the latest for Reserve."""
        collection = self.collect()
        snap = (devices.fingerprint(device_pb2, structs_pb2, collection, self.config)
                if collection is not None else devices.Snapshot())
        with self._lock:
            self.snapshot = snap
        return snap

    def close(self) -> None:
        """Stop /metrics and shut NVML down."""
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        if self.manager is not None:
            self.manager.destroy(timeout=0.5)


def _manager(settings: Settings) -> AcceleratorManager:
    nvml: Any = None
    if settings.nvml_replay is not None:
        from collectors.nvml_replay import ReplayError, ReplayNVML

        try:
            nvml = ReplayNVML.from_path(settings.nvml_replay)
        except (ReplayError, OSError) as exc:
            raise ConfigError(f"config: nvml_replay: {exc}") from exc
    manager = AcceleratorManager(settings, nvml)
    try:
        manager.setup()
    except Exception as exc:
        raise ConfigError(f"config: file_devices.dir: {exc}") from exc
    return manager


class BasePluginServicer(base_pb2_grpc.BasePluginServicer):  # type: ignore[misc]
    """PluginInfo, ConfigSchema, SetConfig (package hashicorp.nomad.plugins.base.proto)."""

    def __init__(self, state: DevicePluginState) -> None:
        self.state = state

    def PluginInfo(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802 - gRPC name
        return base_pb2.PluginInfoResponse(type=base_pb2.DEVICE, plugin_api_versions=API_VERSIONS,
                                           plugin_version=__version__, name=PLUGIN_NAME)

    def ConfigSchema(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        return base_pb2.ConfigSchemaResponse(spec=plugin_config.schema(hclspec_pb2))

    def SetConfig(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        try:
            self.state.set_config(bytes(request.msgpack_config))
        except ConfigError as exc:
            log.error("SetConfig rejected: %s", exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return base_pb2.SetConfigResponse()


class DevicePluginServicer(device_pb2_grpc.DevicePluginServicer):  # type: ignore[misc]
    """Fingerprint, Reserve, Stats (package hashicorp.nomad.plugins.device)."""

    def __init__(self, state: DevicePluginState) -> None:
        self.state = state

    def Fingerprint(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:  # noqa: N802
        state = self.state
        if not state.configured.wait(timeout=1.0):
            yield device_pb2.FingerprintResponse()  # first message promptly, even empty
        last: bytes | None = None
        next_full = 0.0
        while context.is_active() and not state.stop.is_set():
            try:
                snap = state.fingerprint()
                message = device_pb2.FingerprintResponse(device_group=snap.groups)
                wire = message.SerializeToString(deterministic=True)
                now = time.monotonic()
                if wire != last or now >= next_full:  # on change, and a full refresh every fingerprint_period
                    yield message
                    last, next_full = wire, now + state.config.fingerprint_period
            except Exception:
                log.exception("fingerprint failed; retrying")
            state.stop.wait(self._period())

    def _period(self) -> float:
        cfg = self.state.config
        period = min(cfg.fingerprint_period, HEALTH_PERIOD)
        if cfg.file_devices.dir is not None:
            period = min(period, cfg.file_devices.list_period)
        return max(period, 0.05)

    def Stats(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:  # noqa: N802
        interval = request.collection_interval.ToTimedelta().total_seconds() if request.HasField(
            "collection_interval") else 0.0
        interval = interval if interval > 0 else 1.0
        state = self.state
        while context.is_active() and not state.stop.is_set():
            t0 = time.monotonic()
            try:
                collection = state.collect()
                if collection is not None:
                    from google.protobuf import timestamp_pb2

                    ts = timestamp_pb2.Timestamp()
                    ts.GetCurrentTime()
                    yield devices.stats(device_pb2, structs_pb2, collection, state.snapshot, ts)
            except Exception:
                log.exception("stats failed; retrying")
            state.stop.wait(max(0.0, interval - (time.monotonic() - t0)))

    def Reserve(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        state = self.state
        with state._lock:
            snap = state.snapshot
        try:
            mig_caps = _mig_caps(state) if any(r.kind == "mig" for i in request.device_ids
                                              if (r := snap.devices.get(i)) is not None) else {}
            res = devices.reserve(device_pb2, snap, list(request.device_ids), mig_caps)
        except devices.ReserveError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return device_pb2.ReserveResponse(container_res=res)


def _mig_caps(state: DevicePluginState) -> dict[tuple[int, int, int], list[int]]:
    """(parent minor, gi, ci) -> the nvidia-caps minors a MIG instance's task needs, from mig-minors."""
    from accelstats.cgroups import parse_mig_minors
    from accelstats.fsread import read_small

    data = read_small(state.config.proc_root / "driver" / "nvidia-caps" / "mig-minors")
    if data is None:
        return {}
    caps, _ = parse_mig_minors(data.decode("utf-8", errors="replace"))
    out: dict[tuple[int, int, int], list[int]] = {}
    gi_minor = {(c.gpu_minor, c.gi): m for m, c in caps.items() if c.kind == "access" and c.ci is None}
    for minor, c in caps.items():
        if c.kind == "access" and c.ci is not None and c.gpu_minor is not None and c.gi is not None:
            key = (c.gpu_minor, c.gi, c.ci)
            out[key] = [m for m in (gi_minor.get((c.gpu_minor, c.gi)), minor) if m is not None]
    return out
