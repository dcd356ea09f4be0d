"""The exporter with the kubelet's allocations: ``AcceleratorManager`` on the replay (captures from real
hosts) with the ``kubernetes`` collector reading a stand-in kubelet (a real gRPC server on a unix socket
serving the generated ``v1.PodResourcesLister``), rendered by the real ``/metrics`` encoder."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from accelstats.kubernetes.collector import KubernetesCollector
from accelstats.kubernetes.podresources import PodResourcesClient
from accelstats.kubernetes.proto import podresources_pb2 as pb
from accelstats.kubernetes.proto import podresources_pb2_grpc as pb_grpc
from accelstats.manager import AcceleratorManager, build_manager
from accelstats.settings import KubernetesSettings, Settings
from accelstats.web.exposition import exposition

# dual_a5000-v13.xml: two whole GPUs; a100-sxm4-v12.xml: GPU 0 in MIG mode with four instances
A5000_0, A5000_1 = "GPU-12345678-aaaa-bbbb-cccc-0123456789ab", "GPU-12345678-aaaa-bbbb-cccc-0123456789cd"
A100, A100_MIG_GI3 = "GPU-513536b6-7d19-9063-b049-1e69664bb298", "MIG-a4a164a4-3605-50c3-b619-069a661e90d6"


def _pod(namespace: str, name: str, container: str, *devices: tuple[str, tuple[str, ...]],
         claims: tuple[pb.DynamicResource, ...] = ()) -> pb.PodResources:
    return pb.PodResources(namespace=namespace, name=name, containers=[pb.ContainerResources(
        name=container, devices=[pb.ContainerDevices(resource_name=r, device_ids=list(ids)) for r, ids in devices],
        dynamic_resources=list(claims))])


DRA_CLAIM = pb.DynamicResource(claim_name="dra-job-gpu-x7k2p", claim_namespace="batch", claim_resources=[
    pb.ClaimResource(driver_name="gpu.nvidia.com", pool_name="node-1", device_name="gpu-1",
                     cdi_devices=[pb.CDIDevice(name="k8s.gpu.nvidia.com/device=gpu-1")])])

A5000_PODS = [
    _pod("ml", "trainer-0", "trainer", ("nvidia.com/gpu", (A5000_0,)), ("example.com/nic", ("eth1",))),
    _pod("batch", "sweep-1", "worker", ("nvidia.com/gpu.shared", (f"{A5000_1}::3",))),
    _pod("batch", "by-index", "main", ("nvidia.com/gpu", ("1",))),
    _pod("batch", "dra-job", "main", claims=(DRA_CLAIM,)),
    _pod("kube-system", "coredns-5d78c", "coredns"),
]
A100_PODS = [_pod("ml", "notebook-7f9c", "jupyter", ("nvidia.com/mig-1g.10gb", (A100_MIG_GI3,)))]


class Kubelet(pb_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    """The stand-in kubelet: ``List`` answers ``pods``; with ``hang`` set it waits until released."""

    def __init__(self, pods: list[pb.PodResources]) -> None:
        self.pods = pods
        self.hang = threading.Event()
        self.release = threading.Event()

    def List(self, request: Any, context: Any) -> Any:  # noqa: N802
        if self.hang.is_set():
            self.release.wait(10)
        return pb.ListPodResourcesResponse(pod_resources=self.pods)


@pytest.fixture
def kubelet_socket(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """``start(servicer=None, handler=None)``: a gRPC server on ``tmp_path/kubelet.sock``; its path."""
    servers: list[tuple[grpc.Server, Any]] = []

    def start(servicer: Any = None, handler: Any = None) -> Path:
        sock = tmp_path / "kubelet.sock"
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
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


def _manager(tmp_path: Path, fixtures_dir: Path, capture: str, socket: Path) -> AcceleratorManager:
    root = tmp_path / "empty"
    root.mkdir(exist_ok=True)
    settings = Settings(nvml_replay=fixtures_dir / "public" / capture, cgroup_root=root, proc_root=root,
                        accounting_interval=0, collectors=("nvidia", "kubernetes"),
                        kubernetes=KubernetesSettings(pod_resources_socket=socket))
    return build_manager(settings)


def _scrape(manager: AcceleratorManager) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``/metrics`` as the server encodes it: family name -> [(labels, value)]."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(exposition(manager).decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _labels(rows: list[tuple[dict[str, str], float]], *names: str) -> set[tuple[str, ...]]:
    assert all(v == 1.0 for _, v in rows)
    return {tuple(labels[n] for n in names) for labels, _ in rows}


ALLOCATION = ("namespace", "pod", "container", "resource", "uuid", "gpu", "replica")


def test_device_plugin_allocations_by_uuid_replica_and_index(tmp_path: Path, fixtures_dir: Path,
                                                             kubelet_socket: Callable[..., Path]) -> None:
    manager = _manager(tmp_path, fixtures_dir, "dual_a5000-v13.xml", kubelet_socket(Kubelet(A5000_PODS)))
    got = _scrape(manager)
    assert _labels(got["accelstats_kubernetes_gpu_allocation"], *ALLOCATION) == {
        # namespace, pod,        container,  resource,               uuid,     gpu, replica
        ("ml",    "trainer-0",   "trainer",  "nvidia.com/gpu",        A5000_0,  "0", ""),
        ("batch", "sweep-1",     "worker",   "nvidia.com/gpu.shared", A5000_1,  "1", "3"),
        ("batch", "by-index",    "main",     "nvidia.com/gpu",        A5000_1,  "1", ""),
    }  # fmt: skip
    assert got["accelstats_kubernetes_pod_resources_up"] == [({}, 1.0)]
    assert ({"collector": "kubernetes"}, 1.0) in got["accelstats_scrape_collector_success"]


def test_a_mig_instance_allocation(tmp_path: Path, fixtures_dir: Path,
                                   kubelet_socket: Callable[..., Path]) -> None:
    manager = _manager(tmp_path, fixtures_dir, "a100-sxm4-v12.xml", kubelet_socket(Kubelet(A100_PODS)))
    assert _labels(_scrape(manager)["accelstats_kubernetes_gpu_allocation"], *ALLOCATION) == {
        ("ml", "notebook-7f9c", "jupyter", "nvidia.com/mig-1g.10gb", A100_MIG_GI3, "0", "")}


CLAIM_LABELS = ("namespace", "pod", "container", "claim", "claim_namespace", "driver", "pool", "device", "uuid", "gpu")
A5000_CLAIM_ROW = ("batch", "dra-job", "main", "dra-job-gpu-x7k2p", "batch", "gpu.nvidia.com", "node-1", "gpu-1")


def _cdi_spec(rootfs: Path, directory: str, kind: str, devices: dict[str, list[str]]) -> None:
    """A CDI spec file as NVIDIA's DRA driver writes one per prepared claim (cdiVersion, kind, devices with
    their deviceNodes; the spec-level edits carry the control nodes)."""
    spec_dir = rootfs / directory.lstrip("/")
    spec_dir.mkdir(parents=True, exist_ok=True)
    (spec_dir / "k8s.gpu.nvidia.com-claim.yaml").write_text(yaml.safe_dump({
        "cdiVersion": "0.6.0", "kind": kind,
        "devices": [{"name": n, "containerEdits": {"deviceNodes": [{"path": x} for x in nodes]}}
                    for n, nodes in devices.items()],
        "containerEdits": {"deviceNodes": [{"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia-uvm"}]}}))


def _dra_manager(tmp_path: Path, fixtures_dir: Path, capture: str, socket: Path) -> AcceleratorManager:
    """The exporter with ``--rootfs``/``--proc-root`` at ``tmp_path/host`` (CDI specs and mig-minors there)."""
    host = tmp_path / "host"
    (host / "proc").mkdir(parents=True, exist_ok=True)
    (host / "cgroup").mkdir(exist_ok=True)
    return build_manager(Settings(
        nvml_replay=fixtures_dir / "public" / capture, cgroup_root=host / "cgroup", proc_root=host / "proc",
        rootfs=host, accounting_interval=0, collectors=("nvidia", "kubernetes"),
        kubernetes=KubernetesSettings(pod_resources_socket=socket)))


def test_a_dra_claim_is_published_with_the_gpu_its_cdi_spec_names(
        tmp_path: Path, fixtures_dir: Path, kubelet_socket: Callable[..., Path]) -> None:
    """The claim's CDI device adds /dev/nvidia0: minor 0 is A5000 index 1 in this capture (minor and index
    differ), so the claim is published with that GPU's uuid and index."""
    _cdi_spec(tmp_path / "host", "/var/run/cdi", "k8s.gpu.nvidia.com/device", {"gpu-1": ["/dev/nvidia0"]})
    manager = _dra_manager(tmp_path, fixtures_dir, "dual_a5000-v13.xml", kubelet_socket(Kubelet(A5000_PODS)))
    got = _scrape(manager)["accelstats_kubernetes_gpu_claim_allocation"]
    assert _labels(got, *CLAIM_LABELS) == {(*A5000_CLAIM_ROW, A5000_1, "1")}


def test_a_dra_claim_of_a_mig_instance_names_the_instance(
        tmp_path: Path, fixtures_dir: Path, kubelet_socket: Callable[..., Path]) -> None:
    """A MIG claim device adds its GPU's node and the instance's capability nodes: read in mig-minors
    (under --proc-root) as GPU instance 3, compute instance 0 of the GPU with minor 1."""
    host = tmp_path / "host"
    _cdi_spec(host, "/etc/cdi", "k8s.gpu.nvidia.com/device",
              {"mig-0-3": ["/dev/nvidia1", "/dev/nvidia-caps/nvidia-cap30", "/dev/nvidia-caps/nvidia-cap31"]})
    caps = host / "proc" / "driver" / "nvidia-caps"
    caps.mkdir(parents=True)
    (caps / "mig-minors").write_text("config 1\nmonitor 2\ngpu1/gi3/access 30\ngpu1/gi3/ci0/access 31\n"
                                     "gpu1/gi4/access 39\ngpu1/gi4/ci0/access 40\n")
    claim = pb.DynamicResource(claim_name="nb-mig", claim_namespace="ml", claim_resources=[
        pb.ClaimResource(driver_name="gpu.nvidia.com", pool_name="node-1", device_name="mig-0-3",
                         cdi_devices=[pb.CDIDevice(name="k8s.gpu.nvidia.com/device=mig-0-3")])])
    manager = _dra_manager(tmp_path, fixtures_dir, "a100-sxm4-v12.xml",
                           kubelet_socket(Kubelet([_pod("ml", "notebook", "jupyter", claims=(claim,))])))
    got = _scrape(manager)["accelstats_kubernetes_gpu_claim_allocation"]
    assert _labels(got, *CLAIM_LABELS) == {
        ("ml", "notebook", "jupyter", "nb-mig", "ml", "gpu.nvidia.com", "node-1", "mig-0-3", A100_MIG_GI3, "0")}


def test_a_dra_claim_no_cdi_spec_names_is_published_without_a_gpu(
        tmp_path: Path, fixtures_dir: Path, kubelet_socket: Callable[..., Path],
        caplog: pytest.LogCaptureFixture) -> None:
    """No spec for the claim's CDI name (or one naming several GPUs): the claim labels, uuid and gpu '',
    and one INFO line with the reason however many scrapes."""
    _cdi_spec(tmp_path / "host", "/var/run/cdi", "k8s.gpu.nvidia.com/device",
              {"other": ["/dev/nvidia0"]})
    manager = _dra_manager(tmp_path, fixtures_dir, "dual_a5000-v13.xml", kubelet_socket(Kubelet(A5000_PODS)))
    with caplog.at_level(logging.INFO, logger="accelstats.kubernetes.collector"):
        for _ in range(3):
            got = _scrape(manager)["accelstats_kubernetes_gpu_claim_allocation"]
            assert _labels(got, *CLAIM_LABELS) == {(*A5000_CLAIM_ROW, "", "")}
    said = [r.getMessage() for r in caplog.records if "DRA claim device" in r.getMessage()]
    assert said == ["DRA claim device k8s.gpu.nvidia.com/device=gpu-1 not resolved to a GPU of this host: "
                    "no CDI spec on this host names this device"]


def test_configured_resources_only(tmp_path: Path, fixtures_dir: Path,
                                   kubelet_socket: Callable[..., Path]) -> None:
    root = tmp_path / "empty"
    root.mkdir()
    manager = build_manager(Settings(
        nvml_replay=fixtures_dir / "public" / "dual_a5000-v13.xml", cgroup_root=root, proc_root=root,
        accounting_interval=0, collectors=("nvidia", "kubernetes"),
        kubernetes=KubernetesSettings(pod_resources_socket=kubelet_socket(Kubelet(A5000_PODS)),
                                      resources=("nvidia.com/gpu.shared",))))
    assert _labels(_scrape(manager)["accelstats_kubernetes_gpu_allocation"], "pod", "resource") == {
        ("sweep-1", "nvidia.com/gpu.shared")}


def test_a_ten_thousand_pod_answer_is_published_whole(tmp_path: Path, fixtures_dir: Path,
                                                      kubelet_socket: Callable[..., Path]) -> None:
    """10 000 pods, each with one time-sliced replica of one of the two GPUs (an answer of about 1.2 MB,
    under the 16 MiB receive limit): every allocation is a series, the collector succeeds."""
    pods = [_pod("load", f"p-{n}", "c", ("nvidia.com/gpu.shared", (f"{(A5000_0, A5000_1)[n % 2]}::{n}",)))
            for n in range(10_000)]
    manager = _manager(tmp_path, fixtures_dir, "dual_a5000-v13.xml", kubelet_socket(Kubelet(pods)))
    got = _scrape(manager)
    rows = _labels(got["accelstats_kubernetes_gpu_allocation"], "pod", "uuid", "replica")
    assert len(rows) == 10_000
    assert ("p-9999", A5000_1, "9999") in rows and ("p-0", A5000_0, "0") in rows
    assert ({"collector": "kubernetes"}, 1.0) in got["accelstats_scrape_collector_success"]


# --- the kubelet misbehaving: a reason series, one log line, every GPU family intact ---

def _gpu_families_intact(got: dict[str, list[tuple[dict[str, str], float]]]) -> None:
    assert _labels(got["accelstats_gpu_info"], "uuid") == {(A5000_0,), (A5000_1,)}
    assert ({"collector": "nvidia"}, 1.0) in got["accelstats_scrape_collector_success"]
    assert "accelstats_kubernetes_gpu_allocation" not in got


def _short_deadline(manager: AcceleratorManager, socket: Path) -> None:
    """The collector's client with a 0.3 s deadline (the default 2 s would make the test slow)."""
    collector = next(c for c in manager.collectors if isinstance(c, KubernetesCollector))
    collector.client = PodResourcesClient(str(socket), timeout_s=0.3)


def test_a_hanging_kubelet(tmp_path: Path, fixtures_dir: Path, kubelet_socket: Callable[..., Path],
                           caplog: pytest.LogCaptureFixture) -> None:
    kubelet = Kubelet(A5000_PODS)
    kubelet.hang.set()
    socket = kubelet_socket(kubelet)
    manager = _manager(tmp_path, fixtures_dir, "dual_a5000-v13.xml", socket)
    _short_deadline(manager, socket)
    with caplog.at_level(logging.INFO, logger="accelstats"):
        _scrape(manager)
        got = _scrape(manager)  # a second failing collection: no second log line
    assert got["accelstats_kubernetes_pod_resources_up"] == [({}, 0.0)]
    assert got["accelstats_kubernetes_pod_resources_errors_total"] == [({"reason": "deadline"}, 2.0)]
    assert ({"collector": "kubernetes"}, 0.0) in got["accelstats_scrape_collector_success"]
    _gpu_families_intact(got)
    lines = [r for r in caplog.records if "pod-resources" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "no answer within 0.3 s" in lines[0].getMessage() and "\n" not in lines[0].getMessage()
    kubelet.hang.clear()
    kubelet.release.set()
    with caplog.at_level(logging.INFO, logger="accelstats"):
        got = _scrape(manager)
    assert got["accelstats_kubernetes_pod_resources_up"] == [({}, 1.0)]
    assert any("answers again" in r.getMessage() for r in caplog.records)


def test_an_absent_socket_is_the_feature_off(tmp_path: Path, fixtures_dir: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="accelstats"):
        manager = _manager(tmp_path, fixtures_dir, "dual_a5000-v13.xml", tmp_path / "no" / "kubelet.sock")
        _scrape(manager)
        got = _scrape(manager)
    assert "accelstats_kubernetes_pod_resources_up" not in got
    assert ({"collector": "kubernetes"}, 1.0) in got["accelstats_scrape_collector_success"]
    _gpu_families_intact(got)
    assert len([r for r in caplog.records if "absent" in r.getMessage()]) == 1


def test_a_garbage_answer(tmp_path: Path, fixtures_dir: Path, kubelet_socket: Callable[..., Path]) -> None:
    handler = grpc.method_handlers_generic_handler("v1.PodResourcesLister", {
        "List": grpc.unary_unary_rpc_method_handler(lambda request, context: b"\x08\x01\xff\xff\xff")})
    manager = _manager(tmp_path, fixtures_dir, "dual_a5000-v13.xml", kubelet_socket(handler=handler))
    got = _scrape(manager)
    assert got["accelstats_kubernetes_pod_resources_up"] == [({}, 0.0)]
    assert got["accelstats_kubernetes_pod_resources_errors_total"] == [({"reason": "garbage"}, 1.0)]
    _gpu_families_intact(got)


def test_the_cdi_directories_are_the_cdi_modules() -> None:
    """The collector names them without importing cdi.py (PyYAML stays out of a serve without claims)."""
    from accelstats.kubernetes.cdi import SPEC_DIRS
    from accelstats.kubernetes.collector import CDI_SPEC_DIRS

    assert CDI_SPEC_DIRS == SPEC_DIRS
