"""Cgroups: host cgroup mode, ``devices.list`` rules, container identity and discovery.

Pure parsers (:mod:`.devices_list`, :mod:`.identity`, :func:`.mode.parse_mountinfo`) with the file
reading kept at the edges (:func:`.mode.detect_layout`, :mod:`.discovery`).  Contract:
docs/containers.md.
"""

from accelstats.cgroups.devices_list import (
    NVIDIA_CTL_MINOR,
    NVIDIA_MAJOR,
    NVIDIA_MODESET_MINOR,
    DeviceRule,
    DevicesList,
    GpuGrant,
    MigCap,
    MigInstance,
    format_rule,
    gpu_grant,
    mig_instances,
    parse_devices_list,
    parse_mig_minors,
    parse_rule,
)
from accelstats.cgroups.discovery import (
    ContainerCgroup,
    Discovery,
    WalkStats,
    discover_v1_containers,
    discover_v2_containers,
    read_devices_list,
    read_devices_list_text,
)
from accelstats.cgroups.identity import (
    RUNTIMES,
    ContainerIdentity,
    cgroup_path_for,
    identify,
    identify_with_root,
    is_host_cgroup,
    parse_proc_cgroup,
)
from accelstats.cgroups.mode import CgroupLayout, CgroupMode, Mount, detect_layout, parse_mountinfo

__all__ = [
    "NVIDIA_CTL_MINOR",
    "NVIDIA_MAJOR",
    "NVIDIA_MODESET_MINOR",
    "RUNTIMES",
    "CgroupLayout",
    "CgroupMode",
    "ContainerCgroup",
    "ContainerIdentity",
    "DeviceRule",
    "DevicesList",
    "Discovery",
    "GpuGrant",
    "MigCap",
    "MigInstance",
    "Mount",
    "WalkStats",
    "cgroup_path_for",
    "detect_layout",
    "discover_v1_containers",
    "discover_v2_containers",
    "format_rule",
    "gpu_grant",
    "identify",
    "identify_with_root",
    "is_host_cgroup",
    "mig_instances",
    "parse_devices_list",
    "parse_mig_minors",
    "parse_mountinfo",
    "parse_proc_cgroup",
    "parse_rule",
    "read_devices_list",
    "read_devices_list_text",
]
