"""Fault, hang and XID-event injection for the NVML replay: the scenario tables ``[[fault]]`` and
``[[event]]``. Test support, not part of accelstats.

The product's replay (``collectors.replay.state``, ``collectors.replay.lib``) hands these tables to
the extension registered in the process (:func:`collectors.replay.lib.register_extension`), and
refuses them when none is. :func:`register` registers this module: ``tests/conftest.py`` calls it in
the test processes, and ``tests/support/site/sitecustomize.py`` (first on the ``PYTHONPATH`` that
conftest gives every subprocess) calls it in each process the tests start, once
``collectors.replay.lib`` is imported there (``python -m accelstats …``, ``nomad-device-accelstats``).
A fault runs inside the replayed C function, below the real pynvml::

    [[fault]]
    gpu = 1                          # NVML index; without it the fault hits that call on every GPU
    call = "nvmlDeviceGetMemoryInfo" # a call the replay answers (pynvml's name; versioned symbols
                                     #   such as nvmlDeviceGetMemoryInfo_v2 match it), or "*"
                                     #   (every call naming that GPU)
    error = "GPU_IS_LOST"            # NVML_ERROR_<error>; optional when hang_seconds is given
    after_calls = 0                  # this many matching calls succeed first
    times = 3                        # then fail this many times (default: forever)
    hang_seconds = 5                 # block (the state's sleep) this long before failing / answering
    [[event]]                        # an NVML event (nvmlEventSetWait_v2), delivered once it is due
    gpu = 1                          # NVML index; required
    xid = 79                         # required: the XID (eventData), 1..2^64-1
    after_seconds = 0.2              # due this long after the replay's first nvmlInit (default 0)
    type = "xid_critical"            # optional; the only type (nvmlEventTypeXidCriticalError)
    gpu_instance_id = 1              # optional, MIG: an instance of that GPU (default: whole GPU,
    compute_instance_id = 0          #   0xFFFFFFFF); compute_instance_id only with gpu_instance_id

``hang_seconds`` and ``after_seconds`` are finite, 0..a year; ``after_calls`` / ``times``
non-negative integers; an event's ``gpu`` must exist and its instance ids name one of that GPU's MIG
instances. Errors are CaptureError naming the file and the key.

An event falls due ``after_seconds`` after the first nvmlInit (by the state's clock). It is
delivered to a set registered for its GPU and type, once per set, the earliest due first: to every
set registered before it fell due and, when none took it, to the first set registered later that
waits (so ``after_seconds = 0`` reaches the watcher that registers after init); a set created after
another took it does not get it again.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import pynvml

from collectors.replay.capture import U64, GpuCapture, ScenarioTable
from collectors.replay.state import IMPLEMENTED_CALLS, DueEvent, EventSource, ReplayEventSet, ReplayState

TABLES = ("fault", "event")
EVENT_TYPES = {"xid_critical": 0x8}  # nvmlEventTypeXidCriticalError (nvml.h)
CALLS = IMPLEMENTED_CALLS | {"nvmlDeviceGetPciInfo_v3", "nvmlEventSetWait"}
_FAULT_KEYS = {"gpu", "call", "error", "after_calls", "times", "hang_seconds"}
_EVENT_KEYS = {"gpu", "xid", "after_seconds", "type", "gpu_instance_id", "compute_instance_id"}


@dataclass(frozen=True)
class Fault:
    """``call`` (a call name or ``"*"``) fails with NVML_ERROR_<``error``> on GPU ``gpu`` (None:
    every GPU, or a system call), after ``after_calls`` matching calls succeed, ``times`` times
    (None: forever), each first blocking ``hang_seconds``."""

    call: str
    error: str | None = None
    gpu: int | None = None
    after_calls: int = 0
    times: int | None = None
    hang_seconds: float = 0.0


@dataclass(frozen=True)
class EventCapture:
    """An ``[[event]]``: type ``kind`` on GPU ``gpu`` carrying ``xid``, due ``after_seconds`` after
    the first nvmlInit; MIG instance ids None for the whole GPU."""

    gpu: int
    xid: int
    after_seconds: float = 0.0
    kind: str = "xid_critical"
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


class FaultHook:
    """The call hook that applies ``faults`` (see the module docstring) on ``state``."""

    def __init__(self, state: ReplayState, faults: Sequence[Fault]) -> None:
        self.state, self.faults = state, tuple(faults)
        self._lock = threading.Lock()
        self._calls = [0] * len(self.faults)
        self._hits = [0] * len(self.faults)

    def __call__(self, names: tuple[str, ...], gpu: int | None) -> None:
        hang, error = 0.0, None
        with self._lock:
            for i, f in enumerate(self.faults):
                if (f.call not in names and f.call != "*") or (f.gpu is not None and f.gpu != gpu) or \
                        (f.call == "*" and gpu is None):
                    continue
                self._calls[i] += 1
                if self._calls[i] <= f.after_calls or (f.times is not None and self._hits[i] >= f.times):
                    continue
                self._hits[i] += 1
                hang, error = max(hang, f.hang_seconds), error or f.error
        if hang:
            self.state.sleep(hang)
        if error:
            raise pynvml.NVMLError(getattr(pynvml, f"NVML_ERROR_{error}"))


class ScheduledEvents(EventSource):
    """The event source of a scenario's ``[[event]]`` tables (rules: the module docstring)."""

    def __init__(self, events: Sequence[EventCapture]) -> None:
        self.events = sorted(enumerate(events), key=lambda e: (e[1].after_seconds, e[0]))
        self.claimed: set[int] = set()

    def take(self, es: ReplayEventSet, now: float, start: float) -> tuple[DueEvent | None, float | None]:
        for pos, event in self.events:
            due = start + event.after_seconds
            registered = es.registered.get((event.gpu, EVENT_TYPES[event.kind]))
            if registered is None or pos in es.delivered:
                continue
            if due > now:
                return None, due
            if registered > due and pos in self.claimed:
                continue  # it happened before this set listened, and another set took it
            self.claimed.add(pos)
            return DueEvent(pos, event.gpu, EVENT_TYPES[event.kind], event.xid, event.gpu_instance_id,
                            event.compute_instance_id), None
        return None, None


def attach(state: ReplayState) -> None:
    """Read ``state.extra``'s ``fault`` and ``event`` tables and apply them to ``state``. Raises
    CaptureError naming the file and the key."""
    path = state.path
    assert path is not None or not state.extra
    errors = [n.removeprefix("NVML_ERROR_") for n in dir(pynvml) if n.startswith("NVML_ERROR_")]
    faults = [_fault(ScenarioTable(path, f"fault[{i}]", t, _FAULT_KEYS), len(state.capture.gpus), CALLS, errors)
              for i, t in enumerate(state.extra.get("fault", []))]  # type: ignore[arg-type]
    events = [_event(ScenarioTable(path, f"event[{i}]", t, _EVENT_KEYS), state.capture.gpus)  # type: ignore[arg-type]
              for i, t in enumerate(state.extra.get("event", []))]
    if faults:
        state.call_hooks.append(FaultHook(state, faults))
    if events:
        state.event_source = ScheduledEvents(events)


def register() -> None:
    """Hand every scenario's ``[[fault]]`` and ``[[event]]`` tables to :func:`attach` in this process
    (:func:`collectors.replay.lib.register_extension`; registering again changes nothing)."""
    # imported here, not at the top: where sitecustomize's hook is on, importing collectors.replay.lib
    # calls register(), which must then find this module complete
    from collectors.replay.lib import ReplayExtension, register_extension

    register_extension(ReplayExtension("tests/support/replay_faults.py", TABLES, attach))


def faults_of(state: ReplayState) -> tuple[Fault, ...]:
    """The faults attached to ``state`` (for tests that inspect them)."""
    return tuple(f for h in state.call_hooks if isinstance(h, FaultHook) for f in h.faults)


def _fault(t: ScenarioTable, gpu_count: int, calls: Collection[str], errors: Collection[str]) -> Fault:
    call = t.get("call", str, required=True)
    if call != "*" and call not in calls:
        t.fail(f"{call!r} is not a call the replay implements (or '*')", "call")
    error = t.get("error", str)
    if error is not None and error not in errors:
        t.fail(f"unknown NVML error {error!r} (expected an NVML_ERROR_* name without the prefix)", "error")
    gpu = t.get("gpu", int)
    if gpu is not None and gpu >= gpu_count:
        t.fail(f"no GPU with NVML index {gpu} (the scenario has {gpu_count})", "gpu")
    hang = t.seconds("hang_seconds")
    if error is None and not hang:
        t.fail("a fault needs `error`, `hang_seconds` or both", "error")
    return Fault(call=call, error=error, gpu=gpu, after_calls=t.get("after_calls", int, 0),
                 times=t.get("times", int), hang_seconds=hang)


def _event(t: ScenarioTable, gpus: Sequence[GpuCapture]) -> EventCapture:
    gpu = t.get("gpu", int, required=True)
    if gpu >= len(gpus):
        t.fail(f"no GPU with NVML index {gpu} (the scenario has {len(gpus)})", "gpu")
    xid = t.uint("xid", U64, required=True)
    if xid == 0:
        t.fail("XIDs are numbered from 1, got 0", "xid")
    kind = t.get("type", str, "xid_critical")
    if kind not in EVENT_TYPES:
        t.fail(f"expected {' or '.join(map(repr, EVENT_TYPES))}, got {kind!r}", "type")
    gi, ci = t.uint("gpu_instance_id"), t.uint("compute_instance_id")
    if ci is not None and gi is None:
        t.fail("given without gpu_instance_id", "compute_instance_id")
    migs = gpus[gpu].migs
    if gi is not None and not any(m.gpu_instance_id == gi and ci in (None, m.compute_instance_id) for m in migs):
        have = ", ".join(f"{m.gpu_instance_id}/{m.compute_instance_id}" for m in migs)
        t.fail(f"GPU {gpu} has no MIG instance {gi}{'' if ci is None else f'/{ci}'} "
               f"({f'gpu/compute instance ids: {have}' if have else 'MIG is not enabled'})",
               "gpu_instance_id" if ci is None else "compute_instance_id")
    return EventCapture(gpu=gpu, xid=xid, after_seconds=t.seconds("after_seconds"), kind=kind,
                        gpu_instance_id=gi, compute_instance_id=ci)

