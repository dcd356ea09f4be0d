"""Fuzzing cgroup-namespace path resolution (accelstats/attribution/cgroupns.py) and the mountinfo parser
(accelstats/cgroups/mode.py ``parse_mountinfo``).

Documented error type: none for both. ``CgroupNamespace.resolve`` answers a host path or None (never
above the host's root); ``parse_mountinfo`` "never raises" and skips malformed lines.
"""

from __future__ import annotations

import posixpath
from pathlib import Path

from hypothesis import example, given
from hypothesis import strategies as st

from accelstats.attribution.cgroupns import CgroupNamespace
from accelstats.cgroups.mode import Mount, parse_mountinfo

from .profiles import fuzz_settings

components = st.one_of(st.sampled_from(["..", ".", "", "kubepods.slice", "docker"]),
                       st.text(st.characters(blacklist_characters="/\0", blacklist_categories=("Cs",)), max_size=12))
paths = st.lists(components, max_size=12).map(lambda parts: "/" + "/".join(parts))
# a namespace root is a real cgroup directory: no "." or ".." components
roots = st.lists(st.text("abcdefghij-._0123456789", min_size=1, max_size=10).filter(lambda c: c not in (".", "..")),
                 max_size=6).map(lambda parts: "/" + "/".join(parts))


class KnownRoot(CgroupNamespace):
    """A namespace whose root is given (the search of the host tree is tested in test_attribution.py)."""

    def __init__(self, root: str) -> None:
        super().__init__(Path("/nonexistent"), Path("/nonexistent"), "")
        self._given = root

    def root(self) -> str | None:
        return self._given


@fuzz_settings()
@given(roots, paths)
@example("/kubepods.slice/pod0/c0", "/../../kubepods-pod1.slice/c1")
@example("/a", "/../../..")
def test_resolve_stays_inside_the_host_tree(root: str, path: str) -> None:
    resolved = KnownRoot(root).resolve(path)
    if resolved is None:
        return
    assert resolved.startswith("/") and resolved == posixpath.normpath(resolved)
    assert ".." not in resolved.split("/")
    if ".." not in path.split("/"):  # a path below the namespace root stays below it
        assert resolved == posixpath.normpath(posixpath.join(root, path.lstrip("/")))


@fuzz_settings()
@given(roots, st.integers(min_value=0, max_value=8))
def test_climbing_to_the_host_root_and_back_down_round_trips(root: str, extra: int) -> None:
    """``/..`` once per level of the namespace root, then a host path, names that host path; one more
    ``..`` than there are levels is refused."""
    depth = len([p for p in root.split("/") if p])
    target = "/kubepods.slice/x"
    assert KnownRoot(root).resolve("/.." * depth + target) == target
    assert KnownRoot(root).resolve("/.." * (depth + 1 + extra) + target) is None


lines = st.one_of(
    st.text(max_size=200),
    st.builds(lambda a, b, r, m, f: f"{a} {b} 0:1 {r} {m} rw shared:1 - {f} src rw",
              st.text("0123456789²٣", min_size=1, max_size=12), st.text("0123456789", min_size=1, max_size=5000),
              st.text(max_size=20).filter(lambda t: " " not in t and "\n" not in t), st.just("/sys/fs/cgroup"),
              st.sampled_from(["cgroup2", "cgroup", "tmpfs"])),
)


@fuzz_settings()
@given(st.lists(lines, max_size=8).map("\n".join))
@example("² 1 0:1 / / rw - ext4 x")  # str.isdigit() accepts '²'; int() did not: found by this target
@example("1" * 5000 + " 1 0:1 / / rw - ext4 x")  # int() refuses more than 4300 digits
def test_parse_mountinfo_never_raises(text: str) -> None:
    mounts = parse_mountinfo(text)
    assert all(isinstance(m, Mount) and m.mount_id >= 0 and m.parent_id >= 0 for m in mounts)
    assert len(mounts) <= len(text.splitlines())
