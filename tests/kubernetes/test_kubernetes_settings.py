"""``[kubernetes]`` in the config file and ``accelstats serve --pod-resources-socket``: the values each
takes, the one-line error for a bad one, and the flag reaching the collector (a real ``accelstats serve``
reading a stand-in kubelet)."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.ports import free_port

from accelstats.config import load_config
from accelstats.kubernetes.proto import podresources_pb2 as pb
from accelstats.kubernetes.proto import podresources_pb2_grpc as pb_grpc
from accelstats.settings import DEFAULT_POD_RESOURCES_SOCKET, ConfigError, KubernetesSettings

CLI = [sys.executable, "-m", "accelstats"]
GPU0 = "GPU-12345678-aaaa-bbbb-cccc-0123456789ab"  # dual_a5000-v13.xml, index 0


def _load(tmp_path: Path, text: str) -> KubernetesSettings:
    cfg = tmp_path / "config.toml"
    cfg.write_text(text)
    return load_config(cfg).kubernetes


def test_defaults_are_the_kubelets_socket_and_every_gpu_resource(tmp_path: Path) -> None:
    assert _load(tmp_path, "") == KubernetesSettings(DEFAULT_POD_RESOURCES_SOCKET, None)
    assert str(DEFAULT_POD_RESOURCES_SOCKET) == "/var/lib/kubelet/pod-resources/kubelet.sock"


def test_the_table_sets_both(tmp_path: Path) -> None:
    got = _load(tmp_path, '[kubernetes]\npod_resources_socket = "/host/kubelet.sock"\n'
                          'resources = ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb"]\n')
    assert got == KubernetesSettings(Path("/host/kubelet.sock"), ("nvidia.com/gpu", "nvidia.com/mig-1g.10gb"))


@pytest.mark.parametrize(("table", "error"), [
    ('pod_resources_socket = ""',           "key 'kubernetes.pod_resources_socket': expected a socket path, got ''"),
    ("pod_resources_socket = 1",            "key 'kubernetes.pod_resources_socket': expected str, got int 1"),
    ('resources = "nvidia.com/gpu"',        "key 'kubernetes.resources': expected list, got str"),
    ('resources = ["gpu"]',                 "key 'kubernetes.resources[0]': expected an extended-resource name "
                                            "such as 'nvidia.com/gpu', got 'gpu'"),
    ('resources = ["a.io/x", "a.io/x"]',    "key 'kubernetes.resources[1]': 'a.io/x' listed twice"),
    ("socket = 'x'",                        "unknown key 'kubernetes.socket' (known: pod_resources_socket, resources)"),
])  # fmt: skip
def test_bad_values_are_one_line_errors(tmp_path: Path, table: str, error: str) -> None:
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, f"[kubernetes]\n{table}\n")
    assert str(e.value).startswith(str(tmp_path / "config.toml") + ": ")
    assert error in str(e.value) and "\n" not in str(e.value)


def test_an_empty_flag_is_refused() -> None:
    done = subprocess.run([*CLI, "serve", "--pod-resources-socket", ""], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "accelstats: error: --pod-resources-socket: expected a socket path, got ''"]


class _Kubelet(pb_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    def List(self, request: Any, context: Any) -> Any:  # noqa: N802
        return pb.ListPodResourcesResponse(pod_resources=[pb.PodResources(namespace="ml", name="trainer-0", containers=[
            pb.ContainerResources(name="trainer", devices=[
                pb.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=[GPU0])])])])


def test_serve_reads_the_socket_the_flag_names(tmp_path: Path, fixtures_dir: Path) -> None:
    sock = tmp_path / "kubelet.sock"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_PodResourcesListerServicer_to_server(_Kubelet(), server)
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    port = free_port()
    proc = subprocess.Popen([*CLI, "serve", "--listen", f"127.0.0.1:{port}", "--config", "/dev/null",
                             "--nvml-replay", str(fixtures_dir / "public" / "dual_a5000-v13.xml"),
                             "--cgroup-root", str(tmp_path), "--proc-root", str(tmp_path),
                             "--pod-resources-socket", str(sock)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        text = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                    text = r.read().decode()
                break
            except OSError:
                time.sleep(0.1)  # not listening yet
        rows = {(s.labels["pod"], s.labels["uuid"]) for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "accelstats_kubernetes_gpu_allocation"}
        assert rows == {("trainer-0", GPU0)}
    finally:
        proc.kill()
        proc.communicate(timeout=10)
        server.stop(grace=None).wait(5)
