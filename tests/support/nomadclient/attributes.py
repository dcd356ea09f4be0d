"""How Nomad's scheduler compares a device attribute with a job's constraint or affinity value.

From hashicorp/nomad ``plugins/shared/structs/attribute.go`` and ``units.go``:

* the job's value is a string parsed by ``ParseAttribute``: a known unit suffix is split off
  (longest unit first, only when the last character is a letter), then the rest is tried as an
  int64, a float64, a bool (Go's ``strconv.ParseBool``), else it stays a string — so ``"9.0"`` is a
  Float, ``"1"`` an Int, ``"80 GiB"`` an Int in GiB;
* two attributes compare only when ``Comparable``: both with units of the same base, or both
  without units and then string with string, bool with bool, number with number
  (``attribute.go:299-301``); a String attribute never compares with a number, and a unit-ful one
  never with a unitless one;
* numbers compare in the base unit: two ints as int64 (``getInt``: a unit's multiplier wraps on
  overflow, ``mW`` divides and truncates), otherwise as 256-bit floats (``getBigFloat``);
* the ``version``, ``semver`` and ``regexp`` operators take only String (and, for the version ones,
  Int) attributes — not modelled here.

The scheduler's ``=`` / ``!=`` / ``<`` … operators on ``${device.attr.*}`` use this comparison
(``scheduler/feasible/feasible.go:1680-1684, 1746-1753``): not comparable means the constraint is
not met and the affinity does not apply.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

_BINARY = {u: Fraction(1 << (10 * i)) for i, u in enumerate(("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"), 1)}
_DECIMAL = {"kB": Fraction(1000),
            **{u: Fraction(1000 ** i) for i, u in enumerate(("KB", "MB", "GB", "TB", "PB", "EB"), 1)}}
# unit -> (base, multiplier over the base) — hashicorp/nomad plugins/shared/structs/units.go at aa026cc
# (mW is base / 1000; MHz is Pow(1000, 2) and GHz Pow(1000, 3) Hz, :208-219)
UNITS: dict[str, tuple[str, Fraction]] = {
    **{u: ("byte", m) for u, m in {**_BINARY, **_DECIMAL}.items()},
    **{f"{u}/s": ("byterate", m) for u, m in {**_BINARY, **_DECIMAL}.items()},
    "MHz": ("hertz", Fraction(1000 ** 2)),
    "GHz": ("hertz", Fraction(1000 ** 3)),
    "mW": ("watt", Fraction(1, 1000)),
    "W": ("watt", Fraction(1)),
    "kW": ("watt", Fraction(10 ** 3)),
    "MW": ("watt", Fraction(10 ** 6)),
    "GW": ("watt", Fraction(10 ** 9)),
}
_BY_LENGTH = sorted(UNITS, key=len, reverse=True)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class Attr:
    """One attribute: exactly one of the values, and a unit for numbers."""

    int_val: int | None = None
    float_val: float | None = None
    string_val: str | None = None
    bool_val: bool | None = None
    unit: str = ""

    @property
    def kind(self) -> str:
        """"int", "float", "string" or "bool"."""
        for name in ("int", "float", "string", "bool"):
            if getattr(self, f"{name}_val") is not None:
                return name
        raise ValueError("no value set")


def from_proto(attribute: Any) -> Attr:
    """An ``hashicorp.nomad.plugins.shared.structs.Attribute`` message as :class:`Attr`."""
    which = attribute.WhichOneof("value")
    value = getattr(attribute, which)
    return Attr(**{which: value}, unit=attribute.unit)


def _go_int(text: str) -> int | None:
    """``strconv.ParseInt(text, 10, 64)``: an optional sign and ASCII digits, within int64."""
    body = text[1:] if text[:1] in "+-" else text
    if not body or not body.isascii() or not body.isdigit():
        return None
    value = int(text)
    return value if INT64_MIN <= value <= INT64_MAX else None


_GO_FLOAT = re.compile(r"[+-]?(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf(?:inity)?|nan)",
                       re.IGNORECASE)


def _go_float(text: str) -> float | None:
    """``strconv.ParseFloat(text, 64)`` without error: decimal forms, ``inf``/``infinity``/``nan`` in
    any case; a finite spelling whose value overflows float64 is an error (ErrRange), so None. (Go's
    hex floats and underscores are not modelled.)"""
    if not _GO_FLOAT.fullmatch(text):
        return None
    value = float(text)
    if math.isinf(value) and "inf" not in text.lower():
        return None
    return value


def parse_attribute(text: str) -> Attr:
    """A job's constraint or affinity value as ``ParseAttribute`` reads it (see module docstring)."""
    if not text:
        return Attr(string_val=text)
    unit, numeric = "", text
    if text[-1].isalpha():
        unit = next((u for u in _BY_LENGTH if text.endswith(u)), "")
        if unit:
            numeric = text[: -len(unit)].strip()
    if (i := _go_int(numeric)) is not None:
        return Attr(int_val=i, unit=unit)
    if (f := _go_float(numeric)) is not None:
        return Attr(float_val=f, unit=unit)
    if text in ("1", "t", "T", "TRUE", "true", "True", "0", "f", "F", "FALSE", "false", "False"):
        return Attr(bool_val=text in ("1", "t", "T", "TRUE", "true", "True"))
    return Attr(string_val=text)


def comparable(a: Attr, b: Attr) -> bool:
    """``Attribute.Comparable``."""
    ua, ub = UNITS.get(a.unit), UNITS.get(b.unit)
    if ua is not None or ub is not None:
        return ua is not None and ub is not None and ua[0] == ub[0]
    if a.kind == "string" or b.kind == "string":
        return a.kind == b.kind
    if a.kind == "bool" or b.kind == "bool":
        return a.kind == b.kind
    return True


def _wrap64(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63


def _go_int_in_base(a: Attr) -> int:
    """``getInt``: the int64 in the base unit, as Go computes it (a multiplier wraps around on
    overflow; ``mW`` divides, truncating toward zero)."""
    assert a.int_val is not None
    unit = UNITS.get(a.unit)
    if unit is None:
        return a.int_val
    if unit[1].denominator != 1:  # mW: i /= 1000
        q = abs(a.int_val) // unit[1].denominator
        return q if a.int_val >= 0 else -q
    return _wrap64(a.int_val * unit[1].numerator)


def _float_in_base(a: Attr) -> Fraction | float | None:
    """``getBigFloat``: the value in the base unit (exact here; Go uses 256-bit floats). None for NaN,
    which Go's big.Float cannot hold."""
    value = float(a.int_val) if a.int_val is not None else a.float_val
    assert value is not None
    if math.isnan(value):
        return None
    unit = UNITS.get(a.unit)
    scale = unit[1] if unit is not None else Fraction(1)
    if math.isinf(value):
        return value
    exact = Fraction(a.int_val) if a.int_val is not None else Fraction(value)
    return exact * scale


def compare(a: Attr, b: Attr) -> int | None:
    """``Attribute.Compare``: -1, 0 or 1 (bools: 0 equal, 1 not), None when not comparable."""
    if not comparable(a, b):
        return None
    if a.kind == "bool":
        return 0 if a.bool_val == b.bool_val else 1
    if a.kind == "string":
        assert a.string_val is not None and b.string_val is not None
        return (a.string_val > b.string_val) - (a.string_val < b.string_val)
    if a.int_val is not None and b.int_val is not None:
        x, y = _go_int_in_base(a), _go_int_in_base(b)
        return (x > y) - (x < y)
    fx, fy = _float_in_base(a), _float_in_base(b)
    if fx is None or fy is None:
        return None
    return (fx > fy) - (fx < fy)


def constraint_met(attribute: Attr | None, operator: str, value: str) -> bool:
    """Whether ``${device.attr.X} <operator> value`` holds for a device whose X is ``attribute``
    (``=``, ``==``, ``is``, ``!=``, ``not``, ``<``, ``<=``, ``>``, ``>=``; ``None``: the device has
    no such attribute, which only ``!=``/``not`` accept). Not comparable: not met."""
    if attribute is None:
        return operator in ("!=", "not")
    result = compare(attribute, parse_attribute(value))
    if result is None:
        return False
    return {"=": result == 0, "==": result == 0, "is": result == 0, "!=": result != 0, "not": result != 0,
            "<": result < 0, "<=": result <= 0, ">": result > 0, ">=": result >= 0}[operator]
