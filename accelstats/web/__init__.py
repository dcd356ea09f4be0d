"""The /metrics door: :func:`serve`, used by ``accelstats serve`` and the Nomad plugin's ``metrics_listen``."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from accelstats.manager import AcceleratorManager
    from accelstats.web.server import HTTPServer
    from accelstats.web.source import WebConfigSource


def serve(manager: AcceleratorManager, host: str, port: int,
          web: WebConfigSource | None = None) -> tuple[HTTPServer, threading.Thread]:
    """:func:`accelstats.web.server.serve`, imported on first use: ``/metrics``, ``/healthz`` and ``/`` of
    ``manager`` on ``host:port`` in a daemon thread, ``web`` the web configuration (TLS, basic auth,
    headers). Returns ``(server, thread)``; raises OSError when the address cannot be bound."""
    from accelstats.web.server import serve as start

    return start(manager, host, port, web)
