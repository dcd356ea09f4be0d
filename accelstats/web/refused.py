"""What :class:`accelstats.web.auth.CheckGate` remembers of refused checks, for telling a retry.

A scraper sends the same credentials again at its next scrape (Prometheus: 10-60 s later); a guesser
sends fresh ones. The memory must outlast the refusals a flood causes in that time (about 1000 a
second on 2 CPUs, docs/performance.md), from a fresh address each (an IPv6 /64 gives anyone
millions), so it is not a per-address LRU (4096 addresses turned over in about 4 s): it is a fixed
table of :data:`REFUSED_SLOTS` 8-byte fingerprints, each refused (address, credentials) pair having
two slots chosen by a keyed hash. A new pair takes an empty one of its two slots, else overwrites one
of them: a remembered pair is lost only when later pairs land on both its slots (with the table
``f`` full, about ``f / REFUSED_SLOTS`` per refusal). The pages are an anonymous mapping, made
resident only as refusals touch them (a flood: :data:`REFUSED_SLOTS` x 8 bytes).
"""

from __future__ import annotations

import hashlib
import mmap
import os

REFUSED_SLOTS = 1 << 19  # fingerprints kept (4 MiB once a flood has touched every page)


class RefusedMemory:
    """Refused ``(address, credentials)`` pairs, remembered until :meth:`forget` or overwritten.

    ``slots``: a power of two. Fingerprints are 64-bit (a pair never refused is taken for one with
    probability about 2^-63 per slot); the hash key is random per process, so a client cannot aim its
    refusals at another's slots."""

    def __init__(self, slots: int = REFUSED_SLOTS) -> None:
        if slots <= 0 or slots & (slots - 1):
            raise ValueError(f"slots must be a power of two, got {slots}")
        self._key = os.urandom(16)
        self._mask = slots - 1
        self._map = mmap.mmap(-1, 8 * slots)
        self._table = memoryview(self._map).cast("Q")

    def _place(self, address: str, credentials: bytes) -> tuple[int, int, int, bool]:
        digest = hashlib.blake2b(address.encode("utf-8", "surrogateescape") + b"\0" + credentials,
                                 key=self._key, digest_size=17).digest()
        fingerprint = int.from_bytes(digest[:8], "little") | 1  # 0 marks an empty slot
        first = int.from_bytes(digest[8:12], "little") & self._mask
        second = int.from_bytes(digest[12:16], "little") & self._mask
        return fingerprint, first, second, bool(digest[16] & 1)

    def note(self, address: str, credentials: bytes) -> None:
        """Remember that a check from ``address`` with ``credentials`` was refused."""
        fingerprint, first, second, pick = self._place(address, credentials)
        table = self._table
        if fingerprint in (table[first], table[second]):
            return
        if table[first] == 0:
            table[first] = fingerprint
        elif table[second] == 0 or pick:
            table[second] = fingerprint
        else:
            table[first] = fingerprint

    def seen(self, address: str, credentials: bytes) -> bool:
        """True when a check from ``address`` with ``credentials`` was refused and is still remembered."""
        fingerprint, first, second, _ = self._place(address, credentials)
        return fingerprint in (self._table[first], self._table[second])

    def forget(self, address: str, credentials: bytes) -> None:
        """Drop the pair (its check got a slot)."""
        fingerprint, first, second, _ = self._place(address, credentials)
        for slot in (first, second):
            if self._table[slot] == fingerprint:
                self._table[slot] = 0
