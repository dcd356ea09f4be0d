"""A plugin config as a Nomad client sends it in ``SetConfig.msgpack_config``.

How Nomad builds those bytes (spec/nomad-plugin.md §2 "SetConfig's msgpack_config"; hashicorp/nomad
``helper/pluginutils/loader/init.go`` ``validatePluginConfig``):

1. the plugin's ``ConfigSchema`` answer (an hclspec ``Spec``) is converted to an ``hcldec`` spec
   (``helper/pluginutils/hclspecutils``); each ``Literal`` is an HCL *expression* parsed with
   ``hclsyntax.ParseExpression`` (a string default keeps its quotes: ``"5s"``);
2. the agent's ``plugin "<file>" { config { … } }`` block (a JSON-like map) is decoded against it
   with ``hcldec`` (``helper/pluginutils/hclutils.ParseHclInterface``): attributes are converted to
   their declared type (``go-cty/cty/convert``), ``Default`` fills what is absent (unconverted: the
   literal keeps its own type), an absent ``Block`` is null, an absent ``BlockList``/``BlockSet``
   an empty list, an absent ``BlockMap`` an empty map; unknown keys and missing required
   attributes are errors;
3. the value is encoded by ``go-cty/cty/msgpack.Marshal``: object attributes and map keys in
   sorted order, every attribute present (null as msgpack nil), strings as str, bools as bool,
   lists/sets/tuples as arrays, objects/maps as maps, and a number as an int when it is an exact
   int64, else as a float64 when it is not an integer and exactly representable, else (integers
   outside int64 included) as its decimal text (``big.Float.Text('f', -1)``; zclconf/go-cty
   ``cty/msgpack/marshal.go:81-97`` since v1.14.4, the version Nomad pins).

Step 2 goes through JSON (``ParseHclInterface`` marshals the map and parses it with HCL's JSON
parser at 512-bit precision), so a user's ``0.1`` reaches step 3 as the decimal 0.1 — not a
float64 — and is sent as the string ``"0.1"``; a user's ``0.5`` is sent as float64. The default
``number_mode="cty"`` reproduces that exactly; ``"float"`` sends every non-int as float64 and
``"string"`` every number as decimal text (both to test a plugin's decoder).

Public API: :func:`schema_defaults`, :func:`encode_config` (the dict-level encoder),
:func:`decode_config`/:func:`encode_for_spec` (type-aware, as ``hcldec`` does), :func:`parse_literal`
(HCL expressions) and :func:`pack`/:func:`unpack`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

import msgpack  # type: ignore[import-untyped, unused-ignore]

NumberMode = Literal["cty", "float", "string"]

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_DIGITS = 4000
"""Numbers are refused (ConfigError) beyond 10^4000 or below 10^-4000 in magnitude: go-cty would spell
them as thousands of digits, and Python refuses int conversions of more than 4300 digits."""
MAX_NESTING = 200
"""Deepest nesting of HCL literals, type expressions and packed values (ConfigError beyond)."""


class ConfigError(ValueError):
    """The config cannot be decoded against the schema (Nomad: ``failed parsing config: …``, which
    stops the agent) or a value cannot be encoded."""


# --------------------------------------------------------------------------- numbers


def _to_decimal(value: int | float | Decimal) -> Decimal:
    """The number as HCL's JSON parser would hold it after Nomad's JSON round trip: a Python float
    via its shortest round-trip text (what Go's ``json.Marshal`` writes for a float64)."""
    if isinstance(value, Decimal):
        return value
    if isinstance(value, float):
        return Decimal(repr(value))
    return Decimal(value)


def _decimal_text(d: Decimal) -> str:
    """``big.Float.Text('f', -1)``: plain positional notation, shortest form (no exponent, no
    trailing zeros), every digit kept (``normalize()`` would round to the context's 28)."""
    if d == 0:
        return "0"
    text = format(d, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def _check_magnitude(d: Decimal) -> Decimal:
    """``d`` when finite and within 10^±:data:`MAX_DIGITS`; raises ConfigError otherwise."""
    if d.is_finite() and d != 0 and abs(d.adjusted()) > MAX_DIGITS:
        raise ConfigError(f"number {d:.3e} has more than {MAX_DIGITS} digits")
    return d


def _parse_decimal(text: str) -> Decimal:
    """The Decimal of a number's text (already matched by a number pattern); ConfigError when its
    exponent is beyond what Decimal holds (``5e9999999999999999999``: InvalidOperation)."""
    try:
        return Decimal(text)
    except InvalidOperation:
        raise ConfigError(f"number {text[:40]!r} is out of range") from None


def _exact(d: Decimal) -> int | Decimal:
    """An HCL/JSON number as this module holds it: an int when integral, else the exact Decimal.
    Raises ConfigError beyond :data:`MAX_DIGITS` digits."""
    _check_magnitude(d)
    return int(d) if d == d.to_integral_value() else d


def encode_number(value: int | float | Decimal, mode: NumberMode = "cty") -> int | float | str:
    """The msgpack item go-cty writes for a number (``cty/msgpack/marshal.go:81-97``): an exact int64 as
    int, else a non-integer that a float64 holds exactly as float, else (an integer outside int64
    too) the decimal text. Infinities are
    float64 (``cty.PositiveInfinity``); NaN does not exist in cty and is refused."""
    if isinstance(value, bool):
        raise ConfigError("a bool is not a number")
    if isinstance(value, float) and math.isnan(value):
        raise ConfigError("NaN is not a cty number")
    if isinstance(value, float) and math.isinf(value):
        return value
    if isinstance(value, Decimal) and not value.is_finite():
        if value.is_nan():
            raise ConfigError("NaN is not a cty number")
        return float(value)
    d = _check_magnitude(_to_decimal(value))
    if mode == "string":
        return _decimal_text(d)
    integral = d == d.to_integral_value()
    if integral and INT64_MIN <= d <= INT64_MAX:
        return int(d)
    if mode == "float":
        return float(d)
    if integral:  # go-cty v1.14.4+ (marshal.go:90-96): an integer outside int64 is decimal text, never a float64
        return _decimal_text(d)
    try:
        f = float(d)
    except (OverflowError, InvalidOperation):  # pragma: no cover - float() of a Decimal saturates
        f = math.inf
    if math.isfinite(f) and Decimal(f) == d:
        return f
    return _decimal_text(d)


# --------------------------------------------------------------------------- packing


def _normalize(value: Any, mode: NumberMode, path: str, depth: int = 0) -> Any:
    where = path or "config"
    if depth > MAX_NESTING:
        raise ConfigError(f"{where}: nested deeper than {MAX_NESTING} levels")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(f"{where}: string {value[:100]!r} is not valid Unicode (a lone surrogate)") from None
        return value
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float, Decimal)):
        try:
            return encode_number(value, mode)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    if isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise ConfigError(f"{where}: map key {key!r} is not a string")
        return {key: _normalize(value[key], mode, f"{path}.{key}" if path else key, depth + 1) for key in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [_normalize(v, mode, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        try:
            items = sorted(value)
        except TypeError:
            raise ConfigError(f"{where}: a set's elements must all have one type") from None
        return [_normalize(v, mode, f"{path}[{i}]", depth + 1) for i, v in enumerate(items)]
    raise ConfigError(f"{where}: {type(value).__name__} has no cty equivalent")


def pack(value: Any, *, number_mode: NumberMode = "cty") -> bytes:
    """msgpack bytes of a decoded config value, laid out as ``cty/msgpack.Marshal`` does (maps with
    sorted keys; str as msgpack str; ints in their smallest form, floats as float64 — the same
    choices as the vmihailenco/msgpack encoder go-cty uses)."""
    data: bytes = msgpack.packb(_normalize(value, number_mode, ""), use_bin_type=True)
    return data


def unpack(data: bytes) -> Any:
    """Decode as a plugin should: ``msgpack.unpackb(data, raw=False)`` (spec §2)."""
    return msgpack.unpackb(data, raw=False)


# --------------------------------------------------------------------------- dict-level encoder


def _merge(defaults: Mapping[str, Any], user: Mapping[str, Any], path: str) -> dict[str, Any]:
    out = dict(defaults)
    for key, value in user.items():
        where = f"{path}.{key}" if path else key
        if key not in defaults:
            raise ConfigError(f'{where}: unsupported argument; an argument named "{key}" is not expected here')
        default = defaults[key]
        if isinstance(default, Mapping) and default and isinstance(value, Mapping):
            out[key] = _merge(default, value, where)
        else:
            out[key] = value
    return out


def encode_config(
    schema_defaults: Mapping[str, Any], user: Mapping[str, Any], *, number_mode: NumberMode = "cty"
) -> bytes:
    """``msgpack_config`` for ``user`` over ``schema_defaults`` (the :func:`schema_defaults` of the
    plugin's schema): every schema attribute present, user values replacing defaults (non-empty
    nested maps merged key by key), keys the schema lacks refused like ``hcldec`` refuses them.
    No type conversion here — use :func:`encode_for_spec` to convert as Nomad does."""
    return pack(_merge(schema_defaults, user, ""), number_mode=number_mode)


# --------------------------------------------------------------------------- HCL literal expressions

_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", '"': '"', "\\": "\\"}
_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


class _HclParser:
    """Enough of ``hclsyntax.ParseExpression`` for literal values evaluated without variables or
    functions (what a plugin schema's ``Literal`` holds): quoted strings with HCL escapes, numbers
    (kept exact as :class:`Decimal` when not integral), ``true``/``false``/``null``, tuples
    ``[…]``, objects ``{k = v, "k": v}`` (newline or comma separated), unary ``-`` and ``!``,
    parentheses."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.depth = 0

    def error(self, msg: str) -> ConfigError:
        return ConfigError(f"HCL literal {self.text!r}: {msg} at offset {self.pos}")

    def skip(self, newlines: bool = True) -> None:
        while self.pos < len(self.text):
            ch = self.text[self.pos]
            if ch in " \t\r" or (newlines and ch == "\n"):
                self.pos += 1
            elif self.text.startswith(("#", "//"), self.pos):
                end = self.text.find("\n", self.pos)
                self.pos = len(self.text) if end < 0 else end
            elif self.text.startswith("/*", self.pos):
                end = self.text.find("*/", self.pos + 2)
                if end < 0:
                    raise self.error("unterminated comment")
                self.pos = end + 2
            else:
                break

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def parse(self) -> Any:
        self.skip()
        value = self.expr()
        self.skip()
        if self.pos != len(self.text):
            raise self.error("extra characters after the expression")
        return value

    def expr(self) -> Any:
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise self.error(f"expression nested deeper than {MAX_NESTING} levels")
        value = self.operand()
        self.depth -= 1
        return value

    def operand(self) -> Any:
        self.skip()
        ch = self.peek()
        if ch == "-":
            self.pos += 1
            value = self.expr()
            if isinstance(value, bool) or not isinstance(value, (int, Decimal)):
                raise self.error("unary minus needs a number")
            return value.copy_negate() if isinstance(value, Decimal) else -value
        if ch == "!":
            self.pos += 1
            value = self.expr()
            if not isinstance(value, bool):
                raise self.error("! needs a bool")
            return not value
        if ch == "(":
            self.pos += 1
            value = self.expr()
            self.skip()
            if self.peek() != ")":
                raise self.error("missing )")
            self.pos += 1
            return value
        if ch == '"':
            return self.string()
        if ch == "[":
            return self.tuple()
        if ch == "{":
            return self.object()
        m = _NUMBER.match(self.text, self.pos)
        if m:
            try:
                value = _exact(_parse_decimal(m.group(0)))
            except ConfigError as exc:
                raise self.error(str(exc)) from None
            self.pos = m.end()
            return value
        m = _IDENT.match(self.text, self.pos)
        if m:
            self.pos = m.end()
            word = m.group(0)
            if word == "true":
                return True
            if word == "false":
                return False
            if word == "null":
                return None
            raise self.error(f"variables and functions are not allowed in a literal ({word!r})")
        raise self.error("expected a value")

    def string(self) -> str:
        self.pos += 1  # opening quote
        out: list[str] = []
        while True:
            if self.pos >= len(self.text) or self.text[self.pos] == "\n":
                raise self.error("unterminated string")
            ch = self.text[self.pos]
            if ch == '"':
                self.pos += 1
                return "".join(out)
            if ch == "\\":
                nxt = self.text[self.pos + 1 : self.pos + 2]
                if nxt in _ESCAPES:
                    out.append(_ESCAPES[nxt])
                    self.pos += 2
                elif nxt in ("u", "U"):
                    width = 4 if nxt == "u" else 8
                    digits = self.text[self.pos + 2 : self.pos + 2 + width]
                    if len(digits) != width or not all(c in "0123456789abcdefABCDEF" for c in digits):
                        raise self.error("bad unicode escape")
                    out.append(chr(int(digits, 16)))
                    self.pos += 2 + width
                else:
                    raise self.error(f"invalid escape \\{nxt}")
                continue
            if self.text.startswith(("$${", "%%{"), self.pos):
                out.append(self.text[self.pos + 1 : self.pos + 3])
                self.pos += 3
                continue
            if self.text.startswith(("${", "%{"), self.pos):
                raise self.error("template interpolation is not allowed in a literal")
            out.append(ch)
            self.pos += 1

    def tuple(self) -> list[Any]:
        self.pos += 1
        items: list[Any] = []
        while True:
            self.skip()
            if self.peek() == "]":
                self.pos += 1
                return items
            items.append(self.expr())
            self.skip()
            if self.peek() == ",":
                self.pos += 1
            elif self.peek() != "]":
                raise self.error("expected , or ]")

    def object(self) -> dict[str, Any]:
        self.pos += 1
        items: dict[str, Any] = {}
        while True:
            self.skip()
            if self.peek() == "}":
                self.pos += 1
                return items
            if self.peek() == '"':
                key: Any = self.string()
            elif self.peek() == "(":
                key = self.expr()
            else:
                m = _IDENT.match(self.text, self.pos)
                if not m:
                    raise self.error("expected an object key")
                key = m.group(0)
                self.pos = m.end()
            if isinstance(key, bool) or not isinstance(key, (str, int, Decimal)):
                raise self.error("object key must be a string")
            key = key if isinstance(key, str) else _decimal_text(Decimal(key))
            self.skip(newlines=False)
            if self.peek() not in ("=", ":"):
                raise self.error("expected = or :")
            self.pos += 1
            items[key] = self.expr()
            self.skip(newlines=False)
            if self.peek() in (",", "\n"):
                self.pos += 1
            elif self.peek() != "}":
                raise self.error("expected , newline or }")


def parse_literal(text: str) -> Any:
    """The value of an hclspec ``Literal`` (an HCL expression, as Nomad's ``hclspecutils`` parses it
    with ``hclsyntax.ParseExpression``): ``"5s"`` → ``"5s"``, ``true`` → True, ``5`` → 5,
    ``1.5`` → ``Decimal("1.5")`` (cty numbers are exact), ``[]`` → ``[]``, ``["a","b"]``,
    ``{}`` → ``{}``, ``null`` → None. Raises :class:`ConfigError` on anything else."""
    return _HclParser(text).parse()


# --------------------------------------------------------------------------- type expressions


@dataclass(frozen=True)
class CtyType:
    """A cty type constraint from an hclspec ``Attr.type`` (``string``, ``list(number)``, …);
    ``kind`` is string/number/bool/any/list/set/map; ``object(…)``/``tuple(…)`` are held as
    ``any`` (no conversion)."""

    kind: str
    elem: CtyType | None = None


_ANY = CtyType("any")


def parse_type(text: str) -> CtyType:
    """Parse a type expression as ``typeexpr.TypeConstraint`` does for the common cases. Raises
    ConfigError for anything else, and beyond :data:`MAX_NESTING` levels."""
    s = "".join(text.split())
    kinds: list[str] = []  # the collection kinds from the outside in
    while len(kinds) <= MAX_NESTING:
        if s in ("string", "number", "bool", "any"):
            ty = CtyType(s)
        elif s.startswith(("object(", "tuple(")) and s.endswith(")"):
            ty = _ANY
        else:
            kind = next((k for k in ("list", "set", "map") if s.startswith(k + "(") and s.endswith(")")), None)
            if kind is None:
                raise ConfigError(f"unsupported type expression {text[:200]!r}")
            kinds.append(kind)
            s = s[len(kind) + 1 : -1]
            continue
        for kind in reversed(kinds):
            ty = CtyType(kind, ty)
        return ty
    raise ConfigError(f"type expression {text[:200]!r} nested deeper than {MAX_NESTING} levels")


_NUMBER_TEXT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def convert(value: Any, ty: CtyType, where: str) -> Any:
    """``convert.Convert(value, ty)`` from go-cty for the JSON-like values a Nomad agent config
    holds: number/bool → string (``5`` → ``"5"``, ``true`` → ``"true"``), numeric string → number,
    ``"true"``/``"1"``/``"false"``/``"0"`` → bool, element-wise for list/set/map. Null stays null."""
    if value is None or ty.kind == "any":
        return value
    if ty.kind == "string":
        if isinstance(value, str):
            return value
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, (int, float, Decimal)):
            d = _to_decimal(value)
            if not d.is_finite():  # Nomad's JSON round trip cannot carry NaN or infinities
                raise ConfigError(f"{where}: a string is required, {value} has no decimal spelling")
            try:
                return _decimal_text(_check_magnitude(d))
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None
        raise ConfigError(f"{where}: a string is required")
    if ty.kind == "number":
        if isinstance(value, bool):
            raise ConfigError(f"{where}: a number is required")
        if isinstance(value, (int, float, Decimal)):
            return value
        if isinstance(value, str) and _NUMBER_TEXT.fullmatch(value):
            try:
                return _exact(_parse_decimal(value))
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None
        raise ConfigError(f"{where}: a number is required")
    if ty.kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value in ("true", "1", "false", "0"):
            return value in ("true", "1")
        raise ConfigError(f"{where}: a bool is required")
    assert ty.elem is not None
    if ty.kind in ("list", "set"):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: a {ty.kind} is required")
        items = [convert(v, ty.elem, f"{where}[{i}]") for i, v in enumerate(value)]
        if ty.kind == "set":
            unique: list[Any] = []
            for item in items:
                if item not in unique:
                    unique.append(item)
            try:
                items = sorted(unique)
            except TypeError:
                items = unique
        return items
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: a map is required")
    return {str(k): convert(v, ty.elem, f"{where}.{k}") for k, v in value.items()}


# --------------------------------------------------------------------------- hclspec decoding


def _names(spec: Any) -> set[str]:
    """Attribute and block names a spec reads from the current body (for unknown-key checks)."""
    kind = spec.WhichOneof("block")
    if kind == "object":
        return set().union(*(_names(s) for s in spec.object.attributes.values())) if spec.object.attributes else set()
    if kind == "array":
        return set().union(*(_names(s) for s in spec.array.values)) if spec.array.values else set()
    if kind == "default":
        return _names(spec.default.primary) | _names(spec.default.default)
    if kind == "Attr":
        return {spec.Attr.name}
    if kind in ("block_value", "block_attrs", "block_list", "block_set", "block_map"):
        return {getattr(spec, kind).name}
    return set()


def _blocks(value: Any, where: str) -> list[Mapping[str, Any]]:
    """A block's user value: a map, or a list of maps (how Nomad's HCL1 agent parser hands blocks)."""
    if isinstance(value, Mapping):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, Mapping) for v in value):
        return list(value)
    raise ConfigError(f"{where}: a block (map) is required")


def _decode(spec: Any, body: Mapping[str, Any], where: str, check: bool) -> Any:
    kind = spec.WhichOneof("block")
    prefix = f"{where}." if where else ""
    if kind == "object":
        names = _names(spec)
        if check:
            for key in body:
                if key not in names:
                    raise ConfigError(
                        f'{prefix}{key}: unsupported argument; an argument named "{key}" is not expected here'
                    )
        return {key: _decode(sub, body, where, check) for key, sub in sorted(spec.object.attributes.items())}
    if kind == "array":
        return [_decode(sub, body, where, check) for sub in spec.array.values]
    if kind == "default":
        value = _decode(spec.default.primary, body, where, check)
        return _decode(spec.default.default, body, where, check) if value is None else value
    if kind == "literal":
        return parse_literal(spec.literal.value)
    if kind == "Attr":
        attr = spec.Attr
        if attr.name not in body or body[attr.name] is None:
            if check and attr.required:
                raise ConfigError(f'{prefix}{attr.name}: missing required argument; the argument "{attr.name}" '
                                  "is required, but no definition was found")
            return None
        return convert(body[attr.name], parse_type(attr.type) if attr.type else _ANY, prefix + attr.name)
    if kind == "block_value":
        blk = spec.block_value
        items = _blocks(body[blk.name], prefix + blk.name) if blk.name in body else []
        if not items:  # absent, or an empty list of blocks
            if check and blk.required:
                raise ConfigError(f'{prefix}{blk.name}: missing {blk.name} block; a block of type "{blk.name}" '
                                  "is required here")
            return None
        if len(items) > 1:
            raise ConfigError(f"{prefix}{blk.name}: duplicate {blk.name} block; only one is allowed")
        return _decode(blk.nested, items[0], prefix + blk.name, check)
    if kind in ("block_list", "block_set"):
        blk = getattr(spec, kind)
        items = _blocks(body[blk.name], prefix + blk.name) if blk.name in body else []
        if check and len(items) < blk.min_items:
            raise ConfigError(f"{prefix}{blk.name}: insufficient {blk.name} blocks; at least {blk.min_items} required")
        if check and blk.max_items and len(items) > blk.max_items:
            raise ConfigError(f"{prefix}{blk.name}: too many {blk.name} blocks; no more than {blk.max_items} allowed")
        return [_decode(blk.nested, item, f"{prefix}{blk.name}[{i}]", check) for i, item in enumerate(items)]
    if kind == "block_map":
        blk = spec.block_map
        raw = body.get(blk.name, {})
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{prefix}{blk.name}: a map of labelled blocks is required")

        def walk(level: Mapping[str, Any], labels: Sequence[str], path: str) -> dict[str, Any]:
            if not labels:  # pragma: no cover - guarded below
                return {}
            out: dict[str, Any] = {}
            for label, sub in sorted(level.items()):
                if len(labels) == 1:
                    items = _blocks(sub, f"{path}.{label}")
                    if not items:  # an empty list of blocks: no block with this label
                        continue
                    if len(items) > 1:
                        raise ConfigError(f"{path}.{label}: duplicate block")
                    out[label] = _decode(blk.nested, items[0], f"{path}.{label}", check)
                elif isinstance(sub, Mapping):
                    out[label] = walk(sub, labels[1:], f"{path}.{label}")
                else:
                    raise ConfigError(f"{path}.{label}: a map is required")
            return out

        return walk(raw, list(blk.labels) or ["label"], prefix + blk.name)
    if kind == "block_attrs":
        blk = spec.block_attrs
        items = _blocks(body[blk.name], prefix + blk.name) if blk.name in body else []
        if not items:  # absent, or an empty list of blocks
            if check and blk.required:
                raise ConfigError(f"{prefix}{blk.name}: missing {blk.name} block")
            return None
        if len(items) > 1:
            raise ConfigError(f"{prefix}{blk.name}: duplicate {blk.name} block")
        return convert(dict(items[0]), CtyType("map", parse_type(blk.type) if blk.type else _ANY), prefix + blk.name)
    raise ConfigError(f"{where or 'schema'}: empty or unknown hclspec Spec ({kind})")


def decode_config(spec: Any, user: Mapping[str, Any]) -> Any:
    """The value ``hcldec.Decode`` gives the agent's ``config`` block ``user`` under the plugin's
    schema ``spec`` (an hclspec ``Spec`` message): defaults filled, attributes converted to their
    types, unknown keys / missing required ones / block count limits refused with
    :class:`ConfigError`."""
    return _decode(spec, user, "", True)


def schema_defaults(spec_proto: Any) -> dict[str, Any]:
    """Every top-level attribute of the schema with the value Nomad sends when the user sets
    nothing: a ``Default``'s literal (parsed as an HCL expression), None for an attribute without
    one and for an absent ``Block``/``BlockAttrs``, ``[]`` for ``BlockList``/``BlockSet``, ``{}`` for
    ``BlockMap``; a nested ``Object`` gives a nested dict. The top-level spec must be an Object."""
    if spec_proto.WhichOneof("block") != "object":
        raise ConfigError("the plugin's config schema must be an hclspec Object at top level")
    value = _decode(spec_proto, {}, "", False)
    assert isinstance(value, dict)
    return value


def encode_for_spec(spec: Any, user: Mapping[str, Any], *, number_mode: NumberMode = "cty") -> bytes:
    """``msgpack_config`` exactly as a Nomad client builds it from the plugin's schema and the
    agent's ``config`` block (:func:`decode_config` then :func:`pack`)."""
    return pack(decode_config(spec, user), number_mode=number_mode)
