"""Every size the configuration controls is bounded.

Before, the plugin built what its config asked, however large: ``replicas = 20000000`` grew it to
4.6 GB in 20 s and killed it before its first fingerprint. Now ``replicas`` is bounded by NVIDIA's
MPS limit (up to 48 clients per GPU, Volta and newer; NVIDIA's Multi-Process Service
documentation), in the plugin's ``mps`` block and in the exporter's ``[mps]`` table, and every list
and string of the plugin config has a bound no operator reaches; a value past one is refused at
once, by name, before anything is built from it.

Part one drives the installed ``nomad-device-accelstats`` as Nomad does
(:class:`support.nomadclient.launcher.PluginProcess`) and measures the refusal's time and the plugin's
memory; part two checks each bound on the decoders themselves.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import psutil
import pytest
from support.nomadclient import ctymsgpack
from support.nomadclient.ctymsgpack import encode_for_spec
from support.nomadclient.launcher import PluginProcess
from support.plugin_util import binary
from support.plugin_util import config as plugin_config

from accelstats.config import load_config
from accelstats.nomad.config import decode, schema
from accelstats.nomad.devices import MAX_RESERVE_IDS
from accelstats.nomad.proto import hclspec_pb2
from accelstats.settings import ConfigError

MPS_DOUBLE = Path(__file__).resolve().parents[1] / "support" / "mps_double"  # nvidia-smi, MPS control

H200 = "GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c10"
HUGE = 20_000_000  # the replica count of the issue
REFUSE_WITHIN_S = 2.0  # a SetConfig refused by a bound answers within this
RSS_GROWTH_LIMIT = 50 * 2**20  # bytes the plugin may grow by while refusing (it grew by 4.6 GB)


def mps_config(tmp_path: Path, fixtures_dir: Path, replicas: Any, **resource: Any) -> dict[str, Any]:
    return {"fingerprint_period": "1m", "nvml_replay": str(fixtures_dir / "h200" / "nvidia-smi-q.xml"),
            "mps": {"root": str(tmp_path / "mps"), "resource": [{"name": "shared", "replicas": replicas, **resource}]}}


def rss(plugin: PluginProcess) -> int:
    assert plugin.pid is not None
    return int(psutil.Process(plugin.pid).memory_info().rss)


def refused(plugin: PluginProcess, data: bytes) -> tuple[str, float]:
    """SetConfig ``data``: (details of the INVALID_ARGUMENT it must answer, seconds it took)."""
    t0 = time.monotonic()
    with pytest.raises(Exception) as err:
        plugin.set_config(data)
    took = time.monotonic() - t0
    assert err.value.code().name == "INVALID_ARGUMENT", err.value  # type: ignore[attr-defined]
    return str(err.value.details()), took  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------- the installed plugin


def test_twenty_million_replicas_are_refused_at_once_and_the_plugin_stays_small(
        tmp_path: Path, fixtures_dir: Path) -> None:
    env = {**os.environ, "PATH": f"{MPS_DOUBLE}{os.pathsep}{os.environ['PATH']}"}
    with PluginProcess(binary(), env=env) as plugin:
        spec = plugin.config_schema().spec
        before = rss(plugin)
        details, took = refused(plugin, encode_for_spec(spec, mps_config(tmp_path, fixtures_dir, HUGE)))
        assert "mps.resource[0].replicas" in details and "48" in details and str(HUGE) in details, details
        assert took < REFUSE_WITHIN_S
        details, _ = refused(plugin, encode_for_spec(spec, mps_config(tmp_path, fixtures_dir, 49)))
        assert "replicas" in details and "got 49" in details  # the first value past NVIDIA's limit
        # still serving, and a fingerprint (where the replicas would have been built) stays small
        plugin.set_config(encode_for_spec(spec, {"fingerprint_period": "1m",
                                                 "nvml_replay": str(fixtures_dir / "h200" / "nvidia-smi-q.xml")}))
        (group,) = plugin.fingerprint().read(timeout=20).device_group
        assert [d.ID for d in group.devices] == [H200]
        assert rss(plugin) - before < RSS_GROWTH_LIMIT, (before, rss(plugin))
        assert plugin.health() == "SERVING"


def test_lists_past_their_bound_are_refused_by_the_plugin_and_by_nomads_schema(tmp_path: Path) -> None:
    """A list the plugin refuses by name, sent as raw msgpack (anyone who can reach the socket can), and
    the ``resource`` block bound that the schema gives Nomad (it refuses more blocks before sending)."""
    with PluginProcess(binary()) as plugin:
        before = rss(plugin)
        ids = [f"GPU-{n:08d}-0000-0000-0000-000000000000" for n in range(20_000)]  # ~1 MB, under gRPC's 4 MiB
        details, took = refused(plugin, msgpack.packb({"ignored_gpu_ids": ids}))
        assert "ignored_gpu_ids" in details and "20000" in details and took < REFUSE_WITHIN_S
        blocks = [{"name": f"r{n}", "replicas": 2, "devices": []} for n in range(10_000)]
        details, took = refused(plugin, msgpack.packb({"mps": {"resource": blocks}}))
        assert "mps.resource" in details and "10000" in details and took < REFUSE_WITHIN_S
        details, _ = refused(plugin, msgpack.packb({"mps": {"resource": [
            {"name": "r", "replicas": 2, "devices": [str(n) for n in range(100_000)]}]}}))
        assert "mps.resource[0].devices" in details and "100000" in details
        assert rss(plugin) - before < RSS_GROWTH_LIMIT, (before, rss(plugin))
        with pytest.raises(ctymsgpack.ConfigError, match="too many resource blocks; no more than 256"):
            encode_for_spec(plugin.config_schema().spec, {"mps": {"resource": blocks[:257]}})
        assert plugin.health() == "SERVING"


def test_reserve_counts_a_repeated_id_once_and_refuses_more_ids_than_one_request_holds(tmp_path: Path) -> None:
    """Reserve through the plugin's gRPC server, as whoever can reach its socket may send it.

    | request | answer |
    |---|---|
    | ``dev0, dev1, dev0, dev0`` | one mount each for dev0 and dev1 (a repeat names the same device) |
    | ``dev0`` x 1024 (``MAX_RESERVE_IDS``) | one mount |
    | ``dev0`` x 1025; x 600 000 (3.6 MB), eight at once | INVALID_ARGUMENT "too many device IDs ...", at once |
    | 5 MB of IDs | RESOURCE_EXHAUSTED (gRPC's 4 MiB, set explicitly) |

    Before, 600 000 repeats were answered with 600 000 mounts (28.8 MB), and eight such requests at
    once took the plugin from 45 MiB to a 1.4 GiB peak RSS (2026-12-05, this VM)."""
    devdir = tmp_path / "devices"
    devdir.mkdir()
    for name in ("dev0", "dev1"):
        (devdir / name).write_text("x")
    with PluginProcess(binary()) as plugin:
        plugin.set_config(encode_for_spec(plugin.config_schema().spec, plugin_config(devdir=devdir)))
        plugin.fingerprint().read(timeout=20)

        def mounts(ids: list[str]) -> list[str]:
            return [m.task_path for m in plugin.reserve(ids, timeout=10).container_res.mounts]

        assert mounts(["dev0", "dev1", "dev0", "dev0"]) == ["/tmp/task-mounts/dev0", "/tmp/task-mounts/dev1"]
        assert mounts(["dev0"] * MAX_RESERVE_IDS) == ["/tmp/task-mounts/dev0"]
        with pytest.raises(Exception) as err:
            plugin.reserve(["dev0"] * (MAX_RESERVE_IDS + 1), timeout=10)
        assert err.value.code().name == "INVALID_ARGUMENT"  # type: ignore[attr-defined]
        assert err.value.details() == (f"too many device IDs to reserve: {MAX_RESERVE_IDS + 1}, at most "  # type: ignore[attr-defined]
                                        f"{MAX_RESERVE_IDS} (Nomad sends the IDs of one device request)")
        before = peak = rss(plugin)
        answers: list[str] = []

        def flood() -> None:
            try:
                plugin.reserve(["dev0"] * 600_000, timeout=60)
                answers.append("answered")
            except Exception as exc:  # noqa: BLE001 - the answer's code is what is checked
                answers.append(f"{exc.code().name}: {exc.details()}")  # type: ignore[attr-defined]

        threads = [threading.Thread(target=flood) for _ in range(8)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            peak = max(peak, rss(plugin))
            time.sleep(0.005)
        took = time.monotonic() - t0
        print(f"eight 600 000-ID Reserves: {took:.2f} s, RSS {before >> 20} MiB, peak {peak >> 20} MiB")
        assert answers == [f"INVALID_ARGUMENT: too many device IDs to reserve: 600000, at most {MAX_RESERVE_IDS} "
                           "(Nomad sends the IDs of one device request)"] * 8
        assert took < REFUSE_WITHIN_S * 4 and peak - before < 4 * RSS_GROWTH_LIMIT, (took, before, peak)
        with pytest.raises(Exception) as err:
            plugin.reserve(["d" * 1000] * 5000, timeout=10)  # 5 MB
        assert err.value.code().name == "RESOURCE_EXHAUSTED"  # type: ignore[attr-defined]
        assert mounts(["dev1"]) == ["/tmp/task-mounts/dev1"] and plugin.health() == "SERVING"


# ---------------------------------------------------------------------------- the decoders


def packed(config: dict[str, Any]) -> bytes:
    return encode_for_spec(schema(hclspec_pb2), config)


@pytest.mark.parametrize(("config", "field"), [
    ({"mps": {"resource": [{"name": "r", "replicas": HUGE}]}}, "mps.resource[0].replicas"),
    ({"mps": {"resource": [{"name": "r", "replicas": 49}]}}, "mps.resource[0].replicas"),
    ({"mps": {"resource": [{"name": "r", "replicas": str(10**18)}]}}, "mps.resource[0].replicas"),
    ({"mps": {"resource": [{"name": "r", "replicas": 2}] * 257}}, "mps.resource"),
    ({"mps": {"resource": [{"name": "r", "replicas": 2, "devices": ["0"] * 257}]}}, "mps.resource[0].devices"),
    ({"mps": {"resource": [{"name": "r", "replicas": 2, "devices": ["GPU-" + "a" * 300]}]}},
     "mps.resource[0].devices"),
    ({"mps": {"resource": [{"name": "n" * 256, "replicas": 2}]}}, "mps.resource[0].name"),
    ({"ignored_gpu_ids": ["GPU-1"] * 1025}, "ignored_gpu_ids"),
    ({"ignored_gpu_ids": ["GPU-" + "1" * 300]}, "ignored_gpu_ids"),
    ({"file_devices": {"dir": "/tmp", "vendor": "v" * 257}}, "file_devices.vendor"),
    ({"file_devices": {"dir": "/tmp", "type": "t" * 257}}, "file_devices.type"),
    ({"file_devices": {"dir": "/tmp", "name": "n" * 257}}, "file_devices.name"),
    ({"file_devices": {"dir": "/" + "d" * 5000}}, "file_devices.dir"),
    ({"nvml_replay": "/" + "r" * 5000}, "nvml_replay"),
])
def test_each_bound_of_the_plugin_config_is_refused_by_name(config: dict[str, Any], field: str) -> None:
    data = msgpack.packb(config)  # raw: past the schema's own bound too
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as err:
        decode(data)
    assert time.monotonic() - t0 < 0.5
    message = str(err.value)
    assert message.startswith(f"config: {field}") and "\n" not in message, message


def test_the_largest_values_within_bounds_are_accepted() -> None:
    config = decode(packed({"ignored_gpu_ids": ["GPU-" + "1" * 252] * 1024,
                            "file_devices": {"dir": "/tmp", "vendor": "v" * 256},
                            "mps": {"resource": [{"name": "n" * 255, "replicas": 48,  # distinct: one GPU, one listing
                                                  "devices": [str(n) for n in range(256)]}]
                                    + [{"name": f"r{n}", "replicas": 2} for n in range(255)]}}))
    assert len(config.nomad.ignored_gpu_ids) == 1024 and config.file_devices.vendor == "v" * 256
    assert len(config.mps.resources) == 256 and config.mps.resources[0].replicas == 48
    assert len(config.mps.resources[0].devices) == 256


@pytest.mark.parametrize(("table", "key"), [
    (f'[[mps.resources]]\nname = "r"\nreplicas = {HUGE}\n', "mps.resources[0].replicas"),
    ('[[mps.resources]]\nname = "r"\nreplicas = 49\n', "mps.resources[0].replicas"),
    ('[[mps.resources]]\nname = "r"\nreplicas = 2\ndevices = [' + ", ".join(["0"] * 257) + "]\n",
     "mps.resources[0].devices"),
    ("".join(f'[[mps.resources]]\nname = "r{n}"\nreplicas = 2\n' for n in range(257)), "mps.resources"),
    (f'[[mps.resources]]\nname = "{"n" * 256}"\nreplicas = 2\n', "mps.resources[0].name"),
])
def test_the_exporter_mps_table_is_bounded_too(tmp_path: Path, table: str, key: str) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text("[mps]\n" + table)
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    message = str(err.value)
    assert message.startswith(f"{cfg}: key '{key}'") and "\n" not in message, message
    cfg.write_text('[mps]\n[[mps.resources]]\nname = "r"\nreplicas = 48\n')
    assert load_config(cfg).mps.resources[0].replicas == 48
