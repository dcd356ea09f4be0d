"""Call-counting fault and hang injection for the NVML replay: the scenario table ``[[fault]]``. Test
support, not part of accelstats.

A GPU's own state (it falls off the bus at a time, a call on it fails or hangs, it reports XIDs) is
the product's (``[[gpu]]`` keys ``lost_at_s``, ``[gpu.errors]``, ``[gpu.hangs]``, ``[[gpu.xid]]``:
``collectors/replay/device_state.py``, docs/replay.md). What stays here exists only for tests:
failures counted in C calls (``after_calls``, ``times``), on system calls (``nvmlInit``) or on every
GPU at once.

The product's replay (``collectors.replay.state``, ``collectors.replay.lib``) hands this table to the
extension registered in the process (:func:`collectors.replay.lib.register_extension`), and refuses
it when none is. :func:`register` registers this module: ``tests/conftest.py`` calls it in the test
processes, and ``tests/support/site/sitecustomize.py`` (first on the ``PYTHONPATH`` that conftest
gives every subprocess) calls it in each process the tests start, once ``collectors.replay.lib`` is
imported there (``python -m accelstats …``, ``nomad-device-accelstats``). A fault runs inside the
replayed C function, below the real pynvml, after the GPUs' own state::

    [[fault]]
    gpu = 1                          # NVML index; without it the fault hits that call on every GPU
    call = "nvmlDeviceGetMemoryInfo" # a call the replay answers (pynvml's name; versioned symbols
                                     #   such as nvmlDeviceGetMemoryInfo_v2 match it), or "*"
                                     #   (every call naming that GPU)
    error = "GPU_IS_LOST"            # NVML_ERROR_<error>; optional when hang_seconds is given
    after_calls = 0                  # this many matching calls succeed first
    times = 3                        # then fail this many times (default: forever)
    hang_seconds = 5                 # block (the state's sleep) this long before failing / answering

``hang_seconds`` is finite, 0..a year; ``after_calls`` / ``times`` non-negative integers. Errors are
CaptureError naming the file and the key.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import pynvml

from collectors.replay.capture import ScenarioTable
from collectors.replay.state import CALL_ALIASES, IMPLEMENTED_CALLS, ReplayState

TABLES = ("fault",)
CALLS = IMPLEMENTED_CALLS | CALL_ALIASES
_FAULT_KEYS = {"gpu", "call", "error", "after_calls", "times", "hang_seconds"}


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


def attach(state: ReplayState) -> None:
    """Read ``state.extra``'s ``fault`` tables and apply them to ``state``. Raises CaptureError naming
    the file and the key."""
    path = state.path
    assert path is not None or not state.extra
    errors = [n.removeprefix("NVML_ERROR_") for n in dir(pynvml) if n.startswith("NVML_ERROR_")]
    faults = [_fault(ScenarioTable(path, f"fault[{i}]", t, _FAULT_KEYS), len(state.capture.gpus), CALLS, errors)
              for i, t in enumerate(state.extra.get("fault", []))]  # type: ignore[arg-type]
    if faults:
        state.call_hooks.append(FaultHook(state, faults))


def register() -> None:
    """Hand every scenario's ``[[fault]]`` tables to :func:`attach` in this process
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
