"""Real docker, podman and containerd for the tests, each with its state under a temporary directory.

No image registry is reachable, so each runtime gets a one-layer image made from Debian's static
busybox (``busybox-static``): ``docker import`` and ``podman import`` of a root-filesystem tar, and
``ctr image import`` of a docker-archive built here.  Fake GPU device nodes (``mknod c 195 N``) are
passed with ``--device``: the kernel only needs the rule in the devices cgroup, not a driver.

* :class:`Docker` starts ``dockerd`` (Debian's ``docker.io``) with ``--data-root``, ``--exec-root``
  and its socket in the directory, no bridge and no iptables, the cgroupfs driver; its client is
  Debian's ``/usr/bin/docker`` (a newer client elsewhere on ``PATH`` may not speak the daemon's API).
* :class:`Podman` runs ``podman`` with ``--root``/``--runroot`` (graphroot/runroot) there, the
  cgroupfs manager, runc, file events, no network, and a ``containers.conf`` whose default ulimits
  fit this sandbox (podman's defaults raise ``RLIMIT_NPROC``, which needs ``CAP_SYS_RESOURCE``).
* :class:`Containerd` starts ``containerd`` with ``root``, ``state`` and its socket there; ``ctr``
  talks to it.

Each is a context manager; leaving it removes every container it started, stops the daemon,
unmounts whatever it left mounted under its directory, removes the cgroup directories it created
(empty ones only, never one that existed before) and deletes the directory.  ``unavailable()`` says
why a runtime cannot run here, for a skip (or, under ``CI=true``, a failure).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import secrets
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from support.runc_harness import BUSYBOX, _cgroup_registry, cgroup_mounts

IMAGE = "localhost/accelstats-busybox:latest"
APPLETS = ("sh", "sleep", "cat", "ls", "true")
_TIMEOUT = 60.0


class RuntimeCommandError(RuntimeError):
    """A runtime command failed; the message holds its output."""


def docker_client() -> str | None:
    """Debian's docker client (``/usr/bin/docker``), which matches Debian's ``dockerd``."""
    return "/usr/bin/docker" if os.access("/usr/bin/docker", os.X_OK) else shutil.which("docker")


def _missing(*binaries: str) -> str | None:
    if os.geteuid() != 0:
        return "not root: container runtimes need root"
    for name in binaries:
        if shutil.which(name) is None:
            return f"{name} not found (apt-get install docker.io podman containerd runc)"
    if not BUSYBOX.is_file():
        return f"{BUSYBOX} missing (apt-get install busybox-static)"
    return None


def rootfs_tar() -> bytes:
    """A root filesystem tar: static busybox as ``/bin/busybox`` with applet links, and ``/dev``,
    ``/proc``, ``/sys``, ``/tmp`` directories."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in ("bin", "dev", "proc", "sys", "tmp", "etc"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        tar.add(str(BUSYBOX), arcname="bin/busybox")
        for applet in APPLETS:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
    return buf.getvalue()


def docker_archive(tag: str) -> bytes:
    """A ``docker save``-format archive of the busybox root filesystem, tagged ``tag`` (what ``ctr
    image import`` reads)."""
    layer = rootfs_tar()
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Cmd": ["sh"]},
                         "rootfs": {"type": "layers", "diff_ids": [diff_id]}}).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    layer_dir = hashlib.sha256(layer).hexdigest()
    manifest = json.dumps([{"Config": config_name, "RepoTags": [tag], "Layers": [f"{layer_dir}/layer.tar"]}]).encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in ((f"{layer_dir}/layer.tar", layer), (config_name, config), ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def make_gpu_nodes(directory: Path, minors: Sequence[int]) -> dict[int, Path]:
    """Char device nodes ``nvidia<N>`` (195:N) and ``nvidiactl`` (195:255) in ``directory``."""
    out = {}
    for minor in [*minors, 255]:
        path = directory / ("nvidiactl" if minor == 255 else f"nvidia{minor}")
        if not path.exists():
            os.mknod(path, 0o666 | 0o020000, os.makedev(195, minor))
        out[minor] = path
    return out


def _run(cmd: Sequence[str], *, env: dict[str, str] | None = None, input_: bytes | None = None,
         timeout: float = _TIMEOUT) -> str:
    proc = subprocess.run(list(cmd), input=input_, capture_output=True, timeout=timeout, check=False,
                          env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise RuntimeCommandError(f"{' '.join(cmd[:6])} … failed ({proc.returncode}): "
                            f"{proc.stderr.decode(errors='replace').strip()[-2000:]}")
    return proc.stdout.decode(errors="replace").strip()


def _wait(check: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        try:
            if check():
                return
        except (OSError, RuntimeCommandError, subprocess.SubprocessError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeCommandError(f"timed out waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.25)


class _Runtime:
    """Shared parts: the temporary directory, cgroup bookkeeping, cleanup."""

    name = "runtime"

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"accelstats-{self.name}-"))
        self._cgroups_before = self._cgroup_tops()
        self._proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def _cgroup_tops() -> set[Path]:
        out: set[Path] = set()
        for m in cgroup_mounts():
            with contextlib.suppress(OSError):
                out.update(p for p in m.mountpoint.iterdir() if p.is_dir())
        return out

    def __enter__(self) -> Any:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def start(self) -> None:
        raise NotImplementedError

    def stop_containers(self) -> None:
        raise NotImplementedError

    def _daemon(self, cmd: Sequence[str], log_name: str) -> None:
        with open(self.dir / log_name, "wb") as log:
            self._proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                          start_new_session=True)

    def log_tail(self, log_name: str) -> str:
        with contextlib.suppress(OSError):
            return (self.dir / log_name).read_text(errors="replace")[-3000:]
        return ""

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stop_containers()
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(timeout=15)
        self._unmount_below()
        self._remove_new_cgroups()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _unmount_below(self) -> None:
        prefix = str(self.dir) + "/"
        points = []
        with contextlib.suppress(OSError):
            for line in Path("/proc/self/mountinfo").read_text().splitlines():
                point = line.split()[4].encode().decode("unicode_escape")
                if point.startswith(prefix):
                    points.append(point)
        for point in sorted(points, key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)

    def _remove_new_cgroups(self) -> None:
        """rmdir (leaf first) the empty cgroup directories under the top-level ones this runtime
        created; directories that existed before are never touched, nor the tests' own ``accelstats-*``
        cgroups, which a test running beside this one may have made meanwhile and removes itself (a CI
        run lost a fault-matrix test's cgroup tree this way)."""
        with _cgroup_registry():
            made = {top for top in self._cgroup_tops() - self._cgroups_before if not top.name.startswith("accelstats-")}
            for top in sorted(made):
                # bottom-up; a directory another test's runtime removes meanwhile is skipped, not an error
                for parent, subdirs, _ in os.walk(top, topdown=False):
                    for name in subdirs:
                        with contextlib.suppress(OSError):
                            os.rmdir(os.path.join(parent, name))
                with contextlib.suppress(OSError):
                    top.rmdir()


class Docker(_Runtime):
    """``dockerd`` with its state in a temporary directory (:attr:`data_root`)."""

    name = "docker"

    @staticmethod
    def unavailable() -> str | None:
        """Why dockerd cannot run here, or None."""
        return _missing("dockerd", "containerd", "runc") or (None if docker_client() else "docker client missing")

    @property
    def data_root(self) -> Path:
        return self.dir / "data"

    def docker(self, *args: str, input_: bytes | None = None, env: dict[str, str] | None = None,
               timeout: float = _TIMEOUT) -> str:
        """``docker -H <this daemon> <args>``: its standard output; raises RuntimeCommandError on failure.
        ``env``: added to the client's environment (``DOCKER_BUILDKIT``); ``timeout`` in seconds."""
        client = docker_client()
        assert client is not None
        return _run([client, "-H", f"unix://{self.dir / 'docker.sock'}", *args], input_=input_, env=env,
                    timeout=timeout)

    def start(self) -> None:
        self._daemon(["dockerd", "--data-root", str(self.data_root), "--exec-root", str(self.dir / "exec"),
                      "--pidfile", str(self.dir / "docker.pid"), "-H", f"unix://{self.dir / 'docker.sock'}",
                      "--bridge=none", "--iptables=false", "--ip6tables=false", "--ip-masq=false",
                      "--exec-opt", "native.cgroupdriver=cgroupfs", "--storage-driver", "overlay2"], "dockerd.log")

        def up() -> bool:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise AssertionError(f"dockerd exited ({self._proc.returncode}): {self.log_tail('dockerd.log')}")
            self.docker("version")
            return True

        try:
            _wait(up, "dockerd to answer")
        except AssertionError as exc:
            raise RuntimeCommandError(str(exc)) from exc
        self.docker("import", "-", IMAGE, input_=rootfs_tar())

    def run(self, *args: str, name: str | None = None) -> dict[str, Any]:
        """``docker run -d --network none [--name name] <args> IMAGE sleep 600``; the container's
        ``docker inspect``."""
        cid = self.docker("run", "-d", "--network", "none", *(("--name", name) if name else ()), *args,
                          IMAGE, "sleep", "600")
        info: dict[str, Any] = json.loads(self.docker("inspect", cid))[0]
        return info

    def remove(self, cid: str) -> None:
        self.docker("rm", "-f", cid)

    def stop_containers(self) -> None:
        ids = self.docker("ps", "-aq").split()
        if ids:
            self.docker("rm", "-f", *ids)


class Podman(_Runtime):
    """``podman`` with graphroot, runroot and a ``containers.conf`` in a temporary directory."""

    name = "podman"

    def __init__(self, storage_driver: str = "overlay") -> None:
        super().__init__()
        self.storage_driver = storage_driver

    @staticmethod
    def unavailable() -> str | None:
        """Why podman cannot run here, or None."""
        return _missing("podman", "conmon", "runc")

    @property
    def graphroot(self) -> Path:
        return self.dir / "graphroot"

    @property
    def runroot(self) -> Path:
        return self.dir / "runroot"

    def podman(self, *args: str, input_: bytes | None = None) -> str:
        return _run(["podman", "--root", str(self.graphroot), "--runroot", str(self.runroot),
                     "--storage-driver", self.storage_driver, "--cgroup-manager", "cgroupfs",
                     "--events-backend", "file", "--runtime", "runc", "--tmpdir", str(self.dir / "tmp"), *args],
                    env={"CONTAINERS_CONF": str(self.dir / "containers.conf")}, input_=input_)

    def start(self) -> None:
        (self.dir / "containers.conf").write_text(
            '[containers]\ndefault_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]\n')
        self.podman("import", "-", IMAGE, input_=rootfs_tar())

    def run(self, *args: str, name: str | None = None) -> dict[str, Any]:
        """``podman run -d --network none [--name name] <args> IMAGE sleep 600``; its inspect."""
        net = () if "--pod" in args else ("--network", "none")
        cid = self.podman("run", "-d", *net, *(("--name", name) if name else ()), *args, IMAGE, "sleep", "600")
        info: dict[str, Any] = json.loads(self.podman("inspect", cid))[0]
        return info

    def pod(self, name: str) -> str:
        """A pod with an infra container (``podman pod create``'s default); its id."""
        return self.podman("pod", "create", "--name", name, "--network", "none", "--infra-image", IMAGE,
                           "--infra-command", "sleep 600")

    def remove(self, cid: str) -> None:
        self.podman("rm", "-f", cid)

    def stop_containers(self) -> None:
        self.podman("rm", "-af", "-t", "0")
        self.podman("pod", "rm", "-af")


class Containerd(_Runtime):
    """``containerd`` with root, state and socket in a temporary directory; ``ctr`` for containers."""

    name = "containerd"

    @staticmethod
    def unavailable() -> str | None:
        """Why containerd cannot run here, or None."""
        return _missing("containerd", "ctr", "runc")

    @property
    def root(self) -> Path:
        return self.dir / "root"

    @property
    def state(self) -> Path:
        return self.dir / "state"

    def ctr(self, namespace: str, *args: str, input_: bytes | None = None) -> str:
        return _run(["ctr", "-a", str(self.dir / "containerd.sock"), "-n", namespace, *args], input_=input_)

    def start(self) -> None:
        (self.dir / "config.toml").write_text(
            f'version = 2\nroot = "{self.root}"\nstate = "{self.state}"\n'
            f'[grpc]\n  address = "{self.dir / "containerd.sock"}"\n'
            f'[ttrpc]\n  address = "{self.dir / "containerd.sock.ttrpc"}"\n'
            '[plugins."io.containerd.grpc.v1.cri"]\n  disable_cgroup = true\n')
        self._daemon(["containerd", "--config", str(self.dir / "config.toml")], "containerd.log")
        self._namespaces: set[str] = set()

        def up() -> bool:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise AssertionError(f"containerd exited ({self._proc.returncode}): "
                                     f"{self.log_tail('containerd.log')}")
            self.ctr("default", "version")
            return True

        try:
            _wait(up, "containerd to answer")
        except AssertionError as exc:
            raise RuntimeCommandError(str(exc)) from exc

    def run(self, namespace: str, cid: str, *devices: Path, privileged: bool = False,
            annotations: dict[str, str] | None = None) -> int:
        """``ctr -n <namespace> run -d [--device …] [--annotation k=v …] IMAGE <cid> sleep 600``; the task's
        host PID. ``annotations`` land in the OCI spec (the bundle's ``config.json``), where the CRI
        plugin puts a Kubernetes container's names (``io.kubernetes.cri.*``)."""
        if namespace not in self._namespaces:
            self.ctr(namespace, "image", "import", "-", input_=docker_archive(IMAGE))
            self._namespaces.add(namespace)
        flags = [a for d in devices for a in ("--device", str(d))] + (["--privileged"] if privileged else [])
        flags += [a for k, v in (annotations or {}).items() for a in ("--annotation", f"{k}={v}")]
        self.ctr(namespace, "run", "-d", *flags, IMAGE, cid, "sleep", "600")
        for line in self.ctr(namespace, "task", "ls").splitlines()[1:]:
            fields = line.split()
            if fields and fields[0] == cid:
                return int(fields[1])
        raise RuntimeCommandError(f"task {cid} not listed")

    def remove(self, namespace: str, cid: str) -> None:
        with contextlib.suppress(RuntimeCommandError):
            self.ctr(namespace, "task", "kill", "-s", "KILL", cid)
        _wait(lambda: self._task_gone_or_stopped(namespace, cid), f"task {cid} to stop", 15)
        with contextlib.suppress(RuntimeCommandError):
            self.ctr(namespace, "task", "rm", "-f", cid)
        self.ctr(namespace, "container", "rm", cid)

    def _task_gone_or_stopped(self, namespace: str, cid: str) -> bool:
        for line in self.ctr(namespace, "task", "ls").splitlines()[1:]:
            fields = line.split()
            if fields and fields[0] == cid:
                return fields[-1] == "STOPPED"
        return True

    def stop_containers(self) -> None:
        for ns in list(getattr(self, "_namespaces", ())):
            for line in self.ctr(ns, "container", "ls", "-q").splitlines():
                with contextlib.suppress(RuntimeCommandError):
                    self.remove(ns, line.strip())


def token() -> str:
    """A short random suffix for names that must not collide with another test run's."""
    return secrets.token_hex(3)


@contextlib.contextmanager
def gpu_nodes(minors: Sequence[int]) -> Iterator[dict[int, Path]]:
    """Fake NVIDIA device nodes in a temporary directory (removed after)."""
    directory = Path(tempfile.mkdtemp(prefix="accelstats-nodes-"))
    try:
        yield make_gpu_nodes(directory, minors)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
