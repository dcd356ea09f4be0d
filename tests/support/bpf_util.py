"""Cgroup v2 device programs for the tests: an assembler, generators in several runtimes' styles, and a
kernel oracle (load, attach to a real cgroup, and let the kernel decide real ``open``s).

Generators (each emits different code for the same rules, which is the point: the product must
evaluate, not recognise a pattern):

* :func:`runc_style` — the shape of runc's ``devicefilter.go``: rules in order, first match wins,
  access checked as ``(access & allowed) == access``;
* :func:`crun_style` — crun's ``ebpf.c`` shape: rules walked from the last, a match returns its own
  allow/deny, so deny rules after allows win;
* :func:`systemd_style` — ``bpf-devices.c`` shape: a jump to one shared ``return 1`` block;
* :func:`clang_style` — what a C program compiled with clang looks like: 16-bit narrow loads of the
  context, the context pointer and values spilled to the stack, 32-bit jumps, 64-bit immediates,
  and a bounded loop over a table of minors stored on the stack.

Rules are ``(type, major, minor, access, allow)`` with type ``"a"``/``"c"``/``"b"``, major/minor
``None`` for ``*`` and access a subset of ``"rwm"``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import platform
import struct
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

Rule = tuple[str, int | None, int | None, str, bool]

R0, R1, R2, R3, R4, R5, R6, R7, R8, R9, R10 = range(11)
_TYPE = {"c": 2, "b": 1}
_ACCESS = {"m": 1, "r": 2, "w": 4}


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    """One ``struct bpf_insn`` (``imm`` taken modulo 2**32, as the signed 32-bit field stores it)."""
    imm &= 0xFFFFFFFF
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm - (1 << 32) if imm >> 31 else imm)


# the few instructions the generators use (include/uapi/linux/bpf_common.h, bpf.h)
def ldx_w(dst: int, src: int, off: int) -> bytes:
    return insn(0x61, dst, src, off)


def ldx_h(dst: int, src: int, off: int) -> bytes:
    return insn(0x69, dst, src, off)


def ldx_dw(dst: int, src: int, off: int) -> bytes:
    return insn(0x79, dst, src, off)


def stx_dw(dst: int, src: int, off: int) -> bytes:
    return insn(0x7B, dst, src, off)


def st_w(dst: int, off: int, imm: int) -> bytes:
    return insn(0x62, dst, 0, off, imm)


def alu32_imm(op: int, dst: int, imm: int) -> bytes:
    return insn(0x04 | op, dst, 0, 0, imm)


def alu64_imm(op: int, dst: int, imm: int) -> bytes:
    return insn(0x07 | op, dst, 0, 0, imm)


def mov32_reg(dst: int, src: int) -> bytes:
    return insn(0xBC, dst, src)


def mov64_reg(dst: int, src: int) -> bytes:
    return insn(0xBF, dst, src)


def mov64_imm(dst: int, imm: int) -> bytes:
    return insn(0xB7, dst, 0, 0, imm)


def jne_imm(dst: int, imm: int, off: int) -> bytes:
    return insn(0x55, dst, 0, off, imm)


def jeq_imm(dst: int, imm: int, off: int) -> bytes:
    return insn(0x15, dst, 0, off, imm)


def jne_reg(dst: int, src: int, off: int) -> bytes:
    return insn(0x5D, dst, src, off)


def jeq_reg(dst: int, src: int, off: int) -> bytes:
    return insn(0x1D, dst, src, off)


def ja(off: int) -> bytes:
    return insn(0x05, 0, 0, off)


def exit_() -> bytes:
    return insn(0x95)


def ld_imm64(dst: int, value: int) -> bytes:
    return insn(0x18, dst, 0, 0, value & 0xFFFFFFFF) + insn(0, 0, 0, 0, (value >> 32) & 0xFFFFFFFF)


AND, RSH, ADD, LSH, OR = 0x50, 0x70, 0x00, 0x60, 0x40


def _access_bits(access: str) -> int:
    return sum(_ACCESS[a] for a in set(access))


def _prologue() -> list[bytes]:
    return [ldx_w(R2, R1, 0), alu32_imm(AND, R2, 0xFFFF), ldx_w(R3, R1, 0), alu32_imm(RSH, R3, 16),
            ldx_w(R4, R1, 4), ldx_w(R5, R1, 8)]


def _rule_block(rule: Rule) -> list[bytes]:
    """``if rule matches: return allow`` with the checks runc and crun both emit (type, access, major,
    minor); the skip offsets are filled in for the block's own length."""
    dtype, major, minor, access, allow = rule
    checks: list[tuple[str, int]] = []
    if dtype != "a":
        checks.append(("type", _TYPE[dtype]))
    if set(access) != set("rwm"):
        checks.append(("access", _access_bits(access)))
    if major is not None:
        checks.append(("major", major))
    if minor is not None:
        checks.append(("minor", minor))
    body_len = sum(3 if c == "access" else 1 for c, _ in checks) + 2
    out: list[bytes] = []
    done = 0
    for what, value in checks:
        if what == "access":
            done += 3
            out += [mov32_reg(R1, R3), alu32_imm(AND, R1, value), jne_reg(R1, R3, body_len - done)]
        else:
            done += 1
            reg = {"type": R2, "major": R4, "minor": R5}[what]
            out.append(jne_imm(reg, value, body_len - done))
    out += [insn(0xB4, R0, 0, 0, 1 if allow else 0), exit_()]
    return out


def runc_style(rules: Sequence[Rule], default_allow: bool = False) -> bytes:
    """First match wins, in order; then the default (runc's devicefilter shape)."""
    code = _prologue()
    for rule in rules:
        block = _rule_block(rule)
        code += block
        if len(block) == 2:  # matches everything: what follows would be unreachable (the verifier refuses it)
            return b"".join(code)
    code += [insn(0xB4, R0, 0, 0, 1 if default_allow else 0), exit_()]
    return b"".join(code)


def crun_style(rules: Sequence[Rule], default_allow: bool = False) -> bytes:
    """The last matching rule wins: rules walked from the end (crun's ebpf.c shape)."""
    return runc_style(list(reversed(rules)), default_allow)


def systemd_style(rules: Sequence[Rule]) -> bytes:
    """Allow rules only (systemd's DeviceAllow=), each jumping to one shared ``return 1``; access
    checked with the opposite comparison order and 64-bit moves."""
    allows = [r for r in rules if r[4]]
    blocks: list[list[bytes]] = []
    for dtype, major, minor, access, _ in allows:
        b: list[bytes] = []
        if dtype != "a":
            b.append(("type", _TYPE[dtype]))  # type: ignore[arg-type]
        b.append(("access", _access_bits(access)))  # type: ignore[arg-type]
        if major is not None:
            b.append(("major", major))  # type: ignore[arg-type]
        if minor is not None:
            b.append(("minor", minor))  # type: ignore[arg-type]
        blocks.append(b)
    code = _prologue()
    lengths = [sum(3 if c[0] == "access" else 1 for c in b) + 1 for b in blocks]  # + the jump to "allow"
    tail = 2  # "r0 = 0; exit"
    for i, b in enumerate(blocks):
        remaining = sum(lengths[i + 1:]) + tail
        size = lengths[i]
        done = 0
        for what, value in b:  # type: ignore[misc]
            if what == "access":
                done += 3
                code += [mov64_reg(R1, R3), alu32_imm(AND, R1, value), jne_reg(R3, R1, size - done)]
            else:
                done += 1
                reg = {"type": R2, "major": R4, "minor": R5}[what]
                code.append(jne_imm(reg, value, size - done))
        code.append(ja(remaining))  # matched: jump over the rest and "r0 = 0; exit" to "r0 = 1"
    code += [mov64_imm(R0, 0), exit_(), mov64_imm(R0, 1), exit_()]
    return b"".join(code)


class Asm:
    """A tiny assembler with labels: ``emit`` raw instructions, ``jump`` to a label, ``label`` a place."""

    def __init__(self) -> None:
        self.items: list[bytes | tuple[int, int, int, int, str]] = []
        self.labels: dict[str, int] = {}
        self.size = 0

    def emit(self, *code: bytes) -> None:
        for c in code:
            self.items.append(c)
            self.size += len(c) // 8

    def jump(self, code: int, label: str, dst: int = 0, src: int = 0, imm: int = 0) -> None:
        self.items.append((code, dst, src, imm, label))
        self.size += 1

    def label(self, name: str) -> None:
        self.labels[name] = self.size

    def assemble(self) -> bytes:
        out, pos = [], 0
        for item in self.items:
            if isinstance(item, bytes):
                out.append(item)
                pos += len(item) // 8
            else:
                code, dst, src, imm, label = item
                out.append(insn(code, dst, src, self.labels[label] - pos - 1, imm))
                pos += 1
        return b"".join(out)


def clang_style(char_major: int, minors: Sequence[int], access: str) -> bytes:
    """A C-compiled-looking program allowing ``c <major>:<m> <access>`` for each m of ``minors`` and
    ``c 1:3 <access>`` (/dev/null), denying the rest.  Nothing like runc's code: the context pointer
    spilled and reloaded, 16-bit narrow loads of ``access_type``, 32-bit jumps, a 64-bit immediate, a
    table of minors on the stack searched by a bounded loop (a back-edge, pointer + index)."""
    if not 0 < len(minors) <= 16:
        raise ValueError("1 to 16 minors")
    a = Asm()
    a.emit(stx_dw(R10, R1, -8), ldx_dw(R6, R10, -8),   # spill and reload ctx
           ldx_h(R2, R6, 0), ldx_h(R3, R6, 2),          # type, access: narrow loads
           ldx_w(R4, R6, 4), ldx_w(R5, R6, 8), stx_dw(R10, R5, -16))
    a.jump(0x56, "deny", dst=R2, imm=2)                 # JMP32: if w2 != char
    a.emit(ld_imm64(R7, ~_access_bits(access) & 0xFFFFFFFFFFFFFFFF), mov64_reg(R8, R3), insn(0x5F, R8, R7))
    a.jump(0x56, "deny", dst=R8, imm=0)                 # JMP32: access bits not allowed
    a.jump(0x15, "null", dst=R4, imm=1)                 # major 1: /dev/null
    a.jump(0x55, "deny", dst=R4, imm=char_major)
    for i, m in enumerate(minors):
        a.emit(st_w(R10, -80 + 4 * i, m))
    a.emit(mov64_imm(R9, 0), ldx_dw(R5, R10, -16))
    a.label("loop")
    a.jump(0x35, "deny", dst=R9, imm=len(minors))       # JGE: end of the table
    a.emit(mov64_reg(R1, R9), alu64_imm(LSH, R1, 2), mov64_reg(R0, R10), alu64_imm(ADD, R0, -80),
           insn(0x0F, R0, R1), ldx_w(R1, R0, 0))        # r1 = table[i] (pointer + scalar)
    a.jump(0x1E, "allow", dst=R1, src=R5)               # JMP32 JEQ reg
    a.emit(alu64_imm(ADD, R9, 1))
    a.jump(0x05, "loop")                                # back-edge
    a.label("deny")
    a.emit(mov64_imm(R0, 0), exit_())
    a.label("allow")
    a.emit(mov64_imm(R0, 1), exit_())
    a.label("null")
    a.jump(0x15, "allow", dst=R5, imm=3)
    a.jump(0x05, "deny")
    return a.assemble()


def rules_allow(rules: Sequence[Rule], dtype: str, major: int, minor: int, access: str, *,
                last_wins: bool = False, default_allow: bool = False) -> bool:
    """What the rules mean, without any program: the reference the generators are checked against."""
    ordered = list(reversed(rules)) if last_wins else list(rules)
    for rtype, rmajor, rminor, raccess, allow in ordered:
        if rtype != "a" and rtype != dtype:
            continue
        if not set(access) <= set(raccess):
            continue
        if rmajor is not None and rmajor != major:
            continue
        if rminor is not None and rminor != minor:
            continue
        return allow
    return default_allow


# --- the kernel oracle -----------------------------------------------------------------------------

_SYS_BPF = {"x86_64": 321, "aarch64": 280}
_PROG_LOAD, _PROG_ATTACH = 5, 8
_CGROUP_DEVICE_TYPE, _CGROUP_DEVICE_ATTACH, _ALLOW_MULTI = 15, 6, 2


def _bpf(cmd: int, attr: ctypes.Array[ctypes.c_char]) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    ret = libc.syscall(ctypes.c_long(_SYS_BPF[platform.machine()]), ctypes.c_long(cmd), attr,
                       ctypes.c_uint(len(attr)))
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(ret)


def _put(buf: ctypes.Array[ctypes.c_char], off: int, value: int, size: int) -> None:
    ctypes.memmove(ctypes.addressof(buf) + off, value.to_bytes(size, "little"), size)


def load_program(code: bytes) -> int:
    """``BPF_PROG_LOAD`` a ``cgroup_device`` program; returns its fd.  OSError with the verifier log
    in the message when the kernel refuses it.  Loaded without a log first: the log of a program
    the verifier walks long (a bounded loop of 250 000 rounds) overflows any buffer (ENOSPC), so the
    log is asked for only to say why a refused program was refused."""
    insns = ctypes.create_string_buffer(code, len(code))
    license_ = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(65536)
    attr = ctypes.create_string_buffer(120)
    _put(attr, 0, _CGROUP_DEVICE_TYPE, 4)
    _put(attr, 4, len(code) // 8, 4)
    _put(attr, 8, ctypes.addressof(insns), 8)
    _put(attr, 16, ctypes.addressof(license_), 8)
    _put(attr, 68, _CGROUP_DEVICE_ATTACH, 4)  # expected_attach_type
    try:
        return _bpf(_PROG_LOAD, attr)
    except OSError:
        pass
    _put(attr, 24, 1, 4)  # log_level
    _put(attr, 28, len(log), 4)
    _put(attr, 32, ctypes.addressof(log), 8)
    try:
        return _bpf(_PROG_LOAD, attr)
    except OSError as exc:
        raise OSError(exc.errno, f"BPF_PROG_LOAD: {exc.strerror}\n{log.value.decode(errors='replace')}") from exc


def attach(cgroup_dir: Path, prog_fd: int) -> None:
    """``BPF_PROG_ATTACH`` the program to the cgroup with ``BPF_F_ALLOW_MULTI`` (as runc does)."""
    fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        attr = ctypes.create_string_buffer(120)
        _put(attr, 0, fd, 4)
        _put(attr, 4, prog_fd, 4)
        _put(attr, 8, _CGROUP_DEVICE_ATTACH, 4)
        _put(attr, 12, _ALLOW_MULTI, 4)
        _bpf(_PROG_ATTACH, attr)
    finally:
        os.close(fd)


def unified_root() -> Path | None:
    """The cgroup2 mount of this host (``/sys/fs/cgroup/unified`` on hybrid, ``/sys/fs/cgroup`` on v2)."""
    for candidate in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")):
        if (candidate / "cgroup.controllers").is_file():
            return candidate
    return None


@contextlib.contextmanager
def cgroup_with_programs(name: str, programs: Sequence[bytes], held: bool = False) -> Iterator[Path]:
    """A fresh cgroup v2 directory ``<unified>/<name>`` with ``programs`` attached; removed after. ``held``:
    a ``sleep`` process lives in it meanwhile, as in a real container, so that nothing can remove it (an
    empty cgroup can be removed by anyone with the right; three full runs of the suite saw the empty tree of
    the looping-programs test removed while it ran, beside the runtime tests' daemons)."""
    root = unified_root()
    if root is None:
        raise OSError(errno.ENOENT, "no cgroup2 mount")
    directory = root / name
    fds: list[int] = []
    holder: subprocess.Popen[bytes] | None = None
    try:
        # loaded first: the verifier takes a while over a long loop, and the directory is made just before
        # its programs are attached (in full runs, an empty directory made before a slow load was gone
        # when the attach came; which concurrent test removed it is not known: once more, then raise)
        for code in programs:
            fds.append(load_program(code))
        for attempt in (1, 2):
            directory.mkdir(exist_ok=attempt > 1)
            try:
                for fd in fds:
                    attach(directory, fd)
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
        if held:
            holder = subprocess.Popen(["sleep", "600"])
            (directory / "cgroup.procs").write_text(f"{holder.pid}\n")
        yield directory
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            directory.rmdir()


_PROBE = r"""
import errno, json, os, sys
cgroup, nodes, probes = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
flags = {"r": os.O_RDONLY, "w": os.O_WRONLY, "rw": os.O_RDWR}
out = []
for key, access in probes:
    try:
        os.close(os.open(nodes[key], flags[access] | os.O_NONBLOCK))
        out.append(True)
    except OSError as exc:
        if exc.errno == errno.EPERM:
            out.append(False)
        elif exc.errno in (errno.ENXIO, errno.ENODEV):
            out.append(True)
        else:
            raise
print(json.dumps(out))
"""


def kernel_verdicts(cgroup_dir: Path, node_dir: Path, devices: Sequence[tuple[str, int, int]],
                    probes: Sequence[tuple[int, str]]) -> list[bool]:
    """Let the kernel decide: make device nodes ``devices`` (``(type, major, minor)``) in ``node_dir``,
    start a process in ``cgroup_dir`` and ``open`` node ``i`` with access ``"r"``/``"w"``/``"rw"`` for
    each probe ``(i, access)``.  True: allowed (the open succeeded or failed for want of a driver,
    ENXIO/ENODEV); False: EPERM (the device programs denied it)."""
    nodes = {}
    for i, (dtype, major, minor) in enumerate(devices):
        path = node_dir / f"dev{i}"
        if not path.exists():
            os.mknod(path, 0o666 | (0o020000 if dtype == "c" else 0o060000), os.makedev(major, minor))
        nodes[str(i)] = str(path)
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(cgroup_dir), json.dumps(nodes),
                           json.dumps([(str(i), a) for i, a in probes])],
                          capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"probe failed: {proc.stderr}")
    result: list[bool] = json.loads(proc.stdout)
    return result


# --- programs the evaluator cannot decide (what a privileged container can attach) -------------------

def looping(rounds: int, allow: bool = True) -> bytes:
    """A bounded loop of ``rounds`` rounds, then ``return allow``: ``r0 = 0; do r0 += 1 while r0 <
    rounds``.  The verifier walks every round (about 2 instructions each, within its 1 000 000), so up
    to about 490 000 rounds load; distinct ``rounds`` give distinct programs (distinct tags)."""
    return b"".join([mov64_imm(R0, 0), alu64_imm(ADD, R0, 1), insn(0xA5, R0, 0, -2, rounds),  # JLT imm
                     mov64_imm(R0, 1 if allow else 0), exit_()])


def calls_helper(salt: int = 0) -> bytes:
    """Calls ``bpf_ktime_get_ns`` (helper 5, offered to every program type), then allows everything:
    not a pure function of the device.  ``salt`` (stored in r6, unused) makes programs distinct."""
    return b"".join([mov64_imm(R6, salt), insn(0x85, 0, 0, 0, 5), mov64_imm(R0, 1), exit_()])
