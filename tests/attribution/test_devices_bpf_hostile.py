"""Device programs a privileged container attaches to its own cgroup that the evaluator cannot decide
(issue 24 rows 2 and 8): what they may cost a collection in memory and in CPU.

| program attached                        | what a collection costs us                                  |
|-----------------------------------------|-------------------------------------------------------------|
| calls a helper, loops, reads a map      | no memory kept per collection: the cached "no decision" is a |
|                                         | reason, each ask raises a fresh error with a short traceback |
| the same undecidable text again         | nothing evaluated again (by program IDs, then by text)      |
"""

from __future__ import annotations

import contextlib
import gc
import os
import secrets
import tracemalloc
import types
from pathlib import Path

import pytest
import support.bpf_util as b
from test_devices_bpf import require_bpf_cgroup

from accelstats.attribution.attributor import Attributor
from accelstats.cgroups.bpf_program import UndecidableError
from accelstats.cgroups.devices_bpf import DeviceProgramCache
from accelstats.cgroups.mode import CgroupLayout, CgroupMode
from collectors.model import Device, DeviceSnapshot


class FakeReader:
    """The bpf(2) reads of :class:`BpfReader`, from a table: cgroup directory -> [(program ID, text)]."""

    def __init__(self, programs: dict[str, list[tuple[int, bytes]]]) -> None:
        self.programs = programs

    def query(self, cgroup_dir: str) -> list[int]:
        return [i for i, _ in self.programs[cgroup_dir]]

    def instructions(self, prog_id: int) -> bytes:
        return next(t for ps in self.programs.values() for i, t in ps if i == prog_id)


def traceback_length(exc: BaseException) -> int:
    n, tb = 0, exc.__traceback__
    while tb is not None:
        n, tb = n + 1, tb.tb_next
    return n


def test_a_cached_no_decision_is_raised_as_a_fresh_error_each_time() -> None:
    """Row 2: the cache keeps the reason, not the exception: every ask gets its own error, whose
    traceback is as long the 50th time as the 2nd (the old cache re-raised one object, whose
    traceback grew by the asker's frames each time and pinned them)."""
    cache = DeviceProgramCache(FakeReader({"/cg": [(7, b.calls_helper())]}))  # type: ignore[arg-type]
    raised: list[UndecidableError] = []
    for _ in range(50):
        with pytest.raises(UndecidableError, match="device programs 7: instruction 1: calls helper 5") as info:
            cache.grant("/cg", [0])
        raised.append(info.value)
    assert len({id(e) for e in raised}) == 50
    assert traceback_length(raised[-1]) == traceback_length(raised[1])
    assert all(e.__cause__ is None and e.__context__ is None for e in raised[1:])  # no chain kept from the first


HOSTILE_CGROUPS = 10


@pytest.mark.root
def test_undecidable_programs_keep_no_memory_across_collections() -> None:
    """Row 2 on a real kernel: 10 containers with a helper-calling program each; 40 collections
    of the real attribution cost no memory and keep no traceback (the old code kept every frame of
    every collection: +2 tracebacks per container per collection)."""
    unified = require_bpf_cgroup()
    top = f"accelstats-test-{os.getpid()}-undecidable"
    with contextlib.ExitStack() as stack:
        root = stack.enter_context(b.cgroup_with_programs(top, []))
        for i in range(HOSTILE_CGROUPS):
            stack.enter_context(b.cgroup_with_programs(f"{top}/docker-{secrets.token_hex(32)}.scope",
                                                       [b.calls_helper(i)]))
        assert root == unified / top
        attributor = Attributor(CgroupLayout(CgroupMode.V2, None, root), Path("/proc"), open_fds=False)
        snapshot = DeviceSnapshot(devices=[Device(uuid="GPU-0", index=0, minor=0, name="H200")])

        def collect() -> None:
            asked = attributor.skipped["device_program_undecidable"]
            attributor.attribute(snapshot)  # none is listed: no decision, and none holds a GPU
            assert attributor.skipped["device_program_undecidable"] == asked + HOSTILE_CGROUPS

        def live_tracebacks() -> int:
            gc.collect()
            return sum(isinstance(o, types.TracebackType) for o in gc.get_objects())

        for _ in range(5):
            collect()
        tracemalloc.start()
        try:
            before, tracebacks = tracemalloc.take_snapshot(), live_tracebacks()
            for _ in range(40):
                collect()
            gc.collect()
            grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
        finally:
            tracemalloc.stop()
        assert live_tracebacks() == tracebacks
        assert grown < 32 * 1024, f"{grown} bytes more after 40 collections"
