"""Container metadata from runtime state files (accelstats.attribution.metadata): one case per runtime, absent and
malformed files, the cache, the rootfs prefix."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accelstats.attribution.containers import ContainerMetadata
from accelstats.attribution.metadata import (
    MAX_FILE_BYTES,
    MAX_OTHER_NAMESPACES,
    REFRESH_SECONDS,
    MetadataReader,
)
from accelstats.cgroups.identity import ContainerIdentity

ID = "3f4e9c0b8a1d2e7f6c5b4a3928172635445362718190a0b1c2d3e4f5a6b7c8d9"
ID2 = "0" * 63 + "1"
ID3 = "0" * 63 + "2"
SANDBOX = "9" * 64
POD_UID = "6f1a9d52-0b3c-4e8d-9a7f-2c1b0e4d5f60"
ALLOC = "8d0e3b5c-1f2a-4b6c-9d8e-7f6a5b4c3d2e"
IMAGE_ID = "5ef79149e0ec84a7a9f9284c3f91aa3c20608f8391f5445eabe92ef07dbda03c"

DOCKER = "var/lib/docker/containers/{id}/config.v2.json"
TASK = "run/containerd/io.containerd.runtime.v2.task/{ns}/{id}/config.json"
CRIO_LIB = "var/lib/containers/storage/overlay-containers/{id}/userdata/config.json"
CRIO_RUN = "run/containers/storage/overlay-containers/{id}/userdata/config.json"
STORAGE = "var/lib/containers/storage/overlay-containers/containers.json"
STORAGE_VOLATILE = "var/lib/containers/storage/overlay-containers/volatile-containers.json"
STORAGE_RUN_VOLATILE = "run/containers/storage/overlay-containers/volatile-containers.json"


# -- realistic documents ----------------------------------------------------------------------------


def docker_config(name: str, image: str, labels: dict[str, str] | None = None, cid: str = ID) -> dict[str, Any]:
    """The shape of dockerd's config.v2.json (trimmed)."""
    return {
        "StreamConfig": {},
        "State": {"Running": True, "Paused": False, "Pid": 4242, "ExitCode": 0,
                  "StartedAt": "2024-06-01T10:00:00.123456789Z", "Health": None},
        "ID": cid,
        "Created": "2024-06-01T09:59:59.987654321Z",
        "Managed": False,
        "Path": "/docker-entrypoint.sh",
        "Args": ["nginx", "-g", "daemon off;"],
        "Config": {
            "Hostname": cid[:12], "Domainname": "", "User": "", "Tty": False,
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "NGINX_VERSION=1.27.0"],
            "Cmd": ["nginx", "-g", "daemon off;"],
            "Image": image,
            "Volumes": None, "WorkingDir": "", "Entrypoint": ["/docker-entrypoint.sh"], "OnBuild": None,
            "Labels": labels if labels is not None else {},
            "StopSignal": "SIGQUIT",
        },
        "Image": "sha256:" + IMAGE_ID,
        "NetworkSettings": {"Bridge": "", "SandboxID": "", "Networks": {}},
        "LogPath": f"/var/lib/docker/containers/{cid}/{cid}-json.log",
        "Name": name,
        "Driver": "overlay2",
        "RestartCount": 0,
    }


def oci_spec(annotations: dict[str, str]) -> dict[str, Any]:
    """The shape of an OCI runtime-spec config.json (trimmed)."""
    return {
        "ociVersion": "1.1.0",
        "process": {"user": {"uid": 0, "gid": 0}, "args": ["python", "train.py"],
                    "env": ["PATH=/usr/bin:/bin", "NVIDIA_VISIBLE_DEVICES=GPU-1"], "cwd": "/workspace"},
        "root": {"path": "rootfs"},
        "hostname": "",
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
        "annotations": annotations,
        "linux": {"resources": {"devices": [{"allow": False, "access": "rwm"}]},
                  "cgroupsPath": f"kubepods-besteffort-pod{POD_UID.replace('-', '_')}.slice:cri-containerd:{ID}",
                  "namespaces": [{"type": "pid"}, {"type": "mount"}]},
    }


CRI_ANNOTATIONS = {
    "io.kubernetes.cri.container-type": "container",
    "io.kubernetes.cri.container-name": "trainer",
    "io.kubernetes.cri.image-name": "nvcr.io/nvidia/pytorch:24.05-py3",
    "io.kubernetes.cri.sandbox-id": SANDBOX,
    "io.kubernetes.cri.sandbox-name": "train-6c9f8d7b5-x2x4q",
    "io.kubernetes.cri.sandbox-namespace": "ml",
    "io.kubernetes.cri.sandbox-uid": POD_UID,
}

CRIO_ANNOTATIONS = {
    "io.container.manager": "cri-o",
    "io.kubernetes.container.hash": "3c2a9e5b",
    "io.kubernetes.container.name": "infer",
    "io.kubernetes.cri-o.ContainerID": ID,
    "io.kubernetes.cri-o.ContainerType": "container",
    "io.kubernetes.cri-o.Created": "2024-06-01T10:00:00.000000000Z",
    "io.kubernetes.cri-o.Image": "vllm/vllm-openai:v0.5.0",
    "io.kubernetes.cri-o.ImageName": "docker.io/vllm/vllm-openai:v0.5.0",
    "io.kubernetes.cri-o.ImageRef": "docker.io/vllm/vllm-openai@sha256:" + IMAGE_ID,
    "io.kubernetes.cri-o.Labels": json.dumps({"io.kubernetes.container.name": "infer",
                                              "io.kubernetes.pod.name": "llm-0",
                                              "io.kubernetes.pod.namespace": "serving",
                                              "io.kubernetes.pod.uid": POD_UID}),
    "io.kubernetes.cri-o.Name": f"k8s_infer_llm-0_serving_{POD_UID}_0",
    "io.kubernetes.cri-o.SandboxID": SANDBOX,
    "io.kubernetes.cri-o.SandboxName": f"k8s_llm-0_serving_{POD_UID}_0",
    "io.kubernetes.pod.name": "llm-0",
    "io.kubernetes.pod.namespace": "serving",
    "io.kubernetes.pod.uid": POD_UID,
}

PODMAN_SPEC_ANNOTATIONS = {  # what podman writes: no name, no image name
    "io.container.manager": "libpod",
    "io.kubernetes.cri-o.Created": "2024-06-01T10:00:00.000000000Z",
    "io.kubernetes.cri-o.TTY": "false",
    "io.podman.annotations.autoremove": "FALSE",
    "io.podman.annotations.init": "FALSE",
    "io.podman.annotations.privileged": "FALSE",
    "io.podman.annotations.publish-all": "FALSE",
    "org.opencontainers.image.stopSignal": "3",
}


def storage_entry(cid: str, name: str, image_name: str) -> dict[str, Any]:
    """One entry of containers/storage's containers.json, as podman writes it."""
    meta = {"image-name": image_name, "image-id": IMAGE_ID, "name": name, "created-at": 1717236000}
    return {
        "id": cid, "names": [name], "image": IMAGE_ID, "layer": "a" * 64,
        "metadata": json.dumps(meta), "created": "2024-06-01T10:00:00.000000000Z",
        "flags": {"MountLabel": "", "ProcessLabel": ""},
    }


K8S_DOCKER_LABELS = {
    "annotation.io.kubernetes.container.hash": "8e2a3f1c",
    "io.kubernetes.container.logpath": f"/var/log/pods/ml_train-0_{POD_UID}/cuda/0.log",
    "io.kubernetes.container.name": "cuda",
    "io.kubernetes.docker.type": "container",
    "io.kubernetes.pod.name": "train-0",
    "io.kubernetes.pod.namespace": "ml",
    "io.kubernetes.pod.uid": POD_UID,
    "io.kubernetes.sandbox.id": SANDBOX,
}


# -- helpers ----------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def write(root: Path, rel: str, doc: Any) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(doc, bytes):
        path.write_bytes(doc)
    else:
        path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def ident(runtime: str, cid: str = ID, **kw: str) -> ContainerIdentity:
    return ContainerIdentity(runtime=runtime, id=cid, **kw)


# -- one case per runtime ---------------------------------------------------------------------------

CASES: list[tuple[str, ContainerIdentity, dict[str, Any], ContainerMetadata]] = [
    ("docker", ident("docker"),
     {DOCKER.format(id=ID): docker_config("/web-1", "nginx:1.27", {"com.docker.compose.service": "web"})},
     ContainerMetadata(name="web-1", image="nginx:1.27")),
    ("docker, dockershim labels", ident("docker", pod_uid=POD_UID),
     {DOCKER.format(id=ID): docker_config(f"/k8s_cuda_train-0_ml_{POD_UID}_0", "nvidia/cuda:12.4.1-base-ubuntu22.04",
                                          K8S_DOCKER_LABELS)},
     ContainerMetadata(name=f"k8s_cuda_train-0_ml_{POD_UID}_0", image="nvidia/cuda:12.4.1-base-ubuntu22.04",
                       container="cuda", pod="train-0", namespace="ml")),
    ("docker, Labels null", ident("docker"),
     {DOCKER.format(id=ID): {**docker_config("/db", "postgres:16"),
                             "Config": {"Image": "postgres:16", "Labels": None}}},
     ContainerMetadata(name="db", image="postgres:16")),
    ("containerd, Kubernetes (k8s.io)", ident("containerd", pod_uid=POD_UID),
     {TASK.format(ns="k8s.io", id=ID): oci_spec(CRI_ANNOTATIONS)},
     ContainerMetadata(name=ID, image="nvcr.io/nvidia/pytorch:24.05-py3", container="trainer",
                       pod="train-6c9f8d7b5-x2x4q", namespace="ml")),
    ("containerd, io.kubernetes.* annotations only", ident("containerd"),
     {TASK.format(ns="k8s.io", id=ID): oci_spec({"io.kubernetes.pod.name": "p", "io.kubernetes.pod.namespace": "n",
                                                 "io.kubernetes.container.name": "c"})},
     ContainerMetadata(name=ID, container="c", pod="p", namespace="n")),
    ("containerd, not Kubernetes (default namespace)", ident("containerd"),
     {TASK.format(ns="default", id=ID): oci_spec({})},
     ContainerMetadata(name=ID)),
    ("containerd, another namespace", ident("containerd"),
     {TASK.format(ns="buildkit", id=ID): oci_spec({})},
     ContainerMetadata(name=ID)),
    ("containerd identity, cri-dockerd with cgroupfs", ident("containerd", pod_uid=POD_UID),
     {DOCKER.format(id=ID): docker_config(f"/k8s_cuda_train-0_ml_{POD_UID}_0", "cuda:12", K8S_DOCKER_LABELS)},
     ContainerMetadata(name=f"k8s_cuda_train-0_ml_{POD_UID}_0", image="cuda:12", container="cuda", pod="train-0",
                       namespace="ml")),
    ("cri-o, /var/lib", ident("cri-o", pod_uid=POD_UID),
     {CRIO_LIB.format(id=ID): oci_spec(CRIO_ANNOTATIONS)},
     ContainerMetadata(name=f"k8s_infer_llm-0_serving_{POD_UID}_0", image="docker.io/vllm/vllm-openai:v0.5.0",
                       container="infer", pod="llm-0", namespace="serving")),
    ("cri-o, /run only, labels only in io.kubernetes.cri-o.Labels", ident("cri-o"),
     {CRIO_RUN.format(id=ID): oci_spec({k: v for k, v in CRIO_ANNOTATIONS.items()
                                        if not k.startswith(("io.kubernetes.pod.", "io.kubernetes.container."))
                                        and k != "io.kubernetes.cri-o.ImageName"})},
     ContainerMetadata(name=f"k8s_infer_llm-0_serving_{POD_UID}_0", image="vllm/vllm-openai:v0.5.0",
                       container="infer", pod="llm-0", namespace="serving")),
    ("cri-o, storage index only", ident("cri-o"),
     {STORAGE: [storage_entry(ID, f"k8s_infer_llm-0_serving_{POD_UID}_0", "docker.io/vllm/vllm-openai:v0.5.0")]},
     ContainerMetadata(name=f"k8s_infer_llm-0_serving_{POD_UID}_0", image="docker.io/vllm/vllm-openai:v0.5.0")),
    ("podman, containers.json", ident("podman"),
     {STORAGE: [storage_entry(ID2, "other", "docker.io/library/redis:7"),
                storage_entry(ID, "jupyter", "quay.io/jupyter/pytorch-notebook:cuda12-latest")],
      CRIO_RUN.format(id=ID): oci_spec(PODMAN_SPEC_ANNOTATIONS)},
     ContainerMetadata(name="jupyter", image="quay.io/jupyter/pytorch-notebook:cuda12-latest")),
    ("podman --rm, volatile-containers.json", ident("podman"),
     {STORAGE: [storage_entry(ID2, "other", "docker.io/library/redis:7")],
      STORAGE_VOLATILE: [storage_entry(ID, "scratch", "docker.io/library/alpine:3.20")]},
     ContainerMetadata(name="scratch", image="docker.io/library/alpine:3.20")),
    ("podman, transient store", ident("podman"),
     {STORAGE_RUN_VOLATILE: [storage_entry(ID, "ephemeral", "registry.fedoraproject.org/fedora:40")]},
     ContainerMetadata(name="ephemeral", image="registry.fedoraproject.org/fedora:40")),
    ("nomad", ident("nomad", cid=f"{ALLOC}.train", alloc_id=ALLOC, task="train"), {},
     ContainerMetadata(name="train")),
    ("lxc", ident("lxc", cid="web01", name="web01"), {}, ContainerMetadata(name="web01")),
    ("systemd-nspawn", ident("systemd-nspawn", cid="debian-12", name="debian-12"), {},
     ContainerMetadata(name="debian-12")),
]


@pytest.mark.parametrize(("identity", "files", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_runtime(tmp_path: Path, identity: ContainerIdentity, files: dict[str, Any],
                 expected: ContainerMetadata) -> None:
    for rel, doc in files.items():
        write(tmp_path, rel, doc)
    reader = MetadataReader(tmp_path)
    assert reader.lookup(identity) == expected
    assert reader.errors == 0


@pytest.mark.parametrize(("identity", "files", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_absent_files_give_the_identity(tmp_path: Path, identity: ContainerIdentity, files: dict[str, Any],
                                        expected: ContainerMetadata) -> None:
    reader = MetadataReader(tmp_path)
    assert reader.lookup(identity) == ContainerMetadata(name=identity.name or identity.task)
    assert reader.errors == 0


def test_rootfs_prefix(tmp_path: Path) -> None:
    host = tmp_path / "host"
    write(host, DOCKER.format(id=ID), docker_config("/under-host", "nginx:1.27"))
    write(tmp_path, DOCKER.format(id=ID), docker_config("/not-under-host", "nginx:1.27"))
    assert MetadataReader(host).lookup(ident("docker")).name == "under-host"
    assert MetadataReader(tmp_path / "elsewhere").lookup(ident("docker")) == ContainerMetadata()


def test_default_rootfs_is_slash() -> None:
    assert MetadataReader().rootfs == Path("/")


# -- containerd namespaces ----------------------------------------------------------------------------


def test_containerd_namespace_order(tmp_path: Path) -> None:
    for ns, image in (("aaa", "a"), ("default", "default"), ("moby", "moby"), ("k8s.io", "k8s")):
        write(tmp_path, TASK.format(ns=ns, id=ID), oci_spec({"io.kubernetes.cri.image-name": image}))
    assert MetadataReader(tmp_path).lookup(ident("containerd")).image == "k8s"
    (tmp_path / TASK.format(ns="k8s.io", id=ID)).unlink()
    assert MetadataReader(tmp_path).lookup(ident("containerd")).image == "moby"
    (tmp_path / TASK.format(ns="moby", id=ID)).unlink()
    assert MetadataReader(tmp_path).lookup(ident("containerd")).image == "default"
    (tmp_path / TASK.format(ns="default", id=ID)).unlink()
    assert MetadataReader(tmp_path).lookup(ident("containerd")).image == "a"


def test_containerd_other_namespaces_are_bounded(tmp_path: Path) -> None:
    names = [f"ns{i:02d}" for i in range(MAX_OTHER_NAMESPACES + 1)]
    for ns in names:
        (tmp_path / TASK.format(ns=ns, id=ID)).parent.parent.mkdir(parents=True, exist_ok=True)
    write(tmp_path, TASK.format(ns=names[-1], id=ID), oci_spec({"io.kubernetes.cri.image-name": "late"}))
    assert MetadataReader(tmp_path).lookup(ident("containerd")) == ContainerMetadata()
    write(tmp_path, TASK.format(ns=names[MAX_OTHER_NAMESPACES - 1], id=ID),
          oci_spec({"io.kubernetes.cri.image-name": "in bound"}))
    assert MetadataReader(tmp_path).lookup(ident("containerd")).image == "in bound"


# -- malformed and odd files --------------------------------------------------------------------------

MALFORMED: list[tuple[str, bytes]] = [
    ("syntax", b'{"Name": "/web-1", "Config": {'),
    ("empty", b""),
    ("not an object", b'["/web-1"]'),
    ("not UTF-8", b'{"Name": "/\xff\xfe"}'),
    ("nested too deep", b"[" * 200_000 + b"]" * 200_000),
    ("too large", b'{"Name": "/big", "Pad": "' + b"x" * MAX_FILE_BYTES + b'"}'),
]


@pytest.mark.parametrize("content", [m[1] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_docker_config(tmp_path: Path, content: bytes) -> None:
    write(tmp_path, DOCKER.format(id=ID), content)
    reader = MetadataReader(tmp_path)
    assert reader.lookup(ident("docker")) == ContainerMetadata()
    assert reader.errors == 1


def test_malformed_is_logged_once_per_file_and_retried(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    path = write(tmp_path, DOCKER.format(id=ID), "{not json")
    write(tmp_path, TASK.format(ns="k8s.io", id=ID2), "{not json either")
    reader = MetadataReader(tmp_path, clock=clock)
    with caplog.at_level(logging.DEBUG, logger="accelstats.attribution.metadata"):
        for _ in range(3):
            assert reader.lookup(ident("docker")) == ContainerMetadata()
            assert reader.lookup(ident("containerd", cid=ID2)) == ContainerMetadata()
            clock.now += REFRESH_SECONDS + 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert {str(path) in r.getMessage() for r in warnings} == {True, False}
    assert reader.errors == 6  # every re-read (once per interval) counts
    path.write_text(json.dumps(docker_config("/fixed", "nginx:1.27")))
    clock.now += REFRESH_SECONDS + 1
    assert reader.lookup(ident("docker")).name == "fixed"


def test_malformed_storage_index(tmp_path: Path) -> None:
    write(tmp_path, STORAGE, {"id": ID})  # an object, not a list
    write(tmp_path, STORAGE_VOLATILE, "[{")
    reader = MetadataReader(tmp_path)
    assert reader.lookup(ident("podman")) == ContainerMetadata()
    assert reader.errors == 2
    # unchanged files are not parsed (nor counted) again
    assert reader.lookup(ident("podman", cid=ID2)) == ContainerMetadata()
    assert reader.errors == 2


def test_odd_shapes_are_ignored_not_counted(tmp_path: Path) -> None:
    write(tmp_path, DOCKER.format(id=ID), {"Name": 7, "Config": "nginx", "Labels": {"io.kubernetes.pod.name": "x"}})
    write(tmp_path, TASK.format(ns="k8s.io", id=ID), {"annotations": ["io.kubernetes.cri.image-name"]})
    write(tmp_path, CRIO_LIB.format(id=ID),
          {"annotations": {"io.kubernetes.cri-o.Name": None, "io.kubernetes.cri-o.Labels": "{oops",
                           "io.kubernetes.pod.name": 3}})
    write(tmp_path, STORAGE, [None, 7, {"id": 5}, {"id": ID, "names": [None], "metadata": "{oops"}])
    reader = MetadataReader(tmp_path)
    for runtime in ("docker", "cri-o", "podman"):
        assert reader.lookup(ident(runtime)) == ContainerMetadata()
    assert reader.lookup(ident("containerd")) == ContainerMetadata(name=ID)
    assert reader.errors == 0


def test_directory_and_fifo_are_not_read(tmp_path: Path) -> None:
    (tmp_path / DOCKER.format(id=ID)).mkdir(parents=True)
    fifo = tmp_path / TASK.format(ns="k8s.io", id=ID)
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)  # opening a FIFO for reading without O_NONBLOCK would hang
    reader = MetadataReader(tmp_path)
    assert reader.lookup(ident("docker")) == ContainerMetadata()
    assert reader.lookup(ident("containerd")) == ContainerMetadata()
    assert reader.errors == 0


def test_unreadable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, DOCKER.format(id=ID), docker_config("/secret", "nginx"))
    real_open = os.open

    def denying_open(p: Any, *args: Any, **kw: Any) -> int:
        if str(p) == str(path):
            raise PermissionError(13, "Permission denied", str(p))
        return real_open(p, *args, **kw)

    monkeypatch.setattr(os, "open", denying_open)  # mode 000 would not stop root, who runs CI here
    reader = MetadataReader(tmp_path)
    assert reader.lookup(ident("docker")) == ContainerMetadata()
    assert reader.errors == 0


@pytest.mark.parametrize("cid", ["../../../../etc", "a/b", "..", ".", "", "x" * 200])
def test_unsafe_ids_are_not_looked_up(tmp_path: Path, cid: str) -> None:
    write(tmp_path, "etc/config.v2.json", docker_config("/escaped", "x"))  # where ../../../../etc leads
    write(tmp_path, DOCKER.format(id="a/b"), docker_config("/nested", "x"))
    reader = MetadataReader(tmp_path)
    for runtime in ("docker", "containerd", "cri-o", "podman"):
        assert reader.lookup(ident(runtime, cid=cid)) == ContainerMetadata()


def test_unknown_runtime(tmp_path: Path) -> None:
    assert MetadataReader(tmp_path).lookup(ident("rkt", name="x")) == ContainerMetadata(name="x")


def test_max_entries_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_entries"):
        MetadataReader(max_entries=0)


# -- the cache ----------------------------------------------------------------------------------------


def test_found_file_is_read_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, DOCKER.format(id=ID), docker_config("/web-1", "nginx:1.27"))
    opened: list[str] = []
    real_open = os.open

    def counting_open(p: Any, *args: Any, **kw: Any) -> int:
        opened.append(str(p))
        return real_open(p, *args, **kw)

    monkeypatch.setattr(os, "open", counting_open)
    clock = FakeClock()
    reader = MetadataReader(tmp_path, clock=clock)
    first = reader.lookup(ident("docker"))
    path.write_text(json.dumps(docker_config("/renamed", "nginx:1.27")))
    clock.now += 10 * REFRESH_SECONDS
    for _ in range(5):
        assert reader.lookup(ident("docker")) == first == ContainerMetadata(name="web-1", image="nginx:1.27")
    assert opened.count(str(path)) == 1


def test_miss_is_reread_after_the_interval(tmp_path: Path) -> None:
    clock = FakeClock()
    reader = MetadataReader(tmp_path, clock=clock)
    assert reader.lookup(ident("containerd")) == ContainerMetadata()
    write(tmp_path, TASK.format(ns="k8s.io", id=ID), oci_spec(CRI_ANNOTATIONS))
    clock.now += REFRESH_SECONDS - 1
    assert reader.lookup(ident("containerd")) == ContainerMetadata()
    clock.now += 2
    assert reader.lookup(ident("containerd")).pod == "train-6c9f8d7b5-x2x4q"


def test_storage_index_reparsed_when_it_changes(tmp_path: Path) -> None:
    clock = FakeClock()
    write(tmp_path, STORAGE, [storage_entry(ID2, "first", "alpine")])
    reader = MetadataReader(tmp_path, clock=clock)
    assert reader.lookup(ident("podman", cid=ID2)).name == "first"
    assert reader.lookup(ident("podman")) == ContainerMetadata()
    write(tmp_path, STORAGE, [storage_entry(ID2, "first", "alpine"), storage_entry(ID, "second", "busybox:1.36")])
    clock.now += REFRESH_SECONDS + 1
    assert reader.lookup(ident("podman")) == ContainerMetadata(name="second", image="busybox:1.36")


def test_cache_is_bounded_least_recently_used_first(tmp_path: Path) -> None:
    for cid, name in ((ID, "a"), (ID2, "b"), (ID3, "c")):
        write(tmp_path, DOCKER.format(id=cid), docker_config(f"/{name}", "img", cid=cid))
    reader = MetadataReader(tmp_path, max_entries=2)
    assert reader.lookup(ident("docker", cid=ID)).name == "a"
    assert reader.lookup(ident("docker", cid=ID2)).name == "b"
    assert reader.lookup(ident("docker", cid=ID)).name == "a"  # ID is now the most recently used
    assert reader.lookup(ident("docker", cid=ID3)).name == "c"  # drops ID2
    for cid, name in ((ID, "a2"), (ID2, "b2"), (ID3, "c2")):
        write(tmp_path, DOCKER.format(id=cid), docker_config(f"/{name}", "img", cid=cid))
    assert reader.lookup(ident("docker", cid=ID)).name == "a"
    assert reader.lookup(ident("docker", cid=ID3)).name == "c"
    assert reader.lookup(ident("docker", cid=ID2)).name == "b2"


def test_a_cache_fitted_to_the_hosts_containers_reads_each_state_file_once(tmp_path: Path) -> None:
    """Issue 29: a host with more containers than the cache holds read every state file at every scrape
    (each collection emptied the cache in turn); ``fit`` (the attributor calls it with the containers
    listed) keeps them all, and never shrinks below the size the reader was made with."""
    ids = [f"{n:064x}" for n in range(1, 7)]
    for n, cid in enumerate(ids):
        write(tmp_path, DOCKER.format(id=cid), docker_config(f"/c{n}", "img", cid=cid))
    reader = MetadataReader(tmp_path, max_entries=2)
    reader.fit(len(ids))
    assert reader.max_entries == 7  # six and a quarter more
    assert [reader.lookup(ident("docker", cid=cid)).name for cid in ids] == [f"c{n}" for n in range(6)]
    for cid in ids:  # a second collection is served from the cache: what the files say now is not read
        write(tmp_path, DOCKER.format(id=cid), docker_config("/renamed", "img", cid=cid))
    assert [reader.lookup(ident("docker", cid=cid)).name for cid in ids] == [f"c{n}" for n in range(6)]
    reader.fit(1)
    assert reader.max_entries == 2


def test_cache_key_includes_runtime(tmp_path: Path) -> None:
    write(tmp_path, DOCKER.format(id=ID), docker_config("/docker-one", "img"))
    write(tmp_path, STORAGE, [storage_entry(ID, "podman-one", "img2")])
    reader = MetadataReader(tmp_path)
    assert reader.lookup(ident("docker")).name == "docker-one"
    assert reader.lookup(ident("podman")).name == "podman-one"


# -- never raises ---------------------------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["Name", "Config", "Image", "Labels", "annotations", "id", "names", "metadata",
                         "io.kubernetes.pod.name", "io.kubernetes.cri.image-name", "io.kubernetes.cri-o.Labels"]),
        inner, max_size=5),
    max_leaves=20,
)


@settings(max_examples=60, deadline=None)
@given(doc=_json)
def test_any_json_gives_strings_and_never_raises(doc: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for rel in (DOCKER.format(id=ID), TASK.format(ns="k8s.io", id=ID), CRIO_LIB.format(id=ID), STORAGE):
            write(root, rel, doc)
        reader = MetadataReader(root)
        for runtime in ("docker", "containerd", "cri-o", "podman"):
            md = reader.lookup(ident(runtime))
            assert all(isinstance(getattr(md, f), str) for f in ("name", "image", "container", "pod", "namespace"))
