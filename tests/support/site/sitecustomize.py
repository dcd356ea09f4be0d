"""Python's own start-up hook, for the processes the tests start: ``tests/conftest.py`` puts this
folder first on ``PYTHONPATH``, so every Python subprocess (``python -m accelstats …``, the
``nomad-device-accelstats`` console script, xdist workers) imports this module at start-up (site(7):
``sitecustomize``). Test support, never shipped; accelstats itself reads no environment variable for it.

It registers the call-counting fault extension (``tests/support/replay_faults.py``) with the NVML
replay the moment ``collectors.replay.lib`` is imported, and only then: a process that never opens a
replay imports nothing of ``collectors``, and one that does gets the ``collectors`` it would have got
anyway (the installed one for a console script, the checkout's for ``python -m`` run from it: the
``sys.path`` of ``-m`` is not settled yet when this runs, so nothing may be imported here). It then runs
the ``sitecustomize`` this one hides, if there is one (Debian's, for instance).
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

TYPE_CHECKING = False  # every Python the tests start pays for what this imports: not even `typing`
if TYPE_CHECKING:  # importlib.abc alone costs 25 ms (it imports importlib.resources)
    from collections.abc import Sequence
    from importlib.abc import Loader
    from types import ModuleType

_TARGET = "collectors.replay.lib"
_HERE = os.path.dirname(os.path.abspath(__file__))
_TESTS = os.path.dirname(os.path.dirname(_HERE))  # tests/: where `support` is a package


class _RegisterAfterLoading:
    """``loader``, then :func:`support.replay_faults.register` once the module has run."""

    def __init__(self, loader: Loader) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> object:  # get_source, get_filename, … for tracebacks and inspect
        return getattr(self._loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        if _TESTS not in sys.path:
            sys.path.append(_TESTS)  # last: `support` must not hide anything the process imports
        from support import replay_faults

        replay_faults.register()


class _WatchForTheReplay:
    """Finds nothing itself; hands the spec of ``collectors.replay.lib`` the normal path-based finder
    gives to :class:`_RegisterAfterLoading`."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _RegisterAfterLoading(spec.loader)
        return spec


def _run_the_hidden_sitecustomize() -> None:
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    from importlib.util import module_from_spec

    module = module_from_spec(spec)
    spec.loader.exec_module(module)


sys.meta_path.insert(0, _WatchForTheReplay())
_run_the_hidden_sitecustomize()
