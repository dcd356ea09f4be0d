"""The walk's memo (issue 29): identify() answers are kept only while the runtimes' state answers the
same — a container the state learns about, or forgets, is seen at the next walk of a new generation.

| step | runtimes' state knows ``trainer-7`` | generation | walk finds |
|---|---|---|---|
| 1 | no  | 0 | an unrecognised leaf |
| 2 | yes, but no refresh: same generation | 0 | the kept answer (unrecognised); the state is not asked |
| 3 | yes | 1 | a containerd container |
| 4 | no  | 2 | an unrecognised leaf again |
"""

from __future__ import annotations

from pathlib import Path

from accelstats.attribution.runtimes import RuntimeState
from accelstats.cgroups.discovery import WalkMemo, discover_v2_containers
from accelstats.settings import RuntimeRoots


def test_kept_answers_follow_the_runtimes_generation(tmp_path: Path) -> None:
    (tmp_path / "gpujobs" / "trainer-7").mkdir(parents=True)
    knows: dict[str, tuple[str, str, str, str]] = {}
    asked: list[str] = []

    def known(candidate: str, parent: str) -> tuple[str, str, str, str] | None:
        asked.append(candidate)
        return knows.get(candidate)

    memo = WalkMemo()

    def walk(generation: int) -> tuple[list[str], list[str]]:
        memo.begin(generation)
        found = discover_v2_containers(tmp_path, known=known, memo=memo)
        return ([f"{c.path} {c.identity.runtime}" for c in found.containers if c.identity],
                [c.path for c in found.unrecognised])

    assert walk(0) == ([], ["/gpujobs/trainer-7"])
    knows["trainer-7"] = ("containerd", "trainer-7", "state", "gpujobs")
    asked.clear()
    assert walk(0) == ([], ["/gpujobs/trainer-7"])
    assert asked == []
    assert walk(1) == (["/gpujobs/trainer-7 containerd"], [])
    del knows["trainer-7"]
    assert walk(2) == ([], ["/gpujobs/trainer-7"])


def test_a_refresh_that_finds_other_ids_is_a_new_generation(tmp_path: Path) -> None:
    state = RuntimeState(tmp_path, RuntimeRoots())
    state.refresh()
    first = state.generation
    state.refresh()
    assert state.generation == first  # nothing changed: answers kept
    (tmp_path / "var/lib/docker/containers" / ("ab" * 32)).mkdir(parents=True)
    state.refresh()
    assert state.generation == first + 1
    assert state.known("ab" * 32, "docker") is not None
