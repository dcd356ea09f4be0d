"""The ``accelstats`` command: serve, dump, devices, containers.

Every command takes the same source options (``--config``, ``--nvml-replay``, ``--file-devices``,
``--cgroup-root``, ``--proc-root``, ``--log-level``); settings come from the defaults, then the config
file (``/etc/accelstats/config.toml`` when present), then the command line. Errors in input print one
line ``accelstats: error: ...`` and exit with status 2.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from accelstats import __version__, sdnotify
from accelstats.config import DEFAULT_CONFIG, Origin, changed_settings, configure_logging, load_config, parse_listen
from accelstats.manager import AcceleratorManager, Collection, build_manager
from accelstats.registry import COLLECTORS
from accelstats.settings import (
    DEFAULT_POD_RESOURCES_SOCKET,
    DEFAULT_PORT,
    LOG_FORMATS,
    LOG_LEVELS,
    ConfigError,
    Settings,
    SetupError,
)

if TYPE_CHECKING:  # the MPS code is imported only by the mps commands
    from accelstats.mps.host import MpsDaemons

log = logging.getLogger("accelstats")
F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str) -> NoReturn:
    """Print ``accelstats: error: <message>`` on stderr and exit with status 2."""
    click.echo(f"accelstats: error: {message}", err=True)
    sys.exit(2)


def source_options(fn: F) -> F:
    """The options every command shares (where the data comes from)."""
    options = [
        click.option("--config", "config_path", type=click.Path(path_type=Path),
                     help=f"TOML config file (default: {DEFAULT_CONFIG} when present)."),
        click.option("--nvml-replay", type=click.Path(path_type=Path),
                     help="Replay an nvidia-smi -q -x XML or a scenario TOML instead of live NVML."),
        click.option("--file-devices", metavar="DIR",
                     help="Directory whose files are file devices (Nomad example-plugin model)."),
        click.option("--cgroup-root", type=click.Path(path_type=Path), help="cgroup root [/sys/fs/cgroup]."),
        click.option("--proc-root", type=click.Path(path_type=Path), help="proc root [/proc]."),
        click.option("--sysfs-root", type=click.Path(path_type=Path), hidden=True, help="sysfs root [/sys]."),
        click.option("--rootfs", type=click.Path(path_type=Path),
                     help="The host's / (container runtime state files are read under it) [/]."),
        click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False),
                     help="Log level [info]."),
        click.option("--log-format", type=click.Choice(LOG_FORMATS, case_sensitive=False),
                     help="Log line format on stderr [text]."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def build_settings(config_path: Path | None, nvml_replay: Path | None, file_devices: str | None,
                   cgroup_root: Path | None, proc_root: Path | None, sysfs_root: Path | None,
                   log_level: str | None, rootfs: Path | None = None, log_format: str | None = None,
                   **extra: Any) -> tuple[Settings, Origin]:
    """Defaults, then the config file, then the command line; and where each came from (to word a
    setup error, :func:`manager_or_exit`). Exits 2 on a config error."""
    settings = Settings()
    path = config_path or (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None)
    origin = Origin()
    try:
        if path is not None:
            settings = load_config(path, settings)
        from_file = changed_settings(settings, Settings())
        changes: dict[str, Any] = {k: v for k, v in {
            "nvml_replay": nvml_replay, "cgroup_root": cgroup_root, "proc_root": proc_root,
            "sysfs_root": sysfs_root, "rootfs": rootfs, "log_level": log_level.lower() if log_level else None,
            "log_format": log_format.lower() if log_format else None}.items()
            if v is not None}
        from_flags = set(changes)
        if extra.get("listen"):
            changes["listen_host"], changes["listen_port"] = parse_listen(extra["listen"])
            from_flags |= {"listen_host", "listen_port"}
        if extra.get("collectors"):
            changes["collectors"] = tuple(extra["collectors"])
            from_flags.add("collectors")
        if extra.get("pod_resources_socket"):
            socket = Path(extra["pod_resources_socket"])
            changes["kubernetes"] = replace(settings.kubernetes, pod_resources_socket=socket)
            from_flags.add("kubernetes.pod_resources_socket")
        if file_devices is not None:  # --file-devices "" means none, as dir = "" does in the config
            changes["file_devices"] = replace(settings.file_devices, dir=Path(file_devices) if file_devices else None)
            from_flags.add("file_devices.dir")
        settings = replace(settings, **changes)
        origin = Origin(path, from_file - from_flags)
        if "nvml_replay" in origin.from_file and settings.nvml_replay is not None \
                and not settings.nvml_replay.exists():
            raise ConfigError(origin.word(SetupError("nvml_replay", f"{settings.nvml_replay} does not exist")))
        for key in ("cgroup_root", "proc_root"):
            root = getattr(settings, key)
            if not root.is_dir():
                raise ConfigError(f"{key.replace('_', '-')} {root} is not a directory")
    except ConfigError as exc:
        fail(str(exc))
    configure_logging(settings.log_level, settings.log_format)
    _warn_about_roots(settings)
    if "files" in (settings.collectors or ()) and settings.file_devices.dir is None:
        log.warning("collector 'files' enabled but no file-devices directory is set (--file-devices, "
                    "[file_devices] dir): it reports nothing")
    return settings, origin


def _warn_about_roots(settings: Settings) -> None:
    """One warning for each root that points at nothing useful (once per process): a mis-mounted
    ``/host`` in a DaemonSet otherwise serves empty data without a word."""
    key = (settings.cgroup_root, settings.proc_root, settings.rootfs)
    if key in _ROOTS_CHECKED:
        return
    _ROOTS_CHECKED.add(key)
    for option, root in (("--cgroup-root", settings.cgroup_root), ("--proc-root", settings.proc_root)):
        try:
            empty = next(root.iterdir(), None) is None
        except OSError as exc:
            log.warning("%s %s cannot be listed (%s): nothing will be found under it", option, root,
                        exc.strerror or exc)
            continue
        if empty:
            log.warning("%s %s is empty: is the host's %s mounted there? No container will be found", option,
                        root, "/sys/fs/cgroup" if option == "--cgroup-root" else "/proc")
    if not settings.rootfs.is_dir():
        log.warning("--rootfs %s does not exist: container runtimes' state files (names, images) will not "
                    "be read", settings.rootfs)


_ROOTS_CHECKED: set[tuple[Path, Path, Path]] = set()


def manager_or_exit(settings: Settings, origin: Origin) -> AcceleratorManager:
    """:func:`accelstats.manager.build_manager`; a setting that cannot be set up exits 2 with one line
    naming it as the operator wrote it (:meth:`accelstats.config.Origin.word`)."""
    try:
        return build_manager(settings)
    except SetupError as exc:
        fail(origin.word(exc))


class _Group(click.Group):
    """click's group with its usage errors (an unknown option, command or choice, a bad value) printed
    as every other input error is: one line ``accelstats: error: …``, exit status 2."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        try:
            rv = super().main(*args, **kwargs)
        except click.exceptions.ClickException as exc:  # UsageError, BadParameter, NoSuchOption, ...
            if type(exc).__name__ == "NoArgsIsHelpError":  # a group without its command: its help, as click
                click.echo(exc.format_message(), err=True)
                sys.exit(exc.exit_code)
            fail(exc.format_message())
        except click.exceptions.Abort:  # Ctrl-C at a prompt
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="accelstats")
def main() -> None:
    """Per-container accelerator metrics: which container uses which GPU, and how hard."""


@main.command()
@click.option("--listen", "--web.listen-address", "listen", default=None, metavar="HOST:PORT",
              help=f"Address to serve /metrics on [:{DEFAULT_PORT}, every interface].")
@click.option("--collector", "collectors", multiple=True,
              type=click.Choice([e.name for e in COLLECTORS]),
              help="Run only these collectors (repeatable). "
              + "; ".join(f"{e.name}: {e.help}{e.default_note}" for e in COLLECTORS))
@click.option("--web-config", "--web.config.file", "web_config", metavar="FILE", default=None,
              help="exporter-toolkit web configuration (YAML): TLS, basic auth, headers; see docs/web-config.md "
                   "[none: plain HTTP; \"\" overrides the config file's web_config].")
@click.option("--pod-resources-socket", metavar="PATH", default=None,
              help=f"The kubelet's pod-resources socket; no socket there: Kubernetes allocations off "
                   f"[{DEFAULT_POD_RESOURCES_SOCKET}].")
@source_options
def serve(listen: str | None, collectors: tuple[str, ...], web_config: str | None,
          pod_resources_socket: str | None, **opts: Any) -> None:
    """Serve /metrics, /healthz and / until SIGTERM or SIGINT."""
    from accelstats.web import load_web_config
    from accelstats.web import serve as start_server

    if pod_resources_socket == "":
        fail("--pod-resources-socket: expected a socket path, got ''")
    settings, origin = build_settings(listen=listen, collectors=collectors,
                                      pod_resources_socket=pod_resources_socket, **opts)
    if web_config is not None:
        settings = replace(settings, web_config=Path(web_config) if web_config else None)
    web = None
    if settings.web_config is not None:  # PyYAML, bcrypt and cryptography only with a web config
        try:
            web = load_web_config(settings.web_config)
        except ConfigError as exc:  # a WebConfigError: the file and the key at fault
            fail(str(exc))
    # Block SIGTERM/SIGINT before any thread starts (threads inherit the mask), then wait for one
    # with sigwait: no Python-level signal handler runs in the middle of other code.
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals | {signal.SIGHUP})
    manager = manager_or_exit(settings, origin)
    try:
        server, thread = start_server(manager, settings.listen_host, settings.listen_port, web)
    except OSError as exc:
        manager.destroy()
        fail(f"cannot listen on {settings.listen}: {exc.strerror or exc}")
    scheme = "https" if web is not None and web.tls_enabled else "http"
    auth = " with basic auth" if web is not None and web.initial.users else ""
    log.info("accelstats %s serving %s://%s/metrics%s", __version__, scheme, settings.listen, auth)
    sdnotify.ready(f"serving {scheme}://{settings.listen}/metrics{auth}")  # systemd Type=notify: bound
    manager.collect()  # start NVML now (under its deadline) so its state is logged at start-up
    while True:
        signum = signal.sigwait(stop_signals | {signal.SIGHUP})
        if signum != signal.SIGHUP:
            break
        log.info("SIGHUP ignored: restart the service to apply a changed configuration")
    log.info("received %s, shutting down", signal.Signals(signum).name)
    sdnotify.stopping()
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)
    manager.destroy()
    log.info("stopped")
    # Everything is closed: skip the interpreter's teardown of modules, caches and idle threads
    # (about 70 ms of the SIGTERM to exit time, measured), as a stopped service has nothing left to do.
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)


@main.command()
@source_options
def dump(**opts: Any) -> None:
    """One collection, as Prometheus exposition text on stdout."""
    from accelstats.web import text_exposition

    settings, origin = build_settings(**opts)
    manager = manager_or_exit(replace(settings, nvml_retry_interval=0.0), origin)  # one shot: no retry
    try:
        sys.stdout.write(text_exposition(manager).decode())
    finally:
        manager.destroy()


def _collect(**opts: Any) -> Collection:
    settings, origin = build_settings(**opts)
    manager = manager_or_exit(replace(settings, nvml_retry_interval=0.0), origin)  # one shot: no retry
    try:
        return manager.collect()
    finally:
        manager.destroy()


def devices_json(collection: Collection) -> list[dict[str, Any]]:
    """``accelstats devices --json``: one object per GPU, MIG instance and file device."""
    snap = collection.snapshot
    out: list[dict[str, Any]] = []
    for d in snap.devices:
        s = snap.samples.get(d.uuid)
        out.append({
            "kind": d.kind, "index": d.index, "minor": d.minor, "uuid": d.uuid, "name": d.name,
            "pci_bus_id": d.pci_bus_id, "parent_uuid": d.parent_uuid, "mig_profile": d.mig_profile,
            "up": bool(s and s.up), "error": s.error if s else "",
            "memory_total_bytes": s.memory_total_bytes if s else None,
            "memory_used_bytes": s.memory_used_bytes if s else None,
            "power_watts": s.power_watts if s else None,
            "temperature_celsius": dict(s.temperatures_celsius).get("gpu") if s else None,
            "utilization_ratio": s.utilization_ratio if s else None,
            "source": snap.source,
        })
    for f in snap.file_devices:
        out.append({"kind": "file", "id": f.id, "path": f.path, "vendor": f.vendor, "type": f.type,
                    "name": f.name, "healthy": f.healthy, "health_description": f.health_description,
                    "size_bytes": f.size_bytes, "mode": oct(f.mode), "permissions": f.permissions})
    return out


def containers_json(collection: Collection) -> list[dict[str, Any]]:
    """``accelstats containers --json``: every container cgroup that holds a GPU grant, a GPU process
    or an open GPU node (or whose device rules could not be read), with the devices attributed."""
    out = []
    for c in collection.containers:
        i, m = c.identity, c.metadata
        out.append({
            "cgroup": c.cgroup, "runtime": i.runtime if i else "unknown", "id": i.id if i else "",
            "name": m.name, "image": m.image, "pod": m.pod, "namespace": m.namespace,
            "pod_uid": i.pod_uid if i else "", "alloc_id": i.alloc_id if i else "", "task": i.task if i else "",
            "owner_uid": i.owner if i else "",
            "devices": [{"uuid": a.id, "minor": a.minor, "attribution": a.attribution,
                         "memory_used_bytes": a.container_memory_used_bytes} for a in c.accelerators],
            "devices_cgroup": c.devices_cgroup, "identified_by": i.how if i else "",
            "reason": c.reason,
        })
    return out


@main.command()
@click.option("--json", "as_json", is_flag=True, help="JSON instead of a table.")
@source_options
def devices(as_json: bool, **opts: Any) -> None:
    """List GPUs, MIG instances and file devices."""
    collection = _collect(**opts)
    rows = devices_json(collection)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if collection.snapshot.nvml_status:
        click.echo(f"# NVIDIA: {collection.snapshot.nvml_status}", err=True)
    # NAME is as wide as the longest GPU or MIG name (a MIG name such as "NVIDIA A100-SXM4-80GB MIG
    # 1g.20gb" is 33 characters; NVML's are at most 96), never cut; a file's path shows its tail
    width = min(96, max([28, *(len(r["name"]) for r in rows if r["kind"] != "file")]))
    click.echo(f"{'KIND':5} {'IDX':>3} {'MINOR':>5} {'UUID / ID':42} {'NAME':{width}} {'UP':3} MEMORY")
    for r in rows:
        if r["kind"] == "file":
            click.echo(f"{'file':5} {'':>3} {'':>5} {_shown(r['id']):42} {_shown(_tail(r['path'], width)):{width}} "
                       f"{'yes' if r['healthy'] else 'NO':3} {r['size_bytes']} B")
        else:
            mem = r["memory_total_bytes"]
            click.echo(f"{r['kind']:5} {r['index']:>3} {'' if r['minor'] is None else r['minor']:>5} "
                       f"{_shown(r['uuid']):42} {_shown(r['name']):{width}} {'yes' if r['up'] else 'NO':3} "
                       f"{'' if mem is None else f'{mem / 2**30:.1f} GiB'}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="JSON instead of a table.")
@source_options
def containers(as_json: bool, **opts: Any) -> None:
    """List the containers that hold a GPU grant, a GPU process or an open GPU node, with the devices
    attributed to each and, in REASON, what could not be read."""
    collection = _collect(**opts)
    rows = containers_json(collection)
    if collection.snapshot.nvml_status:  # no GPU is known, so none can be tied to a container
        click.echo(f"# NVIDIA GPUs not available ({collection.snapshot.nvml_status}): no GPU can be attributed; "
                   "listed are only containers whose device rules allow every device or could not be read",
                   err=True)
    for note in collection.notes.values():
        click.echo(f"# {note}", err=True)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    click.echo(f"{'RUNTIME':10} {'ID':13} {'NAME':20} {'POD':20} {'CGROUP':40} {'DEVICES':40} REASON")
    for r in rows:
        devs = ", ".join(f"{d['uuid'][:12]}…({d['attribution']})" for d in r["devices"]) or "-"
        # a pod whose name is not known: its Kubernetes UID (the cgroup path's) or podman pod ID
        pod = r["pod"] or (f"{'id' if r['runtime'] == 'podman' else 'uid'}:{r['pod_uid']}" if r["pod_uid"] else "")
        click.echo(f"{r['runtime']:10} {_shown(r['id'][:12]):13} {_shown(r['name'][:20]):20} "
                   f"{_shown(pod[:20]):20} {_shown(_tail(r['cgroup'], 40)):40} {devs:40} "
                   f"{_shown(r['reason']) or '-'}")


def _shown(text: str) -> str:
    """``text`` safe for a terminal: control and other unprintable characters (a name from a state
    file may hold escape sequences) as ``?``."""
    return "".join(c if c.isprintable() else "?" for c in text)


def _tail(text: str, width: int) -> str:
    """``text`` cut to its last ``width`` characters, with ``…`` where it was cut."""
    return text if len(text) <= width else "…" + text[-(width - 1):]


@main.group()
def mps() -> None:
    """Start, stop and watch NVIDIA MPS control daemons ([mps] in the config file)."""


def _mps_daemons(opts: dict[str, Any], strict: bool = True) -> tuple[MpsDaemons, Settings, dict[str, str]]:
    """(the configured daemons, settings, {resource: why its devices are not resolved}). ``strict``
    (start): NVML must answer and every device resolve. Not strict (stop, status): the daemons are
    reached through the pipe directories alone, so a GPU that fell off the bus or a driver that is
    down blocks neither."""
    from accelstats.mps.host import daemons_to_start, daemons_to_watch, gpus_of
    from accelstats.mps.rules import MpsError

    settings, _ = build_settings(**opts)
    if not settings.mps.resources:
        fail("no MPS resources configured ([[mps.resources]] in the config file)")
    collection = _collect(**opts)
    nvml_down = collection.snapshot.nvml_status
    if strict and nvml_down:
        fail(f"NVIDIA GPUs not available: {nvml_down}")
    gpus = [] if nvml_down else gpus_of(collection.snapshot)
    try:
        if strict:
            return daemons_to_start(settings.mps, gpus), settings, {}
        daemons, problems = daemons_to_watch(settings.mps, gpus)
    except MpsError as exc:
        fail(str(exc))
    if nvml_down:
        click.echo(f"accelstats: warning: NVIDIA GPUs not available ({nvml_down}): devices not resolved; "
                   "reaching the daemons through their pipe directories alone", err=True)
    for name, why in problems.items():
        click.echo(f"accelstats: warning: MPS resource {name!r}: devices not resolved ({why}); "
                   "reaching its daemon through the pipe directory alone", err=True)
    return daemons, settings, problems


@mps.command("start")
@source_options
def mps_start(**opts: Any) -> None:
    """Start one control daemon per configured resource (all or none)."""
    from accelstats.mps.rules import MpsError

    daemons, _, _ = _mps_daemons(opts)
    try:
        daemons.start_all()
    except MpsError as exc:
        fail(str(exc))
    for d in daemons.daemons():
        click.echo(f"started {d.resource.name}: CUDA_MPS_PIPE_DIRECTORY={d.pipe_dir}")


@mps.command("stop")
@source_options
def mps_stop(**opts: Any) -> None:
    """Stop every configured control daemon and clean up its directories."""
    daemons, _, _ = _mps_daemons(opts, strict=False)
    results = daemons.stop_all_found()  # "found" is decided under each resource's lock: no race with a start
    running = [d.name for d in daemons.daemons() if results[d.name][0]]
    problems = {name: p for name, (_, p) in results.items() if p}
    for name, p in problems.items():
        click.echo(f"accelstats: warning: MPS resource {name!r}: {'; '.join(p)}", err=True)
    click.echo(f"stopped {len(running)} MPS control daemon(s)" + (f": {', '.join(running)}" if running else ""))
    if problems:
        sys.exit(1)


@mps.command("status")
@click.option("--json", "as_json", is_flag=True, help="JSON instead of a table.")
@source_options
def mps_status(as_json: bool, **opts: Any) -> None:
    """Each daemon's health, servers, clients (with their containers) and settings; exit status 1 when
    a daemon is unhealthy (as ``systemctl status`` does for a failed unit)."""
    from accelstats.attribution.runtimes import RuntimeState
    from accelstats.mps.host import client_containers

    daemons, settings, _ = _mps_daemons(opts, strict=False)
    state = RuntimeState(settings.rootfs, settings.runtimes)
    state.refresh()
    rows: list[dict[str, Any]] = []
    for daemon, status in zip(daemons.daemons(), daemons.status_all().values(), strict=True):
        pids = [c for clients in status.clients.values() for c in clients]
        containers = client_containers(pids, settings.proc_root, state.known)
        rows.append({
            "resource": daemon.resource.name, "devices": list(daemon.resource.devices),
            "replicas": daemon.resource.replicas, "pipe_dir": str(daemon.pipe_dir),
            "healthy": status.healthy, "reason": status.reason, "servers": status.servers,
            "clients": [{"server": server, "pid": pid, "container": containers.get(pid, "")}
                        for server, clients in status.clients.items() for pid in clients],
            "active_thread_percentage": status.active_thread_percentage,
            "pinned_memory_limit_bytes": {str(k): v for k, v in status.pinned_limits_bytes.items()},
        })
    unhealthy = any(not r["healthy"] for r in rows)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        sys.exit(1 if unhealthy else 0)
    click.echo(f"{'RESOURCE':24} {'HEALTHY':8} {'SERVERS':10} {'CLIENTS':8} THREADS%  PIPE DIR")
    for r in rows:
        click.echo(f"{r['resource'][:24]:24} {'yes' if r['healthy'] else 'NO':8} "
                   f"{','.join(map(str, r['servers'])) or '-':10} {len(r['clients']):<8} "
                   f"{r['active_thread_percentage'] if r['active_thread_percentage'] is not None else '-':<9} "
                   f"{r['pipe_dir']}")
        if not r["healthy"]:
            click.echo(f"  reason: {r['reason']}")
        for c in r["clients"]:
            click.echo(f"  client {c['pid']} (server {c['server']}) {c['container'] or '(host)'}")
        for uuid, limit in r["pinned_memory_limit_bytes"].items():
            click.echo(f"  pinned memory limit {uuid}: {limit if limit is not None else 'none'}")
    sys.exit(1 if unhealthy else 0)


if __name__ == "__main__":  # pragma: no cover
    main()
