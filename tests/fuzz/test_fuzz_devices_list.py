"""Fuzzing the cgroup v1 ``devices.list`` and ``mig-minors`` parsers (accelstats/cgroups/devices_list.py).

Documented error type: none. :func:`parse_rule`, :func:`parse_devices_list`, :func:`parse_mig_minors`,
:func:`gpu_grant` and :func:`mig_instances` "never raise on content"; a malformed line is returned
in ``skipped_lines`` for the caller to count (spec/cgroups.md §2). So every property below lets no
exception escape at all.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from accelstats.cgroups.devices_list import (
    NVIDIA_MAJOR,
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

from .profiles import fuzz_settings

U32_MAX_PRINTED = 0xFFFFFFFE  # the kernel prints ~0 (0xFFFFFFFF) as '*'
CAPS_MAJOR = 511
UVM_MAJOR = 508
HOST_GPUS = frozenset(range(8))

# ---------------------------------------------------------------------------- strategies

numbers = st.one_of(st.none(), st.integers(0, U32_MAX_PRINTED), st.sampled_from([NVIDIA_MAJOR, 254, 255, 0, 7]))
accesses = st.frozensets(st.sampled_from("rwm"), min_size=1)
rules = st.builds(DeviceRule, type=st.sampled_from("abc"), major=numbers, minor=numbers, access=accesses)
# Rules a GPU host really has: nvidia, caps and uvm majors, small minors.
host_rules = st.builds(
    DeviceRule,
    type=st.sampled_from("abcc"),
    major=st.sampled_from([None, NVIDIA_MAJOR, NVIDIA_MAJOR, CAPS_MAJOR, UVM_MAJOR, 1]),
    minor=st.one_of(st.none(), st.integers(0, 12), st.sampled_from([254, 255, 102, 103, 111, 112])),
    access=accesses,
)
spaces = st.text(alphabet=" \t", min_size=1, max_size=3)

# Tokens that look almost like a field: what a corrupted or future kernel line could hold.
odd_tokens = st.sampled_from([
    "", "*", "**", "-1", "4294967295", "4294967296", "99999999999", "0x10", "1e3", "+1", "195:", ":0", "195:0:1",
    "rwx", "RW", "d", "A", "badformat", "\u0661\u0669\u0665", "r\u200bw", "\x00", ":", "c", "a", "195",
])


@st.composite
def near_valid_lines(draw: st.DrawFn) -> str:
    """A ``devices.list`` line built from the grammar, then maybe mutated (token replaced, dropped,
    added, characters inserted or deleted)."""
    rule = draw(rules)
    tokens = format_rule(rule).replace(":", " : ").split()  # type, major, ':', minor, access
    mutation = draw(st.sampled_from(["none", "replace", "drop", "add", "insert", "delete", "order"]))
    if mutation == "replace":
        tokens[draw(st.integers(0, len(tokens) - 1))] = draw(odd_tokens)
    elif mutation == "drop":
        del tokens[draw(st.integers(0, len(tokens) - 1))]
    elif mutation == "add":
        tokens.insert(draw(st.integers(0, len(tokens))), draw(odd_tokens))
    elif mutation == "order":
        tokens[-1] = "".join(draw(st.permutations(tokens[-1] + draw(st.text("rwm", max_size=2)))))
    line = f"{tokens[0]} {''.join(tokens[1:-1])} {tokens[-1]}" if len(tokens) >= 3 else " ".join(tokens)
    if mutation == "insert":
        at = draw(st.integers(0, len(line)))
        line = line[:at] + draw(st.text(min_size=1, max_size=3)) + line[at:]
    elif mutation == "delete" and line:
        at = draw(st.integers(0, len(line) - 1))
        line = line[:at] + line[at + draw(st.integers(1, 3)):]
    return draw(spaces) + line + draw(spaces) if draw(st.booleans()) else line


texts = st.one_of(
    st.text(),
    st.lists(near_valid_lines(), max_size=12).map("\n".join),
    st.lists(st.one_of(near_valid_lines(), st.text(max_size=20)), max_size=12).map("\r\n".join),
)


def nonblank_lines(text: str) -> list[str]:
    """The lines the parser looks at: ``str.splitlines`` (every Unicode line break), stripped, non-blank."""
    return [line.strip() for line in text.splitlines() if line.strip()]


# ---------------------------------------------------------------------------- the spec's §2 table

SPEC_ROWS = [
    # devices.list lines                                              -> GPUs (minors), unrestricted, skipped
    (["c 195:0 rwm", "c 195:1 rwm", "c 195:255 rwm"],                  {0, 1}, False, 0),
    (["a *:* rwm"],                                                    set(), True, 0),
    ([],                                                               set(), False, 0),
    (["c 1:2 rwm badformat", "c badformat rwm", "c 195:3 rw"],         {3}, False, 2),
    (["c 195:* m"],                                                    set(), False, 0),
    (["c 195:* rw"],                                                   set(HOST_GPUS), False, 0),
    ([f"c {UVM_MAJOR}:0 rw", f"c {UVM_MAJOR}:1 rw"],                   set(), False, 0),
    (["c 195:0 rw", "c 195:0 rw"],                                     {0}, False, 0),
    (["c 136:* rwm", "c 10:200 rwm", "c 5:2 rwm", "c 5:0 rwm", "c 1:9 rwm", "c 1:8 rwm", "c 1:7 rwm",
      "c 1:5 rwm", "c 1:3 rwm", "c *:* m", "b *:* m", "c 195:255 rw", f"c {UVM_MAJOR}:0 rw",
      f"c {UVM_MAJOR}:1 rw", "c 195:7 rw"],                            {7}, False, 0),
]  # fmt: skip


@pytest.mark.parametrize(("lines", "gpus", "unrestricted", "skipped"), SPEC_ROWS)
def test_spec_table_rows(lines: list[str], gpus: set[int], unrestricted: bool, skipped: int) -> None:
    parsed = parse_devices_list("\n".join(lines))
    grant = gpu_grant(parsed, HOST_GPUS)
    assert (set(grant.minors), grant.unrestricted, len(parsed.skipped_lines)) == (gpus, unrestricted, skipped)


def test_spec_mig_row() -> None:
    """§2, MIG row: ``c 195:0 rw`` plus ``c <caps>:102 r``, ``c <caps>:103 r`` is instance gi 11 / ci 0 of GPU 0."""
    caps, _ = parse_mig_minors("config 1\nmonitor 2\ngpu0/gi11/access 102\ngpu0/gi11/ci0/access 103\n")
    parsed = parse_devices_list(f"c 195:0 rw\nc {CAPS_MAJOR}:102 r\nc {CAPS_MAJOR}:103 r\n")
    grant = gpu_grant(parsed, HOST_GPUS, caps_major=CAPS_MAJOR, known_caps_minors=caps)
    assert mig_instances(grant, caps) == {MigInstance(gpu_minor=0, gi=11, ci=0)}


# ---------------------------------------------------------------------------- devices.list properties


@fuzz_settings()
@given(rules)
def test_rule_round_trips_through_its_kernel_spelling(rule: DeviceRule) -> None:
    assert parse_rule(format_rule(rule)) == rule
    assert parse_rule(str(rule)) == rule


@fuzz_settings()
@given(st.lists(rules, max_size=20), spaces, spaces)
def test_devices_list_round_trips_in_file_order(written: list[DeviceRule], lead: str, trail: str) -> None:
    text = "".join(f"{lead}{format_rule(r)}{trail}\n" for r in written)
    assert parse_devices_list(text) == parse_devices_list(text.replace("\n", "\r\n"))
    parsed = parse_devices_list(text)
    assert parsed.rules == tuple(written)
    assert parsed.skipped_lines == ()


@fuzz_settings()
@given(texts)
@example("c 1:2 rwm badformat\nc badformat rwm\n\n  \nc 195:0 rw")
@example("c 4294967295:0 rw\nc 0195:01 wr\nc 195:0 rrw\nc \u0661:0 r")
@example("c 195:0 rw\x1cc 195:1 rw\u2028c 195:2 rw\x85a *:* rwm")
def test_every_line_is_a_rule_or_skipped(text: str) -> None:
    """Nothing raises; each non-blank line is either a rule (in file order) or a skipped line."""
    parsed = parse_devices_list(text)
    lines = nonblank_lines(text)
    assert parsed.rules == tuple(r for r in map(parse_rule, lines) if r is not None)
    assert parsed.skipped_lines == tuple(line for line in lines if parse_rule(line) is None)
    for rule in parsed.rules:
        assert rule.type in "abc" and rule.access and rule.access <= {"r", "w", "m"}
        for number in (rule.major, rule.minor):
            assert number is None or 0 <= number <= U32_MAX_PRINTED
        assert parse_rule(format_rule(rule)) == rule


def kernel_allows(rules_: tuple[DeviceRule, ...], major: int, minor: int, access: str) -> bool:
    """The kernel's check (devices.rst): some rule of type ``a`` or ``c`` whose major and minor
    match (``*`` matches all) grants ``access`` to char device ``major:minor``."""
    return any(
        r.type in "ac" and r.major in (None, major) and r.minor in (None, minor) and access in r.access
        for r in rules_
    )


@fuzz_settings()
@given(st.lists(host_rules, max_size=15), st.frozensets(st.integers(0, 260), max_size=10),
       st.frozensets(st.integers(0, 200), max_size=8))
@example([parse_rule(line) for line in SPEC_ROWS[-1][0]], HOST_GPUS, frozenset())
@example([DeviceRule("c", NVIDIA_MAJOR, 0, frozenset("rw")), DeviceRule("c", CAPS_MAJOR, 102, frozenset("r")),
          DeviceRule("c", CAPS_MAJOR, 103, frozenset("r"))], HOST_GPUS, frozenset({1, 2, 102, 103}))
@example([DeviceRule("c", None, 0, frozenset("w")), DeviceRule("c", CAPS_MAJOR, None, frozenset("r"))],
         frozenset(), frozenset())  # a caps minor only writable by its own rule, '*' readable: not in mig-minors
def test_grant_agrees_with_the_kernels_rule_matching(
    written: list[DeviceRule], host_gpus: frozenset[int], known_caps: frozenset[int]
) -> None:
    """The grant is what the kernel would allow: GPUs readable or writable (never 254/255, only host
    GPUs), caps minors readable; "unrestricted" exactly when some a/c rule with r or w matches every
    char device."""
    parsed = parse_devices_list("\n".join(map(format_rule, written)))
    grant = gpu_grant(parsed, host_gpus, caps_major=CAPS_MAJOR, known_caps_minors=known_caps)
    unrestricted = any(
        r.type == "a" or (r.major is None and r.minor is None) for r in parsed.rules if r.access & {"r", "w"}
        and r.type != "b"
    )
    if unrestricted:
        assert grant == GpuGrant(minors=frozenset(), unrestricted=True, mig_caps_minors=frozenset())
        return
    assert not grant.unrestricted
    assert grant.minors == {
        m for m in host_gpus - {254, 255}
        if kernel_allows(parsed.rules, NVIDIA_MAJOR, m, "r") or kernel_allows(parsed.rules, NVIDIA_MAJOR, m, "w")
    }
    # '*' stands for the caps that exist (mig-minors); a readable rule's own number for itself
    named = {r.minor for r in parsed.rules
             if r.type == "c" and r.major in (None, CAPS_MAJOR) and r.minor is not None and "r" in r.access}
    candidates = known_caps | named
    assert grant.mig_caps_minors == {m for m in candidates if kernel_allows(parsed.rules, CAPS_MAJOR, m, "r")}


@fuzz_settings()
@given(st.lists(host_rules, max_size=12), st.lists(near_valid_lines(), max_size=6), st.randoms())
def test_grant_ignores_junk_order_duplicates_and_m_only_rules(
    written: list[DeviceRule], junk: list[str], rnd: random.Random
) -> None:
    """Spec §2: skipped lines, ``m``-only rules, ``b`` rules, duplicates and order change nothing."""
    base = gpu_grant(parse_devices_list("\n".join(map(format_rule, written))), HOST_GPUS)
    extra = [line for line in junk if (r := parse_rule(line)) is None or r.type == "b" or r.access == {"m"}]
    lines = [*map(format_rule, written), *map(format_rule, written), *extra]
    rnd.shuffle(lines)
    assert gpu_grant(parse_devices_list("\n".join(lines)), HOST_GPUS) == base


# ---------------------------------------------------------------------------- mig-minors

caps_entries = st.one_of(
    st.sampled_from([MigCap(None, None, None, "config"), MigCap(None, None, None, "monitor")]),
    st.builds(MigCap, gpu_minor=st.integers(0, 10**10 - 1), gi=st.integers(0, 10**10 - 1), ci=st.none(),
              kind=st.just("access")),
    st.builds(MigCap, gpu_minor=st.integers(0, 127), gi=st.integers(0, 20), ci=st.integers(0, 8),
              kind=st.just("access")),
)


def cap_name(cap: MigCap) -> str:
    """The capability's name as the driver writes it in ``mig-minors``."""
    if cap.kind != "access":
        return cap.kind
    ci = "" if cap.ci is None else f"/ci{cap.ci}"
    return f"gpu{cap.gpu_minor}/gi{cap.gi}{ci}/access"


@fuzz_settings()
@given(st.dictionaries(st.integers(0, U32_MAX_PRINTED), caps_entries, max_size=20), spaces)
def test_mig_minors_round_trip(table: dict[int, MigCap], sep: str) -> None:
    text = "".join(f"{cap_name(cap)}{sep}{minor}\n" for minor, cap in table.items())
    assert parse_mig_minors(text) == (table, ())


odd_cap_names = st.sampled_from(["gpu0/gi1/ci/access", "gpu/gi1/access", "gpu0/gi1/ci0/access/x", "GPU0/gi1/access",
                                 "gpu00000000001/gi1/access", "gpu\u0661/gi1/access", "configs", "monitor/"])


@st.composite
def near_valid_mig_lines(draw: st.DrawFn) -> str:
    """A ``mig-minors`` line from the grammar, maybe with a field or characters mutated."""
    cap = draw(caps_entries)
    fields = [cap_name(cap), str(draw(st.integers(0, 2**33)))]
    mutation = draw(st.sampled_from(["none", "replace", "drop", "add", "insert"]))
    if mutation == "replace":
        fields[draw(st.integers(0, 1))] = draw(st.one_of(odd_tokens, odd_cap_names))
    elif mutation == "drop":
        del fields[draw(st.integers(0, 1))]
    elif mutation == "add":
        fields.append(draw(odd_tokens))
    line = " ".join(fields)
    if mutation == "insert":
        at = draw(st.integers(0, len(line)))
        line = line[:at] + draw(st.text(min_size=1, max_size=3)) + line[at:]
    return line


@fuzz_settings()
@given(st.one_of(st.text(), st.lists(near_valid_mig_lines(), max_size=15).map("\n".join)))
@example("config 1\nmonitor 1\ngpu0/gi11/access 102\ngpu0/gi11/ci0/access *\nfabric-mgmt 3\n\n")
def test_mig_minors_never_raises_and_accounts_for_every_line(text: str) -> None:
    """Each non-blank line is one new capability or one skipped line (a minor seen before is skipped)."""
    caps, skipped = parse_mig_minors(text)
    assert len(caps) + len(skipped) == len(nonblank_lines(text))
    for minor, cap in caps.items():
        assert 0 <= minor <= U32_MAX_PRINTED
        assert cap.kind in ("access", "config", "monitor")
        assert parse_mig_minors(f"{cap_name(cap)} {minor}") == ({minor: cap}, ())


@fuzz_settings()
@given(st.lists(host_rules, max_size=12), st.dictionaries(st.integers(100, 115), caps_entries, max_size=10))
def test_mig_instances_need_the_gpu_and_both_capabilities(
    written: list[DeviceRule], caps: dict[int, MigCap]
) -> None:
    grant = gpu_grant(parse_devices_list("\n".join(map(format_rule, written))), HOST_GPUS, caps_major=CAPS_MAJOR,
                      known_caps_minors=caps)
    found = mig_instances(grant, caps)
    readable = {caps[m] for m in grant.mig_caps_minors if m in caps}
    for inst in found:
        assert inst.gpu_minor in grant.minors
        assert MigCap(inst.gpu_minor, inst.gi, None, "access") in readable
        assert MigCap(inst.gpu_minor, inst.gi, inst.ci, "access") in readable
    if grant.unrestricted:
        assert found == frozenset()
        return
    assert found == {
        MigInstance(c.gpu_minor, c.gi, c.ci) for c in readable
        if c.gpu_minor in grant.minors and c.gi is not None and c.ci is not None
        and MigCap(c.gpu_minor, c.gi, None, "access") in readable
    }
