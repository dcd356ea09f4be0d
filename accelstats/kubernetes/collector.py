"""The ``kubernetes`` collector: the kubelet's pod-resources allocations, read once per collection.

One ``List`` per collection through :class:`accelstats.kubernetes.podresources.PodResourcesClient`
(bounded by its deadline and receive-size limit, so the collector bounds its own calls and runs after
the ``nvidia`` collector, on the collection's snapshot: device IDs are resolved against the devices
NVML just listed). What it adds to the snapshot (``DeviceSnapshot.kubelet``):

- no socket at the path: nothing (the feature is off; the client logs one info line);
- ``List`` answered: ``KubeletReading(up=True, allocations=…)``, one ``KubeletAllocation`` per device of
  the configured resources (default: every resource one of whose IDs resolves to a GPU or MIG instance
  here) and one per DRA claim device (``uuid`` "" until CDI resolution names it);
- ``List`` failed: ``KubeletReading(up=False, reason=…)``, the error counted by reason, one warning
  when the failure starts (or its reason changes) and one info line when the kubelet answers again;
  the collector then raises ``NoDataError`` so ``accelstats_scrape_collector_success`` is 0 without a
  second log line. Every other collector's families are unaffected.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

from accelstats.kubernetes.device_ids import Resolved, resolve
from accelstats.kubernetes.podresources import PodAllocations, PodResourcesClient, PodResourcesError, SocketAbsent
from accelstats.settings import KubernetesSettings
from collectors.model import Device, DeviceSnapshot, KubeletAllocation, KubeletReading, NoDataError

log = logging.getLogger(__name__)


class KubernetesCollector:
    """Reads ``List`` from the kubelet at ``settings.pod_resources_socket`` into ``snapshot.kubelet``
    (module docstring). ``client`` may be given (tests); else one is made with the client's defaults."""

    name = "kubernetes"
    bounds_own_calls = True  # the gRPC deadline bounds List; it must see the nvidia collector's devices

    def __init__(self, settings: KubernetesSettings, client: PodResourcesClient | None = None) -> None:
        self.settings = settings
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
        snapshot.kubelet = KubeletReading(True, allocations=allocations(answer, snapshot.devices,
                                                                        self.settings.resources),
                                          errors=tuple(sorted(self.errors.items())))

    def close(self) -> None:
        """Close the client's channel."""
        self.client.close()


def allocations(answer: PodAllocations, devices: Sequence[Device],
                resources: Sequence[str] | None) -> tuple[KubeletAllocation, ...]:
    """The allocations of ``answer`` as published: device-plugin IDs of ``resources`` (None: of every
    resource at least one of whose IDs resolves on this host; an ID that names no device of this host is
    left out: it has no ``uuid`` to publish), then every DRA claim device (``uuid`` "": CDI resolution
    is not done here)."""
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
        out.append(KubeletAllocation(c.namespace, c.pod, c.container, claim=c.claim_name,
                                     claim_namespace=c.claim_namespace, driver=c.driver, pool=c.pool,
                                     device=c.device))
    return tuple(out)
