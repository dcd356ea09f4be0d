"""NVLink links of a GPU: which there are, their state, data counters and error counters.

Read by :class:`collectors.profiling.ProfilingSampler` in the background, never on the scrape path
(a GPU with 18 links takes 18 state reads, one field-values read and 54 error-counter reads a round).

* Links: ``NVML_FI_DEV_NVLINK_LINK_COUNT`` (field values) once per NVML session; NOT_SUPPORTED (a
  GPU without NVLink: the H200 PCIe card answers so, ``tests/shared/fixtures/h200/nvml_probe.json``)
  means none. Links ``0..count-1`` whose ``nvmlDeviceGetNvLinkState`` answers are kept; probing past
  the count would count INVALID_ARGUMENT errors in ``accelstats_nvml_errors_total``.
* State: ``nvmlDeviceGetNvLinkState`` (NVML_FEATURE_ENABLED: the link is active).
* Data: fields ``NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX`` / ``_RX`` with ``scopeId`` the link, "NVLink
  TX/RX Data throughput in KiB" (nvml.h): counters of payload sent and received, exported x 1024 as
  bytes (``accelstats_gpu_nvlink_data_bytes_total``).
* Errors: ``nvmlDeviceGetNvLinkErrorCounter`` with NVML_NVLINK_ERROR_DL_CRC_FLIT, _REPLAY and
  _RECOVERY (any link number; the per-lane ``..._ERROR_COUNT_L<n>`` fields stop at link 11).
"""

from __future__ import annotations

from typing import Any

from collectors.model import NvLinkReading
from collectors.nvml_call import NvmlCaller

KIB = 1024  # bytes per NVML "KiB" (nvml.h: "NVLink TX Data throughput in KiB")
DIRECTIONS = (("tx", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX"), ("rx", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX"))
ERROR_TYPES = (("crc_flit", "NVML_NVLINK_ERROR_DL_CRC_FLIT"), ("replay", "NVML_NVLINK_ERROR_DL_REPLAY"),
               ("recovery", "NVML_NVLINK_ERROR_DL_RECOVERY"))


def links(call: NvmlCaller, nvml: Any, handle: Any) -> tuple[int, ...]:
    """The GPU's NVLink link numbers, ``()`` for a GPU without NVLink (module docstring).
    Raises DeviceLostError / NvmlUnavailableError (:mod:`collectors.nvml_call`)."""
    fields = call("nvmlDeviceGetFieldValues", handle, [nvml.NVML_FI_DEV_NVLINK_LINK_COUNT])
    if not fields or fields[0].nvmlReturn != 0:
        return ()
    count = min(int(fields[0].value.uiVal), int(nvml.NVML_NVLINK_MAX_LINKS))
    return tuple(link for link in range(count) if call("nvmlDeviceGetNvLinkState", handle, link) is not None)


def read(call: NvmlCaller, nvml: Any, handle: Any, numbers: tuple[int, ...]) -> tuple[NvLinkReading, ...]:
    """One reading per link in ``numbers``; a value NVML does not answer is left out (absent).
    Raises DeviceLostError / NvmlUnavailableError."""
    if not numbers:
        return ()
    ids = [(getattr(nvml, const), link) for link in numbers for _, const in DIRECTIONS]
    values = call("nvmlDeviceGetFieldValues", handle, ids) or []
    data: dict[int, list[tuple[str, int]]] = {link: [] for link in numbers}
    for (fid, link), v in zip(ids, values, strict=False):
        if v.nvmlReturn == 0:
            direction = next(d for d, const in DIRECTIONS if getattr(nvml, const) == fid)
            data[link].append((direction, int(v.value.ullVal) * KIB))
    out = []
    for link in numbers:
        state = call("nvmlDeviceGetNvLinkState", handle, link)
        errors = []
        for label, const in ERROR_TYPES:
            n = call("nvmlDeviceGetNvLinkErrorCounter", handle, link, getattr(nvml, const))
            if n is not None:
                errors.append((label, int(n)))
        out.append(NvLinkReading(link=link, up=None if state is None else bool(state),
                                 data_bytes=tuple(data[link]), errors=tuple(errors)))
    return tuple(out)
