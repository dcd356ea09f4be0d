"""The kubelet's allocations as attribution evidence, and GPU use the kubelet did not allocate
(accelstats/attribution/kubelet_evidence.py), read through the catalog's container families. The devices are the
replay's (dual_a5000-v13.xml, read by the real nvidia collector); the containers are what the attributor
gives on cgroup v2 without CAP_SYS_ADMIN (device programs unreadable: no ``devices_cgroup`` evidence)."""

from __future__ import annotations

from pathlib import Path

import pytest

from accelstats import catalog
from accelstats.attribution.containers import ContainerCollector, ContainerMetadata, ContainerStats, HostView
from accelstats.attribution.kubelet_evidence import add_allocations, allocated_keys, unallocated
from accelstats.manager import Collection, build_manager
from accelstats.settings import Settings
from collectors.model import KubeletAllocation, KubeletReading

GPU0, GPU1 = "GPU-12345678-aaaa-bbbb-cccc-0123456789ab", "GPU-12345678-aaaa-bbbb-cccc-0123456789cd"
POD_CGROUP = "/kubepods.slice/kubepods-pod0a1b2c3d.slice/cri-containerd-4f2a.scope"
OTHER_CGROUP = "/kubepods.slice/kubepods-pod9f8e7d6c.slice/cri-containerd-9c8b.scope"


@pytest.fixture
def view(tmp_path: Path, fixtures_dir: Path) -> HostView:
    manager = build_manager(Settings(nvml_replay=fixtures_dir / "public" / "dual_a5000-v13.xml", cgroup_root=tmp_path,
                                     proc_root=tmp_path, accounting_interval=0, collectors=("nvidia",)))
    return HostView(manager.collect().snapshot, by_container={})


def _container(cgroup: str, namespace: str, pod: str, name: str) -> ContainerStats:
    return ContainerStats(cgroup, None, ContainerMetadata(name=name, container=name, pod=pod, namespace=namespace))


def _using(view: HostView, container: ContainerStats, uuid: str, attribution: str) -> ContainerStats:
    device = next(d for d in view.snapshot.devices if d.uuid == uuid)
    container.accelerators.append(
        ContainerCollector(Path(container.cgroup), container.cgroup, view, devices_list=False).stats_for(
            device, attribution, device_open=True))
    return container


def _kubelet(*allocations: tuple[str, str, str, str]) -> KubeletReading:
    return KubeletReading(True, allocations=tuple(
        KubeletAllocation(ns, pod, container, uuid, "nvidia.com/gpu", uuid, "0" if uuid == GPU0 else "1")
        for ns, pod, container, uuid in allocations))


def _rows(family: catalog.Family, collection: Collection) -> set[tuple[str, ...]]:
    assert family.read is not None
    labels = family.labels
    return {tuple(dict(zip(labels, values, strict=True))[n] for n in ("pod", "container", "uuid", "attribution"))
            for values, _ in family.read(collection)}


def test_an_idle_allocated_container_is_listed_with_its_gpu(view: HostView) -> None:
    idle = _container(POD_CGROUP, "ml", "trainer-0", "trainer")  # no process, no open file: no evidence
    kubelet = _kubelet(("ml", "trainer-0", "trainer", GPU0))
    assert allocated_keys(kubelet) == {("ml", "trainer-0", "trainer")}  # the attributor keeps it
    add_allocations(idle, kubelet, view)
    collection = Collection(view.snapshot, containers=[idle], view=view)
    collection.snapshot.kubelet = kubelet
    assert _rows(catalog.CONTAINER_PROCESSES, collection) == {("trainer-0", "trainer", GPU0, "kubelet")}


def test_evidence_found_otherwise_is_kept(view: HostView) -> None:
    busy = _using(view, _container(POD_CGROUP, "ml", "trainer-0", "trainer"), GPU0, "process")
    add_allocations(busy, _kubelet(("ml", "trainer-0", "trainer", GPU0)), view)
    assert [(a.id, a.attribution) for a in busy.accelerators] == [(GPU0, "process")]


def test_no_kubelet_answer_adds_nothing(view: HostView) -> None:
    idle = _container(POD_CGROUP, "ml", "trainer-0", "trainer")
    failed = KubeletReading(False, "pod-resources List on x: no answer within 2 s")
    for reading in (failed, None):
        add_allocations(idle, reading, view)
        assert idle.accelerators == [] and allocated_keys(reading) == frozenset()


def test_a_container_the_runtime_does_not_name_gains_nothing(view: HostView) -> None:
    unnamed = _container(OTHER_CGROUP, "", "", "")
    add_allocations(unnamed, _kubelet(("ml", "trainer-0", "trainer", GPU0)), view)
    assert unnamed.accelerators == []


@pytest.mark.parametrize(("case", "allocations", "flagged"), [
    # case                               kubelet's allocations                              unallocated use
    ("allocated to it",                  [("ml", "trainer-0", "trainer", GPU1)],            set()),
    ("allocated to nobody",              [],                                                {GPU1}),
    ("allocated to another pod",         [("ml", "other-0", "trainer", GPU1)],              {GPU1}),
])  # fmt: skip
def test_use_without_allocation(view: HostView, case: str, allocations: list[tuple[str, str, str, str]],
                                flagged: set[str]) -> None:
    """A container using GPU 1 (NVIDIA_VISIBLE_DEVICES=all, a privileged pod, hostPath /dev)."""
    user = _using(view, _container(POD_CGROUP, "ml", "trainer-0", "trainer"), GPU1, "open_fd")
    kubelet = _kubelet(*allocations)
    assert {a.id for _, a in unallocated([user], kubelet)} == flagged, case
    collection = Collection(view.snapshot, containers=[user], view=view)
    collection.snapshot.kubelet = kubelet
    assert _rows(catalog.CONTAINER_UNALLOCATED, collection) == {("trainer-0", "trainer", u, "open_fd") for u in flagged}


def test_unallocated_needs_the_kubelets_answer(view: HostView) -> None:
    user = _using(view, _container(OTHER_CGROUP, "", "", "render"), GPU1, "devices_cgroup")
    assert list(unallocated([user], None)) == []
    assert list(unallocated([user], KubeletReading(False, "down"))) == []
    assert [a.id for _, a in unallocated([user], _kubelet())] == [GPU1]  # outside Kubernetes: no allocation


def test_a_mig_instance_allocated_covers_its_parent_gpus_open_node(view: HostView) -> None:
    """An open /dev/nvidia<m> names the MIG instance's parent GPU: not use without allocation."""
    user = _using(view, _container(POD_CGROUP, "ml", "notebook-7f9c", "jupyter"), GPU1, "open_fd")
    mig = KubeletReading(True, allocations=(KubeletAllocation(
        "ml", "notebook-7f9c", "jupyter", "MIG-0a0a0a0a-0000-1111-2222-333333333333", "nvidia.com/mig-1g.10gb",
        "MIG-0a0a0a0a-0000-1111-2222-333333333333", "1", parent_uuid=GPU1),))
    assert list(unallocated([user], mig)) == []


@pytest.mark.parametrize(("case", "claim_uuid", "flagged"), [
    # case                                        claim's device (CDI)   unallocated use
    ("claim resolved to the GPU it uses",         GPU1,                  set()),
    ("claim no CDI spec resolves: not judged",    "",                    set()),
    ("claim resolved to another GPU",             "GPU-ffffffff-0000-1111-2222-333333333333", {GPU1}),
])  # fmt: skip
def test_a_dra_claim_counts_as_allocation(view: HostView, case: str, claim_uuid: str, flagged: set[str]) -> None:
    user = _using(view, _container(POD_CGROUP, "ml", "trainer-0", "trainer"), GPU1, "open_fd")
    kubelet = KubeletReading(True, allocations=(KubeletAllocation(
        "ml", "trainer-0", "trainer", uuid=claim_uuid, gpu="1" if claim_uuid else "", claim="train-gpu",
        claim_namespace="ml", driver="gpu.nvidia.com", pool="node-1", device="gpu-1"),))
    assert {a.id for _, a in unallocated([user], kubelet)} == flagged, case
