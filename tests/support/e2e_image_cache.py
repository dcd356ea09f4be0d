"""The slow inputs of the image test (tests/kubernetes/test_image_e2e.py), made once per machine and cached.

No registry image is reachable from CI, so ``deploy/Dockerfile`` is built on a base made here from
Debian's packages, and the project's pinned runtime dependencies are installed in it from wheels:

* :func:`base_tar`: a root filesystem tar of ``debootstrap --variant=minbase
  --include=python3,python3-venv bookworm`` (Debian's ``debootstrap``, from the host's Debian mirror),
  without documentation, manual pages and apt's lists; ``docker import`` makes it an image
  (the Dockerfile's ``--build-arg BASE=``). About 1-2 minutes to make.
* :func:`dependency_wheels`: a directory of wheels of every pin in ``systemd/constraints.txt``
  (``pip wheel -r``: PyPI or pip's cache), for ``PIP_OPTS="--no-index --find-links /tmp/dist"``.
  Debian bookworm's ``python3`` is 3.11, so the host's interpreter must be 3.11 too (cp311 wheels).

Both live in :data:`CACHE_DIR` (``$ACCELSTATS_E2E_CACHE``, default ``/var/cache/accelstats-e2e``) under
names that carry a digest of what made them (the debootstrap arguments; the constraints file's bytes and
the interpreter's tag), so a changed pin or base is made afresh and a stale entry is never used. Each is
made in a temporary directory beside its final name and renamed into place, under an exclusive
``flock`` on ``<cache>/.lock``, so two test runs on one machine make it once. ``.ci/run`` calls
``python3 tests/support/e2e_image_cache.py`` before the tests; the test calls the same functions and makes
whatever is missing itself (slow, but correct).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

CACHE_DIR = Path(os.environ.get("ACCELSTATS_E2E_CACHE", "/var/cache/accelstats-e2e"))
SUITE = "bookworm"
INCLUDE = ("python3", "python3-venv")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# removed from the rootfs after debootstrap: nothing the image needs, a third of its size
_TRIM = ("usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale", "var/lib/apt/lists",
         "var/cache/apt", "var/cache/debconf/templates.dat-old", "var/log")
_BASE_RECIPE = f"debootstrap --variant=minbase --include={','.join(INCLUDE)} {SUITE}; trim {' '.join(_TRIM)}"


class CacheError(RuntimeError):
    """Making a cache entry failed; the message holds the command's output."""


def _digest(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _run(cmd: list[str], timeout: float) -> None:
    proc = subprocess.run(cmd, capture_output=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        out = (proc.stdout + proc.stderr).decode(errors="replace").strip()[-3000:]
        raise CacheError(f"{' '.join(cmd[:4])} … failed ({proc.returncode}): {out}")


def debian_mirror() -> str:
    """The host's Debian mirror for ``bookworm`` (the first ``URIs:`` of
    ``/etc/apt/sources.list.d/debian.sources`` whose stanza lists the suite, else the first ``deb`` line
    of ``/etc/apt/sources.list`` naming it), else :data:`DEFAULT_MIRROR`: CI reaches only that mirror."""
    with contextlib.suppress(OSError):
        for stanza in Path("/etc/apt/sources.list.d/debian.sources").read_text().split("\n\n"):
            fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", stanza, re.M))
            if SUITE in fields.get("Suites", "").split() and fields.get("URIs"):
                return fields["URIs"].split()[0]
    with contextlib.suppress(OSError):
        for line in Path("/etc/apt/sources.list").read_text().splitlines():
            words = line.split()
            if len(words) >= 3 and words[0] == "deb" and SUITE in words[2:]:
                return next(w for w in words[1:] if not w.startswith("["))
    return DEFAULT_MIRROR


def _unmount_below(directory: Path) -> None:
    """Lazily unmount whatever is mounted under ``directory`` (deepest first): a debootstrap stopped midway
    leaves the target's ``proc`` and ``sys`` mounted, which ``shutil.rmtree`` must never walk into."""
    prefix = str(directory) + "/"
    points = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4].encode().decode("unicode_escape")
            if point.startswith(prefix):
                points.append(point)
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)


def base_tar_path(cache: Path = CACHE_DIR) -> Path:
    """Where :func:`base_tar` keeps the base: ``<cache>/base-bookworm-<digest of the recipe>.tar``."""
    return cache / f"base-{SUITE}-{_digest(_BASE_RECIPE)}.tar"


def base_tar(cache: Path = CACHE_DIR) -> Path:
    """The Debian minbase root filesystem tar with ``python3`` and ``python3-venv``; made (as root, with
    ``debootstrap``, about 1-2 minutes) when not in ``cache``. Raises :class:`CacheError` when
    ``debootstrap`` or ``tar`` fails, ``FileNotFoundError`` without ``debootstrap``."""
    path = base_tar_path(cache)
    if path.is_file():
        return path
    with _locked(cache):
        if path.is_file():
            return path
        debootstrap = shutil.which("debootstrap") or "/usr/sbin/debootstrap"
        if not os.access(debootstrap, os.X_OK):
            raise FileNotFoundError("debootstrap not installed (Debian package debootstrap)")
        work = Path(tempfile.mkdtemp(prefix="base-", dir=cache))
        try:
            rootfs = work / "rootfs"
            _run([debootstrap, "--variant=minbase", f"--include={','.join(INCLUDE)}", SUITE, str(rootfs),
                  debian_mirror()], timeout=900)
            for rel in _TRIM:
                target = rootfs / rel
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                    target.mkdir()
            tmp = work / "base.tar"
            _run(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(tmp), "."], timeout=300)
            os.replace(tmp, path)
        finally:
            _unmount_below(work)
            shutil.rmtree(work, ignore_errors=True)
    return path


def _python_tag() -> str:
    return f"cp{sys.version_info.major}{sys.version_info.minor}-{os.uname().machine}"


def dependency_wheels_path(constraints: Path, cache: Path = CACHE_DIR) -> Path:
    """Where :func:`dependency_wheels` keeps the wheels of ``constraints``: ``<cache>/wheels-<python
    tag>-<digest of the file's bytes>``."""
    return cache / f"wheels-{_python_tag()}-{_digest(constraints.read_bytes())}"


@contextlib.contextmanager
def _pip() -> Iterator[list[str]]:
    """A pip to run: this interpreter's, else one in a throwaway virtual environment, removed after (Debian's
    python3 has no pip of its own; python3-venv brings ensurepip)."""
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, check=False).returncode == 0:
        yield [sys.executable, "-m", "pip"]
        return
    venv = Path(tempfile.mkdtemp(prefix="accelstats-e2e-pip-"))
    try:
        _run([sys.executable, "-m", "venv", str(venv)], timeout=300)
        yield [str(venv / "bin" / "python"), "-m", "pip"]
    finally:
        shutil.rmtree(venv, ignore_errors=True)


def dependency_wheels(constraints: Path, cache: Path = CACHE_DIR) -> Path:
    """A directory holding a wheel of every pin in ``constraints`` (and nothing else); made with ``pip
    wheel`` (PyPI or pip's cache) when not in ``cache``. Raises :class:`CacheError` when pip fails."""
    path = dependency_wheels_path(constraints, cache)
    if path.is_dir():
        return path
    with _locked(cache):
        if path.is_dir():
            return path
        work = Path(tempfile.mkdtemp(prefix="wheels-", dir=cache))
        work.chmod(0o755)
        try:
            with _pip() as pip:
                _run([*pip, "wheel", "-q", "--disable-pip-version-check", "-r", str(constraints), "-w", str(work)],
                     timeout=900)
            os.replace(work, path)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    return path


def main(argv: list[str] | None = None) -> int:
    """``python3 tests/support/e2e_image_cache.py [--cache DIR] [--constraints FILE]``: make both entries
    if missing; prints where they are and how long each took."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--cache", type=Path, default=CACHE_DIR)
    parser.add_argument("--constraints", type=Path,
                        default=Path(__file__).resolve().parents[2] / "systemd" / "constraints.txt")
    args = parser.parse_args(argv)
    for what, make in (("base", lambda: base_tar(args.cache)),
                       ("wheels", lambda: dependency_wheels(args.constraints, args.cache))):
        t0 = time.monotonic()
        path = make()
        print(f"{what}: {path} ({time.monotonic() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
