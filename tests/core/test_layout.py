"""The house in wings (docs/design.md, "The wings"): the product's import graph, measured from the source.

| rule | checked by |
|---|---|
| an import goes to its own wing or to one further down :data:`WINGS` | :func:`test_no_import_runs_up_the_wings` |
| no import circle, between wings or inside one | :func:`test_no_import_circle` |
| ``collectors`` imports nothing of ``accelstats`` | :data:`WINGS` (it is the lowest wing but the replay) |
| the web wing holds at most 2 200 lines | :func:`test_the_web_wing_stays_small` |
| no module of ours drives sockets itself (``selectors``, ``select``) | :func:`test_no_module_drives_sockets_itself` |

Imports are read with :mod:`ast` from every module of ``accelstats`` and ``collectors`` (generated
protobuf modules left out), at any depth: inside functions and under ``TYPE_CHECKING`` too, since an
arrow is an arrow whenever it is followed. ``python tests/core/test_layout.py`` prints the graph by wing.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: The wings, top first. A module may import from its own wing and from the wings below it; wings on
#: one row are peers and may not import each other. The longest matching prefix names a module's wing.
WINGS: tuple[tuple[str, ...], ...] = (
    ("accelstats.__main__",),
    ("accelstats.cli",),
    ("accelstats.nomad",),
    ("accelstats.web",),
    ("accelstats.dcgm",),  # dcgm-exporter's names: renamed catalog readings, rendered by the web wing
    ("accelstats.catalog",),
    ("accelstats.manager",),
    ("accelstats.registry",),
    ("accelstats.config",),
    ("accelstats.accounting",),
    ("accelstats.attribution", "accelstats.mps", "accelstats.kubernetes"),
    ("accelstats.cgroups",),
    ("accelstats", "accelstats.settings", "accelstats.sdnotify"),
    ("collectors",),
    ("collectors.replay",),
    ("collectors.fsread",),  # the one bounded, non-following, regular-file-only read: every reader calls it
)
WEB_WING_MAX_LINES = 2200


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the two packages (generated protos left out)."""
    found = {}
    for package in ("accelstats", "collectors"):
        for path in sorted((REPO / package).rglob("*.py")):
            if "proto" in path.relative_to(REPO).parts[:-1]:
                continue
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _imported(node: ast.AST, package: str) -> Iterator[str]:
    """The dotted names an import statement names (``from a import b`` names ``a`` and ``a.b``)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        yield source
        yield from (f"{source}.{alias.name}" for alias in node.names)


def graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports."""
    mods = modules()
    edges: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            for target in _imported(node, package):
                while target and target not in mods:  # a name inside a module: the module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name].add(target)
    return edges


def wing(module: str) -> tuple[int, str]:
    """``(rank, wing)`` of a module: rank 0 is the top row of :data:`WINGS`."""
    best = (-1, -1, "")
    for rank, row in enumerate(WINGS):
        for prefix in row:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best[0]:
                best = (len(prefix), rank, prefix)
    assert best[1] >= 0, f"{module} is in no wing of WINGS"
    return best[1], best[2]


def upward(edges: dict[str, set[str]]) -> list[str]:
    """Imports that go to a wing above, or to a peer wing on the same row."""
    bad = []
    for source, targets in sorted(edges.items()):
        rank, own = wing(source)
        for target in sorted(targets):
            target_rank, other = wing(target)
            if other != own and target_rank <= rank:
                bad.append(f"{source} ({own}) -> {target} ({other})")
    return bad


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def web_wing_lines() -> int:
    """Lines of every module of ``accelstats/web``."""
    return sum(len(p.read_text(encoding="utf-8").splitlines()) for p in (REPO / "accelstats" / "web").rglob("*.py"))


def test_every_module_is_in_a_wing() -> None:
    for name in modules():
        wing(name)


def test_no_import_runs_up_the_wings() -> None:
    assert upward(graph()) == []


def test_no_import_circle() -> None:
    assert circles(graph()) == []


def test_the_checks_catch_what_they_look_for() -> None:
    """The two checks above, on a made-up graph with one arrow up and one circle."""
    edges = {"accelstats.manager": {"accelstats.catalog"}, "accelstats.catalog": {"accelstats.manager"},
             "collectors.fsread": {"collectors.nvidia"}, "collectors.nvidia": set()}
    assert upward(edges) == ["accelstats.manager (accelstats.manager) -> accelstats.catalog (accelstats.catalog)",
                             "collectors.fsread (collectors.fsread) -> collectors.nvidia (collectors)"]
    assert circles(edges) == [["accelstats.catalog", "accelstats.manager"]]


@pytest.mark.xfail(strict=True, reason="the web wing holds about 2 600 lines (issue 23 asks at most 2 200; "
                                      "issue 24 rows 1 and 3 added the prefix-counting bcrypt gate and the capped "
                                      "shared answers): the asyncio + h11 glue and the admission policy, exporter-"
                                      "toolkit's schema and TLS context, the bcrypt gate; less drops behaviour its "
                                      "docs and tests rely on (issue 23 is blocked on that choice)")
def test_the_web_wing_stays_small() -> None:
    assert web_wing_lines() <= WEB_WING_MAX_LINES


def test_the_web_wing_has_one_door() -> None:
    """Outside ``accelstats.web`` only its package (``accelstats/web/__init__.py``: serve,
    load_web_config, exposition) is imported, never a module inside it."""
    inside = sorted((name, target) for name, targets in graph().items() if not name.startswith("accelstats.web")
                    for target in targets if target.startswith("accelstats.web."))
    assert inside == []


def test_no_module_drives_sockets_itself() -> None:
    """Sockets, HTTP framing and TLS come from asyncio and h11: no module of ours imports ``selectors``
    or ``select`` (epoll, poll) — but the one that polls a file, not a socket:
    ``accelstats.cgroups.plainreads`` waits for ``POLLPRI`` on ``/proc/self/mountinfo`` (proc(5): the
    kernel's only signal that the mount table changed)."""
    files_only = {"accelstats.cgroups.plainreads"}
    offenders = sorted(name for name, targets in _stdlib_imports().items()
                       if targets & {"selectors", "select"} and name not in files_only)
    assert offenders == []


def _stdlib_imports() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for name, path in modules().items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(alias.name.partition(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found.add(node.module.partition(".")[0])
        out[name] = found
    return out


def main() -> None:
    """Print the graph by wing, then what breaks the rules."""
    edges = graph()
    by_wing: dict[tuple[int, str], list[str]] = {}
    for name in edges:
        by_wing.setdefault(wing(name), []).append(name)
    arrows = sum(len(t) for t in edges.values())
    print(f"{len(edges)} modules, {arrows} imports, {len(WINGS)} rows of wings")
    for (rank, prefix), names in sorted(by_wing.items()):
        lines = sum(len(modules()[n].read_text(encoding="utf-8").splitlines()) for n in names)
        below = sorted({wing(t)[1] for n in names for t in edges[n]} - {prefix})
        print(f"  {rank:2d} {prefix:24s} {len(names):3d} modules {lines:6d} lines  -> {', '.join(below) or '-'}")
    print(f"web wing: {web_wing_lines()} lines (at most {WEB_WING_MAX_LINES})")
    print("arrows up:", upward(edges) or "none")
    print("circles:", circles(edges) or "none")


if __name__ == "__main__":
    main()
