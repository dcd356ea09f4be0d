"""Helpers of the fault matrix (tests/test_fault_matrix*.py): the two surfaces, served for real.

* :class:`Exporter`: an ``AcceleratorManager`` served by :func:`accelstats.web.server.serve` on a free
  loopback port; :meth:`Exporter.scrape` is an HTTP GET of ``/metrics``, timed and parsed.
* :func:`serve_subprocess`: ``python3 -m accelstats serve`` as a child process (optionally as
  another user), waited for until ``/healthz`` answers.
* :class:`Plugin`: the Nomad plugin's :class:`~accelstats.nomad.plugin.DevicePluginState`, configured
  with the go-cty msgpack bytes a Nomad client sends (SetConfig); Fingerprint and Stats are built by
  the same functions the gRPC servicers call.
* :func:`eight_h200`: a scenario of eight H200s from the real capture.
* :class:`HeldHang` and :class:`ReplayClock`: a replay's ``sleep`` and ``clock`` (both injectable,
  :class:`~collectors.replay.state.ReplayState`): a ``hang_seconds = HELD`` fault hangs until the test
  releases it, and the replay's clock moves when the test moves it; no test races a timer. Also used
  by tests/collectors/test_nvidia_backend.py and tests/collectors/test_pcie_sampler.py.
* :func:`live_threads` / :func:`assert_no_new_threads`: thread leaks by thread identity, not by name.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence, Set
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import timestamp_pb2
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from accelstats.manager import AcceleratorManager
from accelstats.nomad import config as plugin_config
from accelstats.nomad import devices
from accelstats.nomad.plugin import DevicePluginState
from accelstats.nomad.proto import device_pb2, hclspec_pb2, structs_pb2
from accelstats.settings import Settings
from accelstats.web.server import serve
from collectors.nvidia import NvidiaBackend
from collectors.replay.lib import open_replay
from collectors.replay.state import ReplayState
from support.nomadclient.ctymsgpack import encode_for_spec
from support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
H200_UUID = "GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c10"


def uuid_of(i: int) -> str:
    """The UUID of GPU ``i`` in :func:`eight_h200` (the capture's, last two digits 10 + i)."""
    return H200_UUID[:-2] + f"{10 + i:02d}"


def eight_h200(tmp_path: Path, capture: Path, extra: str = "", count: int = 8) -> Path:
    """``count`` H200s from ``capture`` (NVML index = minor = i, distinct UUIDs and bus ids), then
    ``extra`` TOML (faults, processes); returns the scenario's path."""
    text = "".join(f'[[gpu]]\ncapture = "{capture}"\nminor = {i}\nuuid = "{uuid_of(i)}"\n'
                   f'pci_bus_id = "00000000:00:{6 + i:02X}.0"\n' for i in range(count))
    path = tmp_path / "scenario.toml"
    path.write_text(text + extra)
    return path


@dataclass
class Scrape:
    """One GET of /metrics: how long it took and the samples by family name."""

    seconds: float
    families: dict[str, list[Sample]]

    def values(self, family: str, label: str) -> dict[str, float]:
        """``{label value: sample value}`` of ``family`` (e.g. ``gpu_up`` by ``uuid``)."""
        return {s.labels[label]: s.value for s in self.families.get(family, [])}

    def value(self, family: str, **labels: str) -> float | None:
        """The one sample of ``family`` whose labels include ``labels``, or None."""
        found = [s.value for s in self.families.get(family, [])
                 if all(s.labels.get(k) == v for k, v in labels.items())]
        assert len(found) <= 1, (family, labels, found)
        return found[0] if found else None


def scrape(url: str, timeout: float = 30.0) -> Scrape:
    """GET ``url`` (a /metrics), timed; parsed with prometheus_client's parser (counters lose
    ``_total`` in the family name, as the parser names them)."""
    t0 = time.monotonic()
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body = r.read().decode()
    seconds = time.monotonic() - t0
    return Scrape(seconds, {f.name: list(f.samples) for f in text_string_to_metric_families(body)})


class Exporter:
    """``AcceleratorManager(settings, nvml)`` served on 127.0.0.1 (a free port) by the exporter's
    HTTP server; use as a context manager (stops the server, destroys and closes the manager)."""

    def __init__(self, settings: Settings, nvml: Any) -> None:
        self.manager = AcceleratorManager(settings, nvml)

    def __enter__(self) -> Exporter:
        self.manager.setup()
        self.server, self.thread = serve(self.manager, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.server_port}/metrics"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.manager.destroy(timeout=0.5)
        self.manager.close()

    def scrape(self) -> Scrape:
        """One timed GET of /metrics."""
        return scrape(self.url)

    @property
    def backend(self) -> NvidiaBackend:
        """The manager's NVIDIA collector."""
        return next(c for c in self.manager.collectors if isinstance(c, NvidiaBackend))


def replay_exporter(tmp_path: Path, scenario: Path, *, replay: dict[str, Any] | None = None,
                    **settings: Any) -> Exporter:
    """An :class:`Exporter` over the replay of ``scenario`` on an empty cgroup tree and /proc;
    ``replay``: keyword arguments of :class:`ReplayState` (``clock``, ``sleep``)."""
    s = Settings(nvml_replay=scenario, cgroup_root=tmp_path / "cgroup", proc_root=tmp_path / "proc", **settings)
    return Exporter(s, open_replay(scenario, **(replay or {})))



def wait_healthy(proc: subprocess.Popen[bytes], port: int, log: Path, timeout: float) -> None:
    """Return once ``accelstats serve`` (``proc``, logging to ``log``) answers /healthz on ``port``;
    AssertionError with the log's end when it exits first, the last URLError after ``timeout`` s."""
    end = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"accelstats serve exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5):
                return
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > end:
                raise
            time.sleep(0.1)


@contextmanager
def serve_subprocess(args: Sequence[str], log: Path, *, prefix: Sequence[str] = (), timeout: float = 60.0
                     ) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``[*prefix, python3, -m, accelstats, serve, --listen 127.0.0.1:<port>, *args]`` (stdout and
    stderr to the file ``log``) until ``/healthz`` answers; yields (process, /metrics URL); SIGTERM
    and wait at the end."""
    port = free_port()
    cmd = [*prefix, sys.executable, "-m", "accelstats", "serve", "--listen", f"127.0.0.1:{port}", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd="/", env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, port, log, timeout)
        yield proc, f"http://127.0.0.1:{port}/metrics"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Plugin:
    """The plugin's state after a SetConfig of ``cfg`` (a Nomad ``config`` block as a dict).

    ``replay``: keyword arguments (``clock``, ``sleep``) for the :class:`ReplayState` the plugin
    builds from ``cfg["nvml_replay"]``; the plugin has no way to pass them, so ``ReplayState.from_path``
    adds them while SetConfig runs (and only then)."""

    def __init__(self, cfg: dict[str, Any], *, replay: dict[str, Any] | None = None) -> None:
        self.state = DevicePluginState(threading.Event())
        data = encode_for_spec(plugin_config.schema(hclspec_pb2), cfg)
        if not replay:
            self.state.set_config(data)
            return
        original = vars(ReplayState)["from_path"]

        def from_path(cls: type[ReplayState], path: str | Path, **kwargs: Any) -> ReplayState:
            return original.__func__(cls, path, **{**replay, **kwargs})  # type: ignore[no-any-return]

        ReplayState.from_path = classmethod(from_path)  # type: ignore[method-assign, assignment]
        try:
            self.state.set_config(data)
        finally:
            ReplayState.from_path = original  # type: ignore[method-assign]

    def __enter__(self) -> Plugin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.state.stop.set()
        self.state.close()
        if self.state.manager is not None:
            self.state.manager.close()

    @property
    def backend(self) -> NvidiaBackend:
        """The NVIDIA collector of the plugin's manager (the plugin has no retry-interval setting:
        tests shorten ``retry_interval`` here)."""
        assert self.state.manager is not None
        return next(c for c in self.state.manager.collectors if isinstance(c, NvidiaBackend))

    def fingerprint(self) -> dict[str, tuple[bool, str]]:
        """A Fingerprint from a fresh collection: ``{device ID: (healthy, health description)}``."""
        snap = self.state.fingerprint()
        return {d.ID: (d.healthy, d.health_description) for g in snap.groups for d in g.devices}

    def collection(self) -> Any:
        """The manager's latest collection (:class:`accelstats.manager.Collection`): what the last
        Fingerprint or Stats was built from."""
        assert self.state.manager is not None and self.state.manager.latest is not None
        return self.state.manager.latest

    def stats(self, collection: Any = None) -> dict[str, Any]:
        """A StatsResponse from ``collection`` (default: a fresh one): ``{device ID: DeviceStats}``."""
        collection = collection if collection is not None else self.state.collect()
        assert collection is not None
        ts = timestamp_pb2.Timestamp()
        ts.GetCurrentTime()
        response = devices.stats(device_pb2, structs_pb2, collection, self.state.snapshot, ts)
        return {i: s for g in response.groups for i, s in g.instance_stats.items()}


def gpu_utilization(stats: Any) -> str:
    """A GPU's "GPU utilization" stat as text: the percentage, or "N/A"."""
    attr = stats.stats.attributes["GPU utilization"]
    return attr.string_val.value if attr.HasField("string_val") else str(attr.int_numerator_val.value)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, step: float = 0.05) -> None:
    """Poll ``predicate`` until true; AssertionError after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"not true within {timeout}s")
        time.sleep(step)


def live_threads() -> frozenset[threading.Thread]:
    """The live threads, as objects: a thread that started later is never one of them, even when it
    has the same name or the operating system reuses an ended thread's ident."""
    return frozenset(threading.enumerate())


def assert_no_new_threads(before: Set[threading.Thread], timeout: float = 10.0) -> None:
    """Wait up to ``timeout`` seconds until every live thread is one of ``before`` (the HTTP server's
    per-request threads end a moment after their answer); AssertionError naming the new ones
    otherwise. Threads of ``before`` that ended meanwhile do not matter."""
    end = time.monotonic() + timeout
    while True:
        new = sorted(t.name for t in threading.enumerate() if t not in before)
        if not new:
            return
        if time.monotonic() > end:
            raise AssertionError(f"threads started and still alive after {timeout}s: {new}")
        time.sleep(0.05)


HELD = 3600.0  # hang_seconds that HeldHang holds until released (any other duration is slept for real)


class HeldHang:
    """A ``sleep`` for :class:`ReplayState` (``sleep=hang.sleep``) under which a scenario fault with
    ``hang_seconds = HELD`` blocks until :meth:`release`: the test, not a timer, decides when the hung
    call returns. Other durations (the event wait's slices of at most 50 ms) are slept for real.

    ``entered`` / ``returned``: hung calls begun / ended so far. Use as a context manager: leaving it
    releases every hung call (a failed test leaves no thread blocked for an hour)."""

    def __init__(self) -> None:
        self._released = threading.Event()
        self._lock = threading.Lock()
        self.entered = 0
        self.returned = 0

    def __enter__(self) -> HeldHang:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def sleep(self, seconds: float) -> None:
        """The replay's sleep: ``HELD`` seconds wait for :meth:`release`, anything else is ``time.sleep``."""
        if seconds != HELD:
            time.sleep(seconds)
            return
        with self._lock:
            self.entered += 1
        try:
            self._released.wait(HELD)
        finally:
            with self._lock:
                self.returned += 1

    @property
    def in_progress(self) -> int:
        """Hung calls that have begun and not returned."""
        with self._lock:
            return self.entered - self.returned

    def release(self) -> None:
        """Let every hung call (and every later one) return."""
        self._released.set()


class ReplayClock:
    """A replay ``clock`` (seconds since the epoch): the wall clock plus what :meth:`advance` added.
    The replay's energy counter grows with it (power x seconds), so a GPU read anew after an advance
    has more energy, and one whose last reading is repeated has the same."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` forward."""
        self.offset += seconds


def plugin_binary() -> str:
    """The ``nomad-device-accelstats`` console script pip installed next to this interpreter (or on PATH)."""
    beside = Path(sys.executable).parent / "nomad-device-accelstats"
    found = str(beside) if beside.exists() else shutil.which("nomad-device-accelstats")
    assert found, "nomad-device-accelstats is not installed (pip install .)"
    return found
