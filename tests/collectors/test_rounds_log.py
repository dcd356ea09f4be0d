"""What the background rounds (collectors/rounds.py) log when a round is still running as the next is due.

| the running round | logged |
|---|---|
| slow: one call takes 0.5 s, rounds every 0.1 s (a loaded CPU) | info "still running after N s"; no "hang" |
| hung: a call held past ``hang_after`` (0.5 s; default 10 s) | warning "... an NVML call hangs", once per episode |
| late again and again (three held calls in a minute) | one info line a minute; the next counts those left out |

Every round not started because the previous one still ran is counted in ``sampler.skipped``.
The accounting sampler (collectors/procsampler.py) on the replay backend; the slow and hung calls
are the replay's in-process fault injection (``hang_seconds``; ``HELD`` waits for the test). A
loaded runner (2 cores, 4 test workers) can make any ordinary round late too, so the checks allow
more late episodes than the test makes, never fewer, and never a hang that was not held.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support.faultmatrix_util import HELD, HeldHang, wait_until

from collectors.model import DeviceSnapshot
from collectors.nvidia import NvidiaBackend
from collectors.procsampler import ProcessSampler
from collectors.replay.lib import open_replay


def backend(tmp_path: Path, fixtures_dir: Path, hang_seconds: float, sleep: Callable[[float], None], *,
            times: int = 1) -> tuple[NvidiaBackend, ProcessSampler]:
    """One H200 whose ``nvmlDeviceGetProcessUtilization`` calls 2 to ``times + 1`` (one per accounting
    round) take ``hang_seconds``; accounting rounds every 0.1 s."""
    path = tmp_path / "scenario.toml"
    path.write_text(f"""
[[gpu]]
capture = "{fixtures_dir / 'h200' / 'nvidia-smi-q.xml'}"
[[fault]]
call = "nvmlDeviceGetProcessUtilization"
hang_seconds = {hang_seconds:g}
after_calls = 1
times = {times}
""")
    b = NvidiaBackend(open_replay(path, sleep=sleep), deadline=30.0, pcie_interval=0)
    sampler = b.enable_accounting(0.1, lambda rounds: None)
    return b, sampler


class OneAtATime:
    """A replay ``sleep`` under which each ``HELD`` call waits until the test lets one through."""

    def __init__(self) -> None:
        self.gate = threading.Semaphore(0)
        self.entered = 0

    def sleep(self, seconds: float) -> None:
        if seconds != HELD:
            time.sleep(seconds)
            return
        self.entered += 1
        self.gate.acquire(timeout=20)

    def release_all(self) -> None:
        for _ in range(100):
            self.gate.release()


LATE = re.compile(r"accounting: the previous round is still running after \d+\.\d s \(interval 0\.1 s\); "
                  r"this round is skipped(; (\d+) more such episodes since the last line were not logged)?")


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "collectors.rounds" and r.levelno == level]


def test_a_slow_round_is_still_running_not_a_hang(tmp_path: Path, fixtures_dir: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="collectors.rounds")
    b, sampler = backend(tmp_path, fixtures_dir, 0.5, time.sleep)
    try:
        b.update(DeviceSnapshot())
        wait_until(lambda: sampler.rounds >= 3, timeout=20.0)  # the slow round ended and the next ran
    finally:
        b.close()
    assert not any("hang" in r.getMessage() for r in caplog.records), caplog.text
    assert messages(caplog, logging.WARNING) == []
    late = messages(caplog, logging.INFO)
    assert late and all(LATE.fullmatch(m) for m in late), late  # more than one if the runner is loaded
    assert sampler.skipped >= len(late)


def test_a_round_held_past_hang_after_is_a_hang(tmp_path: Path, fixtures_dir: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="collectors.rounds")
    with HeldHang() as hang:
        b, sampler = backend(tmp_path, fixtures_dir, HELD, hang.sleep)
        sampler.hang_after = 0.5
        try:
            b.update(DeviceSnapshot())
            wait_until(lambda: messages(caplog, logging.WARNING), timeout=20.0)
            skipped = sampler.skipped
            wait_until(lambda: sampler.skipped >= skipped + 3, timeout=20.0)  # three more rounds skipped, still held
            assert hang.entered == 1 and sampler.rounds == 1
            hung, late = messages(caplog, logging.WARNING), messages(caplog, logging.INFO)
            hang.release()
            wait_until(lambda: sampler.rounds >= 3, timeout=20.0)
        finally:
            b.close()
    assert len(hung) == 1, hung  # once in the episode, not at each skipped round
    assert hung[0].startswith("accounting: the previous round is still running after ")
    assert ", past 0.5 s: an NVML call hangs; accounting waits for it" in hung[0]
    assert late and LATE.fullmatch(late[-1]), late  # first said to be late


def test_late_episodes_are_said_at_most_once_a_minute(tmp_path: Path, fixtures_dir: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Three held rounds in a row are three late episodes within a minute: one info line (the old
    code said each). Then, the minute taken as over, the next episode's line counts those left out."""
    caplog.set_level(logging.INFO, logger="collectors.rounds")
    gate = OneAtATime()
    b, sampler = backend(tmp_path, fixtures_dir, HELD, gate.sleep, times=4)
    try:
        b.update(DeviceSnapshot())
        for episode in range(1, 4):
            wait_until(lambda: gate.entered == episode, timeout=20.0)  # noqa: B023 (called at once)
            skipped = sampler.skipped
            wait_until(lambda: sampler.skipped > skipped, timeout=20.0)  # noqa: B023 (called at once)
            gate.gate.release()  # this held round ends; the next round is held again
        assert len(messages(caplog, logging.INFO)) == 1, messages(caplog, logging.INFO)
        sampler.late_log_every = 0.0
        wait_until(lambda: gate.entered == 4, timeout=20.0)
        wait_until(lambda: len(messages(caplog, logging.INFO)) >= 2, timeout=20.0)
    finally:
        gate.release_all()
        b.close()
    first, second = messages(caplog, logging.INFO)[:2]
    assert LATE.fullmatch(first) and LATE.fullmatch(first).group(1) is None, first  # type: ignore[union-attr]
    found = LATE.fullmatch(second)
    assert found and found.group(2) and int(found.group(2)) >= 2, second  # episodes 2 and 3, or more if loaded
    assert messages(caplog, logging.WARNING) == []
