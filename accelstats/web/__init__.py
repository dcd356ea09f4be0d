"""The web wing's door, the only names the rest of accelstats imports from it: :func:`serve` (``/metrics``
for ``accelstats serve`` and the Nomad plugin's ``metrics_listen``), :func:`load_web_config` (the
``--web-config`` file, reloaded while serving) and :func:`text_exposition` (``accelstats dump``). Each imports
its module on first use: the web-config stack (PyYAML, bcrypt, cryptography) only with a web config."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from accelstats.manager import AcceleratorManager
    from accelstats.web.server import HTTPServer
    from accelstats.web.source import WebConfigSource


def serve(manager: AcceleratorManager, host: str, port: int,
          web: WebConfigSource | None = None) -> tuple[HTTPServer, threading.Thread]:
    """:func:`accelstats.web.server.serve`: ``/metrics``, ``/healthz`` and ``/`` of ``manager`` on
    ``host:port`` in a daemon thread, ``web`` the web configuration (TLS, basic auth, headers). Returns
    ``(server, thread)``; raises OSError when the address cannot be bound."""
    from accelstats.web.server import serve as start

    return start(manager, host, port, web)


def load_web_config(path: Path) -> WebConfigSource:
    """:class:`accelstats.web.source.WebConfigSource` of ``path``: loaded and checked now, then reloaded
    when the files change. Raises :class:`accelstats.settings.ConfigError` (a ``WebConfigError``) naming
    the file and the key at fault."""
    from accelstats.web.source import WebConfigSource

    return WebConfigSource(path)


def text_exposition(manager: AcceleratorManager) -> bytes:
    """:func:`accelstats.web.exposition.exposition`: one collection as text format 0.0.4."""
    from accelstats.web.exposition import exposition as encode

    return encode(manager)
