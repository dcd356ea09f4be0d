"""devices.list parsing and the GPU grant: one case per row of spec/cgroups.md §2, plus properties."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from accelstats.cgroups.devices_list import (
    DeviceRule,
    GpuGrant,
    MigCap,
    MigInstance,
    format_rule,
    gpu_grant,
    mig_instances,
    parse_devices_list,
    parse_mig_minors,
    parse_rule,
)

HOST_GPU_MINORS = frozenset(range(8))  # an 8-GPU host: /dev/nvidia0 … /dev/nvidia7
UVM_MAJOR = 508
CAPS_MAJOR = 511
MIG_MINORS_TEXT = """\
config 1
monitor 2
gpu0/gi11/access 102
gpu0/gi11/ci0/access 103
gpu0/gi12/access 111
gpu0/gi12/ci0/access 112
"""
K8S_GPU_POD = [
    "c 136:* rwm", "c 10:200 rwm", "c 5:2 rwm", "c 5:0 rwm", "c 1:9 rwm", "c 1:8 rwm", "c 1:7 rwm",
    "c 1:5 rwm", "c 1:3 rwm", "c *:* m", "b *:* m", "c 195:255 rw", "c 508:0 rw", "c 508:1 rw",
    "c 195:7 rw",
]  # fmt: skip


@dataclass(frozen=True)
class Row:
    """One row of the §2 table: the input lines and what accelstats reports."""

    lines: list[str]
    gpus: set[int]
    unrestricted: bool = False
    skipped: int = 0
    mig: frozenset[MigInstance] = frozenset()


SPEC_TABLE = {
    # input                                                  -> accelstats
    "control node 255 is not a GPU": Row(["c 195:0 rwm", "c 195:1 rwm", "c 195:255 rwm"], gpus={0, 1}),
    "a *:* rwm is unrestricted": Row(["a *:* rwm"], gpus=set(), unrestricted=True),
    "empty file": Row([], gpus=set()),
    "malformed lines skipped and counted": Row(
        ["c 1:2 rwm badformat", "c badformat rwm", "c 195:3 rw"], gpus={3}, skipped=2
    ),
    "c 195:* m after daemon-reload: zero GPUs": Row(["c 195:* m"], gpus=set()),
    "c 195:* rw: every GPU": Row(["c 195:* rw"], gpus=set(HOST_GPU_MINORS)),
    "uvm majors ignored": Row([f"c {UVM_MAJOR}:0 rw", f"c {UVM_MAJOR}:1 rw"], gpus=set()),
    "c 195:0 rw twice: once": Row(["c 195:0 rw", "c 195:0 rw"], gpus={0}),
    "access without r or w is not a grant": Row(["c 195:2 m"], gpus=set()),
    "real Kubernetes GPU pod": Row(K8S_GPU_POD, gpus={7}),
    "MIG: capability minors pick the instance": Row(
        ["c 195:0 rw", f"c {CAPS_MAJOR}:102 r", f"c {CAPS_MAJOR}:103 r"],
        gpus={0},
        mig=frozenset({MigInstance(gpu_minor=0, gi=11, ci=0)}),
    ),
}

# Rows the kernel doc adds to the table.
MORE_ROWS = {
    "modeset node 254 is not a GPU": Row(["c 195:254 rw"], gpus=set()),
    "minor of a GPU that does not exist": Row(["c 195:42 rw"], gpus=set()),
    "c *:* rw is unrestricted": Row(["c 195:0 rw", "c *:* rw"], gpus=set(), unrestricted=True),
    "a *:* m is not unrestricted": Row(["a *:* m", "c 195:1 rw"], gpus={1}),
    "block device 195:0 is not a GPU": Row(["b 195:0 rw"], gpus=set()),
    "major wildcard matches minor of 195": Row(["c *:4 rw"], gpus={4}),
    "write-only access counts": Row(["c 195:5 w"], gpus={5}),
    "MIG: gi access without ci access": Row(["c 195:0 rw", f"c {CAPS_MAJOR}:102 r"], gpus={0}),
    "MIG: caps without the parent GPU": Row([f"c {CAPS_MAJOR}:102 r", f"c {CAPS_MAJOR}:103 r"], gpus=set()),
    "MIG: caps need r": Row(["c 195:0 rw", f"c {CAPS_MAJOR}:102 w", f"c {CAPS_MAJOR}:103 w"], gpus={0}),
    "MIG: c caps:* r grants every instance": Row(
        ["c 195:0 rw", f"c {CAPS_MAJOR}:* r"],
        gpus={0},
        mig=frozenset({MigInstance(0, 11, 0), MigInstance(0, 12, 0)}),
    ),
}


def _grant(lines: list[str]) -> tuple[GpuGrant, int]:
    parsed = parse_devices_list("\n".join(lines) + ("\n" if lines else ""))
    caps, _ = parse_mig_minors(MIG_MINORS_TEXT)
    grant = gpu_grant(parsed, HOST_GPU_MINORS, caps_major=CAPS_MAJOR, known_caps_minors=caps)
    return grant, len(parsed.skipped_lines)


@pytest.mark.parametrize("row", [*SPEC_TABLE.values(), *MORE_ROWS.values()], ids=[*SPEC_TABLE, *MORE_ROWS])
def test_spec_table_row(row: Row) -> None:
    grant, skipped = _grant(row.lines)
    caps, _ = parse_mig_minors(MIG_MINORS_TEXT)
    assert grant.minors == row.gpus
    assert grant.unrestricted is row.unrestricted
    assert skipped == row.skipped
    assert mig_instances(grant, caps) == row.mig


def test_unrestricted_grant_names_nothing() -> None:
    grant, _ = _grant(["c 195:0 rw", f"c {CAPS_MAJOR}:102 r", "a *:* rwm"])
    assert grant == GpuGrant(minors=frozenset(), unrestricted=True, mig_caps_minors=frozenset())


def test_no_caps_major_collects_no_caps() -> None:
    parsed = parse_devices_list(f"c 195:0 rw\nc {CAPS_MAJOR}:102 r\n")
    assert gpu_grant(parsed, HOST_GPU_MINORS).mig_caps_minors == frozenset()


def test_non_default_nvidia_major() -> None:
    parsed = parse_devices_list("c 195:0 rw\nc 300:1 rw\n")
    assert gpu_grant(parsed, HOST_GPU_MINORS, nvidia_major=300).minors == {1}


def test_parse_keeps_rules_in_order_and_skipped_lines_stripped() -> None:
    parsed = parse_devices_list("c 195:0 rwm\n  c 1:2 rwm badformat  \n\n   \nb *:* m\n")
    assert parsed.rules == (
        DeviceRule("c", 195, 0, frozenset("rwm")),
        DeviceRule("b", None, None, frozenset("m")),
    )
    assert parsed.skipped_lines == ("c 1:2 rwm badformat",)


@pytest.mark.parametrize(
    "line",
    ["c 195:0", "x 195:0 rw", "c 195-0 rw", "c 195:0 rwx", "c 195:0 ", "c -1:0 rw", "c 195:+1 rw",
     "c 4294967295:0 rw", "c 195:0:1 rw", "cc 195:0 rw", "c \u0661:0 rw", "a", "c 1_0:0 rw"],
)  # fmt: skip
def test_malformed_rule_rejected(line: str) -> None:
    assert parse_rule(line) is None
    assert parse_devices_list(line).skipped_lines == (line.strip(),)


@pytest.mark.parametrize(
    ("rule", "text"),
    [(DeviceRule("a", None, None, frozenset("mwr")), "a *:* rwm"),
     (DeviceRule("c", 195, None, frozenset("m")), "c 195:* m"),
     (DeviceRule("b", 8, 0, frozenset("wr")), "b 8:0 rw")],
)  # fmt: skip
def test_format_rule_kernel_spelling(rule: DeviceRule, text: str) -> None:
    assert format_rule(rule) == text == str(rule)


# ---- properties ----------------------------------------------------------------------------------

_numbers = st.one_of(st.none(), st.integers(min_value=0, max_value=0xFFFFFFFE))
_rules = st.builds(
    DeviceRule,
    type=st.sampled_from("abc"),
    major=_numbers,
    minor=_numbers,
    access=st.frozensets(st.sampled_from("rwm"), min_size=1),
)
_rule_lines = _rules.map(str)
_junk_lines = st.text(alphabet="abcmrw*:0123456789 \t-x", max_size=20)
_texts = st.one_of(st.text(), st.lists(st.one_of(_rule_lines, _junk_lines)).map("\n".join))


@given(_texts)
def test_parse_never_raises_and_accounts_for_every_line(text: str) -> None:
    parsed = parse_devices_list(text)
    non_blank = [line.strip() for line in text.splitlines() if line.strip()]
    assert len(parsed.rules) + len(parsed.skipped_lines) == len(non_blank)
    assert list(parsed.skipped_lines) == [line for line in non_blank if parse_rule(line) is None]


@given(_rules)
def test_round_trip_rule(rule: DeviceRule) -> None:
    assert parse_devices_list(str(rule)).rules == (rule,)


@given(_texts)
def test_round_trip_parsed_rules(text: str) -> None:
    for rule in parse_devices_list(text).rules:
        assert parse_rule(format_rule(rule)) == rule


@given(_texts, st.frozensets(st.integers(min_value=0, max_value=300)))
def test_grant_only_reports_existing_gpus(text: str, gpu_minors: frozenset[int]) -> None:
    grant = gpu_grant(parse_devices_list(text), gpu_minors, caps_major=CAPS_MAJOR)
    assert grant.minors <= gpu_minors - {254, 255}
    if grant.unrestricted:
        assert not grant.minors and not grant.mig_caps_minors


# ---- mig-minors ----------------------------------------------------------------------------------


def test_parse_mig_minors() -> None:
    caps, skipped = parse_mig_minors(MIG_MINORS_TEXT)
    assert skipped == ()
    assert caps[1] == MigCap(gpu_minor=None, gi=None, ci=None, kind="config")
    assert caps[2] == MigCap(None, None, None, "monitor")
    assert caps[102] == MigCap(gpu_minor=0, gi=11, ci=None, kind="access")
    assert caps[103] == MigCap(gpu_minor=0, gi=11, ci=0, kind="access")
    assert caps[103] == (0, 11, 0, "access")  # the tuple shape


def test_parse_mig_minors_skips_unknown_and_malformed_lines() -> None:
    text = "gpu0/gi1/access 3\nfabric-imex-mgmt 4\ngpu0/gi1/access\ngpu0/gi1/ci0/access x\n" \
           "gpu1/gi2/ci3/access 5 6\n\ngpu0/gi9/access 3\ngpux/gi1/access 7\n"  # fmt: skip
    caps, skipped = parse_mig_minors(text)
    assert caps == {3: MigCap(0, 1, None, "access")}
    assert skipped == (
        "fabric-imex-mgmt 4", "gpu0/gi1/access", "gpu0/gi1/ci0/access x", "gpu1/gi2/ci3/access 5 6",
        "gpu0/gi9/access 3", "gpux/gi1/access 7",
    )  # fmt: skip


def test_parse_mig_minors_empty() -> None:
    assert parse_mig_minors("") == ({}, ())


_MIG_LINES = [*MIG_MINORS_TEXT.splitlines(), "x 1", "gpu0/gi11/access 102", ""]


@given(st.one_of(st.text(), st.lists(st.sampled_from(_MIG_LINES)).map("\n".join)))
def test_parse_mig_minors_never_raises(text: str) -> None:
    caps, skipped = parse_mig_minors(text)
    assert len(caps) + len(skipped) == sum(1 for line in text.splitlines() if line.strip())
