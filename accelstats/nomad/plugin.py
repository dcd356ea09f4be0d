"""The BasePlugin and DevicePlugin servicers: Nomad's side of accelstats.

One :class:`DevicePluginState` per process holds the settings from SetConfig
(:func:`accelstats.nomad.config.decode`, the project's one settings model), the
:class:`~accelstats.manager.AcceleratorManager` (one NVML session, shared with ``/metrics`` when
``metrics_listen`` is set), and the latest fingerprint (Reserve answers from it). Stream rules from
docs/nomad.md: Fingerprint sends a first message at once (even empty), then a full snapshot
whenever anything changes, and never ends on purpose; Stats sends at ``collection_interval`` (0 → 1 s)
with a timestamp on every DeviceStats; errors use INVALID_ARGUMENT / FAILED_PRECONDITION, never
UNAVAILABLE or CANCELLED (Nomad reads those as "plugin died").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from accelstats import __version__
from accelstats.manager import AcceleratorManager, Collection, build_manager
from accelstats.nomad import config as plugin_config
from accelstats.nomad import devices
from accelstats.nomad.config import MAX_PERIOD, MIN_PERIOD
from accelstats.nomad.proto import base_pb2, base_pb2_grpc, device_pb2, device_pb2_grpc, hclspec_pb2, structs_pb2
from accelstats.registry import enabled_names
from accelstats.settings import ConfigError, SetupError

log = logging.getLogger("accelstats.nomad")

PLUGIN_NAME = "accelstats"
API_VERSIONS = ["v0.1.0"]  # Nomad's device plugin API versions (plugins/base: DeviceApiVersion010)
HEALTH_PERIOD = 5.0  # seconds: health changes reach Fingerprint well within fingerprint_period


class _CurrentCollections:
    """What the /metrics server collects from: the collections of whichever AcceleratorManager the
    latest SetConfig made, so a config change does not have to restart the HTTP server (scrapes keep
    working across it)."""

    def __init__(self, state: DevicePluginState) -> None:
        self.state = state

    def collect(self) -> Collection:
        """The current manager's collection; RuntimeError before SetConfig (the scrape fails)."""
        manager = self.state.manager
        if manager is None:
            raise RuntimeError("not configured yet")
        return manager.collect()


class DevicePluginState:
    """Settings, manager and latest fingerprint of one plugin process. Thread-safe."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        self.settings = plugin_config.DEFAULTS
        self.manager: AcceleratorManager | None = None
        self.snapshot = devices.Snapshot()
        self.configured = threading.Event()
        self.changed = threading.Event()  # set by SetConfig: streams re-read at once
        self._lock = threading.Lock()
        self._config_lock = threading.Lock()  # serialises SetConfig; never held by Reserve
        self._raw_config: bytes | None = None
        self._metrics_server: Any = None
        self._metrics_listen = ""
        self._metrics_web_config: Path | None = None
        self._wakers: set[threading.Event] = set()
        self._last_gpus: list[Any] = []
        self._mps: Any = None  # accelstats.nomad.mpsshares.PluginMps once MPS is configured

    def set_config(self, data: bytes) -> None:
        """Apply SetConfig; idempotent (the same bytes twice change nothing). The new manager is built
        outside the state lock (Reserve and streams keep going) and only committed once everything,
        /metrics included, worked. Raises ConfigError."""
        with self._config_lock:
            if data == self._raw_config and self.manager is not None:
                return
            settings = plugin_config.decode(data)
            try:
                manager = build_manager(settings)
            except SetupError as exc:
                raise ConfigError(f"config: {plugin_config.plugin_field(exc.field)}: {exc.reason}") from exc
            try:
                self._serve_metrics(settings.listen if settings.nomad.serve_metrics else "", settings.web_config)
            except ConfigError:
                manager.destroy(timeout=0.5)
                manager.close()
                raise
            with self._lock:
                old, self.settings, self.manager = self.manager, settings, manager
            self._raw_config = data
            if old is not None:
                old.destroy(timeout=0.5)
                old.close()
            if self._mps is not None:  # daemons of removed or changed resources stop; the others keep running
                self._mps.reconfigure(settings.mps)
            self.configured.set()
            self.wake_all()

    def _serve_metrics(self, listen: str, web_config: Path | None = None) -> None:
        """``metrics_listen``: /metrics from this process's manager (one NVML session, not two);
        restarted only when the address or ``metrics_web_config`` changes.

        ``web_config``: an exporter-toolkit web config file, as ``accelstats serve --web-config`` takes
        (docs/web-config.md): TLS, basic auth and headers, reloaded when the file changes
        (:class:`accelstats.web.source.WebConfigSource`). It is loaded and checked before the running
        endpoint is touched: a bad file is a ConfigError naming ``metrics_web_config`` and the key
        at fault, and the endpoint in force stays. Raises ConfigError (also when the address cannot
        be bound)."""
        if (listen, web_config) == (self._metrics_listen, self._metrics_web_config):
            return
        web = None
        if listen and web_config is not None:
            from accelstats.web import load_web_config

            try:
                web = load_web_config(web_config)
            except ValueError as exc:  # WebConfigError (a ConfigError): the file and the key at fault
                raise ConfigError(f"config: metrics_web_config: {exc}") from exc
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server, self._metrics_listen, self._metrics_web_config = None, "", None
        if listen:
            from accelstats.config import parse_listen
            from accelstats.web import serve

            host, port = parse_listen(listen)
            try:
                self._metrics_server, _ = serve(_CurrentCollections(self), host, port, web=web)  # type: ignore[arg-type]
            except OSError as exc:
                if web is not None:
                    web.close()
                raise ConfigError(f"config: metrics_listen: cannot listen on {listen[:200]}: "
                                  f"{exc.strerror or exc}") from exc
            self._metrics_listen, self._metrics_web_config = listen, web_config
            log.info("serving /metrics", extra={
                "listen": listen, "tls": bool(web and web.tls_enabled),
                "basic_auth": bool(web and web.initial.users), "web_config": str(web_config or "")})

    def collect(self) -> Collection | None:
        """One (shared) collection, or None before SetConfig."""
        manager = self.manager
        return manager.collect() if manager is not None else None

    def fingerprint(self) -> devices.Snapshot:
        """A fingerprint from a fresh collection; kept as the latest for Reserve.

        When NVML as a whole stops answering (driver unloaded, library gone), the GPUs of the last
        fingerprint stay, unhealthy, with the reason: an empty answer would make Nomad drop them.
        """
        collection = self.collect()
        if collection is None:
            return devices.Snapshot()
        previous = self.snapshot
        shares = self._mps_shares(collection)
        mig_caps = _mig_caps(self) if any(d.kind == "mig" for d in collection.snapshot.devices) else None
        snap = devices.fingerprint(device_pb2, structs_pb2, collection, self.settings, previous, shares, mig_caps)
        gpus = [g for g in snap.groups if g.vendor == "nvidia"]
        nvml_down = collection.snapshot.nvml_status and "nvidia" in enabled_names(self.settings)
        if gpus:
            self._last_gpus = gpus
        elif nvml_down and self._last_gpus:
            snap = devices.keep_unhealthy(device_pb2, snap, self._last_gpus, previous,
                                          f"NVML is not answering ({collection.snapshot.nvml_status}); check the "
                                          "NVIDIA driver (nvidia-smi, dmesg)")
        with self._lock:
            self.snapshot = snap
        return snap

    def _mps_shares(self, collection: Collection) -> dict[str, devices.MpsShare]:
        """GPU UUID → its MPS share (:class:`accelstats.nomad.mpsshares.PluginMps`: daemons started or
        adopted on the first Fingerprint — only the long-lived process C calls it — health-checked and
        retried on every one after, kept running when the plugin exits)."""
        if not self.settings.mps.resources or collection.snapshot.nvml_status:
            return {}
        from accelstats.mps.host import gpus_of
        from accelstats.nomad.mpsshares import PluginMps

        if self._mps is None:
            self._mps = PluginMps(self.settings.mps)
        shares: dict[str, devices.MpsShare] = self._mps.shares(gpus_of(collection.snapshot))
        return shares

    def sleep(self, context: grpc.ServicerContext, seconds: float) -> None:
        """Wait ``seconds``, but wake at once when the RPC is cancelled, SetConfig changes the
        settings, or the plugin stops: a cancelled stream must give its worker back promptly."""
        wake = threading.Event()
        context.add_callback(wake.set)
        with self._lock:
            self._wakers.add(wake)
        try:
            if not self.stop.is_set() and context.is_active():
                wake.wait(seconds)
        finally:
            with self._lock:
                self._wakers.discard(wake)

    def wake_all(self) -> None:
        """Wake every sleeping stream (SetConfig, stop)."""
        with self._lock:
            wakers = list(self._wakers)
        for w in wakers:
            w.set()

    def close(self) -> None:
        """Stop /metrics and shut NVML down (each bounded: the process must exit within 2 s). MPS control
        daemons are left running: tasks keep using them, and the next plugin process adopts them."""
        self.wake_all()  # MPS daemons keep running for the tasks using them (docs/nomad.md, "MPS")
        if self._metrics_server is not None:
            threading.Thread(target=self._metrics_server.shutdown, daemon=True).start()
        if self.manager is not None:
            self.manager.destroy(timeout=0.3)


class BasePluginServicer(base_pb2_grpc.BasePluginServicer):  # type: ignore[misc]
    """PluginInfo, ConfigSchema, SetConfig (package hashicorp.nomad.plugins.base.proto)."""

    def __init__(self, state: DevicePluginState) -> None:
        self.state = state

    def PluginInfo(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802 - gRPC name
        """type DEVICE, API versions ["v0.1.0"], this package's version, name "accelstats"."""
        return base_pb2.PluginInfoResponse(type=base_pb2.DEVICE, plugin_api_versions=API_VERSIONS,
                                           plugin_version=__version__, name=PLUGIN_NAME)

    def ConfigSchema(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        """The hclspec schema with every default (:func:`accelstats.nomad.config.schema`)."""
        return base_pb2.ConfigSchemaResponse(spec=plugin_config.schema(hclspec_pb2))

    def SetConfig(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        """Apply the go-cty msgpack config; INVALID_ARGUMENT naming the field when it is bad, INTERNAL
        (with the traceback in the log) when the failure is no setting's fault."""
        try:
            self.state.set_config(bytes(request.msgpack_config))
        except ConfigError as exc:
            log.error("SetConfig rejected: %s", exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:  # reported as INTERNAL: Nomad shows it, the log has the traceback
            log.exception("SetConfig failed")
            context.abort(grpc.StatusCode.INTERNAL, f"SetConfig failed: {exc!r}")
        return base_pb2.SetConfigResponse()


class DevicePluginServicer(device_pb2_grpc.DevicePluginServicer):  # type: ignore[misc]
    """Fingerprint, Reserve, Stats (package hashicorp.nomad.plugins.device)."""

    def __init__(self, state: DevicePluginState) -> None:
        self.state = state

    def Fingerprint(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:  # noqa: N802
        """A first message at once, then a full snapshot on every change (checked every 5 s, or
        ``list_period``) and every ``fingerprint_period``; never ends on its own."""
        state = self.state
        if not state.configured.wait(timeout=1.0):
            yield device_pb2.FingerprintResponse()  # first message promptly, even empty
        last: bytes | None = None
        next_full = 0.0
        while context.is_active() and not state.stop.is_set():
            state.changed.clear()
            try:
                snap = state.fingerprint()
                message = device_pb2.FingerprintResponse(device_group=snap.groups)
                wire = message.SerializeToString(deterministic=True)
                now = time.monotonic()
                if wire != last or now >= next_full:  # on change, and a full refresh every fingerprint_period
                    yield message
                    last, next_full = wire, now + state.settings.nomad.fingerprint_period
            except Exception:
                log.exception("fingerprint failed; retrying")
            state.sleep(context, self._period())

    def _period(self) -> float:
        settings = self.state.settings
        period = min(settings.nomad.fingerprint_period, HEALTH_PERIOD)
        if settings.file_devices.dir is not None:
            period = min(period, settings.file_devices.list_period)
        return max(period, MIN_PERIOD)

    def Stats(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:  # noqa: N802
        """StatsResponse every ``collection_interval`` (0 → 1 s; clamped to :data:`MIN_PERIOD` -
        :data:`MAX_PERIOD`), timestamped."""
        interval = 0.0
        if request.HasField("collection_interval"):
            d = request.collection_interval
            interval = d.seconds + d.nanos / 1e9
        interval = min(max(interval, MIN_PERIOD), MAX_PERIOD) if interval > 0 else 1.0
        state = self.state
        from google.protobuf import timestamp_pb2

        while context.is_active() and not state.stop.is_set():
            t0 = time.monotonic()
            try:
                collection = state.collect()
                if collection is not None:
                    ts = timestamp_pb2.Timestamp()
                    ts.GetCurrentTime()
                    yield devices.stats(device_pb2, structs_pb2, collection, state.snapshot, ts)
            except Exception:
                log.exception("stats failed; retrying")
            state.sleep(context, max(0.0, interval - (time.monotonic() - t0)))

    def Reserve(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        """ContainerReservation for IDs of the latest fingerprint (:func:`devices.reserve`), a repeated ID
        once; INVALID_ARGUMENT for none, more than :data:`devices.MAX_RESERVE_IDS`, an unknown ID, or any
        request :func:`devices.reserve` refuses (e.g. two MPS replicas, unless the ``mps`` block's
        ``fail_requests_greater_than_one`` is false)."""
        state = self.state
        snap = state.snapshot  # one reference read: the latest fingerprint, never a half-built one
        try:
            ids = devices.reserve_ids(request.device_ids)  # bounded and distinct before anything else
            mig_caps = _mig_caps(state) if any(r.kind == "mig" for i in ids
                                              if (r := snap.devices.get(i)) is not None) else {}
            nomad = state.settings.nomad
            res = devices.reserve(device_pb2, snap, ids, mig_caps, visible_env=nomad.visible_devices_env,
                                  fail_requests_greater_than_one=nomad.fail_mps_requests_greater_than_one)
        except devices.ReserveError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return device_pb2.ReserveResponse(container_res=res)


def _mig_caps(state: DevicePluginState) -> dict[tuple[int, int, int], list[int]]:
    """(parent minor, gi, ci) -> the nvidia-caps minors a MIG instance's task needs, from mig-minors."""
    from accelstats.cgroups import parse_mig_minors
    from collectors.fsread import read_small

    data = read_small(state.settings.proc_root / "driver" / "nvidia-caps" / "mig-minors")
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
