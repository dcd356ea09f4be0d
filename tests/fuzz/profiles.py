"""Hypothesis profiles for the fuzz tests, chosen by ``ACCELSTATS_FUZZ_PROFILE`` (default ``ci``).

* ``ci``: a few hundred examples per target, derandomized (the same examples on every run, so CI
  is reproducible and a red CI is a real regression), no deadline (the CI machine is shared), no
  example database.
* ``long``: 100 000 examples per target, random seeds, the example database kept in
  ``.hypothesis/`` (a failure found once is replayed first next time). Run by hand; see
  docs/fuzzing.md for the command and the longest runs recorded.

``ACCELSTATS_FUZZ_EXAMPLES=N`` overrides ``max_examples`` of either profile (every target, including
those that lower it for CI), to size a run by hand.

The profiles are registered here but never loaded globally (``settings.load_profile`` would
change every other hypothesis test in the suite): fuzz tests take :func:`fuzz_settings`.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILE_ENV = "ACCELSTATS_FUZZ_PROFILE"
EXAMPLES_ENV = "ACCELSTATS_FUZZ_EXAMPLES"
CI_EXAMPLES = 200
LONG_EXAMPLES = 100_000

settings.register_profile(
    "ci",
    max_examples=CI_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long",
    max_examples=LONG_EXAMPLES,
    deadline=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)

PROFILE = os.environ.get(PROFILE_ENV, "ci").strip() or "ci"
if PROFILE not in ("ci", "long"):
    raise ValueError(f"{PROFILE_ENV}={PROFILE!r}: expected 'ci' or 'long'")
_EXAMPLES = os.environ.get(EXAMPLES_ENV, "").strip()
if _EXAMPLES and not (_EXAMPLES.isascii() and _EXAMPLES.isdigit() and int(_EXAMPLES) > 0):
    raise ValueError(f"{EXAMPLES_ENV}={_EXAMPLES!r}: expected a positive integer")


def fuzz_settings(ci_examples: int | None = None) -> settings:
    """The settings of the selected profile; ``ci_examples`` lowers (or raises) ``max_examples`` in
    the ``ci`` profile only, for targets whose single example is slow (the XML reader)."""
    base = settings.get_profile(PROFILE)
    if _EXAMPLES:
        return settings(base, max_examples=int(_EXAMPLES))
    if PROFILE == "ci" and ci_examples is not None:
        return settings(base, max_examples=ci_examples)
    return base
