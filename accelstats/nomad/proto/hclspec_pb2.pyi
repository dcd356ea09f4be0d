from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Spec(_message.Message):
    __slots__ = ("object", "array", "Attr", "block_value", "block_attrs", "block_list", "block_set", "block_map", "default", "literal")
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    ARRAY_FIELD_NUMBER: _ClassVar[int]
    ATTR_FIELD_NUMBER: _ClassVar[int]
    BLOCK_VALUE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ATTRS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LIST_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SET_FIELD_NUMBER: _ClassVar[int]
    BLOCK_MAP_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_FIELD_NUMBER: _ClassVar[int]
    LITERAL_FIELD_NUMBER: _ClassVar[int]
    object: Object
    array: Array
    Attr: Attr
    block_value: Block
    block_attrs: BlockAttrs
    block_list: BlockList
    block_set: BlockSet
    block_map: BlockMap
    default: Default
    literal: Literal
    def __init__(self, object: _Optional[_Union[Object, _Mapping]] = ..., array: _Optional[_Union[Array, _Mapping]] = ..., Attr: _Optional[_Union[Attr, _Mapping]] = ..., block_value: _Optional[_Union[Block, _Mapping]] = ..., block_attrs: _Optional[_Union[BlockAttrs, _Mapping]] = ..., block_list: _Optional[_Union[BlockList, _Mapping]] = ..., block_set: _Optional[_Union[BlockSet, _Mapping]] = ..., block_map: _Optional[_Union[BlockMap, _Mapping]] = ..., default: _Optional[_Union[Default, _Mapping]] = ..., literal: _Optional[_Union[Literal, _Mapping]] = ...) -> None: ...

class Attr(_message.Message):
    __slots__ = ("name", "type", "required")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: str
    required: bool
    def __init__(self, name: _Optional[str] = ..., type: _Optional[str] = ..., required: bool = ...) -> None: ...

class Block(_message.Message):
    __slots__ = ("name", "required", "nested")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_FIELD_NUMBER: _ClassVar[int]
    NESTED_FIELD_NUMBER: _ClassVar[int]
    name: str
    required: bool
    nested: Spec
    def __init__(self, name: _Optional[str] = ..., required: bool = ..., nested: _Optional[_Union[Spec, _Mapping]] = ...) -> None: ...

class BlockAttrs(_message.Message):
    __slots__ = ("name", "type", "required")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: str
    required: bool
    def __init__(self, name: _Optional[str] = ..., type: _Optional[str] = ..., required: bool = ...) -> None: ...

class BlockList(_message.Message):
    __slots__ = ("name", "min_items", "max_items", "nested")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MIN_ITEMS_FIELD_NUMBER: _ClassVar[int]
    MAX_ITEMS_FIELD_NUMBER: _ClassVar[int]
    NESTED_FIELD_NUMBER: _ClassVar[int]
    name: str
    min_items: int
    max_items: int
    nested: Spec
    def __init__(self, name: _Optional[str] = ..., min_items: _Optional[int] = ..., max_items: _Optional[int] = ..., nested: _Optional[_Union[Spec, _Mapping]] = ...) -> None: ...

class BlockSet(_message.Message):
    __slots__ = ("name", "min_items", "max_items", "nested")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MIN_ITEMS_FIELD_NUMBER: _ClassVar[int]
    MAX_ITEMS_FIELD_NUMBER: _ClassVar[int]
    NESTED_FIELD_NUMBER: _ClassVar[int]
    name: str
    min_items: int
    max_items: int
    nested: Spec
    def __init__(self, name: _Optional[str] = ..., min_items: _Optional[int] = ..., max_items: _Optional[int] = ..., nested: _Optional[_Union[Spec, _Mapping]] = ...) -> None: ...

class BlockMap(_message.Message):
    __slots__ = ("name", "labels", "nested")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    NESTED_FIELD_NUMBER: _ClassVar[int]
    name: str
    labels: _containers.RepeatedScalarFieldContainer[str]
    nested: Spec
    def __init__(self, name: _Optional[str] = ..., labels: _Optional[_Iterable[str]] = ..., nested: _Optional[_Union[Spec, _Mapping]] = ...) -> None: ...

class Literal(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: str
    def __init__(self, value: _Optional[str] = ...) -> None: ...

class Default(_message.Message):
    __slots__ = ("primary", "default")
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_FIELD_NUMBER: _ClassVar[int]
    primary: Spec
    default: Spec
    def __init__(self, primary: _Optional[_Union[Spec, _Mapping]] = ..., default: _Optional[_Union[Spec, _Mapping]] = ...) -> None: ...

class Object(_message.Message):
    __slots__ = ("attributes",)
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Spec
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Spec, _Mapping]] = ...) -> None: ...
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    attributes: _containers.MessageMap[str, Spec]
    def __init__(self, attributes: _Optional[_Mapping[str, Spec]] = ...) -> None: ...

class Array(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedCompositeFieldContainer[Spec]
    def __init__(self, values: _Optional[_Iterable[_Union[Spec, _Mapping]]] = ...) -> None: ...
