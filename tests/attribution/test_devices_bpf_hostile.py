"""Device programs a privileged container attaches to its own cgroup that the evaluator cannot decide
(issue 24 rows 2 and 8): what they may cost a collection in memory and in CPU.

| program attached                        | what a collection costs us                                  |
|-----------------------------------------|-------------------------------------------------------------|
| calls a helper, loops, reads a map      | no memory kept per collection: the cached "no decision" is a |
|                                         | reason, each ask raises a fresh error with a short traceback |
| loops (the verifier accepts bounded      | at most MAX_QUESTION_STEPS (10 000) instructions, once per  |
| loops since Linux 5.3)                  | distinct program text                                       |
| the same text again under new IDs (a    | nothing evaluated again: answers, "no decision" included,   |
| container restarted, a program replaced)| are kept by program text too                                |
| many new texts, each costly             | at most MAX_COLLECTION_STEPS (400 000) instructions per      |
|                                         | collection; the rest wait for the next collections          |
| the same, asked from concurrent threads | the same bound: each evaluation reserves its instructions   |
|                                         | before it runs                                              |
"""

from __future__ import annotations

import contextlib
import gc
import os
import secrets
import threading
import time
import tracemalloc
import types
from pathlib import Path
from typing import Any

import pytest
import support.bpf_util as b
from test_devices_bpf import require_bpf_cgroup

import accelstats.cgroups.devices_bpf as devices_bpf
from accelstats.attribution.attributor import Attributor
from accelstats.cgroups.bpf_program import MAX_QUESTION_STEPS, UndecidableError
from accelstats.cgroups.devices_bpf import MAX_COLLECTION_STEPS, DeviceProgramCache
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
        root = stack.enter_context(b.cgroup_with_programs(top, [], held=True))  # not empty: removable by none
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


def deny_after(rounds: int) -> bytes:
    """Loops ``rounds`` rounds (2 instructions each), then denies: just under the question limit at
    4 990 rounds, so every question the grant asks costs about 10 000 instructions."""
    return b.looping(rounds, allow=False)


def test_new_costly_programs_share_one_budget_per_collection() -> None:
    """Row 8: six distinct programs that each run about 10 000 instructions for each of the 10
    questions of a grant (2 probes, 8 GPUs): about 100 000 each.  One collection evaluates at most
    MAX_COLLECTION_STEPS of them; the others say so, are not cached as undecidable, and are decided
    at the next collection."""
    table = {f"/cg{i}": [(100 + i, deny_after(4_990 - i))] for i in range(6)}
    cache = DeviceProgramCache(FakeReader(table))  # type: ignore[arg-type]
    decided: dict[str, frozenset[int]] = {}
    per_collection = []
    for _ in range(3):
        cache.begin_collection()
        before = cache.steps
        for cgroup in table:
            try:
                decided[cgroup] = cache.grant(cgroup, range(8)).grant.minors
            except UndecidableError as exc:
                assert "not evaluated in this collection" in str(exc)
        per_collection.append(cache.steps - before)
    assert decided == {cgroup: frozenset() for cgroup in table}  # all decided: deny every GPU
    assert all(steps <= MAX_COLLECTION_STEPS for steps in per_collection), per_collection
    assert per_collection[0] > 0 and per_collection[1] > 0 and per_collection[2] == 0


def test_concurrent_grants_share_one_budget_per_collection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Row 8 follow-up: the six costly programs above asked from six threads at once.  Every thread
    that gets instructions holds its evaluation until all six have started theirs or given up, so each
    has taken its share before any spends it; together they run at most MAX_COLLECTION_STEPS (the old
    cache read what was left under the lock, evaluated outside it and subtracted after: all six saw
    200 000 left and ran about 600 000)."""
    table = {f"/cg{i}": [(100 + i, deny_after(4_990 - i))] for i in range(6)}
    cache = DeviceProgramCache(FakeReader(table))  # type: ignore[arg-type]
    real = devices_bpf.device_grant
    turn = threading.Condition()
    evaluating = finished = 0

    def held_device_grant(*args: Any, **kwargs: Any) -> Any:
        nonlocal evaluating
        with turn:
            evaluating += 1
            turn.notify_all()
            assert turn.wait_for(lambda: evaluating + finished == len(table), timeout=10)
        return real(*args, **kwargs)

    monkeypatch.setattr(devices_bpf, "device_grant", held_device_grant)
    outcomes: dict[str, str] = {}

    def ask(cgroup: str) -> None:
        nonlocal finished
        try:
            outcomes[cgroup] = f"deny {sorted(cache.grant(cgroup, range(8)).grant.minors)}"
        except UndecidableError as exc:
            outcomes[cgroup] = "next collection" if "not evaluated in this collection" in str(exc) else str(exc)
        finally:
            with turn:
                finished += 1
                turn.notify_all()

    cache.begin_collection()
    threads = [threading.Thread(target=ask, args=(cgroup,)) for cgroup in table]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(outcomes) == len(table), outcomes
    assert cache.steps <= MAX_COLLECTION_STEPS, cache.steps
    assert set(outcomes.values()) == {"deny []", "next collection"}, outcomes


PROGRAMS = 10
ROUNDS = 100_000


@pytest.mark.root
def test_looping_programs_cost_one_question_each_once_per_text() -> None:
    """Row 8 on a real kernel: 10 containers with distinct loops of 100 000 rounds (accepted by the
    verifier).  The first collection runs MAX_QUESTION_STEPS instructions for each and no more, the
    next none; 10 new containers with the same programs (new program IDs) cost reads, no evaluation."""
    require_bpf_cgroup()
    top = f"accelstats-test-{os.getpid()}-looping"
    with contextlib.ExitStack() as stack:
        stack.enter_context(b.cgroup_with_programs(top, [], held=True))  # not empty: removable by none
        cgroups = [stack.enter_context(b.cgroup_with_programs(f"{top}/c{i}", [b.looping(ROUNDS + i)], held=True))
                   for i in range(PROGRAMS)]
        cache = DeviceProgramCache()

        def collect(directories: list[Path]) -> float:
            cache.begin_collection()
            cpu = time.process_time()
            for directory in directories:
                with pytest.raises(UndecidableError, match=f"more than {MAX_QUESTION_STEPS} instructions"):
                    cache.grant(str(directory), range(8))
            return time.process_time() - cpu

        first = collect(cgroups)
        assert cache.steps == PROGRAMS * MAX_QUESTION_STEPS
        assert first < 1.0  # about 0.06 s here; the old evaluator ran 200 000 per program (about 1.3 s)
        collect(cgroups)
        assert cache.steps == PROGRAMS * MAX_QUESTION_STEPS and cache.reads == PROGRAMS
        again = [stack.enter_context(b.cgroup_with_programs(f"{top}/again{i}", [b.looping(ROUNDS + i)], held=True))
                 for i in range(PROGRAMS)]
        collect(again)
        assert cache.reads == 2 * PROGRAMS  # new IDs: read once each
        assert cache.steps == PROGRAMS * MAX_QUESTION_STEPS  # same texts: not evaluated again


def test_a_program_just_under_the_question_limit_is_stopped_by_the_grant_budget() -> None:
    """30 GPUs: 32 questions of about 10 000 instructions each pass MAX_STEPS (200 000) for the grant:
    no decision, after 200 000 instructions."""
    cache = DeviceProgramCache(FakeReader({"/cg": [(9, deny_after(4_990))]}))  # type: ignore[arg-type]
    with pytest.raises(UndecidableError, match="more than 200000 instructions executed for one grant"):
        cache.grant("/cg", range(30))
    assert cache.steps == 200_000
