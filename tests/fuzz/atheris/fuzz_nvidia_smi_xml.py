"""atheris harness: ``collectors.replay.capture.parse_capture`` on arbitrary bytes (docs/fuzzing.md).

Only :class:`CaptureError` may escape; every value of a capture that parses must be within its
NVML C type. Seeds: the four ``nvidia-smi -q -x`` captures of tests/shared/fixtures. The input is
written to a file in /dev/shm (parse_capture reads a path), one file per process.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import sys
import tempfile
from pathlib import Path

import atheris
from _common import FIXTURES, seed_corpus

with atheris.instrument_imports(include=["collectors"]):
    from collectors.replay.capture import U64, CaptureError, GpuCapture, int_max, parse_capture

INT_FIELDS = [f.name for f in dataclasses.fields(GpuCapture) if "int" in str(f.type) and "tuple" not in str(f.type)]
SCRATCH = Path(tempfile.mkdtemp(prefix="fuzz-xml-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
CAPTURE = SCRATCH / "capture.xml"
atexit.register(shutil.rmtree, SCRATCH, ignore_errors=True)


def test_one_input(data: bytes) -> None:
    CAPTURE.write_bytes(data)
    try:
        capture = parse_capture(CAPTURE)
    except CaptureError:
        return
    for gpu in capture.gpus:
        for name in INT_FIELDS:
            value = getattr(gpu, name)
            if value is not None and not 0 <= value <= int_max(name):
                raise AssertionError(f"{name} = {value} is outside 0..{int_max(name)}")
        for mig in gpu.migs:
            for field in dataclasses.fields(mig):
                value = getattr(mig, field.name)
                if isinstance(value, int) and not 0 <= value <= U64:
                    raise AssertionError(f"migs.{field.name} = {value}")


if __name__ == "__main__":
    seed_corpus(sys.argv, (p.read_bytes() for p in sorted(FIXTURES.glob("*/*.xml"))))
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
