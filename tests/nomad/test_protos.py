"""The generated Nomad device-plugin protobuf/gRPC code: up to date with its .proto files, and on the wire
exactly what Nomad and go-plugin expect (service paths, field names and numbers)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from conftest import in_ci

from accelstats.nomad.proto import (
    base_pb2,
    device_pb2,
    grpc_controller_pb2,
    grpc_stdio_pb2,
    hclspec_pb2,
    structs_pb2,
)

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "accelstats" / "nomad" / "proto"
GEN_PROTOS = ROOT / "scripts" / "gen-protos.sh"
STEMS = ("base", "hclspec", "structs", "device", "grpc_controller", "grpc_stdio")
SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")
MODULES: dict[str, ModuleType] = {
    "base": base_pb2,
    "hclspec": hclspec_pb2,
    "structs": structs_pb2,
    "device": device_pb2,
    "grpc_controller": grpc_controller_pb2,
    "grpc_stdio": grpc_stdio_pb2,
}
STALE = "generated protobuf code is stale: run scripts/gen-protos.sh (grpcio-tools=={}) and commit the result"


def _pin() -> str:
    """The grpcio-tools version scripts/gen-protos.sh pins (its ``GRPCIO_TOOLS_VERSION=`` line)."""
    m = re.search(r"^GRPCIO_TOOLS_VERSION=([0-9.]+)$", GEN_PROTOS.read_text(encoding="utf-8"), re.M)
    assert m, "scripts/gen-protos.sh has no GRPCIO_TOOLS_VERSION= line"
    return m.group(1)


@pytest.fixture(scope="module")
def pinned_tools(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Python with the grpcio-tools scripts/gen-protos.sh pins: this one if it has it, else a throwaway
    virtual environment with it installed from the package index. The pinned generator needs protobuf < 6,
    so it never goes into the environment the tests run in, whose protobuf is the one ``pip install .``
    resolves. Skips where it cannot be installed (offline), and fails under ``CI=true``, where PyPI is
    reachable."""
    pin = _pin()
    try:
        have = version("grpcio-tools")
    except PackageNotFoundError:  # the usual case: it is not a dependency of the tests
        have = ""
    if have == pin:
        return Path(sys.executable)
    venv = tmp_path_factory.mktemp("grpcio-tools")
    python = venv / "bin" / "python"
    steps = ([sys.executable, "-m", "venv", str(venv)],
             [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--only-binary=:all:",
              f"grpcio-tools=={pin}"])  # wheels only: none for Python 3.13+, where this skips at once
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            why = f"cannot install grpcio-tools=={pin} for the generated-code check: {done.stderr.strip()[-500:]}"
            if in_ci():
                pytest.fail(why, pytrace=False)
            pytest.skip(why)
    return python


def _protoc(python: Path, *outputs: str) -> None:
    protos = sorted(str(p.relative_to(ROOT)) for p in PROTO_DIR.glob("*.proto"))
    cmd = [str(python), "-m", "grpc_tools.protoc", "-I", ".", *outputs, *protos]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"protoc failed: {done.stderr}"


def test_proto_files_present() -> None:
    for stem in STEMS:
        assert (PROTO_DIR / f"{stem}.proto").is_file()
        for suffix in SUFFIXES:
            assert (PROTO_DIR / f"{stem}{suffix}").is_file(), f"missing {stem}{suffix}: run scripts/gen-protos.sh"
    assert (PROTO_DIR / "__init__.py").is_file()


def _without_json_names(messages: Any) -> None:
    for message in messages:
        for field in message.field:
            field.ClearField("json_name")  # protoc fills it in descriptor sets, not in generated code
        _without_json_names(message.nested_type)


@pytest.mark.slow  # installs the pinned grpcio-tools (about 10 s), once for both tests
@pytest.mark.xdist_group("pinned_grpcio_tools")
def test_generated_descriptors_match_proto_files(tmp_path: Path, pinned_tools: Path) -> None:
    """The descriptors compiled into the committed *_pb2.py equal what the .proto files compile to now."""
    from google.protobuf import descriptor_pb2

    out = tmp_path / "set.pb"
    _protoc(pinned_tools, f"--descriptor_set_out={out}")
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    by_name = {f.name: f for f in fds.file}
    for stem, module in MODULES.items():
        want = by_name[f"accelstats/nomad/proto/{stem}.proto"]
        _without_json_names(want.message_type)
        got = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
        assert got == want, f"{stem}.proto changed since generation; " + STALE.format(_pin())


@pytest.mark.slow
@pytest.mark.xdist_group("pinned_grpcio_tools")
def test_generated_code_is_current(tmp_path: Path, pinned_tools: Path) -> None:
    """Byte-for-byte: scripts/gen-protos.sh, with the pinned grpcio-tools, reproduces the committed files."""
    done = subprocess.run(["bash", str(GEN_PROTOS), "--out", str(tmp_path)],
                          env={**os.environ, "PYTHON": str(pinned_tools)}, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "throwaway" not in done.stderr  # it used the interpreter it was given
    fresh = tmp_path / "accelstats" / "nomad" / "proto"
    expected = {f"{stem}{suffix}" for stem in STEMS for suffix in SUFFIXES}
    assert {p.name for p in fresh.iterdir()} == expected, "a .proto was added or removed; " + STALE.format(_pin())
    stale = [name for name in sorted(expected) if (fresh / name).read_bytes() != (PROTO_DIR / name).read_bytes()]
    assert not stale, f"{', '.join(stale)}: " + STALE.format(_pin())


# --- wire facts (Nomad plugins/base, plugins/device, plugins/shared; go-plugin internal/plugin) ---

METHODS = [
    # (module, service, method, request streams, response streams)
    (base_pb2, "hashicorp.nomad.plugins.base.proto.BasePlugin", "PluginInfo", False, False),
    (base_pb2, "hashicorp.nomad.plugins.base.proto.BasePlugin", "ConfigSchema", False, False),
    (base_pb2, "hashicorp.nomad.plugins.base.proto.BasePlugin", "SetConfig", False, False),
    (device_pb2, "hashicorp.nomad.plugins.device.DevicePlugin", "Fingerprint", False, True),
    (device_pb2, "hashicorp.nomad.plugins.device.DevicePlugin", "Reserve", False, False),
    (device_pb2, "hashicorp.nomad.plugins.device.DevicePlugin", "Stats", False, True),
    (grpc_controller_pb2, "plugin.GRPCController", "Shutdown", False, False),
    (grpc_stdio_pb2, "plugin.GRPCStdio", "StreamStdio", False, True),
]

METHOD_TYPES = {
    "/hashicorp.nomad.plugins.base.proto.BasePlugin/PluginInfo": (
        "hashicorp.nomad.plugins.base.proto.PluginInfoRequest",
        "hashicorp.nomad.plugins.base.proto.PluginInfoResponse",
    ),
    "/hashicorp.nomad.plugins.base.proto.BasePlugin/ConfigSchema": (
        "hashicorp.nomad.plugins.base.proto.ConfigSchemaRequest",
        "hashicorp.nomad.plugins.base.proto.ConfigSchemaResponse",
    ),
    "/hashicorp.nomad.plugins.base.proto.BasePlugin/SetConfig": (
        "hashicorp.nomad.plugins.base.proto.SetConfigRequest",
        "hashicorp.nomad.plugins.base.proto.SetConfigResponse",
    ),
    "/hashicorp.nomad.plugins.device.DevicePlugin/Fingerprint": (
        "hashicorp.nomad.plugins.device.FingerprintRequest",
        "hashicorp.nomad.plugins.device.FingerprintResponse",
    ),
    "/hashicorp.nomad.plugins.device.DevicePlugin/Reserve": (
        "hashicorp.nomad.plugins.device.ReserveRequest",
        "hashicorp.nomad.plugins.device.ReserveResponse",
    ),
    "/hashicorp.nomad.plugins.device.DevicePlugin/Stats": (
        "hashicorp.nomad.plugins.device.StatsRequest",
        "hashicorp.nomad.plugins.device.StatsResponse",
    ),
    "/plugin.GRPCController/Shutdown": ("plugin.Empty", "plugin.Empty"),
    "/plugin.GRPCStdio/StreamStdio": ("google.protobuf.Empty", "plugin.StdioData"),
}


@pytest.mark.parametrize(("module", "service", "method", "client_streams", "server_streams"), METHODS)
def test_service_methods(module: Any, service: str, method: str, client_streams: bool, server_streams: bool) -> None:
    svc = module.DESCRIPTOR.services_by_name[service.rsplit(".", 1)[1]]
    assert svc.full_name == service
    m = svc.methods_by_name[method]
    path = f"/{svc.full_name}/{m.name}"
    assert (m.input_type.full_name, m.output_type.full_name) == METHOD_TYPES[path]
    assert m.client_streaming is client_streams
    assert m.server_streaming is server_streams


def test_no_other_methods() -> None:
    paths = {
        f"/{svc.full_name}/{m.name}"
        for module in MODULES.values()
        for svc in module.DESCRIPTOR.services_by_name.values()
        for m in svc.methods
    }
    assert paths == set(METHOD_TYPES)


def test_grpc_server_routes_the_paths() -> None:
    """The generated *_pb2_grpc registration serves each method at its Nomad/go-plugin path (what a gRPC
    server routes on), with the right request/response streaming."""
    from concurrent import futures

    import grpc
    from google.protobuf import empty_pb2

    from accelstats.nomad.proto import base_pb2_grpc, device_pb2_grpc, grpc_controller_pb2_grpc, grpc_stdio_pb2_grpc

    class Base(base_pb2_grpc.BasePluginServicer):  # type: ignore[misc]
        def PluginInfo(self, request: Any, context: Any) -> Any:  # noqa: N802
            return base_pb2.PluginInfoResponse(type=base_pb2.DEVICE, name="x")

        def ConfigSchema(self, request: Any, context: Any) -> Any:  # noqa: N802
            return base_pb2.ConfigSchemaResponse(spec=hclspec_pb2.Spec(literal=hclspec_pb2.Literal(value="true")))

        def SetConfig(self, request: Any, context: Any) -> Any:  # noqa: N802
            return base_pb2.SetConfigResponse()

    class Device(device_pb2_grpc.DevicePluginServicer):  # type: ignore[misc]
        def Fingerprint(self, request: Any, context: Any) -> Any:  # noqa: N802
            yield device_pb2.FingerprintResponse()

        def Reserve(self, request: Any, context: Any) -> Any:  # noqa: N802
            return device_pb2.ReserveResponse(container_res=device_pb2.ContainerReservation(envs={"A": "1"}))

        def Stats(self, request: Any, context: Any) -> Any:  # noqa: N802
            yield device_pb2.StatsResponse()

    class Controller(grpc_controller_pb2_grpc.GRPCControllerServicer):  # type: ignore[misc]
        def Shutdown(self, request: Any, context: Any) -> Any:  # noqa: N802
            return grpc_controller_pb2.Empty()

    class Stdio(grpc_stdio_pb2_grpc.GRPCStdioServicer):  # type: ignore[misc]
        def StreamStdio(self, request: Any, context: Any) -> Any:  # noqa: N802
            yield grpc_stdio_pb2.StdioData(channel=grpc_stdio_pb2.StdioData.STDERR, data=b"x")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    base_pb2_grpc.add_BasePluginServicer_to_server(Base(), server)
    device_pb2_grpc.add_DevicePluginServicer_to_server(Device(), server)
    grpc_controller_pb2_grpc.add_GRPCControllerServicer_to_server(Controller(), server)
    grpc_stdio_pb2_grpc.add_GRPCStdioServicer_to_server(Stdio(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            # (server streams, request, the reply's bytes as a Go client reads them)
            calls = {
                "/hashicorp.nomad.plugins.base.proto.BasePlugin/PluginInfo": (
                    False, base_pb2.PluginInfoRequest(), b"\x08\x03\x22\x01x"),
                "/hashicorp.nomad.plugins.base.proto.BasePlugin/ConfigSchema": (
                    False, base_pb2.ConfigSchemaRequest(), b"\x0a\x08\x52\x06\x0a\x04true"),
                "/hashicorp.nomad.plugins.base.proto.BasePlugin/SetConfig": (False, base_pb2.SetConfigRequest(), b""),
                "/hashicorp.nomad.plugins.device.DevicePlugin/Fingerprint": (
                    True, device_pb2.FingerprintRequest(), b""),
                "/hashicorp.nomad.plugins.device.DevicePlugin/Reserve": (
                    False, device_pb2.ReserveRequest(device_ids=["a"]), b"\x0a\x08\x0a\x06\x0a\x01A\x12\x011"),
                "/hashicorp.nomad.plugins.device.DevicePlugin/Stats": (True, device_pb2.StatsRequest(), b""),
                "/plugin.GRPCController/Shutdown": (False, grpc_controller_pb2.Empty(), b""),
                "/plugin.GRPCStdio/StreamStdio": (True, empty_pb2.Empty(), b"\x08\x02\x12\x01x"),
            }  # fmt: skip
            assert set(calls) == set(METHOD_TYPES)
            for path, (stream, request, wire) in calls.items():
                kind = channel.unary_stream if stream else channel.unary_unary
                call = kind(path, request_serializer=type(request).SerializeToString, response_deserializer=None)
                got = list(call(request, timeout=10)) if stream else [call(request, timeout=10)]
                assert got == [wire], path
    finally:
        server.stop(None)


# Short package prefixes used in the tables below.
PACKAGES = {
    "base.": "hashicorp.nomad.plugins.base.proto.",
    "hcl.": "hashicorp.nomad.plugins.shared.hclspec.",
    "structs.": "hashicorp.nomad.plugins.shared.structs.",
    "device.": "hashicorp.nomad.plugins.device.",
    "google.": "google.protobuf.",
    "plugin.": "plugin.",
}


def _full(name: str) -> str:
    """'device.DetectedDevice' -> 'hashicorp.nomad.plugins.device.DetectedDevice'; scalars unchanged."""
    for short, full in PACKAGES.items():
        if name.startswith(short):
            return full + name.removeprefix(short)
    return name


FIELDS = [
    # (message, field name, number, kind)  -- kind: a type, "repeated <type>", or "map" (see MAPS)
    ("base.PluginInfoResponse", "type", 1, "base.PluginType"),
    ("base.PluginInfoResponse", "plugin_api_versions", 2, "repeated string"),
    ("base.PluginInfoResponse", "plugin_version", 3, "string"),
    ("base.PluginInfoResponse", "name", 4, "string"),
    ("base.ConfigSchemaResponse", "spec", 1, "hcl.Spec"),
    ("base.SetConfigRequest", "msgpack_config", 1, "bytes"),
    ("base.SetConfigRequest", "nomad_config", 2, "base.NomadConfig"),
    ("base.SetConfigRequest", "plugin_api_version", 3, "string"),
    ("base.NomadConfig", "driver", 1, "base.NomadDriverConfig"),
    ("base.NomadDriverConfig", "ClientMaxPort", 1, "uint32"),
    ("base.NomadDriverConfig", "ClientMinPort", 2, "uint32"),
    ("base.NomadDriverConfig", "Topology", 3, "base.ClientTopology"),
    ("base.ClientTopology", "node_ids", 1, "repeated uint32"),
    ("base.ClientTopology", "distances", 2, "base.ClientTopologySLIT"),
    ("base.ClientTopology", "cores", 3, "repeated base.ClientTopologyCore"),
    ("base.ClientTopology", "override_total_compute", 4, "uint64"),
    ("base.ClientTopology", "override_withold_compute", 5, "uint64"),
    ("base.ClientTopologySLIT", "dimension", 1, "uint32"),
    ("base.ClientTopologySLIT", "values", 2, "repeated uint32"),
    ("base.ClientTopologyCore", "socket_id", 1, "uint32"),
    ("base.ClientTopologyCore", "node_id", 2, "uint32"),
    ("base.ClientTopologyCore", "core_id", 3, "uint32"),
    ("base.ClientTopologyCore", "core_grade", 4, "base.CoreGrade"),
    ("base.ClientTopologyCore", "disable", 5, "bool"),
    ("base.ClientTopologyCore", "base_speed", 6, "uint64"),
    ("base.ClientTopologyCore", "max_speed", 7, "uint64"),
    ("base.ClientTopologyCore", "guess_speed", 8, "uint64"),
    # hclspec
    ("hcl.Spec", "object", 1, "hcl.Object"),
    ("hcl.Spec", "array", 2, "hcl.Array"),
    ("hcl.Spec", "Attr", 3, "hcl.Attr"),
    ("hcl.Spec", "block_value", 4, "hcl.Block"),
    ("hcl.Spec", "block_attrs", 5, "hcl.BlockAttrs"),
    ("hcl.Spec", "block_list", 6, "hcl.BlockList"),
    ("hcl.Spec", "block_set", 7, "hcl.BlockSet"),
    ("hcl.Spec", "block_map", 8, "hcl.BlockMap"),
    ("hcl.Spec", "default", 9, "hcl.Default"),
    ("hcl.Spec", "literal", 10, "hcl.Literal"),
    ("hcl.Object", "attributes", 1, "map"),
    ("hcl.Array", "values", 1, "repeated hcl.Spec"),
    ("hcl.Attr", "name", 1, "string"),
    ("hcl.Attr", "type", 2, "string"),
    ("hcl.Attr", "required", 3, "bool"),
    ("hcl.Block", "name", 1, "string"),
    ("hcl.Block", "required", 2, "bool"),
    ("hcl.Block", "nested", 3, "hcl.Spec"),
    ("hcl.BlockAttrs", "name", 1, "string"),
    ("hcl.BlockAttrs", "type", 2, "string"),
    ("hcl.BlockAttrs", "required", 3, "bool"),
    ("hcl.BlockList", "name", 1, "string"),
    ("hcl.BlockList", "min_items", 2, "uint64"),
    ("hcl.BlockList", "max_items", 3, "uint64"),
    ("hcl.BlockList", "nested", 4, "hcl.Spec"),
    ("hcl.BlockSet", "name", 1, "string"),
    ("hcl.BlockSet", "min_items", 2, "uint64"),
    ("hcl.BlockSet", "max_items", 3, "uint64"),
    ("hcl.BlockSet", "nested", 4, "hcl.Spec"),
    ("hcl.BlockMap", "name", 1, "string"),
    ("hcl.BlockMap", "labels", 2, "repeated string"),
    ("hcl.BlockMap", "nested", 3, "hcl.Spec"),
    ("hcl.Default", "primary", 1, "hcl.Spec"),
    ("hcl.Default", "default", 2, "hcl.Spec"),
    ("hcl.Literal", "value", 1, "string"),
    # structs
    ("structs.Attribute", "float_val", 1, "double"),
    ("structs.Attribute", "int_val", 2, "int64"),
    ("structs.Attribute", "string_val", 3, "string"),
    ("structs.Attribute", "bool_val", 4, "bool"),
    ("structs.Attribute", "unit", 5, "string"),
    ("structs.StatObject", "nested", 1, "map"),
    ("structs.StatObject", "attributes", 2, "map"),
    ("structs.StatValue", "float_numerator_val", 1, "google.DoubleValue"),
    ("structs.StatValue", "float_denominator_val", 2, "google.DoubleValue"),
    ("structs.StatValue", "int_numerator_val", 3, "google.Int64Value"),
    ("structs.StatValue", "int_denominator_val", 4, "google.Int64Value"),
    ("structs.StatValue", "string_val", 5, "google.StringValue"),
    ("structs.StatValue", "bool_val", 6, "google.BoolValue"),
    ("structs.StatValue", "unit", 7, "string"),
    ("structs.StatValue", "desc", 8, "string"),
    # device
    ("device.FingerprintResponse", "device_group", 1, "repeated device.DeviceGroup"),
    ("device.DeviceGroup", "vendor", 1, "string"),
    ("device.DeviceGroup", "device_type", 2, "string"),
    ("device.DeviceGroup", "device_name", 3, "string"),
    ("device.DeviceGroup", "devices", 4, "repeated device.DetectedDevice"),
    ("device.DeviceGroup", "attributes", 5, "map"),
    ("device.DetectedDevice", "ID", 1, "string"),
    ("device.DetectedDevice", "healthy", 2, "bool"),
    ("device.DetectedDevice", "health_description", 3, "string"),
    ("device.DetectedDevice", "hw_locality", 4, "device.DeviceLocality"),
    ("device.DeviceLocality", "pci_bus_id", 1, "string"),
    ("device.ReserveRequest", "device_ids", 1, "repeated string"),
    ("device.ReserveResponse", "container_res", 1, "device.ContainerReservation"),
    ("device.ContainerReservation", "envs", 1, "map"),
    ("device.ContainerReservation", "mounts", 2, "repeated device.Mount"),
    ("device.ContainerReservation", "devices", 3, "repeated device.DeviceSpec"),
    ("device.Mount", "task_path", 1, "string"),
    ("device.Mount", "host_path", 2, "string"),
    ("device.Mount", "read_only", 3, "bool"),
    ("device.DeviceSpec", "task_path", 1, "string"),
    ("device.DeviceSpec", "host_path", 2, "string"),
    ("device.DeviceSpec", "permissions", 3, "string"),
    ("device.StatsRequest", "collection_interval", 1, "google.Duration"),
    ("device.StatsResponse", "groups", 1, "repeated device.DeviceGroupStats"),
    ("device.DeviceGroupStats", "vendor", 1, "string"),
    ("device.DeviceGroupStats", "type", 2, "string"),
    ("device.DeviceGroupStats", "name", 3, "string"),
    ("device.DeviceGroupStats", "instance_stats", 4, "map"),
    ("device.DeviceStats", "summary", 1, "structs.StatValue"),
    ("device.DeviceStats", "stats", 2, "structs.StatObject"),
    ("device.DeviceStats", "timestamp", 3, "google.Timestamp"),
    # go-plugin
    ("plugin.StdioData", "channel", 1, "plugin.StdioData.Channel"),
    ("plugin.StdioData", "data", 2, "bytes"),
]

# Map fields: (message, field) -> (key type, value type)
MAPS = {
    ("hcl.Object", "attributes"): ("string", "hcl.Spec"),
    ("structs.StatObject", "nested"): ("string", "structs.StatObject"),
    ("structs.StatObject", "attributes"): ("string", "structs.StatValue"),
    ("device.DeviceGroup", "attributes"): ("string", "structs.Attribute"),
    ("device.ContainerReservation", "envs"): ("string", "string"),
    ("device.DeviceGroupStats", "instance_stats"): ("string", "device.DeviceStats"),
}

# Messages whose every field is listed above (so a stray extra field fails), and the empty ones.
COMPLETE = {message for message, *_ in FIELDS} | {
    "base.PluginInfoRequest",
    "base.ConfigSchemaRequest",
    "base.SetConfigResponse",
    "device.FingerprintRequest",
    "plugin.Empty",
}


def _message(full_name: str) -> Any:
    for module in MODULES.values():
        pool = module.DESCRIPTOR.pool
        try:
            return pool.FindMessageTypeByName(full_name)
        except KeyError:
            continue
    raise KeyError(full_name)


def _type_name(field: Any) -> str:
    from google.protobuf.descriptor import FieldDescriptor

    if field.message_type is not None:
        return str(field.message_type.full_name)
    if field.enum_type is not None:
        return str(field.enum_type.full_name)
    scalar = {
        FieldDescriptor.TYPE_STRING: "string",
        FieldDescriptor.TYPE_BYTES: "bytes",
        FieldDescriptor.TYPE_BOOL: "bool",
        FieldDescriptor.TYPE_DOUBLE: "double",
        FieldDescriptor.TYPE_INT64: "int64",
        FieldDescriptor.TYPE_UINT32: "uint32",
        FieldDescriptor.TYPE_UINT64: "uint64",
    }
    return scalar[field.type]


def _is_repeated(field: Any) -> bool:
    if hasattr(field, "is_repeated"):  # protobuf >= 6 (7 removed `label`)
        return bool(field.is_repeated)
    from google.protobuf.descriptor import FieldDescriptor

    return bool(field.label == FieldDescriptor.LABEL_REPEATED)


@pytest.mark.parametrize(("message", "name", "number", "kind"), FIELDS, ids=[f"{m}.{f}" for m, f, *_ in FIELDS])
def test_field(message: str, name: str, number: int, kind: str) -> None:
    desc = _message(_full(message))
    field = desc.fields_by_name.get(name)
    assert field is not None, f"{message} has no field {name!r} (fields: {sorted(desc.fields_by_name)})"
    assert field.number == number
    if kind == "map":
        entry = field.message_type
        assert _is_repeated(field) and entry is not None and entry.GetOptions().map_entry
        key_value = (_type_name(entry.fields_by_name["key"]), _type_name(entry.fields_by_name["value"]))
        assert key_value == tuple(_full(t) for t in MAPS[(message, name)])
    elif kind.startswith("repeated "):
        assert _is_repeated(field)
        assert _type_name(field) == _full(kind.removeprefix("repeated "))
    else:
        assert not _is_repeated(field)
        assert _type_name(field) == _full(kind)


@pytest.mark.parametrize("message", sorted(COMPLETE))
def test_no_unlisted_fields(message: str) -> None:
    listed = {(f, n) for m, f, n, _ in FIELDS if m == message}
    have = {(f.name, f.number) for f in _message(_full(message)).fields}
    assert have == listed


def test_packages() -> None:
    assert base_pb2.DESCRIPTOR.package == "hashicorp.nomad.plugins.base.proto"
    assert hclspec_pb2.DESCRIPTOR.package == "hashicorp.nomad.plugins.shared.hclspec"
    assert structs_pb2.DESCRIPTOR.package == "hashicorp.nomad.plugins.shared.structs"
    assert device_pb2.DESCRIPTOR.package == "hashicorp.nomad.plugins.device"
    assert grpc_controller_pb2.DESCRIPTOR.package == "plugin"
    assert grpc_stdio_pb2.DESCRIPTOR.package == "plugin"
    from google.protobuf import descriptor_pb2

    for module in MODULES.values():
        assert descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb).syntax == "proto3"


def test_oneofs() -> None:
    spec = _message("hashicorp.nomad.plugins.shared.hclspec.Spec")
    assert [o.name for o in spec.oneofs] == ["block"]
    assert {f.name: f.number for f in spec.oneofs_by_name["block"].fields} == {
        "object": 1, "array": 2, "Attr": 3, "block_value": 4, "block_attrs": 5,
        "block_list": 6, "block_set": 7, "block_map": 8, "default": 9, "literal": 10,
    }  # fmt: skip
    attribute = _message("hashicorp.nomad.plugins.shared.structs.Attribute")
    assert [o.name for o in attribute.oneofs] == ["value"]
    assert {f.name: f.number for f in attribute.oneofs_by_name["value"].fields} == {
        "float_val": 1, "int_val": 2, "string_val": 3, "bool_val": 4,
    }  # fmt: skip
    assert attribute.fields_by_name["unit"].containing_oneof is None
    stat_value = _message("hashicorp.nomad.plugins.shared.structs.StatValue")
    assert not stat_value.oneofs


def test_enums() -> None:
    assert {v.name: v.number for v in base_pb2.DESCRIPTOR.enum_types_by_name["PluginType"].values} == {
        "UNKNOWN": 0, "DRIVER": 2, "DEVICE": 3,
    }  # fmt: skip
    assert base_pb2.DEVICE == 3
    assert {v.name: v.number for v in base_pb2.DESCRIPTOR.enum_types_by_name["CoreGrade"].values} == {
        "Performance": 0, "Efficiency": 1,
    }  # fmt: skip
    channel = _message("plugin.StdioData").enum_types_by_name["Channel"]
    assert {v.name: v.number for v in channel.values} == {"INVALID": 0, "STDOUT": 1, "STDERR": 2}


def test_wire_bytes() -> None:
    """A few messages encoded by hand (tag = field number << 3 | wire type), as Nomad's Go code would."""
    dev = device_pb2.DetectedDevice(ID="GPU-1", healthy=True)
    assert dev.SerializeToString() == b"\x0a\x05GPU-1\x10\x01"
    spec = hclspec_pb2.Spec(Attr=hclspec_pb2.Attr(name="dir", type="string"))
    assert spec.SerializeToString() == b"\x1a\x0d\x0a\x03dir\x12\x06string"
    literal = hclspec_pb2.Spec(literal=hclspec_pb2.Literal(value='"5s"'))
    assert literal.SerializeToString() == b'\x52\x06\x0a\x04"5s"'
    stats = device_pb2.DeviceGroupStats(vendor="v", type="t", name="n")
    assert stats.SerializeToString() == b"\x0a\x01v\x12\x01t\x1a\x01n"
    info = base_pb2.PluginInfoResponse(type=base_pb2.DEVICE)
    assert info.SerializeToString() == b"\x08\x03"
    value = structs_pb2.StatValue(unit="W")
    value.int_numerator_val.value = 5
    assert value.SerializeToString() == b"\x1a\x02\x08\x05\x3a\x01W"
    empty_reservation = device_pb2.ReserveResponse(container_res=device_pb2.ContainerReservation())
    assert empty_reservation.SerializeToString() == b"\x0a\x00"  # present, even when empty
    stdio = grpc_stdio_pb2.StdioData(channel=grpc_stdio_pb2.StdioData.STDERR, data=b"x")
    assert stdio.SerializeToString() == b"\x08\x02\x12\x01x"
