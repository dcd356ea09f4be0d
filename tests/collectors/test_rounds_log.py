"""What the background rounds (collectors/rounds.py) log when a round is still running as the next is due.

| the running round | logged |
|---|---|
| slow: one call takes 0.5 s, rounds every 0.1 s (a loaded CPU) | info "still running after N s", once; no "hang" |
| hung: a call held past ``hang_after`` (0.5 s; default 10 s) | warning "... past 0.5 s: an NVML call hangs", once |

The accounting sampler (collectors/procsampler.py) on the replay backend; the slow and hung calls
are the replay's in-process fault injection (``hang_seconds``; ``HELD`` waits for the test).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from support.faultmatrix_util import HELD, HeldHang

from collectors.model import DeviceSnapshot
from collectors.nvidia import NvidiaBackend
from collectors.procsampler import ProcessSampler
from collectors.replay.lib import open_replay


def wait_for(predicate: object, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.01)
    raise AssertionError(f"not true within {timeout}s")


def backend(tmp_path: Path, fixtures_dir: Path, hang_seconds: float, hang: HeldHang) -> tuple[NvidiaBackend,
                                                                                               ProcessSampler]:
    """One H200 whose second ``nvmlDeviceGetProcessUtilization`` (the second accounting round) takes
    ``hang_seconds``; accounting rounds every 0.1 s."""
    path = tmp_path / "scenario.toml"
    path.write_text(f"""
[[gpu]]
capture = "{fixtures_dir / 'h200' / 'nvidia-smi-q.xml'}"
[[fault]]
call = "nvmlDeviceGetProcessUtilization"
hang_seconds = {hang_seconds:g}
after_calls = 1
times = 1
""")
    b = NvidiaBackend(open_replay(path, sleep=hang.sleep), deadline=30.0, pcie_interval=0)
    sampler = b.enable_accounting(0.1, lambda rounds: None)
    return b, sampler


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "collectors.rounds" and r.levelno == level]


def test_a_slow_round_is_still_running_not_a_hang(tmp_path: Path, fixtures_dir: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="collectors.rounds")
    with HeldHang() as hang:
        b, sampler = backend(tmp_path, fixtures_dir, 0.5, hang)
        try:
            b.update(DeviceSnapshot())
            wait_for(lambda: sampler.rounds >= 3)  # the slow round ended and the next ran
        finally:
            b.close()
    assert not any("hang" in r.getMessage() for r in caplog.records), caplog.text
    assert messages(caplog, logging.WARNING) == []
    late = messages(caplog, logging.INFO)
    assert len(late) == 1 and late[0].startswith("accounting: the previous round is still running after "), late
    assert late[0].endswith("(interval 0.1 s); this round is skipped")


def test_a_round_held_past_hang_after_is_a_hang(tmp_path: Path, fixtures_dir: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="collectors.rounds")
    with HeldHang() as hang:
        b, sampler = backend(tmp_path, fixtures_dir, HELD, hang)
        sampler.hang_after = 0.5
        try:
            b.update(DeviceSnapshot())
            wait_for(lambda: messages(caplog, logging.WARNING))
            assert hang.entered == 1 and sampler.rounds == 1
            hang.release()
            wait_for(lambda: sampler.rounds >= 3)
        finally:
            b.close()
    hung = messages(caplog, logging.WARNING)
    assert len(hung) == 1, hung
    assert hung[0].startswith("accounting: the previous round is still running after ")
    assert ", past 0.5 s: an NVML call hangs; accounting waits for it" in hung[0]
    assert len(messages(caplog, logging.INFO)) == 1  # first said to be late, once
