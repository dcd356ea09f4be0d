"""The exporter's HTTP server as the kernel sees it."""

from __future__ import annotations

import subprocess
from pathlib import Path

from conftest import require_tool

from accelstats.manager import AcceleratorManager
from accelstats.settings import Settings
from accelstats.web.server import serve


def test_listen_backlog_holds_a_burst_of_scrapers(tmp_path: Path) -> None:
    """``ss -ltn`` shows a listening socket's backlog as Send-Q. socketserver's default, 5, dropped SYNs
    when 50 scrapers connected at once (benchmarks/load.py); the backlog must hold such a burst."""
    ss = require_tool("ss", "iproute2")
    manager = AcceleratorManager(Settings(cgroup_root=tmp_path, proc_root=tmp_path, collectors=()))
    manager.setup()
    server, _ = serve(manager, "127.0.0.1", 0)
    try:
        port = server.server_address[1]
        out = subprocess.run([ss, "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
        (line,) = out.splitlines()
        backlog = int(line.split()[2])  # State Recv-Q Send-Q Local Peer
        assert backlog >= 128, line
    finally:
        server.shutdown()
        server.server_close()
        manager.destroy(timeout=0.5)
        manager.close()


def test_scrapes_sharing_a_collection_share_one_encoded_body(tmp_path: Path, fixtures_dir: Path) -> None:
    """Concurrent scrapes get one collection (AcceleratorManager.collect); the body is encoded once per
    collection and format, gzip on request, OpenMetrics when asked for."""
    import gzip

    from prometheus_client.parser import text_string_to_metric_families

    from accelstats.web.app import SharedExposition
    from collectors.replay.lib import open_replay

    manager = AcceleratorManager(Settings(cgroup_root=tmp_path, proc_root=tmp_path, collectors=("nvidia",)),
                                 open_replay(fixtures_dir / "h200" / "nvidia-smi-q.xml"))
    manager.setup()
    try:
        first = manager.collect()
        collections = iter([first, first, first, first, manager.collect()])
        manager.collect = lambda: next(collections)  # type: ignore[method-assign]
        shared = SharedExposition(manager)
        plain, headers = shared.body("", "")
        assert dict(headers)["Content-Type"].startswith("text/plain; version=")
        assert "Content-Encoding" not in dict(headers)
        names = {f.name for f in text_string_to_metric_families(plain.decode())}
        assert {"accelstats_gpu_info", "accelstats_gpu_up", "accelstats_gpu_power_watts"} <= names
        zipped, headers = shared.body("", "gzip")
        assert dict(headers)["Content-Encoding"] == "gzip" and gzip.decompress(zipped) == plain
        openmetrics, headers = shared.body("application/openmetrics-text; version=1.0.0", "")
        assert dict(headers)["Content-Type"].startswith("application/openmetrics-text")
        assert openmetrics.endswith(b"# EOF\n")
        assert shared.body("", "")[0] is plain  # the same collection: the same bytes, not encoded again
        assert shared.encodings == 2  # text once, OpenMetrics once, for four scrapes
        shared.body("", "")  # a newer collection is encoded anew
        assert shared.encodings == 3
    finally:
        manager.destroy(timeout=0.5)
        manager.close()


def test_the_exporter_serves_what_every_exporter_has(tmp_path: Path) -> None:
    """process_* and python_* families (client_python's process, platform and GC collectors, read per
    scrape) and the answers written, by status code."""
    import urllib.error
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    manager = AcceleratorManager(Settings(cgroup_root=tmp_path, proc_root=tmp_path, collectors=()))
    manager.setup()
    server, _ = serve(manager, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        urllib.request.urlopen(f"{url}/metrics", timeout=10).read()
        for _ in range(2):
            try:
                urllib.request.urlopen(f"{url}/no-such-page", timeout=10)
            except urllib.error.HTTPError as exc:
                assert exc.code == 404
        body = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    finally:
        server.shutdown()
        server.server_close()
        manager.destroy(timeout=0.5)
        manager.close()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(body) for s in f.samples}
    assert samples[("accelstats_http_requests_total", (("code", "200"),))] == 1.0  # this answer not yet
    assert samples[("accelstats_http_requests_total", (("code", "404"),))] == 2.0
    names = {name for name, _ in samples}
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds", "python_info",
            "python_gc_objects_collected_total"} <= names
