"""Unit tests of the Nomad-faithful plugin client: ``support.nomadclient.launcher`` (handshake, hclog,
streams, process start errors with shell stubs), ``support.nomadclient.ctymsgpack`` (go-cty msgpack
encoding, HCL literals, hclspec defaults) and ``support.nomadclient.validate`` (Nomad's checks on
plugin messages). No real plugin is started here; end-to-end runs live elsewhere."""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from collections.abc import Iterator
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import grpc
import msgpack
import pytest
from google.protobuf import timestamp_pb2
from support.nomadclient import attributes, ctymsgpack, launcher, validate
from support.nomadclient.ctymsgpack import ConfigError
from support.nomadclient.launcher import (
    HandshakeError,
    PluginProcess,
    PluginStartError,
    parse_handshake,
    parse_log_line,
)

from accelstats.nomad.proto import base_pb2, device_pb2, hclspec_pb2, structs_pb2

# --------------------------------------------------------------------------------------------
# handshake (go-plugin client.go Start)


@pytest.mark.parametrize(
    ("line", "network", "address", "target"),
    [
        ("1|2|unix|/tmp/plugin123/p.sock|grpc\n", "unix", "/tmp/plugin123/p.sock", "unix:///tmp/plugin123/p.sock"),
        ("1|2|tcp|127.0.0.1:10001|grpc", "tcp", "127.0.0.1:10001", "127.0.0.1:10001"),
        ("  1|2|unix|/s|grpc \r\n", "unix", "/s", "unix:///s"),  # TrimSpace
        ("1|2|unix|/s|grpc|short", "unix", "/s", "unix:///s"),  # a 6th field of <= 50 chars is ignored
        ("+1|2|unix|/s|grpc", "unix", "/s", "unix:///s"),  # strconv.Atoi takes a sign
    ],
)
def test_handshake_accepted(line: str, network: str, address: str, target: str) -> None:
    hs = parse_handshake(line)
    assert (hs.core_version, hs.app_version, hs.network, hs.address, hs.protocol) == (1, 2, network, address, "grpc")
    assert hs.grpc_target == target


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("2|2|unix|/s|grpc", "Incompatible core API version with plugin. Plugin version: 2, Core version: 1"),
        ("x|2|unix|/s|grpc", "Error parsing core protocol version"),
        ("1|1|unix|/s|grpc", "Incompatible API version with plugin. Plugin version: 1, Client versions: [2]"),
        ("1|two|unix|/s|grpc", 'Error parsing protocol version "two"'),
        ("1|2|unix|/s", 'Unsupported plugin protocol "netrpc". Supported: [grpc]'),  # 4 fields: net/rpc
        ("1|2|unix|/s|netrpc", 'Unsupported plugin protocol "netrpc"'),
        ("1|2|udp|/s|grpc", "Unknown address type: /s"),
        ("1|2|tcp|127.0.0.1|grpc", "missing or invalid port"),
        ("1|2|unix|/s", "netrpc"),
        ("1|2|unix", "Unrecognized remote plugin message: 1|2|unix"),
        ("Starting accelstats plugin v0.1", "Unrecognized remote plugin message: Starting accelstats plugin"),
        ("", "Unrecognized remote plugin message"),
        ("WARNING: banner|1|2|unix|/s|grpc", "Error parsing core protocol version"),
        ("1|2|unix|/s|grpc|" + "A" * 60, "AutoMTLS"),
    ],
)
def test_handshake_refused(line: str, message: str) -> None:
    with pytest.raises(HandshakeError) as err:
        parse_handshake(line)
    assert message in str(err.value)


# --------------------------------------------------------------------------------------------
# hclog lines (go-plugin client.go logStderr, log_entry.go parseJSON)

GOOD_TS = "2024-05-01T12:34:56.123456+02:00"


def _hclog(**fields: Any) -> str:
    return json.dumps(fields)


def test_hclog_record_parsed() -> None:
    rec = parse_log_line(_hclog(**{"@level": "info", "@message": "started", "@timestamp": GOOD_TS,
                                   "@module": "accelstats", "devices": 2}) + "\n")
    assert rec.structured and rec.problem is None
    assert (rec.level, rec.message, rec.timestamp) == ("info", "started", GOOD_TS)
    assert rec.fields == {"@module": "accelstats", "devices": 2}


@pytest.mark.parametrize(
    ("ts", "ok"),
    [
        (GOOD_TS, True),
        ("2024-05-01T12:34:56.123456Z", True),  # Z07:00 accepts Z
        ("2024-05-01T12:34:56.123456-07:00", True),
        ("2024-05-01T12:34:56.123+02:00", False),  # 3 fraction digits
        ("2024-05-01T12:34:56.1234567+02:00", False),  # 7
        ("2024-05-01T12:34:56+02:00", False),  # none
        ("2024-05-01T12:34:56.123456+0200", False),  # offset without colon
        ("2024-05-01 12:34:56.123456+02:00", False),
        ("2024-13-01T12:34:56.123456+02:00", False),  # month 13
        ("2024-02-30T12:34:56.123456+02:00", False),
    ],
)
def test_hclog_timestamp_layout(ts: str, ok: bool) -> None:
    rec = parse_log_line(_hclog(**{"@level": "debug", "@message": "m", "@timestamp": ts}))
    assert rec.structured is ok
    assert (rec.problem is None) is ok
    if not ok:
        assert rec.level == "debug" and rec.message.startswith("{")  # logged verbatim


@pytest.mark.parametrize(
    ("line", "level", "structured", "problem"),
    [
        (_hclog(**{"@level": "WARN", "@message": "m", "@timestamp": GOOD_TS}), "warn", True, None),  # any case
        (_hclog(**{"@level": "information", "@message": "m", "@timestamp": GOOD_TS}), "debug", True, "@level"),
        (_hclog(**{"@level": "info", "@message": "m"}), "info", True, "lacks @timestamp"),
        (_hclog(**{"@level": "info", "@message": 5, "@timestamp": GOOD_TS}), "debug", False, "panic"),
        (_hclog(**{"@level": None, "@message": "m", "@timestamp": GOOD_TS}), "debug", False, "panic"),
        ("[WARN] plain text warning", "warn", False, None),
        ("[ERROR] failed", "error", False, None),
        ("[TRACE] t", "trace", False, None),
        ("plain text", "debug", False, None),
        ("", "debug", False, None),
        ('{"@level": "info", "@message": ', "debug", False, "not valid JSON"),
        ("[1, 2]", "debug", False, "not an object"),
        ("null", "debug", False, "null"),
        ('{"@level": "info", "@message": "m", "@timestamp": "' + GOOD_TS + '", "x": NaN}', "debug", False, "JSON"),
    ],
)
def test_hclog_line_levels(line: str, level: str, structured: bool, problem: str | None) -> None:
    rec = parse_log_line(line)
    assert rec.level == level
    assert rec.structured is structured
    if problem is None:
        assert rec.problem is None
    else:
        assert rec.problem is not None and problem in rec.problem


def test_hclog_line_over_64k_is_not_parsed() -> None:
    line = _hclog(**{"@level": "info", "@message": "x" * 70_000, "@timestamp": GOOD_TS})
    rec = parse_log_line(line)
    assert not rec.structured and rec.problem is not None and "64 KiB" in rec.problem
    assert parse_log_line("y" * 70_000).problem is None  # long plain text: just debug


# --------------------------------------------------------------------------------------------
# streams


class _FakeRpcError(grpc.RpcError):  # type: ignore[misc]
    def __init__(self, code: Any, details: str) -> None:
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self) -> Any:
        return self._code

    def details(self) -> str:
        return self._details


class _FakeCall:
    """Iterates queued items like a grpc response iterator; ``cancel`` raises CANCELLED."""

    def __init__(self) -> None:
        self.items: queue.Queue[Any] = queue.Queue()

    def __iter__(self) -> Iterator[Any]:
        while True:
            item = self.items.get()
            if item is StopIteration:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        self.items.put(_FakeRpcError(grpc.StatusCode.CANCELLED, "Locally cancelled by application!"))


def test_stream_handle_reads_times_out_and_ends() -> None:
    call = _FakeCall()
    handle = launcher.StreamHandle(call, "Fingerprint")
    call.items.put("m1")
    assert handle.read(2.0) == "m1"
    with pytest.raises(launcher.StreamTimeoutError):
        handle.read(0.05)
    assert handle.open
    call.items.put(StopIteration)
    with pytest.raises(launcher.StreamEndedError, match="the plugin ended the stream"):
        handle.read(2.0)
    with pytest.raises(launcher.StreamEndedError):  # the end state sticks
        handle.read(0.05)
    assert handle.ended and not handle.open and handle.received == ["m1"]


def test_stream_handle_error_and_cancel() -> None:
    call = _FakeCall()
    handle = launcher.StreamHandle(call, "Stats")
    call.items.put(_FakeRpcError(grpc.StatusCode.INTERNAL, "nvml gone"))
    with pytest.raises(launcher.StreamFailedError) as err:
        handle.read(2.0)
    assert (err.value.code, err.value.details) == ("INTERNAL", "nvml gone")

    call2 = _FakeCall()
    handle2 = launcher.StreamHandle(call2, "Fingerprint")
    handle2.cancel()
    assert handle2.cancelled and not handle2.open and handle2.error is None
    with pytest.raises(launcher.StreamEndedError, match="cancelled"):
        handle2.read(1.0)


# --------------------------------------------------------------------------------------------
# process start with shell stubs (no real plugin)


def _sh(script: str) -> list[str]:
    return ["/bin/sh", "-c", script]


def test_environment_is_parent_plus_go_plugin_variables() -> None:
    plugin = PluginProcess("/bin/true", env={"PATH": "/usr/bin", "KEEP": "1"}, socket_dir="/run/sockets")
    plugin.socket_dir = "/run/sockets"
    env = plugin.environment()
    assert env == {
        "PATH": "/usr/bin",
        "KEEP": "1",
        "NOMAD_PLUGIN_MAGIC_COOKIE": "e4327c2e01eabfd75a8a67adb114fb34a757d57eee7728d857a8cec6e91a7255",
        "PLUGIN_MIN_PORT": "10000",
        "PLUGIN_MAX_PORT": "25000",
        "PLUGIN_PROTOCOL_VERSIONS": "2",
        "PLUGIN_UNIX_SOCKET_DIR": "/run/sockets",
    }
    assert "PLUGIN_UNIX_SOCKET_DIR" not in PluginProcess("/bin/true", env={}).environment()


def test_banner_before_handshake_is_refused_and_process_killed() -> None:
    plugin = PluginProcess(_sh('echo "plugin v1 starting"; echo "1|2|unix|/nonexistent|grpc"; exec sleep 30'),
                           start_timeout=10)
    t0 = time.monotonic()
    with pytest.raises(HandshakeError, match="Unrecognized remote plugin message: plugin v1 starting"):
        plugin.start()
    assert time.monotonic() - t0 < 10
    assert plugin.proc is not None and plugin.proc.poll() is not None  # killed


def test_exit_before_handshake_reports_status_and_stderr() -> None:
    script = 'echo "This binary is a plugin. These are not meant to be executed directly." >&2; exit 1'
    plugin = PluginProcess(_sh(script), env={"NOMAD_PLUGIN_MAGIC_COOKIE": "wrong"})
    with pytest.raises(PluginStartError, match=r"plugin exited before we could connect \(exit status 1\)") as err:
        plugin.start()
    assert err.value.stderr_tail == ["This binary is a plugin. These are not meant to be executed directly."]


def test_start_timeout() -> None:
    plugin = PluginProcess(_sh("exec sleep 30"), start_timeout=0.5)
    with pytest.raises(PluginStartError, match="timeout while waiting for plugin to start"):
        plugin.start()
    assert plugin.proc is not None and plugin.proc.poll() is not None


def test_handshake_sees_nomad_environment(tmp_path: Path) -> None:
    # The stub echoes a handshake built from the variables it was given; nothing listens on the
    # socket, so the connect step fails — after the handshake parsed.
    script = ('[ "$NOMAD_PLUGIN_MAGIC_COOKIE" = e4327c2e01eabfd75a8a67adb114fb34a757d57eee7728d857a8cec6e91a7255 ] '
              '|| exit 9; echo "1|$PLUGIN_PROTOCOL_VERSIONS|unix|$PLUGIN_UNIX_SOCKET_DIR/x.sock|grpc"; exec sleep 30')
    plugin = PluginProcess(_sh(script), socket_dir=str(tmp_path), connect_timeout=0.5)
    with pytest.raises(PluginStartError, match="could not connect"):
        plugin.start()
    assert plugin.handshake is not None and plugin.handshake.address == f"{tmp_path}/x.sock"
    assert plugin.handshake_seconds is not None and plugin.handshake_seconds < 5


def test_main_reports_unstartable_binary(capsys: pytest.CaptureFixture[str]) -> None:
    assert launcher.main(["/nonexistent/plugin"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert report["problems"][0].startswith("A: start failed: failed to start plugin /nonexistent/plugin")


# --------------------------------------------------------------------------------------------
# go-cty numbers and msgpack layout


@pytest.mark.parametrize(
    ("value", "cty", "as_float", "as_string"),
    [
        (5, 5, 5, "5"),
        (5.0, 5, 5, "5"),
        (-0.0, 0, 0, "0"),
        (0.5, 0.5, 0.5, "0.5"),
        (0.1, "0.1", 0.1, "0.1"),  # not exact in float64 after Nomad's JSON round trip: decimal text
        (1.5e-7, "0.00000015", 1.5e-7, "0.00000015"),
        (2**63 - 1, 2**63 - 1, 2**63 - 1, str(2**63 - 1)),
        # beyond int64: decimal text even where a float64 holds it exactly (go-cty v1.14.4+,
        # cty/msgpack/marshal.go:90-96; the emulation sent a float64 before)
        (2**63, str(2**63), float(2**63), str(2**63)),
        (2**70, str(2**70), float(2**70), str(2**70)),
        (-(2**63) - 2048, str(-(2**63) - 2048), float(-(2**63) - 2048), str(-(2**63) - 2048)),
        (2**64 + 1, str(2**64 + 1), float(2**64 + 1), str(2**64 + 1)),
        (Decimal("1.50"), 1.5, 1.5, "1.5"),
        (Decimal("0.10"), "0.1", 0.1, "0.1"),
        (Decimal("1E+3"), 1000, 1000, "1000"),
    ],
)
def test_encode_number(value: Any, cty: Any, as_float: Any, as_string: str) -> None:
    for mode, want in (("cty", cty), ("float", as_float), ("string", as_string)):
        got = ctymsgpack.encode_number(value, mode)  # type: ignore[arg-type]
        assert got == want and type(got) is type(want), (mode, got, want)


def test_encode_number_special() -> None:
    assert ctymsgpack.encode_number(math.inf) == math.inf
    with pytest.raises(ConfigError, match="NaN"):
        ctymsgpack.encode_number(math.nan)
    with pytest.raises(ConfigError):
        ctymsgpack.encode_number(True)


def test_pack_layout_is_go_cty_bytes() -> None:
    # fixmap(2) "a" -> "x", "b" -> 1: sorted keys whatever the insertion order
    assert ctymsgpack.pack({"b": 1, "a": "x"}) == b"\x82\xa1a\xa1x\xa1b\x01"
    # nil for null, bools, float64 (0xcb) for 0.5, array for list
    assert ctymsgpack.pack({"n": None, "t": True, "f": 0.5, "l": ["s"]}) == (
        b"\x84\xa1f\xcb\x3f\xe0\x00\x00\x00\x00\x00\x00\xa1l\x91\xa1s\xa1n\xc0\xa1t\xc3"
    )
    assert ctymsgpack.pack({"big": 300}) == b"\x81\xa3big\xcd\x01\x2c"  # uint16 as vmihailenco writes it
    assert ctymsgpack.pack({"neg": -40}) == b"\x81\xa3neg\xd0\xd8"  # int8


def _key_order(data: bytes) -> list[Any]:
    return list(msgpack.unpackb(data, raw=False, object_pairs_hook=lambda pairs: [k for k, _ in pairs]))


def test_encode_config_round_trip() -> None:
    defaults: dict[str, Any] = {"list_period": "5s", "dir": ".", "unhealthy_perm": "-rwxrwxrwx", "count": None,
                "ids": [], "nested": {"b": True, "a": 1}}
    data = ctymsgpack.encode_config(defaults, {"dir": "/dev", "nested": {"a": 0.1}, "count": 3})
    assert _key_order(data) == ["count", "dir", "ids", "list_period", "nested", "unhealthy_perm"]
    assert ctymsgpack.unpack(data) == {
        "count": 3, "dir": "/dev", "ids": [], "list_period": "5s", "unhealthy_perm": "-rwxrwxrwx",
        "nested": {"a": "0.1", "b": True},  # 0.1 as go-cty's decimal text
    }
    # every attribute present even when the user sets nothing
    assert ctymsgpack.unpack(ctymsgpack.encode_config(defaults, {})) == {
        "count": None, "dir": ".", "ids": [], "list_period": "5s", "unhealthy_perm": "-rwxrwxrwx",
        "nested": {"a": 1, "b": True},
    }
    as_strings = ctymsgpack.unpack(ctymsgpack.encode_config(defaults, {"count": 3}, number_mode="string"))
    assert as_strings["count"] == "3" and as_strings["nested"]["a"] == "1"
    with pytest.raises(ConfigError, match='an argument named "bogus" is not expected here'):
        ctymsgpack.encode_config(defaults, {"bogus": 1})


# --------------------------------------------------------------------------------------------
# HCL literals (hclspec Literal.value)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ('"5s"', "5s"),
        ('"."', "."),
        ('"-rwxrwxrwx"', "-rwxrwxrwx"),
        ('""', ""),
        ("true", True),
        ("false", False),
        ("null", None),
        ("5", 5),
        ("-3", -3),
        ("1.5", Decimal("1.5")),
        ("1e3", 1000),
        ("-0.25", Decimal("-0.25")),
        ("[]", []),
        ('["a", "b"]', ["a", "b"]),
        ('[\n  "a",\n  "b",\n]', ["a", "b"]),
        ("{}", {}),
        ('{a = 1, "b": "x"}', {"a": 1, "b": "x"}),
        ('{\n  a = 1\n  b = [true]\n}', {"a": 1, "b": [True]}),
        (r'"a\nb\t\"q\" \\ \u00e9"', 'a\nb\t"q" \\ é'),
        ('"$${not_interpolated}"', "${not_interpolated}"),
        ("  true  ", True),
        ("(7)", 7),
        ("!false", True),
    ],
)
def test_parse_literal(text: str, value: Any) -> None:
    got = ctymsgpack.parse_literal(text)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("text", ['"${var.x}"', "foo", "[1,", '"open', "1 2", "upper(\"x\")", "{a 1}", "-true"])
def test_parse_literal_refuses(text: str) -> None:
    with pytest.raises(ConfigError, match="HCL literal"):
        ctymsgpack.parse_literal(text)


# --------------------------------------------------------------------------------------------
# hclspec schemas


def _attr(name: str, type_: str = "string", required: bool = False) -> hclspec_pb2.Spec:
    return hclspec_pb2.Spec(Attr=hclspec_pb2.Attr(name=name, type=type_, required=required))


def _default(primary: hclspec_pb2.Spec, literal: str) -> hclspec_pb2.Spec:
    return hclspec_pb2.Spec(default=hclspec_pb2.Default(primary=primary,
                                                        default=hclspec_pb2.Spec(literal=hclspec_pb2.Literal(value=literal))))


def _object(**attrs: hclspec_pb2.Spec) -> hclspec_pb2.Spec:
    return hclspec_pb2.Spec(object=hclspec_pb2.Object(attributes=attrs))


def _example_schema() -> hclspec_pb2.Spec:
    """Nomad's example device plugin schema (spec §2) plus one of each other kind."""
    return _object(
        dir=_default(_attr("dir"), '"."'),
        list_period=_default(_attr("list_period"), '"5s"'),
        unhealthy_perm=_default(_attr("unhealthy_perm"), '"-rwxrwxrwx"'),
        enabled=_default(_attr("enabled", "bool"), "true"),
        ignored_gpu_ids=_default(_attr("ignored_gpu_ids", "list(string)"), "[]"),
        ratio=_default(_attr("ratio", "number"), "0.5"),
        labels=_attr("labels", "map(string)"),
        count=_attr("count", "number"),
        files=hclspec_pb2.Spec(block_value=hclspec_pb2.Block(
            name="files", nested=_object(path=_default(_attr("path"), '"/dev"'), mode=_attr("mode")))),
        rules=hclspec_pb2.Spec(block_list=hclspec_pb2.BlockList(
            name="rules", max_items=2, nested=_object(match=_attr("match", required=True)))),
        per_host=hclspec_pb2.Spec(block_map=hclspec_pb2.BlockMap(
            name="per_host", labels=["host"], nested=_object(weight=_default(_attr("weight", "number"), "1")))),
    )


def test_schema_defaults() -> None:
    assert ctymsgpack.schema_defaults(_example_schema()) == {
        "dir": ".",
        "list_period": "5s",
        "unhealthy_perm": "-rwxrwxrwx",
        "enabled": True,
        "ignored_gpu_ids": [],
        "ratio": Decimal("0.5"),
        "labels": None,  # attribute without a default: null
        "count": None,
        "files": None,  # absent block: null
        "rules": [],  # absent block list: empty list
        "per_host": {},  # absent block map: empty map
    }


def test_schema_defaults_needs_an_object() -> None:
    with pytest.raises(ConfigError, match="must be an hclspec Object"):
        ctymsgpack.schema_defaults(_attr("x"))


def test_decode_config_converts_like_hcldec() -> None:
    value = ctymsgpack.decode_config(_example_schema(), {
        "dir": 5,  # number -> string
        "enabled": "false",  # string -> bool
        "count": "12",  # string -> number
        "ignored_gpu_ids": ["GPU-1", 2],
        "labels": {"b": 1, "a": True},
        "files": {"mode": "rw"},  # block: nested defaults filled
        "rules": [{"match": "x"}],
        "per_host": {"h1": {}},
    })
    assert value["dir"] == "5" and value["enabled"] is False and value["count"] == 12
    assert value["ignored_gpu_ids"] == ["GPU-1", "2"]
    assert value["labels"] == {"a": "true", "b": "1"}
    assert value["files"] == {"mode": "rw", "path": "/dev"}
    assert value["rules"] == [{"match": "x"}]
    assert value["per_host"] == {"h1": {"weight": 1}}
    assert value["list_period"] == "5s"


@pytest.mark.parametrize(
    ("user", "message"),
    [
        ({"bogus": 1}, 'bogus: unsupported argument; an argument named "bogus" is not expected here'),
        ({"files": {"nope": 1}}, "files.nope: unsupported argument"),
        ({"count": "twelve"}, "count: a number is required"),
        ({"enabled": "yes"}, "enabled: a bool is required"),
        ({"ignored_gpu_ids": "GPU-1"}, "ignored_gpu_ids: a list is required"),
        ({"rules": [{}]}, 'rules[0].match: missing required argument; the argument "match" is required'),
        ({"rules": [{"match": "a"}, {"match": "b"}, {"match": "c"}]}, "too many rules blocks"),
        ({"files": [{}, {}]}, "duplicate files block"),
        ({"dir": ["a"]}, "dir: a string is required"),
    ],
)
def test_decode_config_refuses(user: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        ctymsgpack.decode_config(_example_schema(), user)
    assert message in str(err.value)


def test_encode_for_spec_matches_nomad_bytes() -> None:
    data = ctymsgpack.encode_for_spec(_example_schema(), {"dir": "/tmp/devs", "count": 0.1})
    assert _key_order(data) == sorted(ctymsgpack.schema_defaults(_example_schema()))
    decoded = ctymsgpack.unpack(data)
    assert decoded["dir"] == "/tmp/devs"
    assert decoded["count"] == "0.1"  # decimal string, as go-cty sends a non-float64 number
    assert decoded["ratio"] == 0.5  # exact float64
    assert decoded["files"] is None and decoded["rules"] == [] and decoded["per_host"] == {}
    strings = ctymsgpack.unpack(ctymsgpack.encode_for_spec(_example_schema(), {"count": 7}, number_mode="string"))
    assert strings["count"] == "7" and strings["ratio"] == "0.5"


# --------------------------------------------------------------------------------------------
# validation: PluginInfo


def _info(**kw: Any) -> base_pb2.PluginInfoResponse:
    fields: dict[str, Any] = {"type": base_pb2.DEVICE, "plugin_api_versions": ["v0.1.0"],
                              "plugin_version": "0.1.0", "name": "accelstats"}
    fields.update(kw)
    return base_pb2.PluginInfoResponse(**fields)


@pytest.mark.parametrize(
    ("kw", "problem"),
    [
        ({}, None),
        ({"plugin_api_versions": ["0.1.0"]}, None),  # leading v optional
        ({"plugin_api_versions": ["v0.2.0", "v0.1.0"]}, None),
        ({"plugin_version": "1.2.3-beta.1+abc"}, None),
        ({"plugin_version": "v2"}, None),
        ({"type": base_pb2.DRIVER}, "plugin type is 2, want DEVICE (3)"),
        ({"plugin_api_versions": []}, "plugin provided no compatible API versions"),
        ({"plugin_api_versions": ["v0.2.0"]}, "do not overlap"),
        ({"plugin_api_versions": ["v0.1.0-beta"]}, "do not overlap"),
        ({"plugin_api_versions": ["latest"]}, 'plugin provided invalid versions: failed to convert version "latest"'),
        ({"plugin_version": "one"}, 'failed to parse plugin "accelstats" version "one": Malformed version'),
        ({"plugin_version": ""}, "Malformed version"),
        ({"name": ""}, "plugin name must be non-empty"),
    ],
)
def test_validate_plugin_info(kw: dict[str, Any], problem: str | None) -> None:
    problems = validate.validate_plugin_info(_info(**kw))
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0], problems


@pytest.mark.parametrize(
    ("versions", "chosen"),
    [(["v0.1.0"], "v0.1.0"), (["0.1.0"], "0.1.0"), (["v0.2.0", "v0.1"], "v0.1"), (["v0.2.0"], None), (["x"], None)],
)
def test_select_api_version_keeps_the_plugins_spelling(versions: list[str], chosen: str | None) -> None:
    assert validate.select_api_version(_info(plugin_api_versions=versions)) == chosen


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("1", ((1, 0, 0), "")),
        ("v1.2.3", ((1, 2, 3), "")),
        ("1.2.3.4", ((1, 2, 3, 4), "")),
        ("1.0.0-rc.1+build.5", ((1, 0, 0), "rc.1")),
        ("1.0.0beta", ((1, 0, 0), "beta")),
        ("", None),
        ("1..2", None),
        ("1.2.3 ", None),
        ("one", None),
        ("99999999999999999999", None),  # int64 overflow
    ],
)
def test_parse_go_version(text: str, parsed: Any) -> None:
    assert validate.parse_go_version(text) == parsed


# --------------------------------------------------------------------------------------------
# validation: Fingerprint


def _group(**kw: Any) -> device_pb2.DeviceGroup:
    fields: dict[str, Any] = {
        "vendor": "nvidia", "device_type": "gpu", "device_name": "NVIDIA H200",
        "devices": [device_pb2.DetectedDevice(ID="GPU-1", healthy=True,
                                              hw_locality=device_pb2.DeviceLocality(pci_bus_id="0000:3B:00.0"))],
        "attributes": {
            "memory": structs_pb2.Attribute(int_val=143771, unit="MiB"),
            "power": structs_pb2.Attribute(float_val=700.0, unit="W"),
            "model": structs_pb2.Attribute(string_val="H200"),
            "mig": structs_pb2.Attribute(bool_val=False),
        },
    }
    fields.update(kw)
    return device_pb2.DeviceGroup(**fields)


def _fp(*groups: device_pb2.DeviceGroup) -> device_pb2.FingerprintResponse:
    return device_pb2.FingerprintResponse(device_group=list(groups))


def test_validate_fingerprint_accepts_good_and_empty() -> None:
    assert validate.validate_fingerprint(_fp(_group())) == []
    assert validate.validate_fingerprint(_fp()) == []  # an empty first fingerprint is fine
    assert validate.validate_fingerprint(_fp(_group(devices=[]))) == []


@pytest.mark.parametrize("unit", sorted(validate.UNITS))
def test_every_nomad_unit_is_accepted(unit: str) -> None:
    attrs = {"x": structs_pb2.Attribute(int_val=1, unit=unit), "y": structs_pb2.Attribute(float_val=0.5, unit=unit)}
    assert validate.validate_fingerprint(_fp(_group(attributes=attrs))) == []


@pytest.mark.parametrize(
    ("kw", "problem"),
    [
        ({"vendor": ""}, "device group 0: device vendor must be specified"),
        ({"device_type": ""}, "device group 0: device type must be specified"),
        ({"device_name": ""}, "device group 0: device name must be specified"),
        ({"devices": [device_pb2.DetectedDevice(ID="a"), device_pb2.DetectedDevice(ID="")]},
         "device group 0: device 1: device ID must be specified"),
        ({"attributes": {"x": structs_pb2.Attribute()}},
         'device group 0: device attribute "x" invalid: no attribute value set'),
        ({"attributes": {"x": structs_pb2.Attribute(unit="MiB")}},
         'device attribute "x" invalid: no attribute value set'),
        ({"attributes": {"x": structs_pb2.Attribute(int_val=1, unit="XB")}},
         'device group 0: device attribute "x" invalid: unrecognized unit "XB"'),
        ({"attributes": {"x": structs_pb2.Attribute(int_val=1, unit="%")}}, 'unrecognized unit "%"'),
        ({"attributes": {"x": structs_pb2.Attribute(float_val=1.0, unit="B")}}, 'unrecognized unit "B"'),
        ({"attributes": {"x": structs_pb2.Attribute(string_val="1", unit="MiB")}},
         'device attribute "x" invalid: unit can not be specified on a boolean or string attribute'),
        ({"attributes": {"x": structs_pb2.Attribute(bool_val=True, unit="W")}},
         "unit can not be specified on a boolean or string attribute"),
        ({"devices": [device_pb2.DetectedDevice(ID="a"), device_pb2.DetectedDevice(ID="a")]},
         'duplicate device ID "a"'),
        ({"devices": [device_pb2.DetectedDevice(ID="a", hw_locality=device_pb2.DeviceLocality(
            pci_bus_id="0000:3B:00.0\x00\x00"))]}, "NUL"),
    ],
)
def test_validate_fingerprint_refuses(kw: dict[str, Any], problem: str) -> None:
    problems = validate.validate_fingerprint(_fp(_group(**kw)))
    assert len(problems) == 1 and problem in problems[0], problems


def test_validate_fingerprint_prefixes_the_group_and_flags_duplicates() -> None:
    problems = validate.validate_fingerprint(_fp(_group(), _group(vendor="")))
    assert problems == ["device group 1: device vendor must be specified"]
    assert "duplicate group nvidia/gpu/NVIDIA H200" in validate.validate_fingerprint(_fp(_group(), _group()))[0]


# --------------------------------------------------------------------------------------------
# validation: Stats


def _ts(seconds: int = 1_700_000_000, nanos: int = 0) -> timestamp_pb2.Timestamp:
    return timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos)


def _stats(instance: dict[str, device_pb2.DeviceStats], **kw: Any) -> device_pb2.StatsResponse:
    fields: dict[str, Any] = {"vendor": "nvidia", "type": "gpu", "name": "NVIDIA H200", "instance_stats": instance}
    fields.update(kw)
    return device_pb2.StatsResponse(groups=[device_pb2.DeviceGroupStats(**fields)])


def _summary() -> structs_pb2.StatValue:
    value = structs_pb2.StatValue(unit="%", desc="GPU utilization")
    value.int_numerator_val.value = 40
    return value


def test_validate_stats_good_and_empty() -> None:
    good = _stats({"GPU-1": device_pb2.DeviceStats(summary=_summary(), timestamp=_ts())})
    assert validate.validate_stats(good) == []
    assert validate.validate_stats(good, _fp(_group())) == []
    assert validate.validate_stats(device_pb2.StatsResponse()) == []  # empty groups: Nomad keeps the old stats


@pytest.mark.parametrize(
    ("stats", "problem"),
    [
        (_stats({"GPU-1": device_pb2.DeviceStats(summary=_summary())}),
         'device "GPU-1": timestamp missing: Nomad drops this device\'s stats'),
        (_stats({"GPU-1": device_pb2.DeviceStats(timestamp=_ts(nanos=1_000_000_000))}),
         "nanos 1000000000 out of range"),
        (_stats({"GPU-1": device_pb2.DeviceStats(timestamp=_ts(seconds=253402300800))}), "out of range"),
        (_stats({"GPU-1": device_pb2.DeviceStats(timestamp=_ts())}, vendor=""), "vendor must be non-empty"),
        (_stats({"GPU-1": device_pb2.DeviceStats(timestamp=_ts())}, type=""), "type must be non-empty"),
        (_stats({"": device_pb2.DeviceStats(timestamp=_ts())}), "empty device ID key"),
    ],
)
def test_validate_stats_refuses(stats: device_pb2.StatsResponse, problem: str) -> None:
    problems = validate.validate_stats(stats)
    assert len(problems) == 1 and problem in problems[0], problems


def test_validate_stats_against_the_fingerprint() -> None:
    stats = _stats({"GPU-9": device_pb2.DeviceStats(timestamp=_ts())})
    assert validate.validate_stats(stats) == []
    problems = validate.validate_stats(stats, _fp(_group()))
    assert problems == ['stats group 0 (nvidia/gpu/NVIDIA H200): device "GPU-9" is not in the fingerprint: '
                        "Nomad never shows its stats (beyond Nomad's checks)"]
    assert "no fingerprinted group" in validate.validate_stats(_stats({}, name="A100"), _fp(_group()))[0]


# --------------------------------------------------------------------------------------------
# validation: Reserve


def _reserve(**kw: Any) -> device_pb2.ReserveResponse:
    res: dict[str, Any] = {
        "envs": {"NVIDIA_VISIBLE_DEVICES": "GPU-1"},
        "mounts": [device_pb2.Mount(task_path="/usr/lib/nvidia", host_path="/usr/lib/nvidia", read_only=True)],
        "devices": [device_pb2.DeviceSpec(task_path="/dev/nvidia0", host_path="/dev/nvidia0", permissions="rwm"),
                    device_pb2.DeviceSpec(task_path="/dev/nvidiactl", host_path="/dev/nvidiactl", permissions="rw")],
    }
    res.update(kw)
    return device_pb2.ReserveResponse(container_res=device_pb2.ContainerReservation(**res))


def test_validate_reserve_good_and_empty() -> None:
    assert validate.validate_reserve(_reserve()) == []
    empty = device_pb2.ReserveResponse()
    empty.container_res.SetInParent()  # present but empty: fine
    assert validate.validate_reserve(empty) == []


@pytest.mark.parametrize(
    ("resp", "problem"),
    [
        (device_pb2.ReserveResponse(), "container_res missing"),
        (_reserve(devices=[device_pb2.DeviceSpec(task_path="/dev/a", host_path="/dev/a", permissions="rwx")]),
         "device 0: permissions \"rwx\" hold 'x': only r, w, m allowed"),
        (_reserve(devices=[device_pb2.DeviceSpec(task_path="/dev/a", host_path="dev/a", permissions="r")]),
         'device 0: host_path "dev/a" is not an absolute path'),
        (_reserve(devices=[device_pb2.DeviceSpec(task_path="", host_path="/dev/a", permissions="r")]),
         'device 0: task_path "" is not an absolute path'),
        (_reserve(mounts=[device_pb2.Mount(task_path="lib", host_path="/lib")]),
         'mount 0: task_path "lib" is not an absolute path'),
        (_reserve(envs={"A=B": "1"}), 'env "A=B": not a valid environment variable name'),
    ],
)
def test_validate_reserve_refuses(resp: device_pb2.ReserveResponse, problem: str) -> None:
    problems = validate.validate_reserve(resp)
    assert len(problems) == 1 and problem in problems[0], problems


# --------------------------------------------------------------------------------------------
# process C's agent config


def test_agent_nomad_config_carries_client_ports() -> None:
    cfg = launcher.agent_nomad_config()
    assert (cfg.driver.ClientMinPort, cfg.driver.ClientMaxPort) == (14000, 14512)
    assert list(cfg.driver.Topology.node_ids) == [0] and len(cfg.driver.Topology.cores) >= 1


def test_lifecycle_report_to_dict_is_json() -> None:
    report = launcher.LifecycleReport(argv=["x"], user_config={})
    report.processes.append(launcher.ProcessReport("A", problems=["p"]))
    report.problems.append("A: p")
    out = report.to_dict()
    assert json.loads(json.dumps(out))["ok"] is False and report.process("A").problems == ["p"]


def test_threads_are_daemons() -> None:
    # StreamHandle readers must never keep the interpreter alive after a test fails.
    call = _FakeCall()
    launcher.StreamHandle(call, "x")
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("stream-"))
    call.items.put(StopIteration)


# --------------------------------------------------------------------------------------------
# Nomad's attribute comparison (plugins/shared/structs/attribute.go, units.go)


@pytest.mark.parametrize(("attribute", "operator", "value", "met"), [
    (attributes.Attr(float_val=9.0), "=", "9.0", True),  # the literal is a Float
    (attributes.Attr(string_val="9.0"), "=", "9.0", False),  # a String never compares with it
    (attributes.Attr(string_val="9.0"), "!=", "9.0", False),  # not comparable: not met either
    (attributes.Attr(int_val=1), "=", "1", True),
    (attributes.Attr(string_val="1"), "=", "1", False),  # HashiCorp's "0"/"1" strings
    (attributes.Attr(bool_val=True), "=", "true", True),
    (attributes.Attr(int_val=143771, unit="MiB"), ">=", "80 GiB", True),
    (attributes.Attr(int_val=143771, unit="MiB"), ">=", "81920", False),  # unit-ful vs unitless
    (attributes.Attr(int_val=32768, unit="MB/s"), ">=", "32768 MB/s", True),
    (attributes.Attr(int_val=32768, unit="MB/s"), ">=", "32 GB/s", True),
    (attributes.Attr(int_val=1980, unit="MHz"), ">", "1500 MHz", True),
    # units.go:208-219 gives MHz a multiplier of 1000^2 and GHz one of 1000^3 (Hz): 1 GHz = 1000 MHz
    (attributes.Attr(int_val=1980, unit="MHz"), ">", "1.5 GHz", True),  # float path: 1.98e9 > 1.5e9 Hz
    (attributes.Attr(int_val=1980, unit="MHz"), "<", "2 GHz", True),  # int path: 1980e6 < 2e9 Hz
    (attributes.Attr(int_val=1500, unit="MHz"), "=", "1.5 GHz", True),
    (attributes.Attr(int_val=1000, unit="MHz"), "=", "1 GHz", True),
    (attributes.Attr(int_val=126, unit="W"), ">=", "126500 mW", True),  # int64: 126500 mW / 1000 = 126 W
    (attributes.Attr(float_val=126.0, unit="W"), ">=", "126.5 W", False),
    (attributes.Attr(int_val=126, unit="W"), "=", "126 MiB", False),  # other base unit
    (attributes.Attr(string_val="hopper"), "=", "hopper", True),
    (attributes.Attr(float_val=9.0), "<", "inf", True),  # ParseFloat accepts inf
    (attributes.Attr(float_val=9.0), "=", "nan", False),  # big.Float holds no NaN
    (attributes.Attr(string_val="1e400"), "=", "1e400", True),  # out of float64 range: a String
    (None, "!=", "9.0", True),  # a device without the attribute
    (None, "=", "9.0", False),
])
def test_nomad_attribute_comparison(attribute: attributes.Attr | None, operator: str, value: str, met: bool) -> None:
    assert attributes.constraint_met(attribute, operator, value) is met


# units.go (hashicorp/nomad plugins/shared/structs/units.go at aa026cc): a unit's base and multiplier
@pytest.mark.parametrize(("unit", "base", "multiplier"), [
    ("MiB", "byte", 2**20),
    ("MB", "byte", 10**6),
    ("MB/s", "byterate", 10**6),
    ("MHz", "hertz", 10**6),  # :209-213, Pow(1000, 2)
    ("GHz", "hertz", 10**9),  # :214-218, Pow(1000, 3)
    ("mW", "watt", Fraction(1, 1000)),
    ("W", "watt", 1),
    ("kW", "watt", 10**3),
])
def test_nomad_unit_multipliers(unit: str, base: str, multiplier: int | Fraction) -> None:
    assert attributes.UNITS[unit] == (base, multiplier)
