"""DRA claims' CDI names resolved through CDI spec files in tmp_path (accelstats/kubernetes/cdi.py).

The spec files are written as ``nvidia-ctk cdi generate`` writes them (NVIDIA/nvidia-container-toolkit
``pkg/nvcdi``: kind ``nvidia.com/gpu``; devices by index ``0``, by UUID with ``--device-name-strategy=uuid``,
MIG ``<gpu>:<mig>`` with the instance's ``/dev/nvidia-caps`` nodes, ``all``; control nodes, ``env`` and hooks
in the spec-level ``containerEdits``), in YAML and in JSON.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import pytest

from accelstats.cgroups import parse_mig_minors
from accelstats.kubernetes.cdi import (
    MAX_FILE_BYTES,
    CdiResolved,
    CdiUnresolved,
    load_specs,
    resolve_cdi,
)
from collectors.model import Device

GPU0 = "GPU-11111111-2222-3333-4444-555555555555"  # index 0, /dev/nvidia0, MIG on
GPU1 = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"  # index 1, /dev/nvidia3 (minor and index differ)
MIG_A = "MIG-0a0a0a0a-0000-1111-2222-333333333333"  # GPU0, GPU instance 1, compute instance 0
MIG_B = "MIG-0b0b0b0b-0000-1111-2222-333333333333"  # GPU0, GPU instance 2, compute instance 0
HOST = (
    Device(uuid=GPU0, index=0, minor=0, name="NVIDIA A100-SXM4-80GB", mig_mode="enabled"),
    Device(uuid=GPU1, index=1, minor=3, name="NVIDIA H100 80GB HBM3"),
    Device(uuid=MIG_A, index=0, minor=None, name="MIG 1g.10gb", kind="mig", parent_uuid=GPU0,
           gpu_instance_id=1, compute_instance_id=0),
    Device(uuid=MIG_B, index=0, minor=None, name="MIG 3g.40gb", kind="mig", parent_uuid=GPU0,
           gpu_instance_id=2, compute_instance_id=0),
)
# /proc/driver/nvidia-caps/mig-minors as the driver writes it (excerpt)
MIG_CAPS, _ = parse_mig_minors("config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\n"
                               "gpu0/gi2/access 21\ngpu0/gi2/ci0/access 22\n")

SPEC_LEVEL = """containerEdits:
  env:
  - NVIDIA_VISIBLE_DEVICES=void
  deviceNodes:
  - path: /dev/nvidia-modeset
  - path: /dev/nvidia-uvm
  - path: /dev/nvidia-uvm-tools
  - path: /dev/nvidiactl
  hooks:
  - hookName: createContainer
    path: /usr/bin/nvidia-cdi-hook
    args: [nvidia-cdi-hook, update-ldcache, --folder, /usr/lib/x86_64-linux-gnu]
  mounts:
  - hostPath: /usr/bin/nvidia-smi
    containerPath: /usr/bin/nvidia-smi
    options: [ro, nosuid, nodev, bind]
"""

# nvidia-ctk cdi generate (index names, the default)
NVIDIA_YAML = """---
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
- name: "0:0"
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
    - path: /dev/nvidia-caps/nvidia-cap12
    - path: /dev/nvidia-caps/nvidia-cap13
- name: "0:1"
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
    - path: /dev/nvidia-caps/nvidia-cap21
    - path: /dev/nvidia-caps/nvidia-cap22
- name: "1"
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia3
- name: "9"
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia9
- name: all
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
    - path: /dev/nvidia3
""" + SPEC_LEVEL

# nvidia-ctk cdi generate --device-name-strategy=uuid --format=json, in the DRA driver's own kind
UUID_JSON = {
    "cdiVersion": "0.5.0", "kind": "k8s.gpu.nvidia.com/device",
    "devices": [
        {"name": GPU1, "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia3"}]}},
        {"name": GPU0, "containerEdits": {"env": [f"NVIDIA_VISIBLE_DEVICES={GPU0}"]}},  # no node: by name
    ],
    "containerEdits": {"deviceNodes": [{"path": "/dev/nvidiactl"}]},
}


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    etc, run = tmp_path / "etc-cdi", tmp_path / "run-cdi"
    etc.mkdir()
    run.mkdir()
    (etc / "nvidia.yaml").write_text(NVIDIA_YAML)
    (run / "k8s.gpu.nvidia.com-device.json").write_text(json.dumps(UUID_JSON))
    return etc, run


RESOLVED = [
    # (qualified CDI name from ClaimResource.cdi_devices,  uuid,  kind,  via)
    ("nvidia.com/gpu=1",                                   GPU1,  "gpu", "device-node"),  # /dev/nvidia3: minor 3
    ("nvidia.com/gpu=0:0",                                 MIG_A, "mig", "device-node"),
    ("nvidia.com/gpu=0:1",                                 MIG_B, "mig", "device-node"),
    (f"k8s.gpu.nvidia.com/device={GPU1}",                  GPU1,  "gpu", "device-node"),
    (f"k8s.gpu.nvidia.com/device={GPU0}",                  GPU0,  "gpu", "name-uuid"),
]


@pytest.mark.parametrize(("name", "uuid", "kind", "via"), RESOLVED)
def test_a_cdi_name_resolves_to_the_device_its_nodes_name(dirs: tuple[Path, Path], name: str, uuid: str,
                                                          kind: str, via: str) -> None:
    specs = load_specs(dirs)
    assert specs.problems == ()
    got = resolve_cdi(name, specs, HOST, MIG_CAPS)
    assert isinstance(got, CdiResolved), got
    assert (got.uuid, got.kind, got.via) == (uuid, kind, via)


UNRESOLVED = [
    # (qualified CDI name,            the reason says)
    ("nvidia.com/gpu=all",             "name 2 GPUs"),
    ("nvidia.com/gpu=9",               "no GPU behind /dev/nvidia9"),
    ("nvidia.com/gpu=7",               "no CDI spec on this host names this device"),
    ("gpu-0",                          "not a qualified CDI device name"),
    ("nvidia.com/gpu=../../x",         "not a qualified CDI device name"),
    ("nvidia.com/gpu=" + "0" * 600,    "longer than 512 characters"),
]


@pytest.mark.parametrize(("name", "reason"), UNRESOLVED)
def test_a_cdi_name_naming_no_single_device_is_unresolved_with_the_reason(dirs: tuple[Path, Path], name: str,
                                                                         reason: str) -> None:
    got = resolve_cdi(name, load_specs(dirs), HOST, MIG_CAPS)
    assert isinstance(got, CdiUnresolved)
    assert reason in got.reason and "\n" not in got.reason


def test_mig_nodes_without_mig_minors_are_unresolved(dirs: tuple[Path, Path]) -> None:
    got = resolve_cdi("nvidia.com/gpu=0:1", load_specs(dirs), HOST, {})
    assert isinstance(got, CdiUnresolved) and "name no MIG instance in mig-minors" in got.reason


def test_a_compute_instance_capability_without_its_gpu_instance_capability_is_no_mig_instance(
        dirs: tuple[Path, Path]) -> None:
    # as in the devices cgroup (accelstats/cgroups/devices_list.py mig_instances): both capabilities are needed
    (dirs[1] / "half.yaml").write_text("kind: example.com/mig\ndevices:\n- name: half\n  containerEdits:\n"
                                       "    deviceNodes:\n    - path: /dev/nvidia0\n"
                                       "    - path: /dev/nvidia-caps/nvidia-cap22\n")
    got = resolve_cdi("example.com/mig=half", load_specs(dirs), HOST, MIG_CAPS)
    assert isinstance(got, CdiUnresolved) and "name no MIG instance in mig-minors" in got.reason


def test_missing_spec_directories_are_no_devices_and_no_problem(tmp_path: Path) -> None:
    specs = load_specs((tmp_path / "etc-cdi", tmp_path / "run-cdi"))
    assert (dict(specs.devices), specs.problems) == ({}, ())
    got = resolve_cdi("nvidia.com/gpu=0", specs, HOST, MIG_CAPS)
    assert isinstance(got, CdiUnresolved) and "no CDI spec" in got.reason


NO_DEVICES = '{"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": []}'
BAD_NODES = "kind: a.com/b\ndevices:\n- name: x\n  containerEdits:\n    deviceNodes: SECRET-TEXT\n"
ALIAS = "kind: a.com/b\nx: &a [SECRET-TEXT]\ndevices:\n- name: x\n  y: *a\n"
BAD_FILES = [
    # (file name,        content,                                                    the one line says)
    ("broken.yaml",      "kind: nvidia.com/gpu\ndevices: [\n  - name: SECRET-TEXT\n", "not YAML"),
    ("broken.json",      '{"kind": "nvidia.com/gpu", SECRET-TEXT',                   "not JSON"),
    ("nokind.yaml",      "cdiVersion: 0.5.0\ndevices:\n- name: SECRETTEXT\n",         "'kind' is not vendor.com/class"),
    ("nodevices.json",   NO_DEVICES,                                                 "'devices' is not a non-empty"),
    ("badnodes.yaml",    BAD_NODES,                                                  "'deviceNodes' is not a list"),
    ("alias.yaml",       ALIAS,                                                      "aliases are not read"),
    ("latin1.yaml",      b"kind: a.com/b\ndevices:\n- name: \xff\n",                  "not UTF-8"),
    ("big.yaml",         "#" * (MAX_FILE_BYTES + 1),                                 f"larger than {MAX_FILE_BYTES}"),
]


@pytest.mark.parametrize(("file", "content", "says"), BAD_FILES)
def test_a_bad_spec_file_is_skipped_with_one_line_and_loses_nothing_else(
        dirs: tuple[Path, Path], caplog: pytest.LogCaptureFixture, file: str, content: str | bytes,
        says: str) -> None:
    path = dirs[0] / file
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with caplog.at_level(logging.WARNING, logger="accelstats.kubernetes.cdi"):
        specs = load_specs(dirs)
    assert len(specs.problems) == 1 and str(path) in specs.problems[0] and says in specs.problems[0]
    assert [r.getMessage() for r in caplog.records] == [f"CDI: {specs.problems[0]}"]
    assert "SECRET" not in caplog.text
    assert isinstance(resolve_cdi("nvidia.com/gpu=1", specs, HOST, MIG_CAPS), CdiResolved)


def test_spec_files_past_the_limit_per_directory_are_skipped_with_one_line(
        dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("accelstats.kubernetes.cdi.MAX_FILES", 2)
    for n in range(3):
        (dirs[0] / f"z{n}.yaml").write_text(f"kind: example.com/gpu\ndevices:\n- name: d{n}\n")
    specs = load_specs(dirs)
    assert specs.problems == (f"{dirs[0]}: 4 spec files, only the first 2 read",)
    assert sorted(n for n in specs.devices if n.startswith("example.com/")) == ["example.com/gpu=d0"]


def test_a_symlink_out_of_the_spec_directories_is_refused_unread(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.yaml"
    outside.write_text(NVIDIA_YAML.replace("nvidia.com/gpu", "evil.com/gpu"))
    (dirs[0] / "evil.yaml").symlink_to(outside)
    (dirs[0] / "shadow.yaml").symlink_to("/etc/shadow")
    specs = load_specs(dirs)
    assert sorted(p.split(":")[0] for p in specs.problems) == [str(dirs[0] / "evil.yaml"), str(dirs[0] / "shadow.yaml")]
    assert all("outside the CDI spec directories" in p for p in specs.problems)
    assert not any(n.startswith("evil.com/") for n in specs.devices)


def test_a_symlink_to_a_spec_in_a_spec_directory_is_read(dirs: tuple[Path, Path]) -> None:
    (dirs[1] / "nvidia.yaml").symlink_to(dirs[0] / "nvidia.yaml")  # same devices, higher priority: no conflict
    specs = load_specs(dirs)
    assert specs.problems == ()
    assert specs.devices["nvidia.com/gpu=1"].spec == dirs[1] / "nvidia.yaml"


def test_a_fifo_named_like_a_spec_is_refused_without_waiting_for_a_writer(dirs: tuple[Path, Path]) -> None:
    os.mkfifo(dirs[0] / "fifo.yaml")
    done = threading.Event()
    result: list[tuple[str, ...]] = []
    worker = threading.Thread(target=lambda: (result.append(load_specs(dirs).problems), done.set()), daemon=True)
    worker.start()
    assert done.wait(5), "load_specs blocked on a FIFO"
    assert len(result[0]) == 1 and "not a regular file" in result[0][0]


def test_var_run_cdi_overrides_etc_cdi_and_a_conflict_in_one_directory_drops_the_name(
        dirs: tuple[Path, Path]) -> None:
    etc, run = dirs
    (run / "override.yaml").write_text("kind: nvidia.com/gpu\ndevices:\n- name: '1'\n  containerEdits:\n"
                                       "    deviceNodes:\n    - path: /dev/nvidia0\n")
    (etc / "twin.yaml").write_text("kind: nvidia.com/gpu\ndevices:\n- name: '0:0'\n")
    specs = load_specs(dirs)
    got = resolve_cdi("nvidia.com/gpu=1", specs, HOST, MIG_CAPS)
    assert isinstance(got, CdiResolved) and got.uuid == GPU0  # /var/run/cdi's spec, not /etc/cdi's
    assert "nvidia.com/gpu=0:0" not in specs.devices
    assert specs.problems == (f"conflicting device nvidia.com/gpu=0:0 (specs {etc / 'nvidia.yaml'}, "
                              f"{etc / 'twin.yaml'}): neither used",)


def test_host_path_is_the_node_looked_at(dirs: tuple[Path, Path]) -> None:
    (dirs[1] / "remapped.yaml").write_text("kind: example.com/gpu\ndevices:\n- name: a\n  containerEdits:\n"
                                           "    deviceNodes:\n    - path: /dev/nvidia0\n      hostPath: /dev/nvidia3\n")
    got = resolve_cdi("example.com/gpu=a", load_specs(dirs), HOST, MIG_CAPS)
    assert isinstance(got, CdiResolved) and got.uuid == GPU1
