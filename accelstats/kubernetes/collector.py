"""The ``kubernetes`` collector: the kubelet's pod-resources allocations, read once per collection.

One ``List`` per collection through :class:`accelstats.kubernetes.podresources.PodResourcesClient`
(bounded by its deadline and receive-size limit, so the collector bounds its own calls and runs after
the ``nvidia`` collector, on the collection's snapshot: device IDs are resolved against the devices
NVML just listed). What it adds to the snapshot (``DeviceSnapshot.kubelet``):

- no socket at the path: nothing (the feature is off; the client logs one info line);
- ``List`` answered: ``KubeletReading(up=True, allocations=…)``, one ``KubeletAllocation`` per device of
  the configured resources (default: every resource one of whose IDs resolves to a GPU or MIG instance
  here) and one per DRA claim device, its ``uuid``/``gpu`` resolved through the host's CDI spec files
  (``cdi.py``: ``/etc/cdi`` and ``/var/run/cdi`` under ``--rootfs``, read again in every collection that
  has claims, since DRA drivers write a spec per prepared claim) and ``""`` where they name no single
  device here;
- ``List`` failed: ``KubeletReading(up=False, reason=…)``, the error counted by reason, one warning
  when the failure starts (or its reason changes) and one info line when the kubelet answers again;
  the collector then raises ``NoDataError`` so ``accelstats_scrape_collector_success`` is 0 without a
  second log line. Every other collector's families are unaffected.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from accelstats.cgroups.devices_list import MigCap, parse_mig_minors
from accelstats.kubernetes.device_ids import Resolved, resolve
from accelstats.kubernetes.podresources import PodAllocations, PodResourcesClient, PodResourcesError, SocketAbsent
from accelstats.settings import KubernetesSettings
from collectors.fsread import read_small
from collectors.model import Device, DeviceSnapshot, KubeletAllocation, KubeletReading, NoDataError

if TYPE_CHECKING:  # cdi.py brings PyYAML: imported when a List answer has claims, not by every serve
    from accelstats.kubernetes.cdi import CdiResolved, CdiSpecs

log = logging.getLogger(__name__)
CDI_SPEC_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))
"""The CDI spec directories (``accelstats.kubernetes.cdi.SPEC_DIRS``), under ``--rootfs``."""


class KubernetesCollector:
    """Reads ``List`` from the kubelet at ``settings.pod_resources_socket`` into ``snapshot.kubelet``
    (module docstring). ``client`` may be given (tests); else one is made with the client's defaults.
    ``rootfs`` is where the host's CDI spec directories are looked up (``--rootfs``), ``proc_root`` where
    ``driver/nvidia-caps/mig-minors`` is read (``--proc-root``; MIG instances in CDI specs)."""

    name = "kubernetes"
    bounds_own_calls = True  # the gRPC deadline bounds List; it must see the nvidia collector's devices

    def __init__(self, settings: KubernetesSettings, client: PodResourcesClient | None = None, *,
                 rootfs: Path = Path("/"), proc_root: Path = Path("/proc")) -> None:
        self.settings = settings
        self.cdi_dirs = tuple(rootfs / d.relative_to("/") for d in CDI_SPEC_DIRS)
        self.proc_root = proc_root
        self._cdi_logged: set[str] = set()  # unresolved CDI names already logged
        self.client = client or PodResourcesClient(str(settings.pod_resources_socket))
        self.errors: Counter[str] = Counter()
        self._failing: str = ""  # the reason of the failure episode under way ("" = none)

    def update(self, snapshot: DeviceSnapshot) -> None:
        """Add this collection's ``KubeletReading``; raises ``NoDataError`` when ``List`` failed."""
        try:
            answer = self.client.list()
        except PodResourcesError as exc:
            self.errors[exc.reason] += 1
            if self._failing != exc.reason:
                log.warning("%s (accelstats_kubernetes_pod_resources_up 0 until it answers)", exc)
                self._failing = exc.reason
            snapshot.kubelet = KubeletReading(False, str(exc), errors=tuple(sorted(self.errors.items())))
            raise NoDataError(str(exc)) from None
        if isinstance(answer, SocketAbsent):
            return
        if self._failing:
            log.info("kubelet pod-resources %s answers again", self.client.socket)
            self._failing = ""
        cdi = None
        if answer.claims:
            from accelstats.kubernetes.cdi import load_specs

            cdi = CdiContext(load_specs(self.cdi_dirs), self._mig_caps(snapshot.devices), self._cdi_logged)
        snapshot.kubelet = KubeletReading(True, allocations=allocations(answer, snapshot.devices,
                                                                        self.settings.resources, cdi),
                                          errors=tuple(sorted(self.errors.items())))

    def _mig_caps(self, devices: Sequence[Device]) -> dict[int, MigCap]:
        """``mig-minors`` parsed where this host has MIG instances (unreadable: none; a CDI name of a MIG
        instance then stays unresolved, with the reason in debug)."""
        if not any(d.kind == "mig" for d in devices):
            return {}
        data = read_small(self.proc_root / "driver" / "nvidia-caps" / "mig-minors")
        return {} if data is None else parse_mig_minors(data.decode("utf-8", errors="replace"))[0]

    def close(self) -> None:
        """Close the client's channel."""
        self.client.close()


@dataclass(frozen=True)
class CdiContext:
    """What resolving DRA claims through CDI needs: the host's ``specs`` and ``mig_caps``
    (``parse_mig_minors``; empty without MIG); ``logged``: the unresolved names and reasons already
    logged (the collector keeps one set, so each is said once)."""

    specs: CdiSpecs
    mig_caps: Mapping[int, MigCap]
    logged: set[str] = field(default_factory=set)


def allocations(answer: PodAllocations, devices: Sequence[Device], resources: Sequence[str] | None,
                cdi: CdiContext | None = None) -> tuple[KubeletAllocation, ...]:
    """The allocations of ``answer`` as published: device-plugin IDs of ``resources`` (None: of every
    resource at least one of whose IDs resolves on this host; an ID that names no device of this host is
    left out: it has no ``uuid`` to publish), then every DRA claim device, with the ``uuid``/``gpu`` its
    CDI names resolve to through ``cdi`` (:func:`claim_device`; "" without ``cdi`` or a single device)."""
    out: list[KubeletAllocation] = []
    parents = {x.uuid: x.parent_uuid for x in devices}
    for d in answer.devices:
        if resources is not None and d.resource not in resources:
            continue
        found = [(device_id, resolve(device_id, devices)) for device_id in d.device_ids]
        if resources is None and not any(isinstance(r, Resolved) for _, r in found):
            continue
        for device_id, r in found:
            if isinstance(r, Resolved):
                out.append(KubeletAllocation(
                    d.namespace, d.pod, d.container, device_id, d.resource, r.uuid, str(r.index),
                    parents.get(r.uuid, ""), "" if r.replica is None else str(r.replica)))
    for c in answer.claims:
        device = claim_device(c.cdi_devices, devices, cdi) if cdi is not None else None
        uuid, gpu, parent = ("", "", "") if device is None else (
            device.uuid, str(device.index), parents.get(device.uuid, ""))
        out.append(KubeletAllocation(c.namespace, c.pod, c.container, uuid=uuid, gpu=gpu, parent_uuid=parent,
                                     claim=c.claim_name,
                                     claim_namespace=c.claim_namespace, driver=c.driver, pool=c.pool,
                                     device=c.device))
    return tuple(out)


def claim_device(names: Sequence[str], devices: Sequence[Device], cdi: CdiContext) -> CdiResolved | None:
    """The one GPU or MIG instance a DRA claimed device's fully qualified CDI ``names`` give a container
    (``ClaimResource.cdi_devices``: one name per device as NVIDIA's DRA driver writes them; several names
    must agree), or None: no name, a name that does not resolve (its reason logged once at INFO, per name
    and reason), or names naming different devices."""
    from accelstats.kubernetes.cdi import CdiResolved, resolve_cdi

    found: CdiResolved | None = None
    for name in names:
        r = resolve_cdi(name, cdi.specs, devices, cdi.mig_caps)
        if not isinstance(r, CdiResolved):
            key = f"{r.name}: {r.reason}"
            if key not in cdi.logged and len(cdi.logged) < 1000:
                cdi.logged.add(key)
                log.info("DRA claim device %s not resolved to a GPU of this host: %s", r.name, r.reason)
            continue
        if found is not None and found.uuid != r.uuid:
            return None
        found = r
    return found
