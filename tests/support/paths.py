"""Where the tests find the project's shared inputs (fixtures, spec).

``$ACCELSTATS_SHARED`` when set; else ``../shared`` beside the repository (development checkouts
and CI); else the byte-identical copies in ``tests/shared`` (a clone on its own).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
VENDORED = REPO_ROOT / "tests" / "shared"
BESIDE = REPO_ROOT.parent / "shared"


def find_shared() -> Path:
    """The shared folder to read: see the module docstring."""
    env = os.environ.get("ACCELSTATS_SHARED")
    if env:
        return Path(env)
    if (BESIDE / "fixtures").is_dir():
        return BESIDE
    return VENDORED


SHARED = find_shared()
FIXTURES = SHARED / "fixtures"
