"""NVIDIA GPU chips by PCI device id: the architecture and CUDA compute capability a capture without
``<product_architecture>`` leaves out (older ``nvidia-smi`` schemas, e.g. GeForce GT 1030 or GTX 1070
Ti captures), where NVML would answer them.

Sources: the device id ranges are each chip's lowest and highest NVIDIA (vendor 0x10DE) display
device id in the PCI ID Repository (https://pci-ids.ucw.cz, Debian package ``pci.ids``
0.0~2023.04.11, ``/usr/share/misc/pci.ids``; HD-audio and USB functions left out), e.g.
``1d01  GP108 [GeForce GT 1030]``, ``1b82  GP104 [GeForce GTX 1070 Ti]``. The compute capability of
each chip is NVIDIA's CUDA GPUs table (https://developer.nvidia.com/cuda-gpus) and the CUDA C++
Programming Guide's "Compute Capabilities": Kepler GK10x 3.0, GK110/GK208 3.5, GK210 3.7; Maxwell
GM10x 5.0, GM20x 5.2; Pascal GP100 6.0, GP10x 6.1; Volta 7.0; Turing 7.5; Ampere GA100 8.0, GA10x
8.6; Ada 8.9; Hopper 9.0. A device id outside every range is not guessed (:func:`chip_for` None).
"""

from __future__ import annotations

from dataclasses import dataclass

NVIDIA_VENDOR_ID = 0x10DE


@dataclass(frozen=True)
class Chip:
    """One chip: ``name`` (``"GP108"``), ``architecture`` as ``nvidia-smi`` prints it (``"Pascal"``)
    and CUDA ``compute_capability`` (major, minor)."""

    name: str
    architecture: str
    compute_capability: tuple[int, int]


# (lowest device id, highest device id, chip); see the module docstring for the sources
_RANGES: tuple[tuple[int, int, Chip], ...] = tuple((lo, hi, Chip(name, arch, cc)) for lo, hi, name, arch, cc in (
    (0x0FC0, 0x0FFF, "GK107", "Kepler", (3, 0)),
    (0x1001, 0x1023, "GK110", "Kepler", (3, 5)),
    (0x1024, 0x1024, "GK180", "Kepler", (3, 5)),
    (0x1026, 0x102A, "GK110", "Kepler", (3, 5)),
    (0x102D, 0x102D, "GK210", "Kepler", (3, 7)),
    (0x102E, 0x103F, "GK110", "Kepler", (3, 5)),
    (0x1180, 0x11BF, "GK104", "Kepler", (3, 0)),
    (0x11C0, 0x11FC, "GK106", "Kepler", (3, 0)),
    (0x1280, 0x12BA, "GK208", "Kepler", (3, 5)),
    (0x1340, 0x137D, "GM108", "Maxwell", (5, 0)),
    (0x1380, 0x13BD, "GM107", "Maxwell", (5, 0)),
    (0x13C0, 0x13FB, "GM204", "Maxwell", (5, 2)),
    (0x1401, 0x1436, "GM206", "Maxwell", (5, 2)),
    (0x15F0, 0x15F9, "GP100", "Pascal", (6, 0)),
    (0x1617, 0x1667, "GM204", "Maxwell", (5, 2)),
    (0x1725, 0x172F, "GP100", "Pascal", (6, 0)),
    (0x174D, 0x174E, "GM108", "Maxwell", (5, 0)),
    (0x1789, 0x179C, "GM107", "Maxwell", (5, 0)),
    (0x17C2, 0x17FD, "GM200", "Maxwell", (5, 2)),
    (0x1AF1, 0x1AF1, "GA100", "Ampere", (8, 0)),
    (0x1B00, 0x1B78, "GP102", "Pascal", (6, 1)),
    (0x1B80, 0x1BE1, "GP104", "Pascal", (6, 1)),
    (0x1C00, 0x1C70, "GP106", "Pascal", (6, 1)),
    (0x1C81, 0x1CFB, "GP107", "Pascal", (6, 1)),
    (0x1D01, 0x1D56, "GP108", "Pascal", (6, 1)),
    (0x1D81, 0x1DF6, "GV100", "Volta", (7, 0)),
    (0x1E02, 0x1E78, "TU102", "Turing", (7, 5)),
    (0x1E81, 0x1EF5, "TU104", "Turing", (7, 5)),
    (0x1F02, 0x1F76, "TU106", "Turing", (7, 5)),
    (0x1F81, 0x1FF9, "TU117", "Turing", (7, 5)),
    (0x2082, 0x20FD, "GA100", "Ampere", (8, 0)),
    (0x2182, 0x21D1, "TU116", "Turing", (7, 5)),
    (0x2200, 0x223F, "GA102", "Ampere", (8, 6)),
    (0x2302, 0x2339, "GH100", "Hopper", (9, 0)),
    (0x2414, 0x2460, "GA103", "Ampere", (8, 6)),
    (0x2482, 0x24FA, "GA104", "Ampere", (8, 6)),
    (0x2501, 0x2571, "GA106", "Ampere", (8, 6)),
    (0x2582, 0x25FB, "GA107", "Ampere", (8, 6)),
    (0x2681, 0x26F5, "AD102", "Ada Lovelace", (8, 9)),
    (0x2704, 0x2730, "AD103", "Ada Lovelace", (8, 9)),
    (0x2782, 0x27E0, "AD104", "Ada Lovelace", (8, 9)),
    (0x2803, 0x2860, "AD106", "Ada Lovelace", (8, 9)),
    (0x28A0, 0x28E1, "AD107", "Ada Lovelace", (8, 9)),
))


def chip_for(pci_device_id: int | None) -> Chip | None:
    """The chip of a capture's ``<pci_device_id>`` (NVML's ``pciDeviceId``: device id << 16 | vendor
    id, ``0x1D0110DE`` → GP108); None when it is absent, not NVIDIA's, or in no range listed."""
    if pci_device_id is None or pci_device_id & 0xFFFF != NVIDIA_VENDOR_ID:
        return None
    device = pci_device_id >> 16
    return next((chip for lo, hi, chip in _RANGES if lo <= device <= hi), None)
