"""The sample rule (collectors/smsamples.py) against a driver model that the replay does not give: a
sampling period of 1/6 s or 1 s (nvidia-smi(1): "between 1 second and 1/6 second"), timestamps with
jitter, samples shown some milliseconds after their stamp, random phases between the driver's grid and
the reads, and the exporter starting while a job already runs. The model is written here from NVML's
words alone (a mean shape and an every shape, as in docs/accounting.md), not from the code under test.

| driver                         | reads              | checked                                       |
|--------------------------------|--------------------|-----------------------------------------------|
| mean or every, period 1 s      | 0.1, 0.25, 1, 2 s  | a 60 s job at 100 %: 60 SM-s within 1 %       |
| mean, 1 s, ±2 ms, 30 ms late   | 0.1, 0.25 s        | never learnt as "every" (20 random phases)    |
| every, 1/6 s, random bursts    | 0.1, 0.25, 1 s     | SM-seconds within 1 % of the model's samples  |
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from collectors.smsamples import SmSamples

Util = Callable[[int, float], int]


@dataclass
class Driver:
    """Samples of every PID at ``phase + k x period`` (± ``jitter``) seconds, each the PID's SM % then,
    visible ``lag`` seconds after their stamp; answered in ``shape``: ``mean`` (one sample per PID: the
    newest busy stamp, the whole-percent mean of the samples since the cursor up to it) or ``every``."""

    period: float
    util: Util
    pids: tuple[int, ...]
    shape: str
    lag: float = 0.0
    jitter: float = 0.0
    phase: float = 0.0
    seed: int = 1
    stamps: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        rnd = random.Random(self.seed)
        # from before the first read: a driver samples for as long as it is loaded
        self.stamps = [round((self.phase + k * self.period + rnd.uniform(-self.jitter, self.jitter)) * 1e6)
                       for k in range(-5, int(120 / self.period))]

    def query(self, since_us: int, now: float) -> list[Any]:
        visible = [t for t in self.stamps if since_us < t <= round((now - self.lag) * 1e6)]
        out = []
        for pid in self.pids:
            window = [(t, self.util(pid, t / 1e6)) for t in visible]
            busy = [t for t, v in window if v]
            if not busy:
                continue
            if self.shape == "every":
                out += [SimpleNamespace(pid=pid, timeStamp=t, smUtil=v) for t, v in window if v]
            else:
                upto = [v for t, v in window if t <= busy[-1]]
                out.append(SimpleNamespace(pid=pid, timeStamp=busy[-1], smUtil=int(sum(upto) / len(upto) + 0.5)))
        return out

    def truth(self, pid: int, after: float, until: float) -> float:
        """SM-seconds of ``pid``'s samples stamped in ``(after, until]``: value x the period each stands for."""
        return sum(self.util(pid, t / 1e6) / 100 * (t - s) / 1e6
                   for s, t in zip(self.stamps, self.stamps[1:], strict=False) if after < t / 1e6 <= until)


def read(driver: Driver, interval: float, end: float, start: float) -> tuple[dict[int, float], SmSamples]:
    """Reads every ``interval`` s from ``start`` to ``end`` as collectors/procsampler.py makes them."""
    state, totals, first, t = SmSamples(), {}, True, start
    state.hint_period(driver.stamps[:20])  # the device's own samples at the first read
    while t <= end + 1e-9:
        now_us = round(t * 1e6)
        answer = driver.query(state.ask(now_us), t)
        if answer:
            got = state.answer(answer, now_us, prime=first, query=lambda since, t=t: driver.query(since, t))
        elif first:
            state.prime(now_us)
            got = None
        else:
            got = state.not_found(now_us)
        first = False
        for pid, seconds in (got.seconds if got else {}).items():
            totals[pid] = totals.get(pid, 0.0) + seconds
        t = round(t + interval, 9)
    return totals, state


@pytest.mark.parametrize("shape", ["mean", "every"])
@pytest.mark.parametrize("interval", [0.1, 0.25, 1.0, 2.0])
def test_a_job_on_a_driver_sampling_once_a_second(shape: str, interval: float) -> None:
    driver = Driver(1.0, lambda pid, t: 100 if 5 <= t < 65 else 0, (7,), shape, lag=0.05, phase=0.37)
    totals, state = read(driver, interval, 80.0, start=0.5)
    assert totals[7] == pytest.approx(60.0, rel=0.01)
    assert state.shape in (shape, None)  # learnt right, or not needed


@pytest.mark.parametrize("interval", [0.1, 0.25])
def test_a_mean_driver_with_late_jittered_samples_is_never_taken_for_every(interval: float) -> None:
    wrong = []
    for seed in range(20):
        rnd = random.Random(seed)
        driver = Driver(1.0, lambda pid, t: 100 if t < 60 else 0, (7,), "mean", lag=0.03, jitter=0.002,
                        phase=rnd.uniform(0, 1), seed=seed)
        _, state = read(driver, interval, 80.0, start=rnd.uniform(0, 1))
        if state.shape == "every":
            wrong.append(seed)
    assert wrong == []


@pytest.mark.parametrize("interval", [0.1, 0.25, 1.0])
def test_random_bursts_on_an_every_driver(interval: float) -> None:
    """Two PIDs, bursts of 0.5-5 s at 20-100 % with pauses of 0.5-8 s, 10 random schedules each."""
    for seed in range(10):
        rnd = random.Random(seed)
        bursts: dict[int, list[tuple[float, float, int]]] = {}
        for pid in (7, 8):
            t, mine = rnd.uniform(2, 6), []
            while t < 60:
                length = rnd.choice([0.5, 1, 2, 3, 5])
                mine.append((t, t + length, rnd.choice([20, 40, 50, 100])))
                t += length + rnd.choice([0.5, 1, 2, 4, 8])
            bursts[pid] = mine

        def util(pid: int, t: float, bursts: dict[int, list[tuple[float, float, int]]] = bursts) -> int:
            return next((level for b, e, level in bursts[pid] if b <= t < e), 0)

        driver = Driver(1 / 6, util, (7, 8), "every")
        totals, _ = read(driver, interval, 80.0, start=0.5)
        for pid in (7, 8):
            assert totals.get(pid, 0.0) == pytest.approx(driver.truth(pid, 0.5, 80.0), rel=0.01), (seed, pid)
