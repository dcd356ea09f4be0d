"""The cgroup v2 devices cgroup: evaluating device programs as the kernel does (spec/cgroups.md §5).

Three kinds of check:

* the instruction set, one behaviour a row (pure, no kernel);
* a recorded program of runc 1.1.5, and random rule sets compiled in runc's and crun's shapes,
  against what the rules mean (pure; hypothesis);
* the kernel as the oracle: programs in four generators' shapes are loaded, attached to a real
  cgroup v2 directory, read back through ``bpf(2)`` by the product (the verifier's translated code),
  evaluated, and compared with the kernel's own verdict on real ``open()`` calls of real device
  nodes by a process in that cgroup.
"""

from __future__ import annotations

import errno
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import support.bpf_util as b
from conftest import in_ci
from hypothesis import given, settings
from hypothesis import strategies as st

from accelstats.cgroups.bpf_program import (
    ACC_MKNOD,
    ACC_READ,
    ACC_WRITE,
    DEV_BLOCK,
    DEV_CHAR,
    UndecidableError,
    decode,
    device_grant,
    run,
)
from accelstats.cgroups.devices_bpf import BpfReader, DeviceProgramCache, DeviceProgramsError

ACCESS = {"r": ACC_READ, "w": ACC_WRITE, "rw": ACC_READ | ACC_WRITE, "m": ACC_MKNOD}

# The program runc 1.1.5 (Debian 12) attached for the rules deny-all, then `c 195:3 rw` and
# `c 195:255 rw`, on top of its default device list; read back with BPF_OBJ_GET_INFO_BY_FD
# (xlated_prog_insns) from a container started in unified mode on this project's dev VM (kernel 6.18).
RUNC_1_1_5 = bytes.fromhex(
    "611200000000000054020000ffff000061130000000000007403000010000000611404000000000061150800000000005502"
    "050001000000bc3100000000000054010000010000005d31020000000000b400000001000000950000000000000055020500"
    "02000000bc3100000000000054010000010000005d31020000000000b4000000010000009500000000000000550204000200"
    "000055040300010000005505020003000000b400000001000000950000000000000055020400020000005504030001000000"
    "5505020005000000b4000000010000009500000000000000550204000200000055040300010000005505020007000000b400"
    "0000010000009500000000000000550204000200000055040300010000005505020008000000b40000000100000095000000"
    "00000000550204000200000055040300010000005505020009000000b4000000010000009500000000000000550204000200"
    "000055040300050000005505020000000000b400000001000000950000000000000055020400020000005504030005000000"
    "5505020002000000b40000000100000095000000000000005502040002000000550403000a00000055050200c8000000b400"
    "000001000000950000000000000055020300020000005504020088000000b400000001000000950000000000000055020700"
    "02000000bc3100000000000054010000060000005d3104000000000055040300c30000005505020003000000b40000000100"
    "000095000000000000005502070002000000bc3100000000000054010000060000005d3104000000000055040300c3000000"
    "55050200ff000000b4000000010000009500000000000000b4000000000000009500000000000000")


def prog(*code: bytes) -> tuple:
    return decode(b"".join(code))


def ret(value: int) -> list[bytes]:
    return [b.mov64_imm(b.R0, value), b.exit_()]


# --- the instruction set ---------------------------------------------------------------------------

@pytest.mark.parametrize(("code", "expected"), [
    # ALU32 results are truncated to 32 bits and zero-extended
    ([b.mov64_imm(b.R0, -1), b.alu32_imm(b.ADD, b.R0, 1), b.jeq_imm(b.R0, 0, 2), *ret(0), *ret(1)], True),
    # ALU64 keeps 64 bits: -1 + 1 == 0 as well, but 0xffffffff + 1 is not 0
    ([b.ld_imm64(b.R0, 0xFFFFFFFF), b.alu64_imm(b.ADD, b.R0, 1), b.jeq_imm(b.R0, 0, 1), *ret(1), *ret(0)], True),
    # division by zero gives 0, modulo by zero leaves the dividend (instruction-set.rst)
    ([b.mov64_imm(b.R0, 7), b.insn(0x37, b.R0, 0, 0, 0), b.jeq_imm(b.R0, 0, 2), *ret(0), *ret(1)], True),
    ([b.mov64_imm(b.R0, 7), b.insn(0x97, b.R0, 0, 0, 0), b.jeq_imm(b.R0, 7, 2), *ret(0), *ret(1)], True),
    # signed division (offset 1, v4): -7 / 2 == -3 (truncated toward zero)
    ([b.mov64_imm(b.R0, -7), b.insn(0x37, b.R0, 0, 1, 2), b.jeq_imm(b.R0, -3, 2), *ret(0), *ret(1)], True),
    # arithmetic right shift keeps the sign
    ([b.mov64_imm(b.R0, -8), b.insn(0xC7, b.R0, 0, 0, 1), b.jeq_imm(b.R0, -4, 2), *ret(0), *ret(1)], True),
    # byte swap to big endian (htobe16 of 0x0102 is 0x0201)
    ([b.mov64_imm(b.R0, 0x0102), b.insn(0xDC, b.R0, 0, 0, 16), b.jeq_imm(b.R0, 0x0201, 2), *ret(0), *ret(1)],
     True),
    # sign-extending move (offset 8, v4): (s8)0xff == -1
    ([b.mov64_imm(b.R1, 0xFF), b.insn(0xBF, b.R0, b.R1, 8), b.jeq_imm(b.R0, -1, 2), *ret(0), *ret(1)], True),
    # JMP32 compares the low 32 bits only
    ([b.ld_imm64(b.R0, 0x1_0000_0005), b.insn(0x16, b.R0, 0, 2, 5), *ret(0), *ret(1)], True),
    # signed compare: -1 < 1 signed, not unsigned
    ([b.mov64_imm(b.R0, -1), b.insn(0xC5, b.R0, 0, 1, 2), *ret(0), *ret(1)], True),
    ([b.mov64_imm(b.R0, -1), b.insn(0xA5, b.R0, 0, 1, 2), *ret(0), *ret(1)], False),
    # a value spilled to the stack and read back, also in parts
    ([b.ld_imm64(b.R1, 0x11223344_55667788), b.stx_dw(b.R10, b.R1, -8), b.ldx_w(b.R0, b.R10, -4),
      b.jeq_imm(b.R0, 0x11223344, 2), *ret(0), *ret(1)], True),
])
def test_instruction_semantics(code: list[bytes], expected: bool) -> None:
    assert run(prog(*code), DEV_CHAR, 195, 0, ACC_READ) is expected


def test_the_context_is_access_type_major_minor() -> None:
    """``access_type = (access << 16) | type``, then major and minor, 32 bits each (bpf.h)."""
    code = [b.ldx_h(b.R2, b.R1, 2), b.ldx_h(b.R3, b.R1, 0), b.ldx_w(b.R4, b.R1, 4), b.ldx_w(b.R5, b.R1, 8),
            b.jne_imm(b.R2, ACC_READ | ACC_WRITE, 5), b.jne_imm(b.R3, DEV_BLOCK, 4), b.jne_imm(b.R4, 259, 3),
            b.jne_imm(b.R5, 1 << 19, 2), *ret(1), *ret(0)]
    assert run(prog(*code), DEV_BLOCK, 259, 1 << 19, ACC_READ | ACC_WRITE)
    assert not run(prog(*code), DEV_CHAR, 259, 1 << 19, ACC_READ | ACC_WRITE)


@pytest.mark.parametrize(("code", "why"), [
    ([b.insn(0x85, 0, 0, 0, 1), *ret(1)], "helper 1"),                                 # bpf_map_lookup_elem
    ([b.insn(0x18, b.R1, 1, 0, 3), b.insn(0), *ret(1)], "map"),                        # BPF_PSEUDO_MAP_FD
    ([b.ja(5), *ret(1)], "outside the program"),
    ([b.ja(-1)], "instructions executed"),                                             # never ends
    ([b.ldx_w(b.R0, b.R1, 12), b.exit_()], "outside the ctx"),
    ([b.insn(0x62, b.R1, 0, 0, 1), *ret(1)], "store into the context"),
    ([b.mov64_reg(b.R0, b.R7), b.exit_()], "read before it is written"),
    ([b.alu64_imm(b.ADD, b.R1, 4), b.mov64_reg(b.R0, b.R1), b.alu64_imm(b.AND, b.R0, 1), b.exit_()], "pointer"),
])
def test_what_is_not_a_pure_function_of_the_device_is_undecidable(code: list[bytes], why: str) -> None:
    with pytest.raises(UndecidableError, match=why):
        run(prog(*code), DEV_CHAR, 195, 0, ACC_READ)


@pytest.mark.parametrize("data", [b"", b"\x95" * 7, b"\x00" * 9])
def test_bytes_that_are_not_instructions(data: bytes) -> None:
    with pytest.raises(UndecidableError, match="8-byte instructions"):
        decode(data)


# --- a real runc program, and generated ones against the rules' meaning ---------------------------

def test_recorded_runc_program_grants_exactly_its_rules() -> None:
    p = decode(RUNC_1_1_5)
    assert len(p) == 80
    grant = device_grant([p], [0, 1, 2, 3, 4, 255])
    assert grant.minors == frozenset({3}) and not grant.unrestricted
    assert run(p, DEV_CHAR, 195, 255, ACC_READ | ACC_WRITE)       # nvidiactl: granted, not a GPU
    assert not run(p, DEV_CHAR, 195, 3, ACC_READ | ACC_MKNOD)      # rw, not m (c *:* m allows mknod alone)
    assert run(p, DEV_CHAR, 1, 3, ACC_READ | ACC_WRITE | ACC_MKNOD)  # /dev/null: runc's defaults
    assert run(p, DEV_CHAR, 7, 9, ACC_MKNOD)                       # c *:* m
    assert not run(p, DEV_BLOCK, 8, 0, ACC_READ)


def test_grant_rows() -> None:
    """device_grant, row by row, like gpu_grant's table (spec/cgroups.md §2)."""
    def grant(rules: list[b.Rule], **kw: object) -> tuple[list[int], bool]:
        g = device_grant([decode(b.runc_style(rules))], [0, 1, 2, 3], **kw)  # type: ignore[arg-type]
        return sorted(g.minors), g.unrestricted

    assert grant([("c", 195, 1, "rw", True)]) == ([1], False)
    assert grant([("c", 195, 1, "rwm", True)]) == ([1], False)
    # O_RDWR is one question to the kernel: read alone, or read and write by separate rules, is no
    # grant on v2 (no CUDA process could open the node); on v1 devices.list merges rules first
    assert grant([("c", 195, 1, "r", True)]) == ([], False)
    assert grant([("c", 195, 1, "r", True), ("c", 195, 1, "w", True)]) == ([], False)
    assert grant([("c", 195, 1, "m", True)]) == ([], False)            # mknod alone is not
    assert grant([("c", 195, None, "rw", True)]) == ([0, 1, 2, 3], False)
    assert grant([("c", 195, 255, "rw", True)]) == ([], False)         # nvidiactl only
    assert grant([("c", None, None, "rw", True)]) == ([], True)        # c *:* rw: unrestricted
    assert grant([("a", None, None, "rwm", True)]) == ([], True)
    assert device_grant([], [0, 1]).unrestricted                       # no program: nothing checked
    # every program in effect must allow: a parent that allows 195:* and a child that allows 195:2
    both = [decode(b.runc_style([("c", 195, None, "rw", True)])), decode(b.runc_style([("c", 195, 2, "rw", True)]))]
    assert device_grant(both, [0, 1, 2, 3]).minors == frozenset({2})
    # MIG capability minors count when readable
    caps = device_grant([decode(b.runc_style([("c", 195, 0, "rw", True), ("c", 511, 102, "r", True)]))],
                        [0], caps_major=511, known_caps_minors=[101, 102, 103])
    assert caps.minors == frozenset({0}) and caps.mig_caps_minors == frozenset({102})


rule_st = st.tuples(st.sampled_from(["a", "c", "b"]), st.one_of(st.none(), st.sampled_from([1, 195, 511])),
                    st.one_of(st.none(), st.sampled_from([0, 1, 3, 255])),
                    st.sampled_from(["r", "w", "m", "rw", "rm", "wm", "rwm"]), st.booleans())
probe_st = st.tuples(st.sampled_from(["c", "b"]), st.sampled_from([1, 195, 511, 7]), st.sampled_from([0, 1, 3, 9, 255]),
                     st.sampled_from(["r", "w", "rw", "m"]))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(rule_st, max_size=8), st.booleans(), st.lists(probe_st, min_size=1, max_size=6))
def test_generated_programs_mean_their_rules(rules: list[b.Rule], last_wins: bool,
                                             probes: list[tuple[str, int, int, str]]) -> None:
    code = b.crun_style(rules) if last_wins else b.runc_style(rules)
    p = decode(code)
    for dtype, major, minor, access in probes:
        expected = b.rules_allow(rules, dtype, major, minor, access, last_wins=last_wins)
        assert run(p, DEV_CHAR if dtype == "c" else DEV_BLOCK, major, minor, ACCESS[access]) is expected


# --- the kernel as the oracle --------------------------------------------------------------------------

def require_bpf_cgroup() -> Path:
    """The cgroup2 mount, where this process may load and attach device programs; skip otherwise
    (fail under CI=true)."""
    root = b.unified_root()
    reason = None
    if os.geteuid() != 0:
        reason = "not root: loading device programs needs CAP_SYS_ADMIN"
    elif root is None:
        reason = "no cgroup2 mount (/sys/fs/cgroup or /sys/fs/cgroup/unified)"
    if reason is not None:
        if in_ci():
            pytest.fail(f"cannot run under CI=true: {reason}", pytrace=False)
        pytest.skip(reason)
    assert root is not None
    return root


@pytest.fixture
def node_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="accelstats-devnodes-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


DEVICES = [("c", 195, 0), ("c", 195, 3), ("c", 195, 4), ("c", 195, 255), ("c", 1, 3), ("c", 511, 102),
           ("b", 7, 0), ("c", 4095, 1048575)]
RULES: list[b.Rule] = [("c", 195, 3, "rw", True), ("c", 195, 255, "rw", True), ("c", 1, 3, "rwm", True),
                       ("c", 511, 102, "r", True), ("c", None, None, "m", True)]
GENERATORS = {
    "runc": lambda: b.runc_style(RULES),
    "crun": lambda: b.crun_style([("a", None, None, "rwm", False), ("c", 195, None, "rw", True),
                                  ("c", 195, 4, "w", False), ("c", 1, 3, "rwm", True)]),
    "systemd": lambda: b.systemd_style(RULES),
    "clang": lambda: b.clang_style(195, [3, 255, 0], "rw"),
}


@pytest.mark.root
@pytest.mark.parametrize("generator", sorted(GENERATORS))
def test_evaluation_agrees_with_the_kernel(generator: str, node_dir: Path) -> None:
    require_bpf_cgroup()
    probes = [(i, a) for i in range(len(DEVICES)) for a in ("r", "w", "rw")]
    name = f"accelstats-test-{os.getpid()}-{generator}"
    with b.cgroup_with_programs(name, [GENERATORS[generator]()]) as cgroup:
        reader = BpfReader()
        ids = reader.query(str(cgroup))
        assert len(ids) == 1
        xlated = decode(reader.instructions(ids[0]))  # what the kernel runs (after the verifier), not what we sent
        ours = [run(xlated, DEV_CHAR if DEVICES[i][0] == "c" else DEV_BLOCK, DEVICES[i][1], DEVICES[i][2], ACCESS[a])
                for i, a in probes]
        kernel = b.kernel_verdicts(cgroup, node_dir, DEVICES, probes)
        assert ours == kernel
        grant = DeviceProgramCache().grant(str(cgroup), [0, 3, 4], caps_major=511, known_caps_minors=[101, 102])
        expected = {d[2] for i, d in enumerate(DEVICES[:3]) if kernel[3 * i + 2]}  # the kernel let O_RDWR through
        assert grant.grant.minors == frozenset(expected) and grant.program_ids == tuple(ids)
        assert not grant.grant.unrestricted


@pytest.mark.root
def test_programs_of_parent_and_child_all_apply(node_dir: Path) -> None:
    """BPF_F_ALLOW_MULTI: the parent's program allows 195:* read-write, the child's 195:3 and 195:4;
    the kernel asks both (BPF_F_QUERY_EFFECTIVE lists both) and so do we."""
    require_bpf_cgroup()
    parent = f"accelstats-test-{os.getpid()}-parent"
    with b.cgroup_with_programs(parent, [b.runc_style([("c", 195, None, "rw", True), ("c", 1, 3, "rwm", True)])]), \
            b.cgroup_with_programs(f"{parent}/child", [b.clang_style(195, [3, 4], "rw")]) as child:
        found = DeviceProgramCache().grant(str(child), [0, 3, 4])
        assert len(found.program_ids) == 2
        assert found.grant.minors == frozenset({3, 4})
        probes = [(0, "rw"), (1, "rw"), (2, "rw"), (3, "rw")]  # 195:0, 195:3, 195:4, 195:255
        assert b.kernel_verdicts(child, node_dir, DEVICES, probes) == [False, True, True, False]


@pytest.mark.root
def test_cache_reads_each_program_once_and_sees_a_new_one(node_dir: Path) -> None:
    require_bpf_cgroup()
    cache = DeviceProgramCache()
    name = f"accelstats-test-{os.getpid()}-cache"
    with b.cgroup_with_programs(name, [b.runc_style([("c", 195, 0, "rw", True)])]) as cgroup:
        for _ in range(3):
            assert cache.grant(str(cgroup), [0, 1]).grant.minors == frozenset({0})
        assert cache.reads == 1
        fd = b.load_program(b.runc_style([("c", 195, 1, "rw", True), ("c", 195, 0, "rw", True)]))
        try:
            b.attach(cgroup, fd)  # a second program: now both must allow
            assert cache.grant(str(cgroup), [0, 1]).grant.minors == frozenset({0})
            assert cache.reads == 2
        finally:
            os.close(fd)


@pytest.mark.root
def test_a_cgroup_without_programs_is_unrestricted_and_a_removed_one_vanished() -> None:
    root = require_bpf_cgroup()
    directory = root / f"accelstats-test-{os.getpid()}-bare"
    directory.mkdir()
    try:
        found = DeviceProgramCache().grant(str(directory), [0])
        if found.program_ids == ():  # none attached here nor above: nothing is checked
            assert found.grant.unrestricted
        else:  # an ancestor on this host has programs: the kernel checks those, so do we
            assert not found.grant.unrestricted or found.grant.minors == frozenset()
    finally:
        directory.rmdir()
    with pytest.raises(DeviceProgramsError) as info:
        DeviceProgramCache().grant(str(directory), [0])
    assert info.value.kind == "vanished"


@pytest.mark.root
def test_without_cap_sys_admin_the_read_is_denied(tmp_path: Path) -> None:
    """The exporter's default unit drops CAP_SYS_ADMIN: bpf(2) then answers EPERM and the error says
    which capability is missing."""
    root = require_bpf_cgroup()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.fail("setpriv (util-linux) missing") if in_ci() else pytest.skip("setpriv missing")
    name = f"accelstats-test-{os.getpid()}-nocap"
    with b.cgroup_with_programs(name, [b.runc_style([("c", 195, 0, "rw", True)])]) as cgroup:
        code = ("import sys\nfrom accelstats.cgroups.devices_bpf import DeviceProgramCache, DeviceProgramsError\n"
                "try:\n    DeviceProgramCache().grant(sys.argv[1], [0])\nexcept DeviceProgramsError as e:\n"
                "    print(e.kind, e)\n")
        caps = "-sys_admin,-net_admin,-bpf,-perfmon"
        proc = subprocess.run([setpriv, f"--bounding-set={caps}", f"--inh-caps={caps}", "--", sys.executable,
                               "-c", code, str(cgroup)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("denied ") and "CAP_SYS_ADMIN" in proc.stdout
    assert root.is_dir()


def test_errno_meanings() -> None:
    """How the errors of bpf(2) are told apart (without a kernel)."""
    from accelstats.cgroups.devices_bpf import _classify
    assert _classify(OSError(errno.EPERM, "x"), "BPF_PROG_GET_FD_BY_ID 7").kind == "denied"
    assert _classify(OSError(errno.ENOENT, "x"), "open /x").kind == "vanished"
    assert _classify(OSError(errno.EBADF, "x"), "BPF_PROG_QUERY").kind == "unreadable"
    assert "cgroup v2" in str(_classify(OSError(errno.EBADF, "x"), "BPF_PROG_QUERY"))
    assert struct.calcsize("<BBhi") == 8


def test_blinded_programs_use_r11_and_are_evaluated() -> None:
    """net.core.bpf_jit_harden=2 blinds constants in the translated code through the verifier's
    auxiliary register r11 (BPF_REG_AX): ``r11 = imm ^ key; r11 ^= key; if r2 != r11 goto``."""
    key = 0x5A5A5A5A
    code = [b.ldx_w(b.R2, b.R1, 8),
            b.insn(0xB4, 11, 0, 0, 3 ^ key), b.insn(0xA4, 11, 0, 0, key),  # w11 = 3 ^ key; w11 ^= key
            b.insn(0x5D, b.R2, 11, 2), *ret(1), *ret(0)]                   # if r2 != r11 goto deny
    assert run(prog(*code), DEV_CHAR, 195, 3, ACC_READ) is True
    assert run(prog(*code), DEV_CHAR, 195, 4, ACC_READ) is False
    with pytest.raises(UndecidableError, match="above r11"):
        run(prog(b.insn(0xB7, 12, 0, 0, 1), *ret(1)), DEV_CHAR, 195, 3, ACC_READ)


def test_a_costly_program_is_cut_off_by_one_budget_for_the_whole_grant() -> None:
    """A long loop (a privileged container could attach one) costs at most MAX_STEPS instructions
    for all the questions of a grant together, then has no decision."""
    import time

    from accelstats.cgroups.bpf_program import MAX_STEPS
    loop = [b.mov64_imm(b.R0, 0), b.alu64_imm(b.ADD, b.R0, 1), b.insn(0xA5, b.R0, 0, -2, MAX_STEPS), *ret(1)]
    t0 = time.perf_counter()
    with pytest.raises(UndecidableError, match="instructions executed"):
        device_grant([prog(*loop)], [0, 1, 2, 3, 4, 5, 6, 7])
    assert time.perf_counter() - t0 < 30  # generous: the point is that it ends (about 0.3 s here)


@pytest.mark.root
def test_programs_blinded_by_bpf_jit_harden_are_evaluated(node_dir: Path) -> None:
    """net.core.bpf_jit_harden=2 (KSPP-style hardening) makes the verifier blind every constant of a
    program loaded meanwhile: the translated code then goes through r11 and zeroes r0 with
    "xor r0, r0". The setting is raised only while the program loads, then put back."""
    require_bpf_cgroup()
    harden = Path("/proc/sys/net/core/bpf_jit_harden")
    if not os.access(harden, os.W_OK) or Path("/proc/sys/net/core/bpf_jit_enable").read_text().strip() == "0":
        if in_ci():
            pytest.fail("cannot raise net.core.bpf_jit_harden (or no BPF JIT) under CI=true")
        pytest.skip("cannot raise net.core.bpf_jit_harden, or the BPF JIT is off (no blinding)")
    code = b.runc_style([("c", 195, 0, "rw", True), ("c", 195, 255, "rw", True), ("c", 1, 3, "rwm", True)])
    name = f"accelstats-test-{os.getpid()}-blinded"
    old = harden.read_text().strip()
    root = b.unified_root()
    assert root is not None
    directory = root / name
    directory.mkdir()
    try:
        harden.write_text("2")
        try:
            fd = b.load_program(code)
        finally:
            harden.write_text(old)
        try:
            b.attach(directory, fd)
        finally:
            os.close(fd)
        reader = BpfReader()
        xlated = reader.instructions(reader.query(str(directory))[0])
        assert any(i.dst == 11 or i.src == 11 for i in decode(xlated)), "not blinded: no r11 in the translated code"
        probes = [(i, a) for i in range(len(DEVICES)) for a in ("r", "w", "rw")]
        ours = [run(decode(xlated), DEV_CHAR if DEVICES[i][0] == "c" else DEV_BLOCK, DEVICES[i][1], DEVICES[i][2],
                    ACCESS[a]) for i, a in probes]
        assert ours == b.kernel_verdicts(directory, node_dir, DEVICES, probes)
        assert DeviceProgramCache().grant(str(directory), [0, 3]).grant.minors == frozenset({0})
    finally:
        directory.rmdir()
