"""One MPS resource validator (accelstats/mps/rules.py), used by every caller with one set of bounds.

| caller | rules it runs |
|---|---|
| the TOML loader (``[mps]``, :func:`accelstats.config.load_config`) | :func:`check_settings` |
| the plugin decoder (``mps`` block, :func:`accelstats.nomad.config.decode`) | :func:`check_settings` |
| ``accelstats mps start`` (:class:`accelstats.mps.host.MpsDaemons`) | :func:`validate_resources` |
| the plugin's daemons (:class:`accelstats.nomad.mpsshares.PluginMps`) | :func:`validate_resources` |

The same bad resource gets the same message, with the same bound, from both loaders (each prefixes
the field in its own words); a bound changed in rules.py alone changes what all of them accept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest
from support.mps_util import GPU0, GPUS, H200_BYTES, UUID0, UUID1

from accelstats.config import load_config
from accelstats.mps import rules
from accelstats.mps.host import MpsDaemons
from accelstats.mps.rules import (
    MpsError,
    MpsGpu,
    MpsResource,
    MpsSettingError,
    Root,
    check_settings,
    validate,
    validate_resources,
)
from accelstats.nomad.config import decode
from accelstats.nomad.mpsshares import PluginMps
from accelstats.settings import ConfigError, MpsResourceSettings, MpsSettings


def toml_error(tmp_path: Path, resources: list[dict[str, Any]], **mps: Any) -> str:
    """The TOML loader's message for an ``[mps]`` table of ``resources`` (and ``mps`` keys)."""
    lines = [f"{k} = {v!r}" for k, v in mps.items()]
    for r in resources:
        lines.append("[[mps.resources]]")
        lines.extend(f"{k} = {v!r}" if not isinstance(v, list) else f"{k} = [{', '.join(map(repr, v))}]"
                     for k, v in r.items())
    config = tmp_path / "config.toml"
    config.write_text("[mps]\n" + "\n".join(lines).replace("'", '"') + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(config)
    message = str(err.value)
    assert message.startswith(f"{config}: key 'mps."), message
    return message.removeprefix(f"{config}: key ")


def plugin_error(resources: list[dict[str, Any]], **mps: Any) -> str:
    """The plugin decoder's message for an ``mps`` block of ``resources`` (devices as the strings HCL gives)."""
    blocks = [{**r, "devices": [str(d) for d in r.get("devices", [])]} for r in resources]
    with pytest.raises(ConfigError) as err:
        decode(msgpack.packb({"mps": {**mps, "resource": blocks}}))
    message = str(err.value)
    assert message.startswith("config: mps."), message
    return message.removeprefix("config: ")


def same_rule(toml: str, plugin: str) -> tuple[str, str, str]:
    """(TOML key, plugin field, message): the two front ends' words for the field, and one message."""
    key, _, toml_message = toml.partition(": ")
    field, _, plugin_message = plugin.partition(": ")
    assert toml_message == plugin_message, (toml, plugin)
    return key.strip("'"), field, toml_message


# (resources, the field of the first one at fault, what its message says)
BAD = [
    ([{"name": "r", "replicas": 49}], "resources[0].replicas", "replicas must be at most 48, got 49"),
    ([{"name": "r", "replicas": 20_000_000}], "resources[0].replicas", "at most 48, got 20000000"),
    ([{"name": "r", "replicas": 1}], "resources[0].replicas", "replicas must be at least 2, got 1"),
    ([{"name": "r", "replicas": 2, "devices": list(range(257))}], "resources[0].devices",
     "at most 256 devices, got 257"),
    ([{"name": "r", "replicas": 2, "devices": [0, 0]}], "resources[0].devices", "device 0 is listed twice"),
    ([{"name": "r", "replicas": 2, "devices": ["MIG-1"]}], "resources[0].devices",
     "device 'MIG-1' is neither a GPU UUID (GPU-…) nor an NVML index"),
    ([{"name": "r", "replicas": 2, "devices": ["GPU-" + "a" * 300]}], "resources[0].devices",
     "is longer than 256 characters"),
    ([{"name": "a", "replicas": 2, "devices": [1]}, {"name": "b", "replicas": 2, "devices": [2, 1]}],
     "resources[1].devices", "MPS resources 'a' and 'b' both list GPU 1"),
    ([{"name": "n" * 256, "replicas": 2}], "resources[0].name", "is not a usable MPS resource name"),
    ([{"name": "a/../b", "replicas": 2}], "resources[0].name", "is not a usable MPS resource name"),
    ([{"name": "shm/x", "replicas": 2}], "resources[0].name", "it would live in <root>/shm"),
    ([{"name": "a", "replicas": 2}, {"name": "a", "replicas": 3}], "resources[1].name",
     "MPS resource 'a' is configured twice"),
    ([{"name": "a", "replicas": 2, "devices": [0]}, {"name": "a/b", "replicas": 2, "devices": [1]}],
     "resources[1].name", "MPS resources 'a' and 'a/b' would nest their directories"),
    ([{"name": f"r{n}", "replicas": 2, "devices": [n]} for n in range(257)], "resources",
     "at most 256 resources, got 257"),
]


@pytest.mark.parametrize(("resources", "field", "says"), BAD, ids=[b[2][:40] for b in BAD])
def test_the_toml_file_and_the_plugin_config_refuse_a_resource_with_one_message(
        tmp_path: Path, resources: list[dict[str, Any]], field: str, says: str) -> None:
    key, plugin_field, message = same_rule(toml_error(tmp_path, resources), plugin_error(resources))
    assert key == f"mps.{field}"
    assert plugin_field == "mps." + field.replace("resources", "resource")
    assert says in message
    with pytest.raises(MpsSettingError) as err:  # and it is the validator's own message and field
        check_settings(MpsSettings(resources=tuple(
            MpsResourceSettings(r["name"], r["replicas"], tuple(r["devices"]) if "devices" in r else "all")
            for r in resources)))
    assert (err.value.field, str(err.value)) == (field, message)


def test_the_timeout_has_one_bound_in_both_front_ends(tmp_path: Path) -> None:
    _, field, message = same_rule(toml_error(tmp_path, [], timeout=601), plugin_error([], timeout="601s"))
    assert field == "mps.timeout" and message == "must be from 0.1 s to 600 s (each control command's limit), got 601 s"


def test_a_resource_past_the_per_gpu_bound_is_refused_at_start_by_the_same_rules(tmp_path: Path) -> None:
    """16 before Volta: what no loader can know without the GPU, every start refuses alike."""
    pascal = MpsGpu(UUID0, 0, H200_BYTES, "6.0", False)
    resource = MpsResource("r", 17, (UUID0,))
    with pytest.raises(MpsError, match="replicas 17 exceeds the maximum of 16 per GPU"):
        validate(resource, [pascal])
    assert "maximum of 16" in str(validate_resources([resource], [pascal])["r"])
    with pytest.raises(MpsError, match="replicas 17 exceeds the maximum of 16 per GPU"):
        MpsDaemons([resource], [pascal], Root(tmp_path)).start_all()  # accelstats mps start
    shares = PluginMps(MpsSettings(root=tmp_path, resources=(MpsResourceSettings("r", 17, (0,)),))).shares([pascal])
    assert not shares[UUID0].healthy and "maximum of 16" in shares[UUID0].reason  # the Nomad plugin


def test_a_gpu_named_by_uuid_and_by_index_in_two_resources_is_refused_at_start(tmp_path: Path) -> None:
    settings = MpsSettings(root=tmp_path, resources=(MpsResourceSettings("a", 2, (UUID0,)),
                                                     MpsResourceSettings("b", 2, (0, UUID1))))
    check_settings(settings)  # the text names different devices: only the GPUs tell
    resources = [MpsResource("a", 2, (UUID0,)), MpsResource("b", 2, (UUID0, UUID1))]
    errors = validate_resources(resources, GPUS)
    assert list(errors) == ["b"] and f"both list GPU {UUID0}" in str(errors["b"])


def test_one_bound_in_rules_py_decides_for_every_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lower the replica bound in accelstats/mps/rules.py alone: the TOML loader, the plugin decoder and
    the start all refuse what they accepted, with the new bound; nothing else holds a copy of it."""
    nine = [{"name": "r", "replicas": 9, "devices": [0]}]
    config = tmp_path / "ok.toml"
    config.write_text('[mps]\n[[mps.resources]]\nname = "r"\nreplicas = 9\ndevices = [0]\n')
    assert load_config(config).mps.resources[0].replicas == 9
    monkeypatch.setattr(rules, "MAX_REPLICAS_VOLTA_ON", 8)
    _, _, message = same_rule(toml_error(tmp_path, nine), plugin_error(nine))
    assert "replicas must be at most 8, got 9" in message
    with pytest.raises(MpsError, match="replicas 9 exceeds the maximum of 8 per GPU"):
        validate(MpsResource("r", 9, (UUID0,)), [GPU0])
