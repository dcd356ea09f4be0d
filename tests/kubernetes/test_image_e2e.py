"""deploy/Dockerfile built with the real docker and run as deploy/kubernetes/daemonset.yaml runs it, beside real
containers named as Kubernetes containers and a stand-in kubelet: scraped, it names the pods, the kubelet's
allocations and the GPU use the kubelet did not allocate.

What is real:

* the image: docs/deploy.md's ``docker build -f deploy/Dockerfile --build-arg BASE=… --build-arg
  PIP_OPTS="--no-index --find-links /tmp/dist"`` (Debian's ``docker.io``: a ``dockerd`` with its state in a
  temporary directory, BuildKit, so deploy/Dockerfile.dockerignore picks the context) in a copy of this
  checkout's files, whose ``dist/`` holds the wheel ``pip wheel --no-deps -w dist .`` builds there and wheels
  of the pins of systemd/constraints.txt; the base is made from Debian's packages (``debootstrap
  --variant=minbase --include=python3,python3-venv bookworm``, ``docker import``ed: no registry image is
  reachable from CI). The base tar and the dependency wheels come from tests/support/e2e_image_cache.py's
  cache (made by .ci/run, or here when missing: a minute or two). The build has no network (``--network
  none``: the test's dockerd has no bridge, and pip needs no index);
* how it runs: ``docker run`` flags derived from the DaemonSet in the test (:func:`docker_run`): its
  ``args``, ``env``, every ``hostPath`` volume mounted read-only at its ``mountPath``, ``hostPID`` as
  ``--pid host``, the container's ``securityContext`` (``runAsUser`` as ``--user``, ``capabilities`` as
  ``--cap-drop``/``--cap-add``, ``readOnlyRootFilesystem`` as ``--read-only``, ``allowPrivilegeEscalation:
  false`` as ``no-new-privileges``, ``RuntimeDefault`` seccomp as docker's default profile), its memory limit;
  never ``--privileged``. A key the test does not know how to map fails the test;
* the containers: two tasks of a real ``containerd`` (``ctr run``, runc, cgroupfs) in the namespace ``k8s.io``
  with the ``io.kubernetes.cri.*`` annotations the CRI plugin writes, holding fake GPU device nodes (195:N);
* the kubelet's side: a gRPC server of the generated ``v1.PodResourcesLister``
  (accelstats/kubernetes/proto) on ``kubelet.sock`` in the host directory mounted at
  ``/var/lib/kubelet/pod-resources``, the exporter's default socket.

Substituted, because this host has no GPU, no Kubernetes and no TLS material for it:

* ``--nvml-replay=/replay/scenario.toml`` is added (a replay of the H200 capture, two GPUs, mounted read-only
  at ``/replay``), and ``runtimeClassName: nvidia`` (which would add ``/dev/nvidia*`` and
  ``libnvidia-ml.so.1``) is not applied;
* plain HTTP: ``--web-config`` is dropped and the ``web-config`` secret not mounted; the readiness probe's
  path is polled over HTTP;
* the ``hostPath`` ``/run/containerd/io.containerd.runtime.v2.task`` is that of the test's containerd (its
  state directory), and ``/var/lib/kubelet/pod-resources``, ``/etc/cdi`` and ``/var/run/cdi`` temporary
  directories (the CDI ones empty: no DRA claim here); ``/proc`` and
  ``/sys/fs/cgroup`` are the host's own;
* the pod network: the container gets a network namespace of its own (``--network none``) and is scraped from
  inside that namespace (``nsenter --net``), as Prometheus reaches a pod's address; ``resources.requests``
  have no ``docker run`` counterpart;
* the kubelet creating pods through CRI: ``ctr`` with the CRI plugin's annotations.

On cgroup v1 the containers' GPUs are found by their devices cgroup; on cgroup v2, with no CAP_SYS_ADMIN to
read device programs (as the DaemonSet runs), by the replay's processes, and the idle container's by the
kubelet's allocation alone.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from conftest import in_ci, require_tool
from prometheus_client.parser import text_string_to_metric_families
from support import e2e_image_cache
from support.runc_harness import cgroup_mounts
from support.runtimes_harness import Containerd, Docker, gpu_nodes
from support.scenarios_util import two_gpu_scenario

from accelstats.kubernetes.proto import podresources_pb2 as pb
from accelstats.kubernetes.proto import podresources_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[2]
DAEMONSET = REPO / "deploy" / "kubernetes" / "daemonset.yaml"
GPU0 = "GPU-00000000-2727-4000-8000-000000000000"
GPU1 = "GPU-00000001-2727-4000-8000-000000000001"
REPLAY_MOUNT = "/replay"

# securityContext and pod/container keys this test maps to docker run (or knowingly substitutes)
_POD_KEYS = {"hostPID", "runtimeClassName", "nodeSelector", "tolerations", "containers", "volumes"}
_CONTAINER_KEYS = {"name", "image", "args", "env", "ports", "readinessProbe", "securityContext", "resources",
                   "volumeMounts"}
_SECURITY_KEYS = {"runAsUser", "runAsNonRoot", "allowPrivilegeEscalation", "readOnlyRootFilesystem",
                  "capabilities", "seccompProfile", "privileged"}


def _fail_or_skip(reason: str) -> None:
    if in_ci():
        pytest.fail(f"cannot run under CI=true: {reason}", pytrace=False)
    pytest.skip(reason)


def load_daemonset() -> dict[str, Any]:
    """The DaemonSet object of deploy/kubernetes/daemonset.yaml."""
    docs = [d for d in yaml.safe_load_all(DAEMONSET.read_text()) if d]
    [ds] = [d for d in docs if d.get("kind") == "DaemonSet"]
    return dict(ds)


def _memory(quantity: str) -> str:
    """A Kubernetes memory quantity (``256Mi``) as docker's ``--memory`` (bytes)."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "": 1}
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|)", quantity)
    assert match, f"memory quantity {quantity!r} not handled"
    return str(int(match.group(1)) * units[match.group(2)])


def docker_run(ds: dict[str, Any], host_paths: dict[str, Path],
               replay: Path) -> tuple[list[str], list[str], dict[str, Any]]:
    """``(docker run flags, container args, readiness probe)`` for the DaemonSet's one container, as the module
    docstring says: ``host_paths`` maps a ``hostPath`` of the manifest to the directory this test uses for it
    (absent: the same path); ``replay`` is the host directory mounted at ``/replay``. Raises AssertionError on a
    key of the pod, container or securityContext this function does not map."""
    pod = ds["spec"]["template"]["spec"]
    assert set(pod) <= _POD_KEYS, f"pod spec keys not mapped to docker run: {set(pod) - _POD_KEYS}"
    [ctr] = pod["containers"]
    assert set(ctr) <= _CONTAINER_KEYS, f"container keys not mapped: {set(ctr) - _CONTAINER_KEYS}"
    sec = ctr.get("securityContext", {})
    assert set(sec) <= _SECURITY_KEYS, f"securityContext keys not mapped: {set(sec) - _SECURITY_KEYS}"
    assert not sec.get("privileged"), "the DaemonSet must not be privileged"
    flags = ["--network", "none"]
    if pod.get("hostPID"):
        flags += ["--pid", "host"]
    if "runAsUser" in sec:
        flags += ["--user", str(sec["runAsUser"])]
    caps = sec.get("capabilities", {})
    flags += [f for c in caps.get("drop", []) for f in ("--cap-drop", c)]
    flags += [f for c in caps.get("add", []) for f in ("--cap-add", c)]
    if sec.get("readOnlyRootFilesystem"):
        flags.append("--read-only")
    if sec.get("allowPrivilegeEscalation") is False:
        flags += ["--security-opt", "no-new-privileges"]
    seccomp = sec.get("seccompProfile", {}).get("type", "RuntimeDefault")
    assert seccomp == "RuntimeDefault", f"seccomp profile {seccomp} not mapped"  # docker's default profile
    limit = ctr.get("resources", {}).get("limits", {}).get("memory")
    if limit:
        flags += ["--memory", _memory(limit)]
    flags += [f for e in ctr.get("env", []) for f in ("-e", f"{e['name']}={e['value']}")]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in ctr.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "secret" in volume:
            continue  # the web config: plain HTTP here (module docstring)
        assert set(volume) == {"name", "hostPath"}, f"volume {volume} not mapped"
        assert mount.get("readOnly"), f"{mount['name']} is not mounted read-only"
        source = host_paths.get(volume["hostPath"]["path"], Path(volume["hostPath"]["path"]))
        flags += ["--mount", f"type=bind,source={source},target={mount['mountPath']},readonly"]
    flags += ["--mount", f"type=bind,source={replay},target={REPLAY_MOUNT},readonly"]
    args = [a for a in ctr["args"] if not a.startswith("--web-config")]
    args.append(f"--nvml-replay={REPLAY_MOUNT}/scenario.toml")
    probe = dict(ctr["readinessProbe"]["httpGet"])
    ports = {p["name"]: p["containerPort"] for p in ctr.get("ports", [])}
    probe["port"] = ports.get(probe["port"], probe["port"])
    return flags, args, probe


class _Kubelet(pb_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    def __init__(self, pods: list[pb.PodResources]) -> None:
        self.pods = pods

    def List(self, request: Any, context: Any) -> Any:  # noqa: N802
        return pb.ListPodResourcesResponse(pod_resources=self.pods)


def _pod(namespace: str, name: str, container: str, resource: str = "", *ids: str) -> pb.PodResources:
    devices = [pb.ContainerDevices(resource_name=resource, device_ids=list(ids))] if ids else []
    return pb.PodResources(namespace=namespace, name=name,
                           containers=[pb.ContainerResources(name=container, devices=devices)])


def _cri_annotations(namespace: str, pod: str, container: str) -> dict[str, str]:
    """The annotations containerd's CRI plugin writes into a container's OCI spec."""
    return {"io.kubernetes.cri.container-type": "container", "io.kubernetes.cri.container-name": container,
            "io.kubernetes.cri.sandbox-name": pod, "io.kubernetes.cri.sandbox-namespace": namespace,
            "io.kubernetes.cri.sandbox-id": secrets.token_hex(32)}


def _checkout_copy(dest: Path) -> None:
    """Copy this checkout's files as a fresh clone has them (``git ls-files``: tracked, and untracked ones git
    does not ignore; no ``.venv``, ``build``, caches) to ``dest``."""
    proc = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                          capture_output=True, timeout=60, check=False)
    if proc.returncode != 0:
        _fail_or_skip(f"not a git checkout, cannot tell its files from build outputs: {proc.stderr.decode()[-300:]}")
    for rel in filter(None, proc.stdout.decode().split("\0")):
        source = REPO / rel
        if source.is_file():  # a file deleted but not yet committed is listed too
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / rel, follow_symlinks=False)


def _build_context(ctx: Path) -> None:
    """``ctx``: a copy of the checkout with ``dist/`` holding its wheel (docs/deploy.md's ``pip wheel -q
    --no-deps -w dist .``, run in the copy) and the cached wheels of systemd/constraints.txt; the build sends
    only what deploy/Dockerfile.dockerignore lets through."""
    _checkout_copy(ctx)
    try:
        wheels = e2e_image_cache.dependency_wheels(ctx / "systemd" / "constraints.txt")
    except (e2e_image_cache.CacheError, OSError) as exc:
        _fail_or_skip(f"dependency wheels for the image: {exc}")
        raise
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps",
                           "-w", "dist", "."], cwd=ctx, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for wheel in wheels.glob("*.whl"):
        shutil.copy2(wheel, ctx / "dist" / wheel.name)


def _http(pid: int, port: int, path: str) -> tuple[int, str]:
    """GET ``http://127.0.0.1:<port><path>`` from inside the network namespace of ``pid``: (status, body);
    status 0 when nothing answered."""
    code = ("import sys, urllib.request, urllib.error\n"
            "try:\n"
            "    r = urllib.request.urlopen(f'http://127.0.0.1:{sys.argv[1]}{sys.argv[2]}', timeout=10)\n"
            "    sys.stdout.write(f'{r.status}\\n' + r.read().decode())\n"
            "except urllib.error.HTTPError as e:\n"
            "    sys.stdout.write(f'{e.code}\\n')\n"
            "except OSError:\n"
            "    sys.stdout.write('0\\n')\n")
    proc = subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "--", sys.executable, "-c", code, str(port), path],
                          capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 0, proc.stderr
    status, _, body = proc.stdout.partition("\n")
    return int(status), body


def _series(text: str, family: str) -> list[dict[str, str]]:
    return [dict(s.labels, value=str(s.value)) for f in text_string_to_metric_families(text) if f.name == family
            for s in f.samples]


def _cgroup_v1_devices() -> bool:
    return any("devices" in m.controllers for m in cgroup_mounts())


class _Exporter:
    """The exporter's container: waits for its readiness path, then for a scrape that shows ``ready(text)``."""

    def __init__(self, docker: Docker, cid: str, probe: dict[str, Any]) -> None:
        self.docker, self.cid, self.probe = docker, cid, probe
        self.pid = int(docker.docker("inspect", "-f", "{{.State.Pid}}", cid))

    def _alive(self) -> None:
        state = self.docker.docker("inspect", "-f", "{{.State.Status}}", self.cid)
        if state != "running":
            raise AssertionError(f"the exporter's container is {state}: {self.docker.docker('logs', self.cid)}")

    def scrape_until(self, ready: Any, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        delay, text = 0.05, ""
        while time.monotonic() < deadline:
            self._alive()
            if _http(self.pid, self.probe["port"], self.probe["path"])[0] == 200:
                status, text = _http(self.pid, self.probe["port"], "/metrics")
                if status == 200 and ready(text):
                    return text
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        raise AssertionError(f"no scrape showed the containers within {timeout}s; last:\n{text[-3000:]}\n"
                             f"logs:\n{self.docker.docker('logs', self.cid)}")


@pytest.fixture
def runtimes() -> Iterator[tuple[Docker, Containerd]]:
    """A dockerd and a containerd, each with its state in a temporary directory."""
    for runtime in (Docker, Containerd):
        reason = runtime.unavailable()
        if reason:
            _fail_or_skip(reason)
    require_tool("nsenter", "util-linux")
    with Docker() as docker, Containerd() as containerd:
        yield docker, containerd


@pytest.mark.root
@pytest.mark.slow
def test_the_image_run_as_the_daemonset_names_pods_allocations_and_unallocated_use(
        runtimes: tuple[Docker, Containerd], tmp_path: Path, fixtures_dir: Path) -> None:
    docker, containerd = runtimes
    t0 = time.monotonic()
    try:
        base = e2e_image_cache.base_tar()
    except (e2e_image_cache.CacheError, OSError) as exc:
        _fail_or_skip(f"the image's Debian base: {exc}")
        raise
    t = secrets.token_hex(3)
    ctx = tmp_path / "context"
    with futures.ThreadPoolExecutor(max_workers=1) as pool:  # the import (I/O) beside the wheel's build (CPU)
        imported = pool.submit(docker.docker, "import", str(base), f"accelstats-e2e-base:{t}", timeout=180)
        _build_context(ctx)
        imported.result()
    image = f"accelstats-e2e:{t}"
    docker.docker("build", "-q", "--network", "none", "-f", str(ctx / "deploy" / "Dockerfile"), "--build-arg",
                  f"BASE=accelstats-e2e-base:{t}", "--build-arg", "PIP_OPTS=--no-index --find-links /tmp/dist",
                  "-t", image, str(ctx), env={"DOCKER_BUILDKIT": "1"}, timeout=300)
    built = time.monotonic() - t0

    # the workloads: pod trainer holds GPU 1 and runs nothing; pod sweep holds both GPUs (the
    # NVIDIA_VISIBLE_DEVICES=all bypass) and runs on both, but the kubelet allocated it a replica of GPU 0 only
    trainer, sweep, by_index = f"trainer-{t}", f"sweep-{t}", f"by-index-{t}"
    ids = {"trainer": secrets.token_hex(32), "sweep": secrets.token_hex(32)}
    with gpu_nodes([0, 1]) as nodes:
        containerd.run("k8s.io", ids["trainer"], nodes[1], nodes[255],
                       annotations=_cri_annotations("ml", trainer, "trainer"))
        sweep_pid = containerd.run("k8s.io", ids["sweep"], nodes[0], nodes[1], nodes[255],
                                   annotations=_cri_annotations("batch", sweep, "worker"))
    replay = tmp_path / "replay"
    (replay / "fixtures" / "h200").mkdir(parents=True)
    shutil.copy2(fixtures_dir / "h200" / "nvidia-smi-q.xml", replay / "fixtures" / "h200")
    scenario = two_gpu_scenario(replay, Path(REPLAY_MOUNT) / "fixtures", (GPU0, GPU1),
                                {GPU0: [(sweep_pid, 1 << 30)], GPU1: [(sweep_pid, 1 << 30)]})
    assert scenario == replay / "scenario.toml"

    pod_resources = tmp_path / "pod-resources"
    pod_resources.mkdir()
    cdi_etc, cdi_run = tmp_path / "cdi-etc", tmp_path / "cdi-run"  # DirectoryOrCreate: the kubelet would make them
    cdi_etc.mkdir()
    cdi_run.mkdir()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_PodResourcesListerServicer_to_server(_Kubelet([
        _pod("ml", trainer, "trainer", "nvidia.com/gpu", GPU1),
        _pod("batch", sweep, "worker", "nvidia.com/gpu.shared", f"{GPU0}::3"),
        _pod("batch", by_index, "main", "nvidia.com/gpu", "1"),
        _pod("kube-system", f"coredns-{t}", "coredns"),
    ]), server)
    server.add_insecure_port(f"unix://{pod_resources / 'kubelet.sock'}")
    server.start()
    try:
        flags, args, probe = docker_run(load_daemonset(), {
            "/run/containerd/io.containerd.runtime.v2.task": containerd.state / "io.containerd.runtime.v2.task",
            "/var/lib/kubelet/pod-resources": pod_resources,
            "/etc/cdi": cdi_etc, "/var/run/cdi": cdi_run,
        }, replay)
        assert "--privileged" not in flags
        cid = docker.docker("run", "-d", "--name", f"accelstats-{t}", *flags, image, *args)
        exporter = _Exporter(docker, cid, probe)
        mine = {f"/k8s.io/{i}" for i in ids.values()}

        def ready(text: str) -> bool:
            seen = {s["id"] for s in _series(text, "accelstats_container_info")}
            return mine <= seen and bool(_series(text, "accelstats_kubernetes_gpu_allocation"))

        text = exporter.scrape_until(ready)
        ran = time.monotonic() - t0 - built
    finally:
        server.stop(grace=None).wait(5)
    print(f"image built in {built:.1f}s, run and scraped in {ran:.1f}s")

    # the image, as the DaemonSet runs it
    inspect = json.loads(docker.docker("inspect", cid))[0]["HostConfig"]
    assert (inspect["Privileged"], inspect["ReadonlyRootfs"], inspect["PidMode"]) == (False, True, "host")
    assert sorted(inspect["CapAdd"]) == ["CAP_DAC_READ_SEARCH", "CAP_SYS_PTRACE"] \
        or sorted(inspect["CapAdd"]) == ["DAC_READ_SEARCH", "SYS_PTRACE"]
    assert [s["value"] for s in _series(text, "accelstats_kubernetes_pod_resources_up")] == ["1.0"]

    # the pods, named from containerd's state under --rootfs=/host
    info = {s["id"]: (s["namespace"], s["pod"], s["container"], s["name"], s["runtime"])
            for s in _series(text, "accelstats_container_info") if s["id"] in mine}
    assert info == {f"/k8s.io/{ids['trainer']}": ("ml", trainer, "trainer", ids["trainer"], "containerd"),
                    f"/k8s.io/{ids['sweep']}": ("batch", sweep, "worker", ids["sweep"], "containerd")}

    # the allocations, from the kubelet alone (only this test's kubelet feeds this family)
    assert {(s["namespace"], s["pod"], s["container"], s["resource"], s["uuid"], s["gpu"], s["replica"])
            for s in _series(text, "accelstats_kubernetes_gpu_allocation")} == {
        ("ml",    trainer,  "trainer", "nvidia.com/gpu",        GPU1, "1", ""),
        ("batch", sweep,    "worker",  "nvidia.com/gpu.shared", GPU0, "0", "3"),
        ("batch", by_index, "main",    "nvidia.com/gpu",        GPU1, "1", ""),
    }  # fmt: skip

    # what each container uses, and how it was found
    found = "devices_cgroup" if _cgroup_v1_devices() else "process"
    idle = "devices_cgroup" if _cgroup_v1_devices() else "kubelet"
    processes = {(s["pod"], s["container"], s["uuid"], s["gpu"], s["attribution"]): s["value"]
                 for s in _series(text, "accelstats_container_gpu_processes") if s["id"] in mine}
    assert processes == {(trainer, "trainer", GPU1, "1", idle): "0.0",
                         (sweep, "worker", GPU0, "0", found): "1.0",
                         (sweep, "worker", GPU1, "1", found): "1.0"}

    # the use the kubelet did not allocate: sweep's GPU 1
    unallocated = {(s["namespace"], s["pod"], s["container"], s["uuid"], s["gpu"], s["attribution"], s["value"])
                   for s in _series(text, "accelstats_container_gpu_unallocated") if s["id"] in mine}
    assert unallocated == {("batch", sweep, "worker", GPU1, "1", found, "1.0")}


def test_docker_run_refuses_what_it_cannot_map() -> None:
    """The mapping fails on a key it does not know rather than run something else than the manifest says."""
    ds = load_daemonset()
    ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]["procMount"] = "Unmasked"
    with pytest.raises(AssertionError, match="procMount"):
        docker_run(ds, {}, Path("/nonexistent"))
    ds = load_daemonset()
    ds["spec"]["template"]["spec"]["hostNetwork"] = True
    with pytest.raises(AssertionError, match="hostNetwork"):
        docker_run(ds, {}, Path("/nonexistent"))


def test_docker_run_flags_follow_the_daemonset() -> None:
    """What the e2e test runs, from the manifest: the capabilities, user, mounts and args it says."""
    flags, args, probe = docker_run(load_daemonset(), {"/var/lib/kubelet/pod-resources": Path("/tmp/pr")},
                                    Path("/tmp/replay"))
    joined = " ".join(flags)
    for expected in ("--pid host", "--user 0", "--cap-drop ALL", "--cap-add DAC_READ_SEARCH",
                     "--cap-add SYS_PTRACE", "--read-only", "--security-opt no-new-privileges",
                     "type=bind,source=/proc,target=/host/proc,readonly",
                     "type=bind,source=/sys/fs/cgroup,target=/host/sys/fs/cgroup,readonly",
                     "type=bind,source=/tmp/pr,target=/var/lib/kubelet/pod-resources,readonly"):
        assert expected in joined
    assert "--privileged" not in flags and "--cap-add SYS_ADMIN" not in joined
    assert args == ["serve", "--listen=:9847", "--proc-root=/host/proc", "--cgroup-root=/host/sys/fs/cgroup",
                    "--rootfs=/host", "--nvml-replay=/replay/scenario.toml"]
    assert (probe["path"], probe["port"]) == ("/healthz", 9847)

