"""Fuzzing the go-cty msgpack encoder and the HCL literal reader (tests/support/nomadclient/ctymsgpack.py).

Documented error type: :class:`support.nomadclient.ctymsgpack.ConfigError` ("the config cannot be
decoded against the schema … or a value cannot be encoded"), raised by :func:`parse_literal`,
:func:`encode_number`, :func:`pack`, :func:`convert`, :func:`decode_config` and
:func:`encode_for_spec`. Inputs: arbitrary text and Python values, HCL literals rendered from random
cty values (then mutated), JSON-like agent ``config`` blocks decoded against the plugin's real
schema (:func:`accelstats.nomad.config.schema`) and against one schema with every hclspec kind.
"""

from __future__ import annotations

import functools
import math
import re
from decimal import Decimal
from typing import Any

import msgpack
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from support.nomadclient.ctymsgpack import (
    INT64_MAX,
    INT64_MIN,
    ConfigError,
    CtyType,
    convert,
    decode_config,
    encode_for_spec,
    encode_number,
    pack,
    parse_literal,
    parse_type,
    schema_defaults,
    unpack,
)

from accelstats.nomad import config as plugin_config
from accelstats.nomad.proto import hclspec_pb2

from .profiles import fuzz_settings

int64s = st.integers(INT64_MIN, INT64_MAX)
# Decimals as HCL/JSON would carry them: finite, at most a few hundred digits either side of the point.
decimals = st.decimals(allow_nan=False, allow_infinity=False).filter(lambda d: abs(d.adjusted()) < 400)
numbers = st.one_of(int64s, st.integers(), st.floats(allow_nan=False), decimals)
cty_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.text(max_size=20), int64s, st.floats(allow_nan=False), decimals),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=20,
)
json_like = st.recursive(
    st.one_of(st.none(), st.booleans(), st.text(max_size=12), st.integers(), st.floats(), decimals,
              st.sampled_from(["5s", "1m", "0", "true", "1", "12", "1e999", "-0.5", "GPU-1", ":9400", "-rwxrwxrwx"])),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=10), inner, max_size=4)),
    max_leaves=15,
)


REFUSED = object()


def refused_or(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args)``, or :data:`REFUSED` when it raises ConfigError (with a message); any other
    exception escapes and fails the test."""
    try:
        return fn(*args, **kwargs)
    except ConfigError as exc:
        assert str(exc)
        return REFUSED


def as_decimal(value: int | float | Decimal) -> Decimal:
    """The number Nomad's JSON round trip holds: a float by its shortest round-trip text."""
    return Decimal(repr(value)) if isinstance(value, float) else Decimal(value)


# ---------------------------------------------------------------------------- numbers


@fuzz_settings()
@given(numbers)
@example(Decimal("0.1234567890123456789012345678901"))  # more digits than Decimal's default precision (28)
@example(Decimal("1E+4000"))
@example(2**64 + 1)
def test_encode_number_keeps_the_value(value: int | float | Decimal) -> None:
    """cty mode: an exact int64 as int, else an exact float64, else decimal text — the same number."""
    exact = as_decimal(value) if not (isinstance(value, float) and math.isinf(value)) else None
    for mode in ("cty", "string", "float"):
        got = encode_number(value, mode)  # type: ignore[arg-type]
        if exact is None:
            assert got == value
        elif isinstance(got, int):
            assert got == exact and INT64_MIN <= got <= INT64_MAX
        elif isinstance(got, str):
            assert mode != "float" and re.fullmatch(r"-?[0-9]+(\.[0-9]*[1-9])?", got) and Decimal(got) == exact
        else:
            assert mode != "string"
            assert Decimal(got) == exact if mode == "cty" else got == float(exact)
            assert mode != "cty" or not float(got).is_integer()  # go-cty: an integer is int64 or text


@fuzz_settings()
@given(st.one_of(numbers, st.just(math.nan), st.booleans(), st.integers(-(10**5000), 10**5000),
                 st.sampled_from([Decimal("NaN"), Decimal("-Infinity"), Decimal("1E+999999999"),
                                  Decimal("1E-999999999")])))
def test_encode_number_raises_only_config_error(value: Any) -> None:
    for mode in ("cty", "string", "float"):
        got = refused_or(encode_number, value, mode)
        assert got is REFUSED or type(got) in (int, float, str)


# ---------------------------------------------------------------------------- pack / unpack


def expected_after_msgpack(value: Any, mode: str) -> Any:
    """What a plugin decodes from :func:`pack`: numbers as :func:`encode_number` spells them,
    lists (and tuples) as lists, maps with their keys."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float, Decimal)):
        return encode_number(value, mode)  # type: ignore[arg-type]
    if isinstance(value, dict):
        return {k: expected_after_msgpack(v, mode) for k, v in value.items()}
    return [expected_after_msgpack(v, mode) for v in value]


@fuzz_settings()
@given(cty_values, st.sampled_from(["cty", "float", "string"]))
def test_pack_round_trips(value: Any, mode: str) -> None:
    data = pack(value, number_mode=mode)  # type: ignore[arg-type]
    assert unpack(data) == expected_after_msgpack(value, mode)


@fuzz_settings()
@given(st.recursive(
    st.one_of(json_like, st.binary(max_size=4), st.just(object()), st.complex_numbers(), st.just(math.nan)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.tuples(inner, inner), st.frozensets(st.one_of(st.integers(), st.text()),
                                                                            max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=4), st.integers(), st.none()), inner, max_size=3)),
    max_leaves=10))
@example({1: 2, "a": 3})
@example(frozenset({1, "a"}))
@example({"a": "\ud800"})
def test_pack_raises_only_config_error(value: Any) -> None:
    data = refused_or(pack, value)
    assert data is REFUSED or isinstance(unpack(data), (type(None), bool, str, int, float, list, dict))


def test_pack_limits() -> None:
    """Regressions (found by fuzzing): keys of mixed types, sets of mixed types, lone surrogates and
    nesting deeper than msgpack's 511 levels are ConfigError, not TypeError / ValueError."""
    for value, message in (({1: 2, "a": 3}, "map key 1 is not a string"), (frozenset({1, "a"}), "one type"),
                           ({"a": "\ud800"}, "not valid Unicode"),
                           (functools.reduce(lambda inner, _: [inner], range(600), []), "nested deeper")):
        with pytest.raises(ConfigError, match=message):
            pack(value)
    assert unpack(pack(functools.reduce(lambda inner, _: [inner], range(100), []))) is not None


# ---------------------------------------------------------------------------- HCL literals


def hcl(value: Any) -> str:
    """``value`` spelled as an HCL literal expression."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, Decimal)):
        return str(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
        return '"' + escaped.replace("${", "$${").replace("%{", "%%{") + '"'
    if isinstance(value, list):
        return "[" + ", ".join(map(hcl, value)) + "]"
    return "{" + "\n".join(f"{hcl(k)} = {hcl(v)}" for k, v in value.items()) + "}"


literal_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.text(max_size=20), int64s, decimals),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=15,
)


@fuzz_settings()
@given(literal_values)
@example("${x} $${y} %{z} %%{w} \\ \" \n")
@example(Decimal("1E+20"))
def test_literal_round_trips(value: Any) -> None:
    assert parse_literal(hcl(value)) == value


@st.composite
def mutated_literals(draw: st.DrawFn) -> str:
    text = hcl(draw(literal_values))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(text)))
        if draw(st.booleans()):
            text = text[:at] + draw(st.sampled_from([*'[]{}()"\\,=:!-.e#/*\n', "${", "/*", "//", "1e"])) + text[at:]
        else:
            text = text[:at] + text[at + draw(st.integers(1, 4)):]
    return text


@fuzz_settings()
@given(st.one_of(st.text(), mutated_literals()))
@example("[" * 5000)
@example("-" * 5000 + "1")
@example("(" * 3000 + "1" + ")" * 3000)
@example("1e999999999")
@example("{" + "a = {" * 2000)
@example('{"" = 5.1e9999999999999811120E-18}')  # found by the long run: Decimal's InvalidOperation
def test_parse_literal_raises_only_config_error(text: str) -> None:
    value = refused_or(parse_literal, text)
    assert value is REFUSED or parse_literal(hcl(value)) == value


def test_parse_literal_limits() -> None:
    """Regressions (found by fuzzing): nesting deeper than Python's stack and numbers beyond 4000
    digits are ConfigError, not RecursionError / ValueError or a hang."""
    with pytest.raises(ConfigError, match="nested"):
        parse_literal("[" * 5000)
    with pytest.raises(ConfigError, match="nested"):
        parse_literal("-" * 5000 + "1")
    with pytest.raises(ConfigError, match="digits"):
        parse_literal("1e999999999")
    with pytest.raises(ConfigError, match="out of range"):  # beyond Decimal's exponents: InvalidOperation before
        parse_literal("5.1e9999999999999811120")
    with pytest.raises(ConfigError, match="out of range"):
        convert("1e99999999999999999999", CtyType("number"), "x")
    assert parse_literal("[" * 50 + "]" * 50) is not None
    assert parse_literal("1e3999") == Decimal("1e3999")


# ---------------------------------------------------------------------------- types and schemas


def test_an_empty_list_of_blocks_is_an_absent_block() -> None:
    """Regression (found by fuzzing): ``{"blk": []}`` for a Block or BlockAttrs spec raised IndexError;
    no block is an absent block (null, or "missing … block" when required)."""
    value = decode_config(EVERY_KIND, {"blk": [], "battrs": [], "bmap": {"x": {"y": [], "z": {}}}})
    assert value["blk"] is None and value["battrs"] is None
    assert value["bmap"] == {"x": {"z": {"w": 1}}}  # the labels with no block are left out (long run: IndexError)
    required = _object(blk=hclspec_pb2.Spec(block_value=hclspec_pb2.Block(name="blk", required=True, nested=_object())))
    with pytest.raises(ConfigError, match="missing blk block"):
        decode_config(required, {"blk": []})


types = st.recursive(st.sampled_from([CtyType("string"), CtyType("number"), CtyType("bool"), CtyType("any")]),
                     lambda inner: st.builds(CtyType, st.sampled_from(["list", "set", "map"]), inner), max_leaves=3)


@fuzz_settings()
@given(json_like, types)
@example({"b": 1, "a": True}, CtyType("map", CtyType("string")))
@example(["1e999999999"], CtyType("list", CtyType("number")))
def test_convert_raises_only_config_error_and_conforms(value: Any, ty: CtyType) -> None:
    try:
        got = convert(value, ty, "x")
    except ConfigError:
        return
    assert conforms(got, ty)


def conforms(value: Any, ty: CtyType) -> bool:
    """Whether a converted value has the type's Python shape (null conforms to every type)."""
    if value is None or ty.kind == "any":
        return True
    if ty.kind == "string":
        return isinstance(value, str)
    if ty.kind == "number":
        return isinstance(value, (int, float, Decimal)) and not isinstance(value, bool)
    if ty.kind == "bool":
        return isinstance(value, bool)
    assert ty.elem is not None
    if ty.kind == "map":
        return isinstance(value, dict) and all(isinstance(k, str) and conforms(v, ty.elem) for k, v in value.items())
    return isinstance(value, list) and all(conforms(v, ty.elem) for v in value)


def type_text(ty: CtyType) -> str:
    return ty.kind if ty.elem is None else f"{ty.kind}({type_text(ty.elem)})"


@fuzz_settings()
@given(types, st.text(" \t", max_size=2))
@example(CtyType("list", CtyType("string")), "")
def test_type_expressions_round_trip(ty: CtyType, space: str) -> None:
    assert parse_type(space.join(type_text(ty))) == ty


@fuzz_settings()
@given(st.one_of(st.text(max_size=30), st.text("listmapsetobjecttuplestringnumberbool()", max_size=40)))
@example("list(" * 2000 + "string" + ")" * 2000)
def test_parse_type_raises_only_config_error(text: str) -> None:
    ty = refused_or(parse_type, text)
    assert ty is REFUSED or parse_type(type_text(ty)) == ty


def _attr(name: str, typ: str, default: str | None = None, required: bool = False) -> Any:
    spec = hclspec_pb2.Spec(Attr=hclspec_pb2.Attr(name=name, type=typ, required=required))
    if default is None:
        return spec
    return hclspec_pb2.Spec(default=hclspec_pb2.Default(
        primary=spec, default=hclspec_pb2.Spec(literal=hclspec_pb2.Literal(value=default))))


def _object(**attrs: Any) -> Any:
    return hclspec_pb2.Spec(object=hclspec_pb2.Object(attributes=attrs))


EVERY_KIND = _object(
    s=_attr("s", "string", '"x"'), n=_attr("n", "number", "0.5"), b=_attr("b", "bool", "true"),
    ls=_attr("ls", "list(string)", "[]"), m=_attr("m", "map(number)"), st=_attr("st", "set(string)"),
    any=_attr("any", "any"), req=_attr("req", "string", required=False),
    blk=hclspec_pb2.Spec(block_value=hclspec_pb2.Block(name="blk", nested=_object(p=_attr("p", "string", '"/dev"')))),
    lst=hclspec_pb2.Spec(block_list=hclspec_pb2.BlockList(name="lst", max_items=2, nested=_object(
        k=_attr("k", "string", required=True)))),
    bset=hclspec_pb2.Spec(block_set=hclspec_pb2.BlockSet(name="bset", nested=_object(v=_attr("v", "number")))),
    bmap=hclspec_pb2.Spec(block_map=hclspec_pb2.BlockMap(name="bmap", labels=["a", "b"], nested=_object(
        w=_attr("w", "number", "1")))),
    battrs=hclspec_pb2.Spec(block_attrs=hclspec_pb2.BlockAttrs(name="battrs", type="string")),
)
PLUGIN_SCHEMA = plugin_config.schema(hclspec_pb2)
SCHEMAS = {"plugin": PLUGIN_SCHEMA, "every kind": EVERY_KIND}


@st.composite
def agent_configs(draw: st.DrawFn, spec: Any) -> Any:
    """An agent ``config`` block for ``spec``: its keys (and some unknown ones) with random values."""
    names = sorted(schema_defaults(spec)) + ["bogus"]
    nested = {"file_devices": ["dir", "list_period", "vendor"], "mps": ["root", "timeout", "resource"],
              "blk": ["p"], "lst": ["k"], "bset": ["v"], "bmap": ["x"], "battrs": ["q"]}
    user: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(names), max_size=6, unique=True)):
        if key in nested and draw(st.booleans()):
            block = draw(st.fixed_dictionaries({}, optional={k: json_like for k in nested[key]}))
            user[key] = draw(st.sampled_from([block, [block], [block, block], {"l1": {"l2": block}}]))
        else:
            user[key] = draw(json_like)
    return user


@fuzz_settings()
@given(st.sampled_from(sorted(SCHEMAS)).flatmap(lambda name: st.tuples(st.just(name), agent_configs(SCHEMAS[name]))))
@example(("every kind", {"bmap": {"x": {"y": {"w": "1e999999999"}}}}))
@example(("plugin", {"mps": {"resource": [{"name": "a", "replicas": "1e999999999"}]}}))
@example(("every kind", {"blk": [], "battrs": []}))
@example(("every kind", {"bmap": {"x": {"y": []}}}))  # found by the long run: IndexError
def test_decode_and_encode_for_spec_raise_only_config_error(case: tuple[str, Any]) -> None:
    name, user = case
    spec = SCHEMAS[name]
    try:
        value = decode_config(spec, user)
    except ConfigError:
        return
    assert sorted(value) == sorted(schema_defaults(spec))  # every attribute present, unknown keys refused
    try:
        data = encode_for_spec(spec, user)
    except ConfigError:
        return  # e.g. NaN: decoded, but no cty number
    decoded = msgpack.unpackb(data, raw=False)
    assert list(decoded) == sorted(decoded)  # go-cty writes object attributes in sorted order
