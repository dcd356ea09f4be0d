"""Shared by the atheris harnesses in this folder (run by hand, never by pytest; see docs/fuzzing.md).

``python3 tests/fuzz/atheris/fuzz_<target>.py [libFuzzer flags] [CORPUS_DIR]``: an empty (or new)
``CORPUS_DIR`` is first seeded with the target's real inputs (the fixtures); libFuzzer then keeps
every input that reaches new code there. A crash (an exception the parser does not document) is
written to ``crash-<sha1>`` in the working directory and the run stops.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
FIXTURES = REPO_ROOT / "tests" / "shared" / "fixtures"
if (REPO_ROOT.parent / "shared" / "fixtures").is_dir():  # as tests/support/paths.py: ../shared beside the checkout
    FIXTURES = REPO_ROOT.parent / "shared" / "fixtures"
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def seed_corpus(argv: list[str], seeds: Iterable[bytes]) -> None:
    """Write ``seeds`` into the corpus directory named on the command line when it has no file yet."""
    dirs = [Path(a) for a in argv[1:] if not a.startswith("-")]
    if not dirs:
        return
    corpus = dirs[0]
    corpus.mkdir(parents=True, exist_ok=True)
    if any(corpus.iterdir()):
        return
    for seed in seeds:
        (corpus / hashlib.sha1(seed).hexdigest()).write_bytes(seed)
