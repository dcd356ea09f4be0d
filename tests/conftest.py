"""Shared pytest configuration for accelstats.

Sections (add new fixtures to the matching one):

* markers: ``@pytest.mark.root`` tests need root and real cgroups (runc containers).  They skip
  with the reason when the host cannot run them, except under ``CI=true`` where they fail: CI must
  never go green because an install step went missing.
* paths: ``repo_root``, ``shared_dir`` (``$ACCELSTATS_SHARED`` or ``<repo>/../shared``),
  ``fixtures_dir``.
* containers: ``runc_container``, a factory that starts ``runc_harness.ContainerSpec``s and stops
  and removes every container it started at teardown.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.paths import find_shared
from support.runc_harness import ContainerSpec, RuncContainer, RuncFactory, runc_available
from support.tls_pki import Pki, make_pki, openssl_missing

REPO_ROOT = Path(__file__).resolve().parents[1]

# The replay's call-counting [[fault]] tables are test support: every replay opened by the tests hands
# them to tests/support/replay_faults.py, registered in-process (collectors.replay.lib.register_extension):
# here for this process, and by tests/support/site/sitecustomize.py (Python's start-up hook, first on the
# PYTHONPATH every subprocess inherits) in each process the tests start that opens a replay.
SITE_DIR = REPO_ROOT / "tests" / "support" / "site"
if str(SITE_DIR) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])
import support.replay_faults  # noqa: E402

support.replay_faults.register()


def in_ci() -> bool:
    """True when running under CI (``CI=true``), where nothing may be skipped for lack of setup."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


# --------------------------------------------------------------------------------------------
# markers


@functools.cache
def _runc_unavailable_reason() -> str | None:
    return runc_available()


def require_tool(name: str, package: str) -> str:
    """The path of the command ``name``; skips the test without it, and fails under ``CI=true``, where
    ``.ci/run`` must have installed Debian's ``package``."""
    path = shutil.which(name)
    if path is None:
        if in_ci():
            pytest.fail(f"{name} missing under CI=true: .ci/run must install Debian's {package}", pytrace=False)
        pytest.skip(f"{name} (Debian package {package}) not installed")
    return path


def require_runc() -> None:
    """Skip (or, under CI, fail) the current test if runc containers cannot be started here."""
    reason = _runc_unavailable_reason()
    if reason is None:
        return
    if in_ci():
        pytest.fail(f"root test cannot run under CI=true: {reason}", pytrace=False)
    pytest.skip(reason)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "root: needs root and real cgroups (runc containers); must not skip under CI=true"
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("root") is not None:
        require_runc()


# --------------------------------------------------------------------------------------------
# paths


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root (the directory holding ``pyproject.toml``)."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The read-only shared folder: ``$ACCELSTATS_SHARED``, else ``../shared`` from the repo root, else
    the copies in ``tests/shared`` (see ``tests/support/paths.py``)."""
    path = find_shared()
    if not path.is_dir():
        pytest.fail(f"shared folder {path} not found (set ACCELSTATS_SHARED)", pytrace=False)
    return path


@pytest.fixture(scope="session")
def fixtures_dir(shared_dir: Path) -> Path:
    """``<shared>/fixtures``: captures from real hosts."""
    return shared_dir / "fixtures"


# --------------------------------------------------------------------------------------------
# containers


@pytest.fixture
def runc_state_root() -> Iterator[Path]:
    """A private runc ``--root`` for one test (``runc_harness.runc_list`` reads it)."""
    path = Path(tempfile.mkdtemp(prefix="accelstats-runc-state-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def runc_container(runc_state_root: Path) -> Iterator[RuncFactory]:
    """Factory: ``runc_container(spec)`` starts a container and returns the running RuncContainer.

    Every container started through it is stopped and its cgroups and bundle removed at teardown,
    whatever the test did.  Skips (fails under CI) where runc containers cannot run.
    """
    require_runc()
    with contextlib.ExitStack() as stack:

        def start(spec: ContainerSpec) -> RuncContainer:
            return stack.enter_context(RuncContainer(spec, runc_state_root))

        yield start


# --------------------------------------------------------------------------------------------
# TLS


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A CA, server, client and rogue certificate (tests/support/tls_pki.py), made once per module; skips
    without ``openssl``, and fails under ``CI=true`` where .ci/run must have installed it."""
    reason = openssl_missing()
    if reason:
        if in_ci():
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return make_pki(tmp_path_factory.mktemp("pki"))
