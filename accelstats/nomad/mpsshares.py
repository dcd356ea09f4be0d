"""The Nomad plugin's MPS control daemons: started or adopted, watched, retried, and kept across restarts.

Lifecycle (docs/nomad.md, "MPS"):

* **First Fingerprint**: for each configured resource, a daemon that already answers in the
  resource's pipe directory is *adopted* (a restarted plugin, or ``accelstats mps start``) and
  configured again with this configuration's limits (they apply to the next MPS server it spawns);
  otherwise it is started.
* **Every Fingerprint**: each daemon is health-checked (docs/mps.md, "Health"). A daemon that is down
  — its process gone, or never started — is started again, at most once per ``retry_interval``. A
  daemon whose process lives but does not answer is *not* restarted (that would kill the MPS server
  its running tasks use): its replicas are unhealthy with the reason until it answers again or an
  operator stops it.
* **A resource that fails validation** (replicas out of range, a MIG-enabled GPU, a device that is
  not a GPU of this host, a GPU listed by two resources): its GPUs are still offered as replicas,
  all unhealthy with the rule that failed, never as whole GPUs — the operator meant them to be
  shared, and Nomad shows the reason on the node.
* **Plugin exit**: the daemons keep running. Nomad restarts device plugins with the agent while
  tasks keep running; stopping the daemon would take the MPS server away from those tasks. The next
  plugin process adopts them. ``accelstats mps stop --config …`` stops them for good.
* **A changed configuration in the same process**: daemons of resources that were removed or
  changed are stopped; unchanged ones are kept.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from accelstats.mps.control import DEFAULT_BINARY
from accelstats.mps.daemon import Daemon, DaemonRunningError
from accelstats.mps.host import resolve_one
from accelstats.mps.replies import parse_percentage
from accelstats.mps.rules import (
    MpsError,
    MpsGpu,
    MpsResource,
    Root,
    active_thread_percentage,
    pinned_limit_mib,
    validate_resources,
)
from accelstats.nomad.devices import MpsShare
from accelstats.settings import MpsResourceSettings, MpsSettings

log = logging.getLogger("accelstats.nomad")

RETRY_INTERVAL = 30.0  # seconds between two starts of a daemon that is down
MIB = 1 << 20  # bytes


@dataclass
class _Entry:
    """One configured resource: its daemon once it resolved and validated, else why not."""

    settings: MpsResourceSettings
    daemon: Daemon | None = None
    error: str = ""  # validation error: every replica unhealthy with it, never started
    gpus: tuple[str, ...] = ()  # the UUIDs its replicas are offered on
    ensured: bool = False  # started or adopted once
    next_start: float = 0.0  # monotonic time before which a failed start is not retried
    last_error: str = ""


class PluginMps:
    """The plugin's MPS daemons for one configuration (see the module docstring for the lifecycle).

    ``binary``: the control binary (name on PATH or path); ``retry_interval``: seconds between two
    starts of a daemon that is down. Not thread-safe: the plugin calls :meth:`shares` from its one
    Fingerprint loop and :meth:`reconfigure` under its config lock.
    """

    def __init__(self, settings: MpsSettings, binary: str = DEFAULT_BINARY,
                 retry_interval: float = RETRY_INTERVAL) -> None:
        self.settings = settings
        self.binary = binary
        self.retry_interval = retry_interval
        self._entries: dict[str, _Entry] = {r.name: _Entry(r) for r in settings.resources}
        self._resolved = False

    def reconfigure(self, settings: MpsSettings) -> None:
        """Take a new configuration: stop the daemons of resources removed or changed (a new root,
        timeout or compute-mode switch changes them all), keep the others as they run."""
        same_base = (settings.root, settings.timeout, settings.exclusive_process) == (
            self.settings.root, self.settings.timeout, self.settings.exclusive_process)
        wanted = {r.name: r for r in settings.resources}
        kept: dict[str, _Entry] = {}
        for name, entry in self._entries.items():
            if same_base and wanted.get(name) == entry.settings and entry.daemon is not None:
                kept[name] = entry
            elif entry.daemon is not None and entry.ensured:
                problems = entry.daemon.stop()
                log.info("MPS resource %r: control daemon stopped (configuration changed)%s", name,
                         f"; problems: {'; '.join(problems)}" if problems else "")
        self.settings = settings
        self._entries = {r.name: kept.get(r.name) or _Entry(r) for r in settings.resources}
        self._resolved = all(e.daemon is not None or e.error for e in self._entries.values())

    def _resolve(self, gpus: list[MpsGpu]) -> None:
        """Resolve and validate every new resource once there are GPUs; errors are kept per resource.

        The rules are :func:`accelstats.mps.rules.validate_resources`'s, over the daemons kept from the
        previous configuration first (a running daemon keeps its GPUs), then the new resources in
        configuration order (of two listing one GPU, the earlier keeps it)."""
        root = Root(self.settings.root)
        resolved: dict[str, MpsResource] = {}
        for name, entry in self._entries.items():
            if entry.daemon is not None or entry.error:
                continue
            try:
                resource = resolve_one(entry.settings, gpus)
            except MpsError as exc:
                entry.error = str(exc)
                entry.gpus = tuple(g.uuid for g in gpus if entry.settings.devices == "all"
                                   or g.uuid in entry.settings.devices or g.index in entry.settings.devices)
                continue
            resolved[name] = resource
            entry.gpus = resource.devices
        kept = [e.daemon.resource for e in self._entries.values() if e.daemon is not None]
        errors = validate_resources([*kept, *resolved.values()], gpus)
        for name, resource in resolved.items():
            entry = self._entries[name]
            if name in errors:
                entry.error = str(errors[name])
                continue
            entry.daemon = Daemon(resource, gpus, root, binary=self.binary, timeout=self.settings.timeout,
                                  exclusive_process=self.settings.exclusive_process)
        self._resolved = True

    def shares(self, gpus: list[MpsGpu]) -> dict[str, MpsShare]:
        """GPU UUID → its MPS share for this Fingerprint; starts, adopts or restarts daemons as the
        module docstring says. Never raises: every failure becomes an unhealthy share with its reason."""
        if not gpus:
            return {}
        if not self._resolved:
            self._resolve(gpus)
        by_uuid = {g.uuid: g for g in gpus}
        root = Root(self.settings.root)
        out: dict[str, MpsShare] = {}
        for name, entry in self._entries.items():
            healthy, reason = self._health(entry)
            try:
                pipe_dir, shm_dir = str(root.pipe_dir(name)), str(root.shm_dir())
            except MpsError as exc:
                healthy, reason, pipe_dir, shm_dir = False, str(exc), "", ""
            replicas = entry.settings.replicas
            for uuid in entry.gpus:
                gpu = by_uuid.get(uuid)
                if gpu is None or gpu.mig_enabled or uuid in out:  # MIG parents are never offered (their
                    continue  # instances are); a GPU two resources list belongs to the first
                pinned = pinned_limit_mib(gpu, replicas) * MIB if gpu.memory_total_bytes else None
                out[uuid] = MpsShare(resource=name, replicas=replicas, healthy=healthy, reason=reason,
                                     pipe_dir=pipe_dir, shm_dir=shm_dir, pinned_limit_bytes=pinned)
        return out

    def _health(self, entry: _Entry, after_race: bool = False) -> tuple[bool, str]:
        """(healthy, reason) of one resource's daemon, starting or adopting it when that is due.

        A start refused because a daemon runs after all (``accelstats mps start`` or another plugin
        process started it between the check and the start: starts are serialised by the resource's
        lock) is not a failure: the daemon is checked again, once (``after_race``), and adopted."""
        if entry.error:
            return False, f"MPS resource not usable: {entry.error}"
        daemon = entry.daemon
        if daemon is None:
            return False, "MPS resource not resolved"
        try:
            daemon.assert_healthy()
        except MpsError as exc:
            answer_error = str(exc)
        else:
            if not entry.ensured:
                visible = daemon.visible_devices()
                if visible is not None and visible != daemon.resource.devices:
                    have, want = ",".join(visible) or "(all)", ",".join(daemon.resource.devices)
                    return False, (f"the control daemon (pid {daemon.pid()}) runs for GPUs {have}, not {want}; "
                                   "stop it (accelstats mps stop) to have it started for this configuration")
                self._adopt(entry, daemon)
            return True, ""
        if daemon.running():
            return False, f"control daemon (pid {daemon.pid()}) is running but not answering: {answer_error}"
        if time.monotonic() < entry.next_start:
            return False, entry.last_error or answer_error
        try:
            daemon.start()
        except DaemonRunningError as exc:
            if not after_race:
                return self._health(entry, after_race=True)
            entry.next_start = time.monotonic() + self.retry_interval
            return False, str(exc)
        except MpsError as exc:
            entry.next_start = time.monotonic() + self.retry_interval
            message = f"control daemon not started (next try in {self.retry_interval:g} s): {exc}"
            # the same failure every 30 s is logged once at error level, then at debug level
            log.log(logging.DEBUG if message == entry.last_error else logging.ERROR, "MPS resource %r: %s",
                    entry.settings.name, message)
            entry.last_error = message
            return False, message
        entry.ensured, entry.last_error = True, ""
        return True, ""

    def _adopt(self, entry: _Entry, daemon: Daemon) -> None:
        """A daemon already answered in our pipe dir (a previous plugin process, or ``accelstats mps
        start``): keep it, and apply this configuration's limits to the servers it spawns next."""
        entry.ensured = True
        want = active_thread_percentage(daemon.resource.replicas)
        try:
            have = parse_percentage(daemon.echo_pipe_to_control("get_default_active_thread_percentage"))
            if have != float(want):
                daemon.configure()
                log.warning("MPS resource %r: adopted control daemon (pid %s) had active thread percentage %s, "
                            "set to %d; MPS servers already running keep the old value until they exit",
                            entry.settings.name, daemon.pid(), have, want)
            else:
                log.info("MPS resource %r: adopted the running control daemon (pid %s)", entry.settings.name,
                         daemon.pid())
        except MpsError as exc:
            log.warning("MPS resource %r: adopted control daemon could not be configured: %s", entry.settings.name,
                        exc)

    def resources(self) -> list[MpsResource]:
        """The resources that resolved and validated (for tests and ``/metrics``)."""
        return [e.daemon.resource for e in self._entries.values() if e.daemon is not None]

