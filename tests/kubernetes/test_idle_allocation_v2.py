"""An idle allocated pod on cgroup v2 without CAP_SYS_ADMIN, listed with its GPU from the kubelet alone.

A real runc container on the cgroup2 hierarchy (a device program granting GPU 1, nothing running), named
as a Kubernetes container by its runtime's state (docker's ``config.v2.json`` with the
``io.kubernetes.*`` labels cri-dockerd writes, under a private ``--rootfs``); ``accelstats containers`` and
``dump`` run without CAP_SYS_ADMIN (device programs unreadable: no ``devices_cgroup`` evidence) against a
stand-in kubelet that allocated GPU 1 to that container. Without the kubelet, the container is invisible
(tests/attribution/test_containers_v2.py::test_without_cap_sys_admin_one_reason_and_process_evidence).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import in_ci
from prometheus_client.parser import text_string_to_metric_families
from support.bpf_util import unified_root
from support.runc_harness import ContainerSpec, RuncFactory, docker_cgroupfs_path, docker_id
from support.scenarios_util import two_gpu_scenario

from accelstats.kubernetes.proto import podresources_pb2 as pb
from accelstats.kubernetes.proto import podresources_pb2_grpc as pb_grpc

pytestmark = pytest.mark.root

GPU0 = "GPU-00000000-2222-4000-8000-000000000000"
GPU1 = "GPU-00000001-2222-4000-8000-000000000001"
DROP = "-sys_admin,-net_admin,-bpf,-perfmon"


class _Kubelet(pb_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    def List(self, request: Any, context: Any) -> Any:  # noqa: N802
        return pb.ListPodResourcesResponse(pod_resources=[pb.PodResources(namespace="ml", name="trainer-0", containers=[
            pb.ContainerResources(name="trainer", devices=[
                pb.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=[GPU1])])])])


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.fail("setpriv (util-linux) missing") if in_ci() else pytest.skip("setpriv missing")
    assert setpriv is not None
    cmd = [setpriv, f"--bounding-set={DROP}", f"--inh-caps={DROP}", "--", sys.executable, "-m", "accelstats", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_an_idle_allocated_pod_is_listed_with_its_gpu_without_cap_sys_admin(
        runc_container: RuncFactory, tmp_path: Path, fixtures_dir: Path) -> None:
    v2_root = unified_root()
    if v2_root is None:
        pytest.fail("no cgroup2 mount") if in_ci() else pytest.skip("no cgroup2 mount")
    cid = docker_id()
    ctr = runc_container(ContainerSpec("k8s_idle", docker_cgroupfs_path(cid), unified=True,
                                       devices=[("c", 195, 1, "rw"), ("c", 195, 255, "rw")]))
    state = tmp_path / "rootfs" / "var" / "lib" / "docker" / "containers" / cid
    state.mkdir(parents=True)
    (state / "config.v2.json").write_text(json.dumps({"Name": "/k8s_trainer_trainer-0_ml", "Config": {
        "Image": "nvcr.io/nvidia/pytorch:24.05-py3", "Labels": {
            "io.kubernetes.pod.name": "trainer-0", "io.kubernetes.pod.namespace": "ml",
            "io.kubernetes.container.name": "trainer"}}}))
    sock = tmp_path / "kubelet.sock"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_PodResourcesListerServicer_to_server(_Kubelet(), server)
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    config = tmp_path / "config.toml"
    config.write_text(f'[kubernetes]\npod_resources_socket = "{sock}"\n')
    replay = two_gpu_scenario(tmp_path, fixtures_dir, (GPU0, GPU1), {})
    args = ("--config", str(config), "--cgroup-root", str(v2_root), "--rootfs", str(tmp_path / "rootfs"),
            "--nvml-replay", str(replay))
    try:
        rows = {r["cgroup"]: r for r in json.loads(_cli("containers", "--json", *args).stdout)}
        text = _cli("dump", *args).stdout
    finally:
        server.stop(grace=None).wait(5)
    row = rows[ctr.cgroups_path]
    assert (row["pod"], row["namespace"]) == ("trainer-0", "ml")
    assert [(d["uuid"], d["attribution"]) for d in row["devices"]] == [(GPU1, "kubelet")]
    processes = {(s.labels["pod"], s.labels["container"], s.labels["uuid"], s.labels["attribution"]): s.value
                 for f in text_string_to_metric_families(text) if f.name == "accelstats_container_gpu_processes"
                 for s in f.samples if s.labels["id"] == ctr.cgroups_path}
    assert processes == {("trainer-0", "trainer", GPU1, "kubelet"): 0.0}  # allocated and idle
