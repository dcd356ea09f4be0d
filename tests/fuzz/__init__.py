"""Property-based fuzzing of accelstats' parsers: see docs/fuzzing.md.

Every module here checks one parser family with hypothesis: no exception escapes except the
parser's documented error type, for arbitrary text/bytes and for near-valid inputs built from the
grammar, and round trips hold where they exist. Bounded for CI by the ``ci`` profile of
:mod:`.profiles`; ``ACCELSTATS_FUZZ_PROFILE=long`` runs them for long by hand.
"""
