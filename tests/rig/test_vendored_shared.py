"""tests/shared holds byte-identical copies of ../shared's inputs; drift fails here."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import in_ci
from support.paths import BESIDE, VENDORED

COPIES = sorted(p.relative_to(VENDORED) for p in VENDORED.rglob("*") if p.is_file() and p.name != "README.md")


def test_every_fixture_is_vendored() -> None:
    if not BESIDE.is_dir():
        if in_ci():
            pytest.fail(f"{BESIDE} missing under CI=true")
        pytest.skip("no ../shared beside this clone: nothing to compare with")
    originals = sorted(p.relative_to(BESIDE) for p in (BESIDE / "fixtures").rglob("*") if p.is_file())
    assert [p for p in originals if p not in COPIES] == []


@pytest.mark.parametrize("relative", COPIES, ids=str)
def test_copy_is_identical(relative: Path) -> None:
    original = BESIDE / relative
    if not BESIDE.is_dir():
        if in_ci():
            pytest.fail(f"{BESIDE} missing under CI=true")
        pytest.skip("no ../shared beside this clone: nothing to compare with")
    assert (VENDORED / relative).read_bytes() == original.read_bytes()
