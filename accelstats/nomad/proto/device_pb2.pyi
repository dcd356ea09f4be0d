from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from accelstats.nomad.proto import structs_pb2 as _structs_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FingerprintRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FingerprintResponse(_message.Message):
    __slots__ = ("device_group",)
    DEVICE_GROUP_FIELD_NUMBER: _ClassVar[int]
    device_group: _containers.RepeatedCompositeFieldContainer[DeviceGroup]
    def __init__(self, device_group: _Optional[_Iterable[_Union[DeviceGroup, _Mapping]]] = ...) -> None: ...

class DeviceGroup(_message.Message):
    __slots__ = ("vendor", "device_type", "device_name", "devices", "attributes")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _structs_pb2.Attribute
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_structs_pb2.Attribute, _Mapping]] = ...) -> None: ...
    VENDOR_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    vendor: str
    device_type: str
    device_name: str
    devices: _containers.RepeatedCompositeFieldContainer[DetectedDevice]
    attributes: _containers.MessageMap[str, _structs_pb2.Attribute]
    def __init__(self, vendor: _Optional[str] = ..., device_type: _Optional[str] = ..., device_name: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[DetectedDevice, _Mapping]]] = ..., attributes: _Optional[_Mapping[str, _structs_pb2.Attribute]] = ...) -> None: ...

class DetectedDevice(_message.Message):
    __slots__ = ("ID", "healthy", "health_description", "hw_locality")
    ID_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    HEALTH_DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    HW_LOCALITY_FIELD_NUMBER: _ClassVar[int]
    ID: str
    healthy: bool
    health_description: str
    hw_locality: DeviceLocality
    def __init__(self, ID: _Optional[str] = ..., healthy: bool = ..., health_description: _Optional[str] = ..., hw_locality: _Optional[_Union[DeviceLocality, _Mapping]] = ...) -> None: ...

class DeviceLocality(_message.Message):
    __slots__ = ("pci_bus_id",)
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    pci_bus_id: str
    def __init__(self, pci_bus_id: _Optional[str] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("device_ids",)
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, device_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("container_res",)
    CONTAINER_RES_FIELD_NUMBER: _ClassVar[int]
    container_res: ContainerReservation
    def __init__(self, container_res: _Optional[_Union[ContainerReservation, _Mapping]] = ...) -> None: ...

class ContainerReservation(_message.Message):
    __slots__ = ("envs", "mounts", "devices")
    class EnvsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENVS_FIELD_NUMBER: _ClassVar[int]
    MOUNTS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    envs: _containers.ScalarMap[str, str]
    mounts: _containers.RepeatedCompositeFieldContainer[Mount]
    devices: _containers.RepeatedCompositeFieldContainer[DeviceSpec]
    def __init__(self, envs: _Optional[_Mapping[str, str]] = ..., mounts: _Optional[_Iterable[_Union[Mount, _Mapping]]] = ..., devices: _Optional[_Iterable[_Union[DeviceSpec, _Mapping]]] = ...) -> None: ...

class Mount(_message.Message):
    __slots__ = ("task_path", "host_path", "read_only")
    TASK_PATH_FIELD_NUMBER: _ClassVar[int]
    HOST_PATH_FIELD_NUMBER: _ClassVar[int]
    READ_ONLY_FIELD_NUMBER: _ClassVar[int]
    task_path: str
    host_path: str
    read_only: bool
    def __init__(self, task_path: _Optional[str] = ..., host_path: _Optional[str] = ..., read_only: bool = ...) -> None: ...

class DeviceSpec(_message.Message):
    __slots__ = ("task_path", "host_path", "permissions")
    TASK_PATH_FIELD_NUMBER: _ClassVar[int]
    HOST_PATH_FIELD_NUMBER: _ClassVar[int]
    PERMISSIONS_FIELD_NUMBER: _ClassVar[int]
    task_path: str
    host_path: str
    permissions: str
    def __init__(self, task_path: _Optional[str] = ..., host_path: _Optional[str] = ..., permissions: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("collection_interval",)
    COLLECTION_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    collection_interval: _duration_pb2.Duration
    def __init__(self, collection_interval: _Optional[_Union[_duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[DeviceGroupStats]
    def __init__(self, groups: _Optional[_Iterable[_Union[DeviceGroupStats, _Mapping]]] = ...) -> None: ...

class DeviceGroupStats(_message.Message):
    __slots__ = ("vendor", "type", "name", "instance_stats")
    class InstanceStatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: DeviceStats
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[DeviceStats, _Mapping]] = ...) -> None: ...
    VENDOR_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_STATS_FIELD_NUMBER: _ClassVar[int]
    vendor: str
    type: str
    name: str
    instance_stats: _containers.MessageMap[str, DeviceStats]
    def __init__(self, vendor: _Optional[str] = ..., type: _Optional[str] = ..., name: _Optional[str] = ..., instance_stats: _Optional[_Mapping[str, DeviceStats]] = ...) -> None: ...

class DeviceStats(_message.Message):
    __slots__ = ("summary", "stats", "timestamp")
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    summary: _structs_pb2.StatValue
    stats: _structs_pb2.StatObject
    timestamp: _timestamp_pb2.Timestamp
    def __init__(self, summary: _Optional[_Union[_structs_pb2.StatValue, _Mapping]] = ..., stats: _Optional[_Union[_structs_pb2.StatObject, _Mapping]] = ..., timestamp: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...
