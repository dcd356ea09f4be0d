"""The shell commands of README.md and docs/*.md, as a reader copies them (tests/core/test_doc_examples.py).

A command is one logical line of a fenced block tagged ``sh``, ``bash``, ``shell`` or ``console``
(in ``console`` only the lines after a ``$ `` prompt), or an indented ``$ `` line outside fences:
continuation lines (a trailing ``\\``) joined with one space, a leading ``$ `` removed, blank
lines and whole-line ``#`` comments dropped. Every fence must name its language, so that a command
cannot hide in an untagged block: :func:`untagged_fences` lists the ones that do not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SHELL_LANGS = frozenset({"sh", "bash", "shell", "console"})
FENCE = re.compile(r"^\s*```(\S*)")
INDENTED_PROMPT = re.compile(r"^\s+\$ (.*)$")


@dataclass(frozen=True)
class DocCommand:
    """One command: ``doc`` relative to the repository (``docs/fuzzing.md``), ``line`` 1-based (where
    it starts), ``text`` as run by ``bash -c``."""

    doc: str
    line: int
    text: str

    @property
    def where(self) -> str:
        """``doc:line``, the test id."""
        return f"{self.doc}:{self.line}"


@dataclass(frozen=True)
class Fence:
    """A fenced block: its opening ``line`` (1-based), ``lang`` ("" when untagged) and body lines."""

    doc: str
    line: int
    lang: str
    body: tuple[str, ...]


def doc_files(root: Path) -> list[Path]:
    """README.md and docs/*.md under ``root``, in that order."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def fences(root: Path, doc: Path) -> tuple[list[Fence], list[tuple[int, str]]]:
    """The fenced blocks of ``doc`` and its indented ``$ `` lines outside them ((line, command)).
    Raises ValueError naming the line for a fence that is never closed."""
    rel = doc.relative_to(root).as_posix()
    found: list[Fence] = []
    prompts: list[tuple[int, str]] = []
    opened: tuple[int, str] | None = None
    body: list[str] = []
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        match = FENCE.match(line)
        if match and opened is None:
            opened, body = (number, match.group(1)), []
        elif match and opened is not None:
            found.append(Fence(rel, opened[0], opened[1], tuple(body)))
            opened = None
        elif opened is not None:
            body.append(line)
        elif prompt := INDENTED_PROMPT.match(line):
            prompts.append((number, prompt.group(1)))
    if opened is not None:
        raise ValueError(f"{rel}:{opened[0]}: fenced block never closed")
    return found, prompts


def _logical_lines(first: int, lines: list[str], console: bool) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for offset, raw in enumerate(lines):
        number = first + offset
        if pending is not None:
            text = pending[1] + " " + raw.strip()
            start = pending[0]
        else:
            stripped = raw.strip()
            if console:
                if not stripped.startswith("$ "):
                    continue  # output
                stripped = stripped[2:]
            elif stripped.startswith("$ "):
                stripped = stripped[2:]
            if not stripped or stripped.startswith("#"):
                continue
            text, start = stripped, number
        if text.endswith("\\"):
            pending = (start, text[:-1].rstrip())
            continue
        pending = None
        out.append((start, text))
    if pending is not None:
        out.append(pending)
    return out


def commands(root: Path) -> list[DocCommand]:
    """Every shell command of README.md and docs/*.md under ``root``, in document order."""
    out: list[DocCommand] = []
    for doc in doc_files(root):
        blocks, prompts = fences(root, doc)
        rel = doc.relative_to(root).as_posix()
        for block in blocks:
            if block.lang in SHELL_LANGS:
                lines = _logical_lines(block.line + 1, list(block.body), console=block.lang == "console")
                out.extend(DocCommand(rel, number, text) for number, text in lines)
        out.extend(DocCommand(rel, number, text) for number, text in prompts)
    return sorted(out, key=lambda c: (c.doc != "README.md", c.doc, c.line))


def untagged_fences(root: Path) -> list[str]:
    """``doc:line`` of every fenced block in README.md and docs/*.md that names no language."""
    return [f"{f.doc}:{f.line}" for doc in doc_files(root) for f in fences(root, doc)[0] if not f.lang]
