"""Read the cgroup v2 device programs in effect for a cgroup, through bpf(2), and cache their answers.

Kernel interface (``include/uapi/linux/bpf.h``, ``kernel/bpf/syscall.c``; docs/containers.md):

* ``BPF_PROG_QUERY`` (cmd 16) on an ``O_RDONLY`` descriptor of the cgroup directory, ``attach_type``
  ``BPF_CGROUP_DEVICE`` (6), ``query_flags`` ``BPF_F_QUERY_EFFECTIVE`` (1): the IDs of the programs
  in effect (the cgroup's own and its ancestors' that apply to it).  Needs ``CAP_NET_ADMIN`` or
  ``CAP_SYS_ADMIN``.
* ``BPF_PROG_GET_FD_BY_ID`` (cmd 13): a descriptor of a program by ID.  Needs ``CAP_SYS_ADMIN``.
* ``BPF_OBJ_GET_INFO_BY_FD`` (cmd 15) with ``struct bpf_prog_info``: its type and
  ``xlated_prog_insns``/``xlated_prog_len``, the instructions after the verifier (what runs, less
  the JIT).

There is no C library call for these, so ``syscall(SYS_bpf, …)`` goes through ``ctypes``; the
``union bpf_attr`` members are laid out by hand below (offsets from ``bpf.h``).

Caching: a program ID never changes meaning while the program exists and IDs are not reused before
the 31-bit counter wraps, so a program's instructions are read once per ID, and the answer for a
set of IDs is kept by those IDs; programs with the same instructions (runc emits the same code for
the same rules) share one evaluated grant.  The query
itself runs on every collection, so a container whose rules change (a new program replaces the old
one) is seen at the next scrape, as ``devices.list`` is on v1.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import platform
import threading
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass

from accelstats.cgroups.bpf_program import MAX_STEPS, Budget, Insn, UndecidableError, decode, device_grant
from accelstats.cgroups.devices_list import GpuGrant

log = logging.getLogger(__name__)

# little-endian architectures only: the instructions, the context and the attribute structs are
# read and written little-endian here (a big-endian kernel such as s390x's would need the other order)
_SYS_BPF = {"x86_64": 321, "amd64": 321, "aarch64": 280, "arm64": 280, "ppc64le": 361, "riscv64": 280,
            "loongarch64": 280}
_BPF_PROG_GET_FD_BY_ID = 13
_BPF_OBJ_GET_INFO_BY_FD = 15
_BPF_PROG_QUERY = 16
_BPF_CGROUP_DEVICE = 6
_BPF_F_QUERY_EFFECTIVE = 1
_BPF_PROG_TYPE_CGROUP_DEVICE = 15
_ATTR_SIZE = 120  # bytes of union bpf_attr we pass; every member used here fits, the rest stays zero
_INFO_SIZE = 224  # bytes of struct bpf_prog_info we pass (the kernel fills what it knows)
_MAX_PROGRAMS = 64  # BPF_CGROUP_MAX_PROGS: per cgroup; with its ancestors' more can be in effect
_MAX_EFFECTIVE = 64 * 64  # room asked for at most (64 programs at each of 64 levels)
_MAX_INSNS = 1_000_000  # BPF_COMPLEXITY_LIMIT_INSNS: no program is longer


class DeviceProgramsError(Exception):
    """The device programs of a cgroup could not be read.

    ``kind`` is ``"denied"`` (no ``CAP_SYS_ADMIN``, or a seccomp filter refused ``bpf(2)``),
    ``"vanished"`` (the cgroup was removed), ``"unsupported"`` (no ``bpf(2)`` on this kernel or
    architecture) or ``"unreadable"`` (anything else, e.g. a program removed mid-read); ``str()``
    says what failed.
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class _Syscall:
    """``bpf(2)`` through ``ctypes``; one instance per process (the libc handle is shared)."""

    def __init__(self) -> None:
        number = _SYS_BPF.get(platform.machine().lower())
        if number is None:
            raise DeviceProgramsError("unsupported", f"bpf(2) number unknown on {platform.machine()}")
        self.number = number
        libc = ctypes.CDLL(None, use_errno=True)
        self.syscall = libc.syscall
        self.syscall.restype = ctypes.c_long

    def __call__(self, cmd: int, attr: ctypes.Array[ctypes.c_char], what: str) -> int:
        ret = int(self.syscall(ctypes.c_long(self.number), ctypes.c_long(cmd), attr, ctypes.c_uint(len(attr))))
        if ret < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")
        return ret


def _put(buf: ctypes.Array[ctypes.c_char], offset: int, value: int, size: int) -> None:
    ctypes.memmove(ctypes.addressof(buf) + offset, value.to_bytes(size, "little"), size)


def _get(buf: ctypes.Array[ctypes.c_char], offset: int, size: int) -> int:
    return int.from_bytes(buf.raw[offset:offset + size], "little")


def _classify(exc: OSError, what: str) -> DeviceProgramsError:
    if exc.errno in (errno.EPERM, errno.EACCES):
        return DeviceProgramsError(
            "denied", f"{what}: {os.strerror(exc.errno)} (reading cgroup v2 device programs needs CAP_SYS_ADMIN "
                      "and a bpf(2) that no seccomp filter refuses)")
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return DeviceProgramsError("vanished", f"{what}: {os.strerror(exc.errno)}")
    if exc.errno == errno.EBADF and what == "BPF_PROG_QUERY":
        return DeviceProgramsError("unreadable", f"{what}: not a directory of a cgroup v2 hierarchy")
    if exc.errno in (errno.ENOSYS, errno.EINVAL) and what == "BPF_PROG_QUERY":
        return DeviceProgramsError("unsupported", f"{what}: {os.strerror(exc.errno)} (kernel without "
                                                  "BPF_PROG_QUERY for cgroup device programs)")
    return DeviceProgramsError("unreadable", f"{what}: {exc}")


class BpfReader:
    """The raw reads: program IDs in effect for a cgroup directory, and one program's instructions."""

    def __init__(self) -> None:
        self._bpf = _Syscall()

    def query(self, cgroup_dir: str) -> list[int]:
        """IDs of the ``BPF_CGROUP_DEVICE`` programs in effect for ``cgroup_dir`` (``BPF_PROG_QUERY``
        with ``BPF_F_QUERY_EFFECTIVE``), in the kernel's order.  Raises :class:`DeviceProgramsError`."""
        try:
            fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise _classify(exc, f"open {cgroup_dir}") from exc
        try:
            room = _MAX_PROGRAMS
            while True:
                ids = (ctypes.c_uint32 * room)()
                attr = ctypes.create_string_buffer(_ATTR_SIZE)
                _put(attr, 0, fd, 4)  # target_fd
                _put(attr, 4, _BPF_CGROUP_DEVICE, 4)  # attach_type
                _put(attr, 8, _BPF_F_QUERY_EFFECTIVE, 4)  # query_flags
                _put(attr, 16, ctypes.addressof(ids), 8)  # prog_ids
                _put(attr, 24, room, 4)  # prog_cnt
                try:
                    self._bpf(_BPF_PROG_QUERY, attr, "BPF_PROG_QUERY")
                except OSError as exc:
                    needed = _get(attr, 24, 4)
                    if exc.errno == errno.ENOSPC and room < needed <= _MAX_EFFECTIVE:
                        room = needed  # more programs in effect (with the ancestors') than room: ask again
                        continue
                    raise _classify(exc, "BPF_PROG_QUERY") from exc
                count = min(_get(attr, 24, 4), room)
                return [int(ids[i]) for i in range(count)]
        finally:
            os.close(fd)

    def instructions(self, prog_id: int) -> bytes:
        """The translated instructions of program ``prog_id`` (``BPF_PROG_GET_FD_BY_ID``, then
        ``BPF_OBJ_GET_INFO_BY_FD`` twice: length, then bytes).  Raises :class:`DeviceProgramsError`,
        also for a program that is not a ``BPF_PROG_TYPE_CGROUP_DEVICE``."""
        attr = ctypes.create_string_buffer(_ATTR_SIZE)
        _put(attr, 0, prog_id, 4)
        try:
            fd = self._bpf(_BPF_PROG_GET_FD_BY_ID, attr, f"BPF_PROG_GET_FD_BY_ID {prog_id}")
        except OSError as exc:
            raise _classify(exc, f"BPF_PROG_GET_FD_BY_ID {prog_id}") from exc
        try:
            info = ctypes.create_string_buffer(_INFO_SIZE)
            self._info(fd, info, prog_id)
            kind, length = _get(info, 0, 4), _get(info, 20, 4)
            if kind != _BPF_PROG_TYPE_CGROUP_DEVICE:
                raise DeviceProgramsError("unreadable", f"program {prog_id} has type {kind}, not cgroup_device")
            if not 0 < length <= 8 * _MAX_INSNS:
                raise DeviceProgramsError("unreadable", f"program {prog_id}: translated length {length} "
                                                        "(0: the kernel hides the instructions)")
            insns = ctypes.create_string_buffer(length)
            info = ctypes.create_string_buffer(_INFO_SIZE)
            _put(info, 20, length, 4)  # xlated_prog_len
            _put(info, 32, ctypes.addressof(insns), 8)  # xlated_prog_insns
            self._info(fd, info, prog_id)
            if _get(info, 32, 8) == 0:  # bpf_prog_get_info_by_fd zeroes the pointer instead of copying
                raise DeviceProgramsError("unreadable", f"program {prog_id}: the kernel hides its instructions "
                                                        "(a blinded program and kernel.kptr_restrict)")
            return insns.raw[:min(length, _get(info, 20, 4))]
        finally:
            os.close(fd)

    def _info(self, fd: int, info: ctypes.Array[ctypes.c_char], prog_id: int) -> None:
        attr = ctypes.create_string_buffer(_ATTR_SIZE)
        _put(attr, 0, fd, 4)  # bpf_fd
        _put(attr, 4, len(info), 4)  # info_len
        _put(attr, 8, ctypes.addressof(info), 8)  # info
        try:
            self._bpf(_BPF_OBJ_GET_INFO_BY_FD, attr, f"BPF_OBJ_GET_INFO_BY_FD {prog_id}")
        except OSError as exc:
            raise _classify(exc, f"BPF_OBJ_GET_INFO_BY_FD {prog_id}") from exc


@dataclass(frozen=True)
class _Undecided:
    """A cached "no decision": only the reason, never the exception (raising one exception object
    again appends the raiser's frames to its ``__traceback__`` each time, pinning every frame of
    every collection).  ``position``: which program of the set could not be decoded (None: the set
    as a whole could not be evaluated); the program IDs are named when it is raised, since the same
    texts can come back under new IDs."""

    reason: str
    position: int | None = None

    def error(self, ids: tuple[int, ...]) -> UndecidableError:
        """A fresh error naming ``ids``, without a chain."""
        which = f": program {ids[self.position]}" if self.position is not None else ""
        return UndecidableError(f"device programs {', '.join(map(str, ids))}{which}: {self.reason}")


_Question = tuple[frozenset[int], int | None, frozenset[int]]  # GPU minors, caps major, caps minors


@dataclass(frozen=True)
class ProgramsGrant:
    """What the device programs in effect for one cgroup grant: ``grant`` (GPU minors, MIG capability
    minors, unrestricted) and ``program_ids`` (the programs asked, kernel order; empty: none is
    attached, so nothing is restricted)."""

    grant: GpuGrant
    program_ids: tuple[int, ...]


MAX_COLLECTION_STEPS = 400_000
"""Instructions the evaluations of new program texts may execute together between two calls of
:meth:`DeviceProgramCache.begin_collection`: two programs at the whole
:data:`~accelstats.cgroups.bpf_program.MAX_STEPS` each (0.18 s of CPU measured on the development
VM, docs/performance.md).  A program met once they are spent waits for a later collection."""


class DeviceProgramCache:
    """The v2 devices cgroup of container cgroups: query, read once per program ID, evaluate once per
    program text and question.  Thread-safe.

    ``reader``: the bpf(2) reads (:class:`BpfReader`; injectable).  ``max_programs``: program IDs whose
    instructions are kept (least recently used dropped first); ``max_texts``: distinct program texts
    whose decoded instructions and answers are kept.  An answer is a grant or "no decision"
    (:class:`UndecidableError`), kept by program IDs and by program texts (a program replaced by the
    same code under a new ID is not evaluated again).

    ``collection_steps``: instructions the evaluations may execute per collection (call
    :meth:`begin_collection` at the start of each); a new text met once they are spent is not
    evaluated and its cgroup gets :class:`UndecidableError` saying so, for this collection only.
    Each evaluation reserves its share (at most :data:`MAX_STEPS`) before it runs and gives back what it
    did not execute, so concurrent grants together never pass ``collection_steps``; a grant that finds
    them all reserved by running evaluations waits for the next collection.
    ``steps``: instructions executed in all (the evaluator's total cost).
    """

    def __init__(self, reader: BpfReader | None = None, *, max_programs: int = 16384, max_texts: int = 1024,
                 collection_steps: int = MAX_COLLECTION_STEPS) -> None:
        self._reader = reader
        self._texts_by_id: OrderedDict[int, bytes] = OrderedDict()
        self._decoded: OrderedDict[bytes, tuple[Insn, ...]] = OrderedDict()
        self._grants: OrderedDict[tuple[tuple[bytes, ...], _Question], GpuGrant | _Undecided] = OrderedDict()
        self._by_ids: dict[tuple[tuple[int, ...], _Question], GpuGrant | _Undecided] = {}
        self._max_programs = max_programs
        self._max_texts = max_texts
        self._collection_steps = collection_steps
        self._steps_left = collection_steps
        self._lock = threading.Lock()
        self.reads = 0  # programs read through bpf(2) (each ID once while cached)
        self.steps = 0

    def _bpf(self) -> BpfReader:
        if self._reader is None:
            self._reader = BpfReader()
        return self._reader

    def begin_collection(self) -> None:
        """A new collection: the evaluations may execute ``collection_steps`` instructions again."""
        with self._lock:
            self._steps_left = self._collection_steps

    def grant(self, cgroup_dir: str, gpu_minors: Collection[int], *, caps_major: int | None = None,
              known_caps_minors: Collection[int] = ()) -> ProgramsGrant:
        """The grant of the programs in effect for ``cgroup_dir`` (see
        :func:`accelstats.cgroups.bpf_program.device_grant` for each rule).  Raises
        :class:`DeviceProgramsError` when they cannot be read, :class:`UndecidableError` when one cannot
        be evaluated, or not in this collection's budget (the message names the program IDs)."""
        reader = self._bpf()
        ids = tuple(reader.query(cgroup_dir))
        minors = gpu_minors if isinstance(gpu_minors, frozenset) else frozenset(gpu_minors)
        caps = known_caps_minors if isinstance(known_caps_minors, frozenset) else frozenset(known_caps_minors)
        question = (minors, caps_major, caps)
        by_ids = (ids, question)
        with self._lock:  # the common case: these very programs were asked this question before
            cached = self._by_ids.get(by_ids)
        if cached is None:
            texts = tuple(self._text(reader, i) for i in ids)
            key = (tuple(hashlib.sha1(t, usedforsecurity=False).digest() for t in texts), question)
            with self._lock:
                cached = self._grants.get(key)
                if cached is not None:
                    self._grants.move_to_end(key)
                    self._remember(by_ids, cached)
            if cached is None:
                cached = self._evaluate(texts, question, ids)
                with self._lock:
                    self._grants[key] = cached
                    while len(self._grants) > self._max_texts:
                        self._grants.popitem(last=False)
                    self._remember(by_ids, cached)
        if isinstance(cached, _Undecided):
            raise cached.error(ids)  # a fresh one each time: nothing outlives the caller
        return ProgramsGrant(cached, ids)

    def _evaluate(self, texts: tuple[bytes, ...], question: _Question, ids: tuple[int, ...]) -> GpuGrant | _Undecided:
        """Decode and evaluate, within what is left of this collection's instructions; raises
        :class:`UndecidableError` (nothing cached) when that is spent."""
        programs = []
        for position, text in enumerate(texts):
            try:
                programs.append(self._decode(text))
            except UndecidableError as exc:
                return _Undecided(str(exc), position)
        with self._lock:  # reserved up front: concurrent grants cannot spend the same instructions twice
            steps = max(0, min(self._steps_left, MAX_STEPS))
            self._steps_left -= steps
        if steps <= 0:
            raise UndecidableError(f"device programs {', '.join(map(str, ids))}: not evaluated in this collection, "
                                   f"whose {self._collection_steps} instructions for new device programs are spent")
        budget = Budget(steps)
        minors, caps_major, caps = question
        try:
            return device_grant(programs, minors, caps_major=caps_major, known_caps_minors=caps, budget=budget)
        except UndecidableError as exc:
            if budget.left <= 0 and steps < MAX_STEPS:  # cut short by the collection's budget, not its own
                raise UndecidableError(f"device programs {', '.join(map(str, ids))}: not evaluated in this "
                                       "collection, whose instructions for new device programs ran out") from None
            return _Undecided(str(exc))
        finally:
            with self._lock:  # what the evaluation did not execute goes back to this collection
                self._steps_left = min(self._collection_steps, self._steps_left + steps - budget.used)
                self.steps += budget.used

    def _remember(self, key: tuple[tuple[int, ...], _Question], found: GpuGrant | _Undecided) -> None:
        """Keep the answer for these program IDs (under the lock); bounded like the ID cache."""
        self._by_ids[key] = found
        if len(self._by_ids) > self._max_programs:
            self._by_ids.clear()  # IDs of removed containers: start again rather than track them

    def _text(self, reader: BpfReader, prog_id: int) -> bytes:
        with self._lock:
            text = self._texts_by_id.get(prog_id)
            if text is not None:
                self._texts_by_id.move_to_end(prog_id)
                return text
        text = reader.instructions(prog_id)
        with self._lock:
            self.reads += 1
            self._texts_by_id[prog_id] = text
            while len(self._texts_by_id) > self._max_programs:
                self._texts_by_id.popitem(last=False)
        return text

    def _decode(self, text: bytes) -> tuple[Insn, ...]:
        with self._lock:
            found = self._decoded.get(text)
            if found is not None:
                self._decoded.move_to_end(text)
                return found
        found = decode(text)
        with self._lock:
            self._decoded[text] = found
            while len(self._decoded) > self._max_texts:
                self._decoded.popitem(last=False)
        return found
