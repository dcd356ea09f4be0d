"""The cgroup v2 devices cgroup: evaluate a ``BPF_PROG_TYPE_CGROUP_DEVICE`` program as the kernel runs it.

On cgroup v2 there is no ``devices.list``: the kernel asks every device program in effect for the
cgroup (its own and, attached with ``BPF_F_ALLOW_MULTI``, its ancestors'; all must allow) whether an
``open``/``mknod`` of a device may go ahead (``Documentation/admin-guide/cgroup-v2.rst``, "Device
controller"; ``kernel/bpf/cgroup.c`` ``__cgroup_bpf_check_dev_permission``).  The program's input is
``struct bpf_cgroup_dev_ctx { u32 access_type; u32 major; u32 minor; }`` with ``access_type =
(access << 16) | type`` (``include/uapi/linux/bpf.h``): type ``BPF_DEVCG_DEV_BLOCK`` 1 or
``BPF_DEVCG_DEV_CHAR`` 2, access bits ``BPF_DEVCG_ACC_MKNOD`` 1, ``READ`` 2, ``WRITE`` 4.  It
returns 1 (allow) or 0 (deny); the kernel reads bit 0 of the return value.

The programs the runtimes attach (runc's ``libcontainer/cgroups/devices/devicefilter.go``, crun's
``src/libcrun/ebpf.c``, systemd's ``src/core/bpf-devices.c``, NVIDIA's legacy hook) call no helper
and read no map: each is a pure function of those three words.  So instead of recognising one
generator's instruction pattern, :func:`run` *executes* the translated instructions
(``BPF_OBJ_GET_INFO_BY_FD`` ``xlated_prog_insns``) for a given ``(type, major, minor, access)``,
with the instruction set of ``Documentation/bpf/standardization/instruction-set.rst``: ALU and ALU64
(including the signed division, sign-extending moves and byte swaps of v4), JMP and JMP32, loads
from the context, stack stores and loads, 64-bit immediates.  A program that does anything else
(calls a helper, reads a map, reads outside the context or stack it never wrote, jumps out of the
program, runs more than :data:`MAX_QUESTION_STEPS` instructions for one question or :data:`MAX_STEPS`
in all the questions asked of it) has no
decision here: :class:`UndecidableError` says why, and the caller falls back to process evidence.

Nothing here touches the kernel; reading the programs is :mod:`accelstats.cgroups.devices_bpf`.
The module holds the whole instruction set the evaluator accepts, one class of instruction after
another, as the instruction-set document lists them.
"""

from __future__ import annotations

import struct
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from accelstats.cgroups.devices_list import NVIDIA_CTL_MINOR, NVIDIA_MAJOR, NVIDIA_MODESET_MINOR, GpuGrant

DEV_BLOCK = 1
"""``BPF_DEVCG_DEV_BLOCK``: the device type of a block device."""
DEV_CHAR = 2
"""``BPF_DEVCG_DEV_CHAR``: the device type of a char device (every NVIDIA node is one)."""
ACC_MKNOD = 1
"""``BPF_DEVCG_ACC_MKNOD``."""
ACC_READ = 2
"""``BPF_DEVCG_ACC_READ``: an ``open`` for reading."""
ACC_WRITE = 4
"""``BPF_DEVCG_ACC_WRITE``: an ``open`` for writing."""

MAX_STEPS = 200_000
"""Instructions all the evaluations of one grant may execute together (:func:`device_grant` asks a
program a few dozen questions, more with MIG capabilities).  The budget bounds what a hostile
program attached by a privileged container can cost (about 90 ms of CPU on the development VM,
once per distinct program text: answers are cached, see :mod:`accelstats.cgroups.devices_bpf`)."""

MAX_QUESTION_STEPS = 10_000
"""Instructions one question (one :func:`run`) may execute.  The programs runtimes generate run a
few hundred per question (runc's shape: at most 8 per rule, so 1 250 rules fit); a program that
loops past this has no decision after about 5 ms of CPU instead of the whole :data:`MAX_STEPS`."""

PROBE_MAJOR = 4095
"""Major of the probe device that tells an unrestricted program (the largest major: ``MINORBITS`` 20
leaves 12 bits).  No runtime grants it by name, so a program that lets it be read or written allows
every char device (``c *:* rw``, ``a *:* rwm``): it proves nothing about which GPU is used."""
PROBE_MINOR = (1 << 20) - 1
"""Minor of the probe device (the largest minor)."""

_CTX_SIZE = 12
_STACK_SIZE = 512
_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
_INSN = struct.Struct("<BBhi")

# instruction classes
_LD, _LDX, _ST, _STX, _ALU, _JMP, _JMP32, _ALU64 = range(8)
# load/store sizes and modes
_SIZES = {0x00: 4, 0x08: 2, 0x10: 1, 0x18: 8}
_MODE_IMM, _MODE_MEM, _MODE_MEMSX = 0x00, 0x60, 0x80


class UndecidableError(Exception):
    """The program does something whose result is not a pure function of the device context (a
    helper call, a map, memory outside the context and stack), or is malformed; the message says
    what and where (instruction index)."""


class Insn(NamedTuple):
    """One eBPF instruction: opcode, destination and source registers, signed 16-bit offset, signed
    32-bit immediate (the ``struct bpf_insn`` layout, little-endian)."""

    code: int
    dst: int
    src: int
    off: int
    imm: int


def decode(data: bytes) -> tuple[Insn, ...]:
    """Split translated program bytes into instructions (8 bytes each; a 64-bit immediate load takes
    two).  Raises :class:`UndecidableError` when the length is not a multiple of 8 or is zero."""
    if not data or len(data) % 8:
        raise UndecidableError(f"program of {len(data)} bytes is not a whole number of 8-byte instructions")
    out = []
    for code, regs, off, imm in _INSN.iter_unpack(data):
        out.append(Insn(code, regs & 0x0F, regs >> 4, off, imm))
    return tuple(out)


@dataclass(frozen=True)
class _Ptr:
    """A pointer register: into the context (``ctx``) or the stack (``stack``), at ``off`` bytes."""

    region: str
    off: int


_Value = int | _Ptr | None  # None: never written


def _signed(value: int, bits: int) -> int:
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


def _alu(op: int, dst: int, src: int, bits: int, off: int, where: int) -> int:
    """One ALU operation on unsigned ``bits``-wide values; the result is truncated to ``bits``."""
    mask = (1 << bits) - 1
    dst &= mask
    src &= mask
    if op == 0x00:
        result = dst + src
    elif op == 0x10:
        result = dst - src
    elif op == 0x20:
        result = dst * src
    elif op in (0x30, 0x90):  # DIV, MOD (off 1: signed, instruction set v4); x/0 = 0, x%0 = x
        if off == 1:
            sd, ss = _signed(dst, bits), _signed(src, bits)
            if ss == 0:
                result = 0 if op == 0x30 else sd
            else:
                quotient = abs(sd) // abs(ss) * (1 if (sd < 0) == (ss < 0) else -1)
                result = quotient if op == 0x30 else sd - quotient * ss
        elif src == 0:
            result = 0 if op == 0x30 else dst
        else:
            result = dst // src if op == 0x30 else dst % src
    elif op == 0x40:
        result = dst | src
    elif op == 0x50:
        result = dst & src
    elif op == 0x60:
        result = dst << (src & (bits - 1))
    elif op == 0x70:
        result = dst >> (src & (bits - 1))
    elif op == 0x80:
        result = -dst
    elif op == 0xA0:
        result = dst ^ src
    elif op == 0xC0:
        result = _signed(dst, bits) >> (src & (bits - 1))
    else:
        raise UndecidableError(f"instruction {where}: unknown ALU operation {op:#x}")
    return result & mask


def _byte_swap(value: int, width: int, to_le: bool, swap: bool) -> int:
    """``BPF_END``: convert the low ``width`` bits to (``to_le``) little or big endian on a
    little-endian host, or swap unconditionally (``BPF_ALU64 | BPF_END``, v4)."""
    value &= (1 << width) - 1
    if to_le and not swap:
        return value  # host order already
    return int.from_bytes(value.to_bytes(width // 8, "little"), "big")


def _jump_taken(op: int, dst: int, src: int, bits: int, where: int) -> bool:
    mask = (1 << bits) - 1
    dst &= mask
    src &= mask
    if op == 0x10:
        return dst == src
    if op == 0x20:
        return dst > src
    if op == 0x30:
        return dst >= src
    if op == 0x40:
        return bool(dst & src)
    if op == 0x50:
        return dst != src
    if op == 0xA0:
        return dst < src
    if op == 0xB0:
        return dst <= src
    sd, ss = _signed(dst, bits), _signed(src, bits)
    if op == 0x60:
        return sd > ss
    if op == 0x70:
        return sd >= ss
    if op == 0xC0:
        return sd < ss
    if op == 0xD0:
        return sd <= ss
    raise UndecidableError(f"instruction {where}: unknown jump operation {op:#x}")


class _Machine:
    """One evaluation: registers, a 512-byte stack, the 12-byte context."""

    def __init__(self, ctx: bytes) -> None:
        self.ctx = ctx
        self.stack = bytearray(_STACK_SIZE)
        self.written = bytearray(_STACK_SIZE)  # 1 where the program stored a byte
        self.stack_ptrs: dict[int, _Ptr] = {}  # 8-byte spills of pointer registers, by stack offset
        # r0-r10, and r11: the verifier's auxiliary register (BPF_REG_AX), which constant blinding
        # (net.core.bpf_jit_harden) writes into the translated code
        self.regs: list[_Value] = [None] * 12
        self.regs[1] = _Ptr("ctx", 0)
        self.regs[10] = _Ptr("stack", _STACK_SIZE)

    def scalar(self, reg: int, where: int) -> int:
        value = self.regs[reg]
        if value is None:
            raise UndecidableError(f"instruction {where}: r{reg} is read before it is written")
        if isinstance(value, _Ptr):
            raise UndecidableError(f"instruction {where}: arithmetic on pointer register r{reg}")
        return value

    def address(self, reg: int, off: int, size: int, where: int) -> _Ptr:
        base = self.regs[reg]
        if not isinstance(base, _Ptr):
            raise UndecidableError(f"instruction {where}: memory access through r{reg}, which is not a pointer")
        at = _Ptr(base.region, base.off + off)
        limit = _CTX_SIZE if at.region == "ctx" else _STACK_SIZE
        if at.off < 0 or at.off + size > limit:
            raise UndecidableError(f"instruction {where}: {size}-byte access outside the {at.region} at {at.off}")
        return at

    def load(self, at: _Ptr, size: int, where: int) -> _Value:
        if at.region == "ctx":
            return int.from_bytes(self.ctx[at.off:at.off + size], "little")
        if size == 8 and at.off in self.stack_ptrs:
            return self.stack_ptrs[at.off]
        if any(at.off < o + 8 and o < at.off + size for o in self.stack_ptrs):
            raise UndecidableError(f"instruction {where}: partial read of a spilled pointer")
        if not all(self.written[at.off:at.off + size]):
            raise UndecidableError(f"instruction {where}: reads stack bytes the program never wrote")
        return int.from_bytes(self.stack[at.off:at.off + size], "little")

    def store(self, at: _Ptr, size: int, value: _Value, where: int) -> None:
        if at.region != "stack":
            raise UndecidableError(f"instruction {where}: store into the context")
        for o in [o for o in self.stack_ptrs if at.off < o + 8 and o < at.off + size]:
            del self.stack_ptrs[o]
        if isinstance(value, _Ptr):
            if size != 8:
                raise UndecidableError(f"instruction {where}: partial spill of a pointer")
            self.stack_ptrs[at.off] = value
            self.written[at.off:at.off + 8] = b"\x01" * 8
            return
        if value is None:
            raise UndecidableError(f"instruction {where}: store of an unwritten register")
        self.stack[at.off:at.off + size] = (value & ((1 << (8 * size)) - 1)).to_bytes(size, "little")
        self.written[at.off:at.off + size] = b"\x01" * size


class Budget:
    """Instructions left to execute, shared by the evaluations of one grant (:data:`MAX_STEPS`)."""

    def __init__(self, steps: int = MAX_STEPS) -> None:
        self.steps = steps
        self.left = steps

    @property
    def used(self) -> int:
        """Instructions executed so far."""
        return self.steps - self.left


def run(insns: Sequence[Insn], device_type: int, major: int, minor: int, access: int,
        budget: Budget | None = None) -> bool:
    """Whether the program allows ``access`` (a mask of :data:`ACC_MKNOD`/:data:`ACC_READ`/
    :data:`ACC_WRITE`) to device ``major:minor`` of ``device_type`` (:data:`DEV_CHAR` or
    :data:`DEV_BLOCK`): bit 0 of its return value, as ``bpf_prog_run_array_cg`` reads it.
    ``budget``: the instructions it may execute (a fresh :data:`MAX_STEPS` when None), and at most
    :data:`MAX_QUESTION_STEPS` in this one run.  Raises :class:`UndecidableError` (see the module
    docstring)."""
    budget = budget if budget is not None else Budget()
    if any(i.dst > 11 or i.src > 11 for i in insns):
        raise UndecidableError("an instruction names a register above r11")
    ctx = struct.pack("<III", ((access & 0xFFFF) << 16) | (device_type & 0xFFFF), major & _MASK32, minor & _MASK32)
    m = _Machine(ctx)
    pc = 0
    floor = max(budget.left - MAX_QUESTION_STEPS, 0)  # what is left once this question has had its share
    while budget.left > floor:
        budget.left -= 1
        if not 0 <= pc < len(insns):
            raise UndecidableError(f"jump to instruction {pc}, outside the program of {len(insns)}")
        insn = insns[pc]
        cls = insn.code & 0x07
        if cls in (_ALU, _ALU64):
            pc = _step_alu(m, insn, pc, cls == _ALU64)
        elif cls in (_JMP, _JMP32):
            op = insn.code & 0xF0
            if op == 0x90:  # EXIT
                if cls != _JMP:
                    raise UndecidableError(f"instruction {pc}: unknown opcode {insn.code:#04x}")
                return m.scalar(0, pc) & 1 == 1  # the kernel reads bit 0 (bpf_prog_run_array_cg)
            if op == 0x80:
                raise UndecidableError(f"instruction {pc}: calls {'a function' if insn.src else f'helper {insn.imm}'}")
            if op == 0x00:  # JA (JMP32 | JA: 32-bit offset in imm, v4)
                pc += 1 + (insn.imm if cls == _JMP32 else insn.off)
                continue
            bits = 64 if cls == _JMP else 32
            src = m.scalar(insn.src, pc) if insn.code & 0x08 else insn.imm & _MASK64
            pc += 1 + (insn.off if _jump_taken(op, m.scalar(insn.dst, pc), src, bits, pc) else 0)
        elif cls == _LD:
            pc = _step_ld(m, insns, insn, pc)
        elif cls == _LDX:
            size = _SIZES[insn.code & 0x18]
            mode = insn.code & 0xE0
            if mode not in (_MODE_MEM, _MODE_MEMSX):
                raise UndecidableError(f"instruction {pc}: unknown load mode {mode:#x}")
            loaded = m.load(m.address(insn.src, insn.off, size, pc), size, pc)
            if mode == _MODE_MEMSX and isinstance(loaded, int):
                loaded = _signed(loaded, 8 * size) & _MASK64
            m.regs[insn.dst] = loaded
            pc += 1
        elif cls in (_ST, _STX):
            size = _SIZES[insn.code & 0x18]
            if insn.code & 0xE0 != _MODE_MEM:
                raise UndecidableError(f"instruction {pc}: atomic or unknown store mode {insn.code:#04x}")
            stored: _Value = insn.imm & _MASK64 if cls == _ST else m.regs[insn.src]
            m.store(m.address(insn.dst, insn.off, size, pc), size, stored, pc)
            pc += 1
        else:  # pragma: no cover - the eight classes are all handled
            raise UndecidableError(f"instruction {pc}: unknown class {cls}")
    if budget.left > 0:
        raise UndecidableError(f"more than {MAX_QUESTION_STEPS} instructions executed for one question")
    raise UndecidableError(f"more than {budget.steps} instructions executed for one grant")


def _step_alu(m: _Machine, insn: Insn, pc: int, wide: bool) -> int:
    bits = 64 if wide else 32
    op = insn.code & 0xF0
    if insn.dst == 10:
        raise UndecidableError(f"instruction {pc}: write to the frame pointer r10")
    if op == 0xB0:  # MOV (off 8/16/32: sign-extending, v4)
        value: _Value = m.regs[insn.src] if insn.code & 0x08 else insn.imm & _MASK64
        if isinstance(value, _Ptr):
            if not wide or insn.off:
                raise UndecidableError(f"instruction {pc}: 32-bit copy of a pointer")
            m.regs[insn.dst] = value
            return pc + 1
        if value is None:
            raise UndecidableError(f"instruction {pc}: r{insn.src} is read before it is written")
        if insn.off in (8, 16, 32):
            value = _signed(value, insn.off)
        m.regs[insn.dst] = value & ((1 << bits) - 1)
        return pc + 1
    if op == 0xD0:  # END: byte swap of the low imm bits
        if insn.imm not in (16, 32, 64):
            raise UndecidableError(f"instruction {pc}: byte swap of {insn.imm} bits")
        m.regs[insn.dst] = _byte_swap(m.scalar(insn.dst, pc), insn.imm, not insn.code & 0x08, wide)
        return pc + 1
    dst = m.regs[insn.dst]
    if op in (0x10, 0xA0) and insn.code & 0x08 and insn.src == insn.dst and not isinstance(dst, _Ptr):
        m.regs[insn.dst] = 0  # "r ^= r", "r -= r": zero whatever r held, written or not (blinding emits
        return pc + 1         # "xor r0, r0" for "r0 = 0")
    if isinstance(dst, _Ptr):  # pointer +/- a constant or a scalar register (a table indexed on the stack)
        if wide and op in (0x00, 0x10):
            delta = _signed(m.scalar(insn.src, pc), 64) if insn.code & 0x08 else insn.imm
            m.regs[insn.dst] = _Ptr(dst.region, dst.off + (delta if op == 0x00 else -delta))
            return pc + 1
        raise UndecidableError(f"instruction {pc}: arithmetic on pointer register r{insn.dst}")
    if op == 0x80:  # NEG takes no source
        src = 0
    elif insn.code & 0x08:
        src = m.scalar(insn.src, pc)
    else:
        src = insn.imm & (_MASK64 if wide else _MASK32)
    m.regs[insn.dst] = _alu(op, m.scalar(insn.dst, pc), src, bits, insn.off, pc)
    return pc + 1


def _step_ld(m: _Machine, insns: Sequence[Insn], insn: Insn, pc: int) -> int:
    if insn.code != 0x18:  # only BPF_LD | BPF_IMM | BPF_DW; ABS/IND are for socket filters
        raise UndecidableError(f"instruction {pc}: legacy packet load {insn.code:#04x}")
    if insn.src != 0:
        raise UndecidableError(f"instruction {pc}: loads a map or BTF object (pseudo source {insn.src})")
    if pc + 1 >= len(insns):
        raise UndecidableError(f"instruction {pc}: 64-bit immediate without its second half")
    m.regs[insn.dst] = (insn.imm & _MASK32) | ((insns[pc + 1].imm & _MASK32) << 32)
    return pc + 2


def allows(programs: Iterable[Sequence[Insn]], device_type: int, major: int, minor: int, access: int,
           budget: Budget | None = None) -> bool:
    """Whether every program allows the access (the kernel runs all programs in effect and denies
    when one returns 0; no program at all allows).  Raises :class:`UndecidableError` from any program."""
    budget = budget if budget is not None else Budget()
    return all(run(p, device_type, major, minor, access, budget) for p in programs)


def readable_or_writable(programs: Sequence[Sequence[Insn]], major: int, minor: int,
                         budget: Budget | None = None) -> frozenset[str]:
    """Which of ``"r"``/``"w"`` the programs allow for char device ``major:minor``, each asked on
    its own.  Raises :class:`UndecidableError`."""
    budget = budget if budget is not None else Budget()
    out = set()
    if allows(programs, DEV_CHAR, major, minor, ACC_READ, budget):
        out.add("r")
    if allows(programs, DEV_CHAR, major, minor, ACC_WRITE, budget):
        out.add("w")
    return frozenset(out)


def device_grant(programs: Sequence[Sequence[Insn]], gpu_minors: Collection[int], *,
                 nvidia_major: int = NVIDIA_MAJOR, caps_major: int | None = None,
                 known_caps_minors: Collection[int] = (), budget: Budget | None = None) -> GpuGrant:
    """The GPUs (by NVML minor number) and MIG capability minors the device programs in effect let a
    container use: the v2 counterpart of :func:`accelstats.cgroups.devices_list.gpu_grant`.

    * a GPU counts when ``c 195:<minor>`` may be opened for reading **and** writing in one call: the
      question the kernel asks when NVML and CUDA open ``/dev/nvidia<N>`` with ``O_RDWR``
      (docs/containers.md).  A program that allows only reading, or reading and writing by separate
      rules (runc's code wants one rule granting all the access asked), lets no CUDA process use the
      GPU, so it is no grant.  (On v1 a ``devices.list`` rule with ``r`` or ``w`` counts, as the
      spec's v1 table says: there the kernel merges the rules before it checks.)
    * a program that lets the probe device ``c 4095:1048575`` be read or written allows every char
      device (``c *:*``, ``a *:*``): ``unrestricted``, attribute by process evidence instead;
    * no program at all (an empty ``programs``) is unrestricted too: nothing is checked;
    * ``195:254``/``195:255`` are not GPUs; a MIG capability minor counts when it may be read (the
      driver opens ``nvidia-cap<M>`` read-only).

    ``programs``: the decoded programs in effect (:func:`decode`).  All the questions share one
    :class:`Budget`: ``budget`` (its ``used`` tells the caller the cost), a fresh :data:`MAX_STEPS`
    when None.  Raises :class:`UndecidableError`.
    """
    none = frozenset[int]()
    budget = budget if budget is not None else Budget()
    if not programs or readable_or_writable(programs, PROBE_MAJOR, PROBE_MINOR, budget):
        return GpuGrant(minors=none, unrestricted=True, mig_caps_minors=none)
    gpus = frozenset(
        m for m in gpu_minors
        if m not in (NVIDIA_CTL_MINOR, NVIDIA_MODESET_MINOR)
        and allows(programs, DEV_CHAR, nvidia_major, m, ACC_READ | ACC_WRITE, budget))
    caps = frozenset(
        m for m in known_caps_minors
        if caps_major is not None and allows(programs, DEV_CHAR, caps_major, m, ACC_READ, budget))
    return GpuGrant(minors=gpus, unrestricted=False, mig_caps_minors=caps)
