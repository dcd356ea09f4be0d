"""Reserve storms during Fingerprint and Stats streaming, on the installed plugin.

The real ``nomad-device-accelstats`` (support.nomadclient.launcher.PluginProcess, as Nomad launches
it) with two replayed H200s: while its Fingerprint stream (a full message every second) and a
Stats stream (every 0.5 s) are read, 8 threads fire Reserve back to back for 4 s with valid ID
sets, unknown IDs and an empty list (benchmarks/plugin.py ``reserve_storm``).

| Reserve of | answer |
|---|---|
| fingerprinted GPU IDs | a reservation Nomad accepts, ``CUDA_VISIBLE_DEVICES`` = the IDs in order |
| an unknown ID | INVALID_ARGUMENT ``unknown device "<id>"`` |
| no ID | INVALID_ARGUMENT ``no device IDs`` |

Both streams keep delivering valid messages during the storm and after it, and the plugin stays
SERVING, logs nothing Nomad could not read, and exits by itself on Shutdown. Message counts only:
no timing ratios.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from support.nomadclient.ctymsgpack import encode_for_spec
from support.nomadclient.launcher import PluginProcess
from support.nomadclient.validate import validate_fingerprint, validate_stats
from support.paths import FIXTURES, REPO_ROOT
from support.plugin_util import binary

if str(REPO_ROOT / "benchmarks") not in sys.path:  # benchmarks/ is not a package
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import plugin as bench
from scrape import write_scenario

STORM_SECONDS = 4.0


@pytest.mark.slow  # more than ~5 s: real daemons, deadlines or a soak
def test_reserve_storm_gets_correct_answers_while_both_streams_go_on(tmp_path: Path) -> None:
    scenario = write_scenario(tmp_path / "two.toml", FIXTURES / "h200" / "nvidia-smi-q.xml", 2)
    with PluginProcess(binary()) as plugin:
        plugin.set_config(encode_for_spec(plugin.config_schema().spec, bench.storm_config(scenario)))
        fingerprint = plugin.fingerprint()
        gpus = sorted(d.ID for g in fingerprint.read(timeout=30).device_group for d in g.devices)
        assert len(gpus) == 2
        stats = plugin.stats(0.5)
        stats.read(timeout=30)
        with bench.StreamCounter(fingerprint, validate_fingerprint) as fp, \
                bench.StreamCounter(stats, validate_stats) as st:
            t0 = time.monotonic()
            storm = bench.reserve_storm(plugin, [gpus[:1], gpus, gpus[::-1]], threads=8, seconds=STORM_SECONDS)
            t1 = time.monotonic()

        assert storm.wrong == []
        assert set(storm.correct) == {"valid", "unknown", "empty"} and min(storm.correct.values()) > 0
        assert fp.failure == "" and st.failure == ""
        assert fp.problems == [] and st.problems == []
        assert fp.between(t0, t1) >= 2, fp.messages  # a full fingerprint every second
        assert st.between(t0, t1) >= 2, st.messages  # stats every 0.5 s
        assert validate_fingerprint(fingerprint.read(timeout=10)) == []  # and after the storm
        assert validate_stats(stats.read(timeout=10)) == []
        assert fingerprint.open and stats.open
        assert plugin.health() == "SERVING"
        result = plugin.shutdown()
        assert result.exited_by_itself, plugin.stderr_tail()
        assert plugin.hclog_problems() == []
        assert plugin.problems == []


def test_the_storm_judge_tells_wrong_answers() -> None:
    class Rpc(bench.grpc.RpcError):  # type: ignore[misc]
        def __init__(self, code: str, details: str) -> None:
            self._code, self._details = code, details

        def code(self) -> object:
            return getattr(bench.grpc.StatusCode, self._code)

        def details(self) -> str:
            return self._details

    def raises(code: str, details: str) -> object:
        def call() -> object:
            raise Rpc(code, details)
        return call

    ok_bad = raises("INVALID_ARGUMENT", 'unknown device "x"')
    assert bench.check_reserve("unknown", ["x"], ok_bad) == ""
    assert bench.check_reserve("empty", [], raises("INVALID_ARGUMENT", "no device IDs to reserve")) == ""
    assert "RESOURCE_EXHAUSTED" in bench.check_reserve("unknown", ["x"], raises("RESOURCE_EXHAUSTED", "busy"))
    assert "FAILED_PRECONDITION" in bench.check_reserve("valid", ["GPU-1"], raises("FAILED_PRECONDITION", "no"))
    assert "unknown device" in bench.check_reserve("empty", [], ok_bad)

    reservation = bench.device_pb2.ReserveResponse()
    reservation.container_res.envs["CUDA_VISIBLE_DEVICES"] = "GPU-2,GPU-1"
    assert "answered a reservation" in bench.check_reserve("unknown", ["x"], lambda: reservation)
    assert "'GPU-2,GPU-1'" in bench.check_reserve("valid", ["GPU-1", "GPU-2"], lambda: reservation)
    assert bench.check_reserve("valid", ["GPU-2", "GPU-1"], lambda: reservation) == ""
