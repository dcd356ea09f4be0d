"""A stand-in kubelet: the real ``v1.PodResourcesLister`` proto (accelstats/kubernetes/proto), served on a
unix socket from a JSON description of the node's pods, in a process of its own.

Run as ``python3 tests/support/kubelet_double.py SOCKET PODS.json``; :func:`kubelet_process` does so and
waits for the socket. A process of its own keeps gRPC's threads out of the test process: a fork with
``preexec_fn`` there would abort while a gRPC server runs (tests/support/http_attack_util.py,
grpc/grpc#43055), and the exporter under test reads the socket as it reads the kubelet's.

``PODS.json`` is a list of pods::

    [{"namespace": "ml", "name": "trainer-0", "containers": [
        {"name": "trainer",
         "devices": [{"resource": "nvidia.com/gpu", "ids": ["GPU-…"]}],
         "claims": [{"claim": "c", "claim_namespace": "ml", "driver": "gpu.nvidia.com", "pool": "node-1",
                     "device": "gpu-0", "cdi": ["k8s.gpu.nvidia.com/device=gpu-0"]}]}]}]
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def pods_message(pods: list[dict[str, Any]]) -> Any:
    """``ListPodResourcesResponse`` of the JSON description above."""
    from accelstats.kubernetes.proto import podresources_pb2 as pb

    def container(c: dict[str, Any]) -> Any:
        return pb.ContainerResources(
            name=c["name"],
            devices=[pb.ContainerDevices(resource_name=d["resource"], device_ids=d["ids"])
                     for d in c.get("devices", [])],
            dynamic_resources=[pb.DynamicResource(
                claim_name=k["claim"], claim_namespace=k["claim_namespace"], claim_resources=[pb.ClaimResource(
                    driver_name=k["driver"], pool_name=k["pool"], device_name=k["device"],
                    cdi_devices=[pb.CDIDevice(name=n) for n in k.get("cdi", [])])])
                for k in c.get("claims", [])])

    return pb.ListPodResourcesResponse(pod_resources=[
        pb.PodResources(namespace=p["namespace"], name=p["name"], containers=[container(c) for c in p["containers"]])
        for p in pods])


def serve(socket: Path, pods: list[dict[str, Any]]) -> None:
    """Serve ``List`` (the pods) on ``socket`` until killed."""
    import grpc

    from accelstats.kubernetes.proto import podresources_pb2_grpc as pb_grpc

    answer = pods_message(pods)

    class Kubelet(pb_grpc.PodResourcesListerServicer):  # type: ignore[misc]
        def List(self, request: Any, context: Any) -> Any:  # noqa: N802
            return answer

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_PodResourcesListerServicer_to_server(Kubelet(), server)
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    server.wait_for_termination()


@contextlib.contextmanager
def kubelet_process(socket: Path, pods: list[dict[str, Any]], log: Path) -> Iterator[Path]:
    """The stand-in kubelet serving ``pods`` on ``socket``, in a child process; yields the socket once it
    exists (30 s at most, else the test fails with the child's output); killed at the end."""
    spec = socket.with_suffix(".pods.json")
    spec.write_text(json.dumps(pods))
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, __file__, str(socket), str(spec)], stdout=out,
                                stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while not socket.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"stand-in kubelet did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        yield socket
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    serve(Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()))
