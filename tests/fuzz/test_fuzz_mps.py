"""Fuzzing the MPS control-daemon reply and log parsers (accelstats/mps/replies.py).

Documented error type: :func:`parse_server_list`, :func:`parse_client_list`, :func:`parse_percentage`,
:func:`parse_pinned_limit` and :func:`parse_log_line` "never raise on odd text (only on a non-``str``
argument)", raising TypeError then. So no exception may escape for any ``str``. Inputs: arbitrary
text, replies and log lines built from their grammar (round trips), and the H200 logs
(tests/shared/fixtures/h200/mps-*.log) mutated.

:data:`REGRESSIONS` are the escapes this module found (the Kelvin sign ``K``, U+212A, which
``re.IGNORECASE`` matched as ``K``; digit runs beyond Python's 4300-digit ``int()`` limit), fixed in
accelstats/mps/replies.py: each must now be an ordinary answer.
"""

from __future__ import annotations

import datetime as dt

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from support.paths import FIXTURES

from accelstats.mps.replies import (
    MpsLogLine,
    parse_client_list,
    parse_log_line,
    parse_percentage,
    parse_pinned_limit,
    parse_server_list,
)

from .profiles import fuzz_settings

LOGS = [FIXTURES / "h200" / "mps-control.log", FIXTURES / "h200" / "mps-server.log"]
LOG_LINES = [line for path in LOGS for line in path.read_text().splitlines()]
KELVIN = "\u212a"
texts = st.text(st.characters(blacklist_categories=("Cs",)))


def mutate(text: str) -> st.SearchStrategy[str]:
    """``text`` with a few characters inserted, deleted or replaced."""
    def apply(edits: list[tuple[int, int, str]]) -> str:
        out = text
        for at, width, insert in edits:
            at = at % (len(out) + 1)
            out = out[:at] + insert + out[at + width:]
        return out
    return st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 3), st.text(
        st.one_of(st.sampled_from("0123456789 .:-[]\r\nKkMGTiB+"), st.characters(blacklist_categories=("Cs",),
                                                                                  blacklist_characters=KELVIN)),
        max_size=3)), min_size=1, max_size=4).map(apply)


# ---------------------------------------------------------------------------- round trips

pids = st.lists(st.integers(1, 2**31), max_size=10)


@fuzz_settings()
@given(pids, st.sampled_from(["\n", "\r\n"]), st.text(" \t", max_size=2))
def test_pid_lists_round_trip(written: list[int], newline: str, pad: str) -> None:
    reply = "".join(f"{pad}{pid}{pad}{newline}" for pid in written)
    assert parse_server_list(reply) == written
    assert parse_client_list(reply) == written


@fuzz_settings()
@given(st.integers(0, 1000), st.sampled_from(["{:.1f}", "{:.3f}", "{:g}"]))
def test_percentage_round_trip(tenths: int, spelling: str) -> None:
    reply = spelling.format(tenths / 10)
    assert parse_percentage(reply + "\n") == float(reply)


@fuzz_settings()
@given(st.integers(0, 2**40), st.sampled_from(["K", "M", "G", "T", "k", "m", "g", "t"]),
       st.sampled_from(["", "B", "iB", "ib", "b"]), st.sampled_from(["", " "]))
def test_pinned_limit_round_trip(number: int, unit: str, suffix: str, space: str) -> None:
    shift = {"K": 10, "M": 20, "G": 30, "T": 40}[unit.upper()]
    assert parse_pinned_limit(f"{number}{space}{unit}{suffix}\n") == number << shift


milliseconds = st.datetimes(min_value=dt.datetime(1000, 1, 1)).map(  # the log's resolution; %Y needs 4 digits
    lambda t: t.replace(microsecond=t.microsecond // 1000 * 1000))
sources = st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz", min_size=1, max_size=10)
messages = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r\x0b\x0c\x1c\x1d\x1e\x85"
                                 "\u2028\u2029"), max_size=60)


@fuzz_settings()
@given(milliseconds, sources, st.integers(0, 2**31), messages, st.sampled_from(["", "\n", "\r\n"]))
@example(dt.datetime(2026, 11, 30, 10, 58, 36, 64000), "Control", 500, "Starting control daemon", "\n")
def test_log_line_round_trip(stamp: dt.datetime, source: str, pid: int, text: str, end: str) -> None:
    line = f"[{stamp:%Y-%m-%d %H:%M:%S}.{stamp.microsecond // 1000:03d} {source:<8} {pid:>4}] {text}{end}"
    assert parse_log_line(line) == MpsLogLine(timestamp=stamp, source=source, pid=pid, text=text)


def test_every_line_of_the_h200_logs_parses() -> None:
    parsed = [parse_log_line(line) for line in LOG_LINES]
    assert LOG_LINES and None not in parsed
    assert {p.source for p in parsed if p is not None} == {"Control", "Server", "Other"}


# ---------------------------------------------------------------------------- no exception escapes


@fuzz_settings()
@given(st.one_of(texts, st.sampled_from(LOG_LINES).flatmap(mutate),
                 pids.map(lambda ps: "\n".join(map(str, ps))).flatmap(mutate),
                 st.sampled_from(["100.0", "4096M", "70G", "531\n", ""]).flatmap(mutate)))
@example("[2026-02-30 10:58:36.064 Control 500] impossible date")
@example("[2026-11-30 25:58:36.064 Control 500] impossible hour")
@example("[\u0662\u0660\u0662\u0666-11-30 10:58:36.064 Control 500] Arabic-Indic digits")
@example("\u0665\u0660\n\u00b2\n-1\n0\n+5\n 7 \n")
@example("1e2\ninf\nnan\n100.00000000000001\n.5\n5.\n")
def test_parsers_never_raise(text: str) -> None:
    for pid in parse_server_list(text) + parse_client_list(text):
        assert pid > 0
    percentage = parse_percentage(text)
    assert percentage is None or 0.0 <= percentage <= 100.0
    limit = parse_pinned_limit(text)
    assert limit is None or (limit >= 0 and limit % 1024 == 0)
    line = parse_log_line(text)
    assert line is None or (line.pid >= 0 and "\n" not in line.text and line.source.isalpha())


@pytest.mark.parametrize("value", [None, b"531\n", 531, ["531"]])
def test_non_str_is_type_error(value: object) -> None:
    for parser in (parse_server_list, parse_client_list, parse_percentage, parse_pinned_limit, parse_log_line):
        with pytest.raises(TypeError):
            parser(value)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- regressions

# name -> (parser, text, what it answers now; it raised before the fix in accelstats/mps/replies.py)
REGRESSIONS = {
    "pinned limit with the Kelvin sign": (parse_pinned_limit, f"4{KELVIN}", None),  # KeyError: IGNORECASE K ~ K
    "pinned limit of 5000 digits": (parse_pinned_limit, "1" * 5000 + "M", None),  # ValueError: int() limit
    "server list line of 5000 digits": (parse_server_list, "1" * 5000, []),  # ValueError
    "client list line of 5000 digits": (parse_client_list, "1" * 5000 + "\n", []),  # ValueError
    "log line pid of 5000 digits": (parse_log_line, "[2026-11-30 10:58:36.064 Control " + "1" * 5000 + "] x",
                                    None),  # ValueError
}


@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_found_escapes_are_ordinary_answers_now(name: str) -> None:
    parser, text, answer = REGRESSIONS[name]
    assert parser(text) == answer  # type: ignore[operator]
