"""The exporter's HTTP server as the kernel sees it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from accelstats.config import Settings
from accelstats.exporter import serve
from accelstats.manager import AcceleratorManager


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_listen_backlog_holds_a_burst_of_scrapers(tmp_path: Path) -> None:
    """``ss -ltn`` shows a listening socket's backlog as Send-Q. socketserver's default, 5, dropped SYNs
    when 50 scrapers connected at once (benchmarks/load.py); the backlog must hold such a burst."""
    manager = AcceleratorManager(Settings(cgroup_root=tmp_path, proc_root=tmp_path, collectors=()))
    manager.setup()
    server, _ = serve(manager, "127.0.0.1", 0)
    try:
        port = server.server_address[1]
        out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
        (line,) = out.splitlines()
        backlog = int(line.split()[2])  # State Recv-Q Send-Q Local Peer
        assert backlog >= 128, line
    finally:
        server.shutdown()
        server.server_close()
        manager.destroy(timeout=0.5)
        manager.close()
