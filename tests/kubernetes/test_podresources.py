"""The pod-resources client against a stand-in kubelet: a real gRPC server in this process serving the
generated ``v1.PodResourcesLister`` servicer on a unix socket, answering as a kubelet does, and misbehaving
as one can (socket absent, a hanging call, a 10 000-pod answer, UNIMPLEMENTED, a garbage answer)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from accelstats.kubernetes.podresources import (
    DEFAULT_MAX_RECEIVE_BYTES,
    DEFAULT_SOCKET,
    DEFAULT_TIMEOUT_S,
    Allocatable,
    AllocatableDevices,
    ClaimAllocation,
    DeviceAllocation,
    PodAllocations,
    PodResourcesClient,
    PodResourcesError,
    SocketAbsent,
)
from accelstats.kubernetes.proto import podresources_pb2 as pb
from accelstats.kubernetes.proto import podresources_pb2_grpc as pb_grpc

GPU0 = "GPU-11111111-2222-3333-4444-555555555555"
GPU1 = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
MIG_A = "MIG-0a0a0a0a-0000-1111-2222-333333333333"
MIG_B = "MIG-0b0b0b0b-0000-1111-2222-333333333333"


def _devices(resource: str, *ids: str, numa: int | None = 0) -> pb.ContainerDevices:
    topology = pb.TopologyInfo(nodes=[pb.NUMANode(ID=numa)]) if numa is not None else None
    return pb.ContainerDevices(resource_name=resource, device_ids=list(ids), topology=topology)


def _pod(namespace: str, name: str, *containers: pb.ContainerResources) -> pb.PodResources:
    return pb.PodResources(namespace=namespace, name=name, containers=list(containers))


# What a kubelet with the NVIDIA device plugin (UUIDs, MIG "mixed" strategy, time-slicing) and the NVIDIA
# DRA driver answers: realistic content, including what accelstats ignores (CPU ids, memory, other resources).
PODS = [
    _pod("ml", "trainer-0",
         pb.ContainerResources(name="trainer", devices=[_devices("nvidia.com/gpu", GPU0, GPU1)], cpu_ids=[2, 3],
                               memory=[pb.ContainerMemory(memory_type="memory", size=2**30)]),
         pb.ContainerResources(name="sidecar")),
    _pod("ml", "notebook-7f9c",
         pb.ContainerResources(name="jupyter", devices=[_devices("nvidia.com/mig-1g.10gb", MIG_A, numa=1),
                                                        _devices("example.com/nic", "eth1", numa=None)])),
    _pod("batch", "sweep-1",
         pb.ContainerResources(name="worker", devices=[_devices("nvidia.com/gpu.shared", f"{GPU0}::3")])),
    _pod("batch", "dra-job",
         pb.ContainerResources(name="main", dynamic_resources=[pb.DynamicResource(
             claim_name="dra-job-gpu-x7k2p", claim_namespace="batch", claim_resources=[
                 pb.ClaimResource(driver_name="gpu.nvidia.com", pool_name="node-1", device_name="gpu-1",
                                  cdi_devices=[pb.CDIDevice(name="k8s.gpu.nvidia.com/device=gpu-1")]),
                 pb.ClaimResource(driver_name="gpu.nvidia.com", pool_name="node-1", device_name="gpu-0-mig-1",
                                  share_id="4c1d",
                                  cdi_devices=[pb.CDIDevice(name="k8s.gpu.nvidia.com/device=gpu-0-mig-1")]),
             ])])),
    _pod("kube-system", "coredns-5d78c", pb.ContainerResources(name="coredns")),
]  # fmt: skip

ALLOCATABLE = pb.AllocatableResourcesResponse(
    devices=[_devices("nvidia.com/gpu", GPU0, GPU1), _devices("nvidia.com/mig-1g.10gb", MIG_A, MIG_B, numa=1)],
    cpu_ids=list(range(16)))


class Kubelet(pb_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    """The stand-in kubelet: answers from ``pods``; ``hang`` makes every call wait until released;
    ``get_disabled`` answers Get as a kubelet with the KubeletPodResourcesGet gate off does."""

    def __init__(self, pods: list[pb.PodResources]) -> None:
        self.pods = pods
        self.hang = threading.Event()
        self.release = threading.Event()
        self.get_disabled = False

    def _wait(self) -> None:
        if self.hang.is_set():
            self.release.wait(10)

    def List(self, request: Any, context: Any) -> Any:  # noqa: N802
        self._wait()
        return pb.ListPodResourcesResponse(pod_resources=self.pods)

    def Get(self, request: Any, context: Any) -> Any:  # noqa: N802
        self._wait()
        if self.get_disabled:  # kubelet pkg/kubelet/apis/podresources/server_v1.go: a plain Go error (UNKNOWN)
            context.abort(grpc.StatusCode.UNKNOWN, "PodResources API Get method disabled")
        for pod in self.pods:
            if (pod.namespace, pod.name) == (request.pod_namespace, request.pod_name):
                return pb.GetPodResourcesResponse(pod_resources=pod)
        context.abort(grpc.StatusCode.UNKNOWN, f"pod {request.pod_name} in namespace {request.pod_namespace} not found")

    def GetAllocatableResources(self, request: Any, context: Any) -> Any:  # noqa: N802
        self._wait()
        return ALLOCATABLE


class OldKubelet(pb_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    """A kubelet before Get and GetAllocatableResources: the generated base answers them UNIMPLEMENTED."""

    def List(self, request: Any, context: Any) -> Any:  # noqa: N802
        return pb.ListPodResourcesResponse(pod_resources=PODS[:1])


Serve = Callable[..., Path]


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    """``serve(servicer)`` or ``serve(handler=generic_handler)``: a gRPC server on ``tmp_path/kubelet.sock``;
    returns the socket path. Stopped (and hanging calls released) at the end of the test."""
    servers: list[tuple[grpc.Server, Any]] = []

    def start(servicer: Any = None, handler: Any = None) -> Path:
        sock = tmp_path / "kubelet.sock"
        assert len(str(sock)) < 100, "unix socket paths are limited to 107 bytes"
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        if servicer is not None:
            pb_grpc.add_PodResourcesListerServicer_to_server(servicer, server)
        if handler is not None:
            server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"unix://{sock}")
        server.start()
        servers.append((server, servicer))
        return sock

    yield start
    for server, servicer in servers:
        if isinstance(servicer, Kubelet):
            servicer.release.set()
        server.stop(grace=None).wait(5)


# --- a kubelet answering ---


def test_list_reads_every_allocation_as_the_kubelet_gave_it(serve: Serve) -> None:
    with PodResourcesClient(str(serve(Kubelet(PODS)))) as client:
        got = client.list()
    assert got == PodAllocations(pods=5, devices=(
        # namespace, pod,            container,  resource,                 device IDs,        NUMA nodes
        DeviceAllocation("ml", "trainer-0",     "trainer", "nvidia.com/gpu",          (GPU0, GPU1),      (0,)),
        DeviceAllocation("ml", "notebook-7f9c", "jupyter", "nvidia.com/mig-1g.10gb",  (MIG_A,),          (1,)),
        DeviceAllocation("ml", "notebook-7f9c", "jupyter", "example.com/nic",         ("eth1",),         ()),
        DeviceAllocation("batch", "sweep-1",    "worker",  "nvidia.com/gpu.shared",   (f"{GPU0}::3",),   (0,)),
    ), claims=(
        # namespace, pod,     container, claim,            claim namespace, driver,        pool,    device
        ClaimAllocation("batch", "dra-job", "main", "dra-job-gpu-x7k2p", "batch", "gpu.nvidia.com", "node-1", "gpu-1",
                        ("k8s.gpu.nvidia.com/device=gpu-1",), None),
        ClaimAllocation("batch", "dra-job", "main", "dra-job-gpu-x7k2p", "batch", "gpu.nvidia.com", "node-1",
                        "gpu-0-mig-1", ("k8s.gpu.nvidia.com/device=gpu-0-mig-1",), "4c1d"),
    ))  # fmt: skip


def test_get_reads_one_pod(serve: Serve) -> None:
    with PodResourcesClient(str(serve(Kubelet(PODS)))) as client:
        got = client.get("batch", "sweep-1")
    assert got == PodAllocations(pods=1, claims=(), devices=(
        DeviceAllocation("batch", "sweep-1", "worker", "nvidia.com/gpu.shared", (f"{GPU0}::3",), (0,)),))


def test_get_of_a_pod_the_kubelet_does_not_know_is_an_error(serve: Serve) -> None:
    with PodResourcesClient(str(serve(Kubelet(PODS)))) as client, pytest.raises(PodResourcesError) as e:
        client.get("batch", "gone")
    assert e.value.reason == "error"
    assert str(e.value).endswith("UNKNOWN pod gone in namespace batch not found")


def test_get_allocatable_reads_the_devices(serve: Serve) -> None:
    with PodResourcesClient(str(serve(Kubelet(PODS)))) as client:
        got = client.get_allocatable()
    assert got == Allocatable((AllocatableDevices("nvidia.com/gpu", (GPU0, GPU1), (0,)),
                               AllocatableDevices("nvidia.com/mig-1g.10gb", (MIG_A, MIG_B), (1,))))


def test_methods_the_kubelet_does_not_offer_are_absent_not_errors(serve: Serve) -> None:
    with PodResourcesClient(str(serve(OldKubelet()))) as client:
        assert client.get("ml", "trainer-0") is None  # UNIMPLEMENTED
        assert client.get_allocatable() is None  # UNIMPLEMENTED
        assert client.list().pods == 1  # type: ignore[union-attr]


def test_get_with_its_feature_gate_off_is_absent(serve: Serve) -> None:
    kubelet = Kubelet(PODS)
    kubelet.get_disabled = True
    with PodResourcesClient(str(serve(kubelet))) as client:
        assert client.get("ml", "trainer-0") is None


def test_the_path_is_read_on_the_wire_as_the_kubelet_serves_it() -> None:
    """The method paths a Go kubelet routes on: /v1.PodResourcesLister/<Method>."""
    service = pb.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert service.full_name == "v1.PodResourcesLister"
    assert [m.name for m in service.methods] == ["List", "GetAllocatableResources", "Get"]


def test_defaults() -> None:
    assert DEFAULT_SOCKET == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert DEFAULT_TIMEOUT_S == 2.0
    assert DEFAULT_MAX_RECEIVE_BYTES == 16 * 1024 * 1024


# --- a kubelet misbehaving ---


def test_socket_absent_is_a_result_and_one_info_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sock = tmp_path / "kubelet.sock"
    caplog.set_level(logging.INFO, logger="accelstats.kubernetes.podresources")
    with PodResourcesClient(str(sock)) as client:
        assert client.list() == SocketAbsent(str(sock))
        assert client.get("ml", "x") == SocketAbsent(str(sock))
        assert client.get_allocatable() == SocketAbsent(str(sock))
    assert [r.getMessage() for r in caplog.records] == [
        f"kubelet pod-resources socket {sock} absent: pod-resources allocations off"]
    assert caplog.records[0].levelno == logging.INFO


def test_a_socket_that_appears_later_is_read(serve: Serve, tmp_path: Path) -> None:
    client = PodResourcesClient(str(tmp_path / "kubelet.sock"))
    assert isinstance(client.list(), SocketAbsent)
    serve(Kubelet(PODS))
    assert client.list().pods == 5  # type: ignore[union-attr]
    client.close()


def test_a_restarted_kubelet_is_read_at_once(serve: Serve, tmp_path: Path) -> None:
    """The kubelet stops (its socket stays, nothing answers) and comes back: the next call reads it, without
    waiting out gRPC's reconnect backoff (a second or more after a failed connection)."""
    import socket as socketlib

    sock = tmp_path / "kubelet.sock"
    with PodResourcesClient(str(sock), timeout_s=0.5) as client:
        with socketlib.socket(socketlib.AF_UNIX) as dead:  # a kubelet that is down: bound, not listening
            dead.bind(str(sock))
            for _ in range(2):
                with pytest.raises(PodResourcesError, match="kubelet not answering"):
                    client.list()
        sock.unlink()
        serve(Kubelet(PODS))
        assert client.list().pods == 5  # type: ignore[union-attr]


def test_a_path_that_is_not_a_socket_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "kubelet.sock").write_text("")
    with PodResourcesClient(str(tmp_path / "kubelet.sock")) as client, pytest.raises(PodResourcesError) as e:
        client.list()
    assert e.value.reason == "not_a_socket"


def test_a_socket_nobody_serves_is_unavailable(tmp_path: Path) -> None:
    """The kubelet restarting: its socket file is there, nothing listens (a bound, unlistened socket)."""
    import socket as socketlib

    sock = tmp_path / "kubelet.sock"
    with socketlib.socket(socketlib.AF_UNIX) as s:
        s.bind(str(sock))
        with PodResourcesClient(str(sock), timeout_s=1.0) as client, pytest.raises(PodResourcesError) as e:
            client.list()
    assert e.value.reason == "unavailable"
    assert "kubelet not answering" in str(e.value) and "\n" not in str(e.value)


def test_a_hanging_call_ends_at_the_deadline(serve: Serve) -> None:
    kubelet = Kubelet(PODS)
    kubelet.hang.set()
    with PodResourcesClient(str(serve(kubelet)), timeout_s=0.3) as client:
        for call in (client.list, client.get_allocatable, lambda: client.get("ml", "trainer-0")):
            started = time.monotonic()
            with pytest.raises(PodResourcesError) as e:
                call()
            assert time.monotonic() - started < 0.3 + 0.5
            assert e.value.reason == "deadline"
            assert str(e.value).endswith("no answer within 0.3 s")


def test_an_answer_over_the_size_limit_is_refused(serve: Serve) -> None:
    """10 000 pods with a GPU each (880 000 bytes on the wire) against a 256 KiB limit."""
    pods = [_pod("load", f"pod-{i:05}", pb.ContainerResources(name="c", devices=[_devices("nvidia.com/gpu", GPU0)]))
            for i in range(10_000)]
    size = pb.ListPodResourcesResponse(pod_resources=pods).ByteSize()
    limit = 256 * 1024
    assert size > 3 * limit
    sock = str(serve(Kubelet(pods)))
    with PodResourcesClient(sock, max_receive_bytes=limit) as client:
        with pytest.raises(PodResourcesError) as e:
            client.list()
        assert e.value.reason == "too_large"
        assert f"larger than the {limit} byte receive limit" in str(e.value) and "\n" not in str(e.value)
    with PodResourcesClient(sock) as client:  # the default 16 MiB takes it
        assert client.list().pods == 10_000  # type: ignore[union-attr]


def test_a_garbage_answer_is_an_error(serve: Serve) -> None:
    """Bytes that are not a ListPodResourcesResponse (field 1 as a varint: the wrong wire type)."""
    handler = grpc.method_handlers_generic_handler("v1.PodResourcesLister", {
        "List": grpc.unary_unary_rpc_method_handler(lambda request, context: b"\x08\x01\xff\xff\xff")})
    with PodResourcesClient(str(serve(handler=handler))) as client, pytest.raises(PodResourcesError) as e:
        client.list()
    assert e.value.reason == "garbage"
    assert str(e.value).endswith("answer does not decode as List's response")


@pytest.mark.parametrize(("option", "value"), [("timeout_s", 0), ("timeout_s", -1.0), ("max_receive_bytes", 0)])
def test_bounds_must_be_positive(option: str, value: float) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        PodResourcesClient(**{option: value})  # type: ignore[arg-type]
