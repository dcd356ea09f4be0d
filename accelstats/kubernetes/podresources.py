"""A bounded client of the kubelet's pod-resources API (``v1.PodResourcesLister`` on a unix socket).

The kubelet serves ``List`` (every pod on the node with its containers' device-plugin devices and DRA
claims), ``GetAllocatableResources`` (kubelet 1.21+) and ``Get`` (one pod; kubelet 1.27+, behind the
``KubeletPodResourcesGet`` feature gate) on ``/var/lib/kubelet/pod-resources/kubelet.sock``
(accelstats/kubernetes/proto/podresources.proto says which kubelet release the messages match).

Every call is bounded: a deadline (default 2 s) and a receive-size limit (default 16 MiB, the limit the
kubelet's node e2e tests and NRI's pod-resources client use). What the caller gets:

- the answer, as plain frozen dataclasses (``PodAllocations``, ``Allocatable``);
- ``SocketAbsent`` when no socket is at the path: the kubelet is not there (not Kubernetes, or the
  directory is not mounted). One info line is logged when the socket goes missing, not one per call;
- ``None`` from ``get``/``get_allocatable`` when the kubelet does not offer the method (gRPC
  UNIMPLEMENTED, or the kubelet's "… disabled" answer while its feature gate is off): absent, not an error;
- ``PodResourcesError`` (one line, with a ``reason`` code) for everything else: a deadline passed,
  an answer over the size limit, the kubelet not answering, an answer that does not decode. The client
  does not log these; the caller decides how often to say so.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import grpc

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MAX_RECEIVE_BYTES = 16 * 1024 * 1024

ErrorReason = Literal["deadline", "too_large", "unavailable", "not_a_socket", "garbage", "error"]


class PodResourcesError(Exception):
    """A pod-resources call failed. ``str(error)`` is one line naming the socket and the cause;
    ``reason`` is a short code for a reason label: ``deadline`` (no answer within the deadline),
    ``too_large`` (answer over the receive-size limit), ``unavailable`` (nothing answers on the socket,
    e.g. the kubelet restarting), ``not_a_socket`` (the path is something else), ``garbage`` (the answer
    does not decode as the message), ``error`` (any other gRPC status)."""

    def __init__(self, reason: ErrorReason, message: str) -> None:
        super().__init__(message)
        self.reason: ErrorReason = reason


@dataclass(frozen=True)
class SocketAbsent:
    """No socket at ``socket``: the kubelet's pod-resources API is not available here (feature off)."""

    socket: str


@dataclass(frozen=True)
class DeviceAllocation:
    """Devices of one device-plugin resource assigned to one container.

    ``resource`` is the extended-resource name (``nvidia.com/gpu``, ``nvidia.com/mig-1g.10gb``),
    ``device_ids`` the plugin's IDs in the kubelet's order (see device_ids.py for what they name),
    ``numa_nodes`` the NUMA node IDs the plugin reported the devices local to (empty: none reported).
    """

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]
    numa_nodes: tuple[int, ...] = ()


@dataclass(frozen=True)
class ClaimAllocation:
    """One device of a DRA resource claim used by one container.

    ``claim_name``/``claim_namespace`` name the ResourceClaim; ``driver``, ``pool`` and ``device`` together
    identify the device (``gpu.nvidia.com``, a pool named after the node, ``gpu-0``); ``cdi_devices`` are its
    fully qualified CDI names (``nvidia.com/gpu=…``); ``share_id`` is set where the device is shared
    (kubelet 1.35+), else ``None``.
    """

    namespace: str
    pod: str
    container: str
    claim_name: str
    claim_namespace: str
    driver: str
    pool: str
    device: str
    cdi_devices: tuple[str, ...] = ()
    share_id: str | None = None


@dataclass(frozen=True)
class PodAllocations:
    """What ``List`` (or ``Get``) answered: ``devices`` per container and resource, ``claims`` per container
    and claimed device, each in the kubelet's order; ``pods`` is how many pods the answer held."""

    devices: tuple[DeviceAllocation, ...]
    claims: tuple[ClaimAllocation, ...]
    pods: int


@dataclass(frozen=True)
class AllocatableDevices:
    """Devices of one resource the kubelet can assign (``GetAllocatableResources``)."""

    resource: str
    device_ids: tuple[str, ...]
    numa_nodes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Allocatable:
    """What ``GetAllocatableResources`` answered (devices only; CPUs and memory are not read)."""

    devices: tuple[AllocatableDevices, ...]


class PodResourcesClient:
    """A client of the kubelet's pod-resources socket ``socket``; each call waits at most ``timeout_s``
    seconds and accepts answers up to ``max_receive_bytes``. One gRPC channel, made on first use and
    dropped when the kubelet does not answer (UNAVAILABLE), so that the call after a kubelet restart
    connects at once instead of waiting out gRPC's reconnect backoff. Not locked: calls from several
    threads need the caller's lock. ``close()`` releases the channel."""

    def __init__(self, socket: str = DEFAULT_SOCKET, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_receive_bytes: int = DEFAULT_MAX_RECEIVE_BYTES) -> None:
        if timeout_s <= 0:
            raise ValueError(f"pod-resources timeout must be positive, got {timeout_s}")
        if max_receive_bytes <= 0:
            raise ValueError(f"pod-resources receive limit must be positive, got {max_receive_bytes}")
        self.socket = socket
        self.timeout_s = timeout_s
        self.max_receive_bytes = max_receive_bytes
        self._channel: grpc.Channel | None = None
        self._stub: Any = None
        self._absent_logged = False

    def list(self) -> PodAllocations | SocketAbsent:
        """Every pod's assigned devices and DRA claims (``List``). Raises ``PodResourcesError``."""
        stub = self._connect()
        if isinstance(stub, SocketAbsent):
            return stub
        from accelstats.kubernetes.proto import podresources_pb2

        answer = self._call("List", stub.List, podresources_pb2.ListPodResourcesRequest())
        return _allocations(answer.pod_resources)

    def get(self, namespace: str, pod: str) -> PodAllocations | SocketAbsent | None:
        """One pod's assigned devices and claims (``Get``); ``None`` where the kubelet does not offer Get.
        Raises ``PodResourcesError`` (also for a pod the kubelet does not know: gRPC UNKNOWN)."""
        stub = self._connect()
        if isinstance(stub, SocketAbsent):
            return stub
        from accelstats.kubernetes.proto import podresources_pb2

        request = podresources_pb2.GetPodResourcesRequest(pod_name=pod, pod_namespace=namespace)
        answer = self._call("Get", stub.Get, request, optional=True)
        return None if answer is None else _allocations([answer.pod_resources])

    def get_allocatable(self) -> Allocatable | SocketAbsent | None:
        """The devices the kubelet can assign (``GetAllocatableResources``); ``None`` where it does not
        offer the method. Raises ``PodResourcesError``."""
        stub = self._connect()
        if isinstance(stub, SocketAbsent):
            return stub
        from accelstats.kubernetes.proto import podresources_pb2

        answer = self._call("GetAllocatableResources", stub.GetAllocatableResources,
                            podresources_pb2.AllocatableResourcesRequest(), optional=True)
        if answer is None:
            return None
        return Allocatable(tuple(AllocatableDevices(d.resource_name, tuple(d.device_ids), _numa(d))
                                 for d in answer.devices))

    def close(self) -> None:
        """Close the channel (a later call opens a new one)."""
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None

    def __enter__(self) -> PodResourcesClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _connect(self) -> Any:
        """The stub, or ``SocketAbsent`` (logged once per disappearance) when no file is at the path."""
        try:
            mode = os.stat(self.socket).st_mode
        except FileNotFoundError:
            if not self._absent_logged:
                log.info("kubelet pod-resources socket %s absent: pod-resources allocations off", self.socket)
                self._absent_logged = True
            return SocketAbsent(self.socket)
        except OSError as e:
            raise PodResourcesError("unavailable", f"pod-resources socket {self.socket}: {e.strerror}") from e
        if self._absent_logged:
            log.info("kubelet pod-resources socket %s present again", self.socket)
            self._absent_logged = False
        if not stat.S_ISSOCK(mode):
            raise PodResourcesError("not_a_socket", f"pod-resources socket {self.socket} is not a unix socket")
        if self._stub is None:
            import grpc  # here, not at import: a host without a kubelet never loads gRPC (start-up, issue 29)

            from accelstats.kubernetes.proto import podresources_pb2_grpc

            self._channel = grpc.insecure_channel(
                f"unix://{os.path.abspath(self.socket)}",
                # a channel of its own subchannels: the global pool would hand a new channel the failed
                # connection's reconnect backoff after a kubelet restart
                options=[("grpc.max_receive_message_length", self.max_receive_bytes),
                         ("grpc.use_local_subchannel_pool", 1)])
            self._stub = podresources_pb2_grpc.PodResourcesListerStub(self._channel)
        return self._stub

    def _call(self, method: str, rpc: Any, request: Any, *, optional: bool = False) -> Any:
        """``rpc(request)`` within the deadline; gRPC failures become one-line ``PodResourcesError``s, and
        with ``optional`` a method the kubelet does not offer becomes ``None``."""
        import grpc

        try:
            return rpc(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            code, details = e.code(), (e.details() or "").replace("\n", " ")
            if optional and (code == grpc.StatusCode.UNIMPLEMENTED
                             or (code == grpc.StatusCode.UNKNOWN and details.endswith("disabled"))):
                return None
            if code == grpc.StatusCode.UNAVAILABLE:
                self.close()  # a fresh channel next call: no reconnect backoff after a kubelet restart
            raise _error(method, self.socket, code, details, self) from None


def _error(method: str, socket: str, code: grpc.StatusCode, details: str,
           client: PodResourcesClient) -> PodResourcesError:
    import grpc

    where = f"pod-resources {method} on {socket}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return PodResourcesError("deadline", f"{where}: no answer within {client.timeout_s:g} s")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return PodResourcesError("too_large", f"{where}: answer refused, larger than the "
                                 f"{client.max_receive_bytes} byte receive limit ({details})")
    if code == grpc.StatusCode.UNAVAILABLE:
        return PodResourcesError("unavailable", f"{where}: kubelet not answering ({details})")
    if code == grpc.StatusCode.INTERNAL and "deserializ" in details:
        return PodResourcesError("garbage", f"{where}: answer does not decode as {method}'s response")
    return PodResourcesError("error", f"{where}: {code.name} {details}")


def _numa(message: Any) -> tuple[int, ...]:
    return tuple(node.ID for node in message.topology.nodes)


def _allocations(pods: Iterable[Any]) -> PodAllocations:
    """Flatten ``v1.PodResources`` messages into per-container device and claim rows."""
    devices: list[DeviceAllocation] = []
    claims: list[ClaimAllocation] = []
    count = 0
    for pod in pods:
        count += 1
        for c in pod.containers:
            devices.extend(DeviceAllocation(pod.namespace, pod.name, c.name, d.resource_name,
                                            tuple(d.device_ids), _numa(d)) for d in c.devices)
            claims.extend(
                ClaimAllocation(pod.namespace, pod.name, c.name, claim.claim_name, claim.claim_namespace,
                                r.driver_name, r.pool_name, r.device_name, tuple(cdi.name for cdi in r.cdi_devices),
                                r.share_id if r.HasField("share_id") else None)
                for claim in c.dynamic_resources for r in claim.claim_resources)
    return PodAllocations(tuple(devices), tuple(claims), count)
