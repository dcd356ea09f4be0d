"""Fuzzing the Nomad plugin's ``SetConfig`` msgpack decoder (accelstats/nomad/config.py :func:`decode`).

Documented error type: :class:`accelstats.settings.ConfigError` ("Raises ConfigError naming the
field"; the servicer answers INVALID_ARGUMENT with it). A decoded config is the project's one settings
model, :class:`accelstats.settings.Settings`. Inputs: arbitrary bytes, msgpack of random
values (maps with keys of any type, ext and bin items), near-valid configs (the schema's keys with
values of every type), and valid configs encoded exactly as a Nomad client does
(:func:`support.nomadclient.ctymsgpack.encode_for_spec` over the plugin's own schema, in each number
mode), which must decode to the settings they hold.

The escapes this module found (map keys that are not strings, or not hashable; ``²``, which
``str.isdigit`` accepts and ``int`` refuses; digit runs beyond ``int()``'s 4300-digit limit) were fixed
in accelstats/nomad/config.py and accelstats/config.py; :data:`REGRESSIONS` keeps them as ConfigError cases.
"""

from __future__ import annotations

import math
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from support.nomadclient.ctymsgpack import encode_for_spec

from accelstats.mps.rules import MAX_TIMEOUT, MIN_TIMEOUT
from accelstats.nomad import config as plugin_config
from accelstats.nomad.config import DEFAULTS, decode
from accelstats.nomad.proto import hclspec_pb2
from accelstats.settings import (
    ConfigError,
    FileDevicesSettings,
    MpsResourceSettings,
    MpsSettings,
    NomadSettings,
    Settings,
)

from .profiles import fuzz_settings

SCHEMA = plugin_config.schema(hclspec_pb2)
TOP_KEYS = [*plugin_config.ATTRIBUTES, "file_devices", "mps"]
BLOCK_KEYS = {"file_devices": [*plugin_config.FILE_DEVICE_ATTRIBUTES], "mps": [*plugin_config.MPS_ATTRIBUTES,
                                                                              "resource"]}
RESOURCE_KEYS = ["name", "replicas", "devices"]


def decoded_or_refused(data: bytes) -> Settings | None:
    """``decode(data)``, or None when it raises ConfigError with a message naming ``config``; any
    other exception escapes and fails the test."""
    try:
        return decode(data)
    except ConfigError as exc:
        assert str(exc).startswith("config")
        return None


# ---------------------------------------------------------------------------- strategies

# Any text but lone surrogates (msgpack cannot encode them). Non-ASCII digits ('²', '①') once escaped
# decode as ValueError: kept in, and in REGRESSIONS below as regression examples.
safe_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=16)
scalars = st.one_of(
    st.none(), st.booleans(), safe_text, st.integers(-(2**63), 2**64 - 1), st.floats(), st.binary(max_size=8),
    st.sampled_from(["", "0", "2", "5s", "1m30s", "-1s", "1e9h", ".5s", "0.", ":9400", "[::1]:9400", "host:0",
                     "host:65536", "-rwxrwxrwx", "drwxr-x---", "a/b", "..", "/abs", "GPU-1", "nvidia.com/gpu",
                     "x" * 5000]),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(safe_text, inner, max_size=3)), max_leaves=10)


@st.composite
def near_valid_configs(draw: st.DrawFn) -> dict[str, Any]:
    """The schema's keys (and sometimes an unknown one) with random values, blocks with their keys."""
    config: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from([*TOP_KEYS, "bogus"]), max_size=6, unique=True)):
        if key in BLOCK_KEYS and draw(st.booleans()):
            block = {k: draw(values) for k in draw(st.lists(st.sampled_from([*BLOCK_KEYS[key], "bogus"]), unique=True))}
            if key == "mps" and draw(st.booleans()):
                block["resource"] = draw(st.lists(st.dictionaries(st.sampled_from(RESOURCE_KEYS), values), max_size=3))
            config[key] = block
        else:
            config[key] = draw(values)
    return config


def pack_pairs(pairs: list[tuple[bytes, bytes]]) -> bytes:
    """A msgpack map of already packed keys and values (keys may be arrays or maps, which Python
    dicts cannot hold but a peer can send)."""
    return b"\xdf" + struct.pack(">I", len(pairs)) + b"".join(k + v for k, v in pairs)


any_item = st.recursive(
    # ext 8 written by hand: msgpack.ExtType refuses the reserved negative codes the wire allows (-1 = timestamp)
    st.one_of(scalars.map(msgpack.packb), st.builds(lambda c, d: b"\xc7" + bytes([len(d)]) + struct.pack("b", c) + d,
                                                    st.integers(-128, 127), st.binary(max_size=12))),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3).map(lambda items: b"\xdd" + struct.pack(">I", len(items)) + b"".join(items)),
        st.lists(st.tuples(st.one_of(inner, st.sampled_from(TOP_KEYS).map(msgpack.packb)), inner), max_size=3)
        .map(pack_pairs)),
    max_leaves=10)


# ---------------------------------------------------------------------------- properties


@fuzz_settings()
@given(st.one_of(st.binary(), near_valid_configs().map(msgpack.packb)))
@example(b"\xc1")  # never used
@example(b"\x91" * 100_000)  # nested deeper than msgpack's limit
@example(b"\x81\xa7enabled\xc3\x00")  # extra data after the map
@example(msgpack.packb({"mps": {"timeout": "1e400s"}, "fingerprint_period": "9" * 400 + "h"}))
def test_decode_raises_only_config_error(data: bytes) -> None:
    config = decoded_or_refused(data)
    if config is not None:
        assert isinstance(config, Settings)
        assert 1.0 <= config.nomad.fingerprint_period <= plugin_config.MAX_PERIOD
        assert MIN_TIMEOUT <= config.mps.timeout <= MAX_TIMEOUT
        assert all(isinstance(r.replicas, int) and 2 <= r.replicas <= 48 for r in config.mps.resources)


@fuzz_settings()
@given(any_item)
def test_decode_raises_only_config_error_on_any_msgpack(data: bytes) -> None:
    decoded_or_refused(data)


# name -> (msgpack bytes, the exception that escaped before the fix in accelstats/nomad/config.py and
# accelstats/config.py: found by this module; each is now a ConfigError naming the field)
REGRESSIONS: dict[str, tuple[bytes, type[Exception]]] = {
    "int key at top level": (msgpack.packb({1: 0}), TypeError),  # unknown[0][:100] on an int
    "nil key at top level": (msgpack.packb({None: None}), TypeError),
    "int and str keys at top level": (msgpack.packb({1: 0, "a": 0}), TypeError),  # sorted() of mixed keys
    "array as a map key": (pack_pairs([(msgpack.packb([1]), msgpack.packb(0))]), TypeError),  # unhashable
    "map as a map key": (pack_pairs([(msgpack.packb({}), msgpack.packb(0))]), TypeError),
    "int key in mps": (msgpack.packb({"mps": {1: 2}}), TypeError),
    "int key in file_devices": (msgpack.packb({"file_devices": {1: 2}}), TypeError),
    "replicas '²'": (msgpack.packb({"mps": {"resource": [{"name": "a", "replicas": "²"}]}}), ValueError),
    "replicas of 5000 digits": (msgpack.packb({"mps": {"resource": [{"name": "a", "replicas": "1" * 5000}]}}),
                                ValueError),  # int() refuses more than 4300 digits
    "device '²'": (msgpack.packb({"mps": {"resource": [{"name": "a", "replicas": 2, "devices": ["²"]}]}}),
                   ValueError),
    "device of 5000 digits": (msgpack.packb({"mps": {"resource": [{"name": "a", "replicas": 2,
                                                                   "devices": ["1" * 5000]}]}}), ValueError),
    "metrics_listen ':²'": (msgpack.packb({"metrics_listen": ":²"}), ValueError),  # accelstats/config.parse_listen
}


@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_found_escapes_are_config_errors_now(name: str) -> None:
    with pytest.raises(ConfigError):
        decode(REGRESSIONS[name][0])


# ---------------------------------------------------------------------------- round trip through Nomad's encoding

UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def durations(low: float, high: float) -> st.SearchStrategy[tuple[str, float]]:
    """Go duration strings ``<n><unit>`` between ``low`` and ``high`` seconds, with their seconds."""
    units = [u for u in sorted(UNITS) if math.ceil(low / UNITS[u]) <= math.floor(high / UNITS[u])]
    return st.sampled_from(units).flatmap(lambda unit: st.integers(
        math.ceil(low / UNITS[unit]), math.floor(high / UNITS[unit])).map(lambda n: (f"{n}{unit}", n * UNITS[unit])))


paths = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1, max_size=30)
labels = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="/"), min_size=1, max_size=12)
perms = st.tuples(st.sampled_from("-dlcbps"), *[st.sampled_from(["-", c]) for c in "rwxrwxrwx"]).map("".join)
# resource names the MPS rules take (accelstats.mps.rules.check_name): no NUL, no '.' or '..' part, not under shm
name_parts = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="/\x00"), min_size=1,
                     max_size=12).filter(lambda p: p not in (".", ".."))
resource_names = st.lists(name_parts, min_size=1, max_size=3).map("/".join).filter(lambda n: n.split("/")[0] != "shm")
device_ids = st.one_of(st.uuids().map(lambda u: f"GPU-{u}"), st.integers(0, 15).map(str))


def nested(names: list[str]) -> bool:
    """Two of ``names`` would nest their directories (``a`` and ``a/b``): the rules refuse that."""
    return any(a != b and b.startswith(a + "/") for a in names for b in names)


@st.composite
def mps_resources(draw: st.DrawFn) -> list[tuple[str, int, list[str]]]:
    """(name, replicas, devices) of resources the MPS rules take: unique names none nested in another,
    replicas 2 to 48, each device in one resource only, and ``[]`` (every GPU) only for a sole resource."""
    names = draw(st.lists(resource_names, max_size=3, unique=True).filter(lambda n: not nested(n)))
    replicas = [draw(st.integers(2, 48)) for _ in names]
    if len(names) == 1 and draw(st.booleans()):
        return [(names[0], replicas[0], [])]
    pool = draw(st.lists(device_ids, min_size=len(names), max_size=4 * len(names), unique=True))
    owners = list(range(len(names))) + [draw(st.integers(0, len(names) - 1)) for _ in pool[len(names):]]
    return [(n, r, [d for d, o in zip(pool, owners, strict=True) if o == i])
            for i, (n, r) in enumerate(zip(names, replicas, strict=True))]


@st.composite
def valid_configs(draw: st.DrawFn) -> tuple[dict[str, Any], Settings]:
    """An agent ``config`` block with valid settings, and the :class:`Settings` it means."""
    user: dict[str, Any] = {}
    want: dict[str, Any] = {}
    nomad: dict[str, Any] = {}
    enabled = True
    if draw(st.booleans()):
        user["enabled"] = enabled = draw(st.booleans())
    if draw(st.booleans()):
        user["ignored_gpu_ids"] = draw(st.lists(safe_text, max_size=3))
        nomad["ignored_gpu_ids"] = tuple(user["ignored_gpu_ids"])
    if draw(st.booleans()):
        user["fingerprint_period"], nomad["fingerprint_period"] = draw(durations(1, 8760 * 3600))
    if draw(st.booleans()):
        host = draw(st.sampled_from(["", "127.0.0.1", "[::1]", "localhost"]))
        port = draw(st.integers(1, 65535))
        user["metrics_listen"] = f"{host}:{port}"
        want["listen_host"], want["listen_port"] = host.strip("[]"), port
        nomad["serve_metrics"] = want["attribution"] = True
    for key in ("nvml_replay", "cgroup_root", "proc_root"):
        if draw(st.booleans()):
            user[key] = draw(paths)
            want[key] = Path(user[key])
    file_devices = FileDevicesSettings()
    if draw(st.booleans()):
        block: dict[str, Any] = {}
        fd: dict[str, Any] = {}
        if draw(st.booleans()):
            block["dir"] = draw(paths)
            fd["dir"] = Path(block["dir"]).absolute()
        if draw(st.booleans()):
            block["list_period"], fd["list_period"] = draw(durations(0.1, 8760 * 3600))
        if draw(st.booleans()):
            block["unhealthy_perm"] = fd["unhealthy_perm"] = draw(perms)
        for key in ("vendor", "type", "name"):
            if draw(st.booleans()):
                block[key] = fd[key] = draw(labels)
        file_devices = FileDevicesSettings(**fd)
        user["file_devices"], want["file_devices"] = block, file_devices
    mps = MpsSettings()
    if draw(st.booleans()):
        block = {}
        settings: dict[str, Any] = {}
        if draw(st.booleans()):
            block["root"] = draw(paths)
            settings["root"] = Path(block["root"]).absolute()
        if draw(st.booleans()):
            block["timeout"], settings["timeout"] = draw(durations(0.1, 600))
        if draw(st.booleans()):
            block["exclusive_process"] = settings["exclusive_process"] = draw(st.booleans())
        # replicas: 2 to 48, NVIDIA's MPS client limit per GPU (larger values are refused: test_plugin_bounds.py)
        resources = draw(mps_resources())
        block["resource"] = [{"name": n, "replicas": r, "devices": d} for n, r, d in resources]
        settings["resources"] = tuple(MpsResourceSettings(name=n, replicas=r, devices=tuple(
            int(x) if x.isdigit() else x for x in d) or "all") for n, r, d in resources)
        mps = MpsSettings(**settings)
        user["mps"], want["mps"] = block, mps
    want["collectors"] = tuple(name for name, on in (("nvidia", enabled), ("files", file_devices.dir is not None),
                                                     ("mps", bool(mps.resources))) if on)
    return user, replace(DEFAULTS, **want, nomad=NomadSettings(**nomad))


@fuzz_settings()
@given(valid_configs(), st.sampled_from(["cty", "float", "string"]))
def test_settings_round_trip_through_nomads_encoding(case: tuple[dict[str, Any], Settings], mode: str) -> None:
    user, want = case
    got = decode(encode_for_spec(SCHEMA, user, number_mode=mode))  # type: ignore[arg-type]
    assert got == want
