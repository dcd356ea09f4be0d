from accelstats.nomad.proto import hclspec_pb2 as _hclspec_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PluginType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UNKNOWN: _ClassVar[PluginType]
    DRIVER: _ClassVar[PluginType]
    DEVICE: _ClassVar[PluginType]

class CoreGrade(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    Performance: _ClassVar[CoreGrade]
    Efficiency: _ClassVar[CoreGrade]
UNKNOWN: PluginType
DRIVER: PluginType
DEVICE: PluginType
Performance: CoreGrade
Efficiency: CoreGrade

class PluginInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PluginInfoResponse(_message.Message):
    __slots__ = ("type", "plugin_api_versions", "plugin_version", "name")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    PLUGIN_API_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    PLUGIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    type: PluginType
    plugin_api_versions: _containers.RepeatedScalarFieldContainer[str]
    plugin_version: str
    name: str
    def __init__(self, type: _Optional[_Union[PluginType, str]] = ..., plugin_api_versions: _Optional[_Iterable[str]] = ..., plugin_version: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ConfigSchemaRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ConfigSchemaResponse(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: _hclspec_pb2.Spec
    def __init__(self, spec: _Optional[_Union[_hclspec_pb2.Spec, _Mapping]] = ...) -> None: ...

class SetConfigRequest(_message.Message):
    __slots__ = ("msgpack_config", "nomad_config", "plugin_api_version")
    MSGPACK_CONFIG_FIELD_NUMBER: _ClassVar[int]
    NOMAD_CONFIG_FIELD_NUMBER: _ClassVar[int]
    PLUGIN_API_VERSION_FIELD_NUMBER: _ClassVar[int]
    msgpack_config: bytes
    nomad_config: NomadConfig
    plugin_api_version: str
    def __init__(self, msgpack_config: _Optional[bytes] = ..., nomad_config: _Optional[_Union[NomadConfig, _Mapping]] = ..., plugin_api_version: _Optional[str] = ...) -> None: ...

class NomadConfig(_message.Message):
    __slots__ = ("driver",)
    DRIVER_FIELD_NUMBER: _ClassVar[int]
    driver: NomadDriverConfig
    def __init__(self, driver: _Optional[_Union[NomadDriverConfig, _Mapping]] = ...) -> None: ...

class NomadDriverConfig(_message.Message):
    __slots__ = ("ClientMaxPort", "ClientMinPort", "Topology")
    CLIENTMAXPORT_FIELD_NUMBER: _ClassVar[int]
    CLIENTMINPORT_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    ClientMaxPort: int
    ClientMinPort: int
    Topology: ClientTopology
    def __init__(self, ClientMaxPort: _Optional[int] = ..., ClientMinPort: _Optional[int] = ..., Topology: _Optional[_Union[ClientTopology, _Mapping]] = ...) -> None: ...

class ClientTopology(_message.Message):
    __slots__ = ("node_ids", "distances", "cores", "override_total_compute", "override_withold_compute")
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    DISTANCES_FIELD_NUMBER: _ClassVar[int]
    CORES_FIELD_NUMBER: _ClassVar[int]
    OVERRIDE_TOTAL_COMPUTE_FIELD_NUMBER: _ClassVar[int]
    OVERRIDE_WITHOLD_COMPUTE_FIELD_NUMBER: _ClassVar[int]
    node_ids: _containers.RepeatedScalarFieldContainer[int]
    distances: ClientTopologySLIT
    cores: _containers.RepeatedCompositeFieldContainer[ClientTopologyCore]
    override_total_compute: int
    override_withold_compute: int
    def __init__(self, node_ids: _Optional[_Iterable[int]] = ..., distances: _Optional[_Union[ClientTopologySLIT, _Mapping]] = ..., cores: _Optional[_Iterable[_Union[ClientTopologyCore, _Mapping]]] = ..., override_total_compute: _Optional[int] = ..., override_withold_compute: _Optional[int] = ...) -> None: ...

class ClientTopologySLIT(_message.Message):
    __slots__ = ("dimension", "values")
    DIMENSION_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    dimension: int
    values: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dimension: _Optional[int] = ..., values: _Optional[_Iterable[int]] = ...) -> None: ...

class ClientTopologyCore(_message.Message):
    __slots__ = ("socket_id", "node_id", "core_id", "core_grade", "disable", "base_speed", "max_speed", "guess_speed")
    SOCKET_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CORE_ID_FIELD_NUMBER: _ClassVar[int]
    CORE_GRADE_FIELD_NUMBER: _ClassVar[int]
    DISABLE_FIELD_NUMBER: _ClassVar[int]
    BASE_SPEED_FIELD_NUMBER: _ClassVar[int]
    MAX_SPEED_FIELD_NUMBER: _ClassVar[int]
    GUESS_SPEED_FIELD_NUMBER: _ClassVar[int]
    socket_id: int
    node_id: int
    core_id: int
    core_grade: CoreGrade
    disable: bool
    base_speed: int
    max_speed: int
    guess_speed: int
    def __init__(self, socket_id: _Optional[int] = ..., node_id: _Optional[int] = ..., core_id: _Optional[int] = ..., core_grade: _Optional[_Union[CoreGrade, str]] = ..., disable: bool = ..., base_speed: _Optional[int] = ..., max_speed: _Optional[int] = ..., guess_speed: _Optional[int] = ...) -> None: ...

class SetConfigResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
