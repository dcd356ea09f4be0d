"""A GPU's own state over time in a scenario: it falls off the bus, calls on it fail or hang, it
reports XIDs. The ``[[gpu]]`` keys ``lost_at_s``, ``[gpu.errors]``, ``[gpu.hangs]`` and ``[[gpu.xid]]``
(:mod:`collectors.replay.capture` reads them into :class:`collectors.replay.capture.GpuCapture`);
:func:`attach` applies them to a :class:`collectors.replay.state.ReplayState`
(:func:`collectors.replay.lib.open_replay` calls it for every replay). Times are seconds after the
replay's first ``nvmlInit``, by the state's clock, as a scenario process's ``start_s``.

- ``lost_at_s``: from then on every call naming the GPU (``nvmlDeviceGetHandleByIndex`` of its index
  included) answers ``GPU_IS_LOST``, as NVML does for a GPU that fell off the bus (XID 79); the other
  GPUs and the system calls keep answering.
- ``[gpu.errors]`` ``call = "ERROR"``: that call on this GPU answers ``NVML_ERROR_<ERROR>`` (``"*"``:
  every call naming it), e.g. ``nvmlDeviceGetEncoderUtilization = "NO_PERMISSION"``.
- ``[gpu.hangs]`` ``call = seconds``: that call on this GPU blocks this long (the state's sleep) before
  answering or failing (``"*"``: every call naming it).
- ``[[gpu.xid]]`` ``xid``, ``at_s``, MIG ``gpu_instance_id`` / ``compute_instance_id``: an
  ``nvmlEventTypeXidCriticalError`` event, due ``at_s`` after the first ``nvmlInit``. It is delivered
  to a set registered for its GPU and type, once per set, the earliest due first: to every set
  registered before it fell due and, when none took it, to the first set registered later that waits
  (so ``at_s = 0`` reaches the watcher that registers after init); a set created after another took
  it does not get it again.

A call's names are those :data:`collectors.replay.state.CallHook` sees (pynvml's name; versioned
symbols such as ``nvmlDeviceGetMemoryInfo_v2`` match it).
"""

from __future__ import annotations

from collections.abc import Sequence

import pynvml

from collectors.replay.capture import GpuCapture, XidCapture
from collectors.replay.state import DueEvent, EventSource, ReplayEventSet, ReplayState

XID_EVENT = pynvml.nvmlEventTypeXidCriticalError


class DeviceStateHook:
    """The call hook of the GPUs' ``lost_at_s``, ``[gpu.errors]`` and ``[gpu.hangs]`` on ``state``."""

    def __init__(self, state: ReplayState, gpus: Sequence[GpuCapture]) -> None:
        self.state = state
        self.lost_at = [g.lost_at_s for g in gpus]
        self.errors = [dict(g.call_errors) for g in gpus]
        self.hangs = [dict(g.call_hangs) for g in gpus]

    def __call__(self, names: tuple[str, ...], gpu: int | None) -> None:
        """Sleep and/or raise ``pynvml.NVMLError`` for call ``names`` on NVML index ``gpu`` (None: a
        system call, never affected)."""
        if gpu is None:
            return
        hang = max((s for call, s in self.hangs[gpu].items() if call == "*" or call in names), default=0.0)
        if hang:
            self.state.sleep(hang)
        lost_at, t_init = self.lost_at[gpu], self.state.t_init
        if lost_at is not None and t_init is not None and self.state.clock() - t_init >= lost_at:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        error = next((e for call, e in self.errors[gpu].items() if call in names), self.errors[gpu].get("*"))
        if error is not None:
            raise pynvml.NVMLError(getattr(pynvml, f"NVML_ERROR_{error}"))


class ScheduledXids(EventSource):
    """The event source of the GPUs' ``[[gpu.xid]]`` (rules: the module docstring). ``events``:
    (NVML index, XID) pairs; an event's key is its position."""

    def __init__(self, events: Sequence[tuple[int, XidCapture]]) -> None:
        self.events = sorted(enumerate(events), key=lambda e: (e[1][1].at_s, e[0]))
        self.claimed: set[int] = set()

    def take(self, es: ReplayEventSet, now: float, start: float) -> tuple[DueEvent | None, float | None]:
        """The event to hand ``es`` now, or None and the clock time the next falls due (or None)."""
        for pos, (gpu, event) in self.events:
            due = start + event.at_s
            registered = es.registered.get((gpu, XID_EVENT))
            if registered is None or pos in es.delivered:
                continue
            if due > now:
                return None, due
            if registered > due and pos in self.claimed:
                continue  # it happened before this set listened, and another set took it
            self.claimed.add(pos)
            return DueEvent(pos, gpu, XID_EVENT, event.xid, event.gpu_instance_id, event.compute_instance_id), None
        return None, None


def attach(state: ReplayState) -> None:
    """Apply the device state of ``state.capture``'s GPUs: a call hook when one has ``lost_at_s``,
    errors or hangs, and the XID event source when one has XIDs. Nothing for a plain capture."""
    gpus = state.capture.gpus
    if any(g.lost_at_s is not None or g.call_errors or g.call_hangs for g in gpus):
        state.call_hooks.insert(0, DeviceStateHook(state, gpus))
    xids = [(i, x) for i, g in enumerate(gpus) for x in g.xids]
    if xids:
        state.event_source = ScheduledXids(xids)
