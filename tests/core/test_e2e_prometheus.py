"""End to end: a real Prometheus scrapes a running exporter, then every dashboard query and every
alert rule is asked of it.

The exporter (``python3 -m accelstats serve``) runs on the replay of ``tests/scenarios/h200_fleet.toml``
(three H200s: one busy and power-capped with ECC errors, a remapped row and XID 79; one idle with a
refused NVML call; one lost) with the processes of real runc containers on them:

| container | cgroup | GPU processes | attribution |
|---|---|---|---|
| docker ``inference`` | ``/docker/<id>``, devices.list grants 195:0 | GPU 0 (compute) | devices_cgroup |
| docker ``reserved`` | ``/docker/<id>``, devices.list grants 195:1 | none: allocated and idle | devices_cgroup |
| pod ``ml/trainer-0`` (containerd) | ``/kubepods/burstable/pod<uid>/<id>``, privileged | GPU 0 and 1 | process |
| Nomad allocation, task ``web`` | ``/nomad/reserved/<alloc>.web``, privileged | GPU 0 (MPS client) | process |

A stand-in kubelet (``tests/support/kubelet_double.py``, the real pod-resources proto on a unix socket)
allocated GPU 0 to ``ml/trainer-0`` (so its use of GPU 1 is use without allocation, as is every docker
container's) and a DRA claim to ``batch/dra-job``, which a CDI spec in the ``--rootfs`` names as GPU 1;
plus a file-devices directory (one healthy file, one with the unhealthy permissions) and an MPS
control daemon (``tests/support/mps_double``) started by ``accelstats mps start`` with one client, the Nomad
task's process. Names, images and pods come from runtime state files in a temporary ``--rootfs``.

Prometheus (Debian's package, ``tests/support/prom_harness.py``) scrapes every second with the rule files
``prometheus/*.yml`` loaded; after six successful scrapes (rate windows of 1 m then hold several
samples):

* every panel query of ``grafana/dashboards/*.json``, with each template variable at its "All" value
  (``.*``), ``$topn`` at its default and ``$__rate_interval``/``$__range`` = 1m, must parse, evaluate
  and return at least one series;
* every template variable's ``label_values(...)`` query must find at least one non-empty value;
* every rule of ``prometheus/*.yml`` must load, evaluate without error, and parse and evaluate
  through the query API.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import in_ci, require_runc
from support.dashboards import FILES, load, panels
from support.kubelet_double import kubelet_process
from support.ports import free_port
from support.prom_harness import PrometheusServer, ScrapeTarget, prometheus_unavailable
from support.runc_harness import ContainerSpec, RuncContainer, docker_cgroupfs_path, docker_id

pytestmark = [pytest.mark.root, pytest.mark.slow,  # a real Prometheus and runc containers
              pytest.mark.xdist_group("e2e_prometheus")]  # one worker: the module's Prometheus is started once

REPO = Path(__file__).resolve().parents[2]
SCENARIO = REPO / "tests" / "scenarios" / "h200_fleet.toml"
DOUBLE = REPO / "tests" / "support" / "mps_double"
RULE_FILES = sorted(p for p in (REPO / "prometheus").glob("*.yml") if re.search(r"^groups:", p.read_text(), re.M))

GPU0 = "GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c10"
GPU1 = "GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c11"
ALLOC = str(uuid.uuid4())  # fresh per run: the cgroup paths of one run never meet another's
POD_UID = str(uuid.uuid4())
K8S_CID = docker_id()
GIB = 1 << 30
SCRAPES = 6
KUBELET_PODS = [
    {"namespace": "ml", "name": "trainer-0", "containers": [
        {"name": "trainer", "devices": [{"resource": "nvidia.com/gpu", "ids": [GPU0]}]}]},
    {"namespace": "batch", "name": "dra-job", "containers": [
        {"name": "main", "claims": [{"claim": "dra-job-gpu", "claim_namespace": "batch", "driver": "gpu.nvidia.com",
                                     "pool": "node-1", "device": "gpu-1",
                                     "cdi": ["k8s.gpu.nvidia.com/device=gpu-1"]}]}]},
]
BUILTINS = {"__rate_interval": "1m", "__range": "1m", "__interval": "15s"}


# --- what is asked ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PanelQuery:
    """One query of one panel, with the template variables substituted."""

    dashboard: str
    panel: str
    ref: str
    expr: str


def substitute(text: str, values: dict[str, str]) -> str:
    """Replace ``$name``, ``${name}`` and ``[[name]]`` by ``values[name]``; KeyError for an unknown one."""
    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]", lambda m: values[next(g for g in m.groups() if g)],
                  text)


def variable_values(model: dict[str, Any]) -> dict[str, str]:
    """Each variable at its "All" value (query variables) or its default (custom variables)."""
    values = dict(BUILTINS)
    for v in model["templating"]["list"]:
        if v["type"] == "query":
            values[v["name"]] = v["allValue"]
        elif v["type"] == "custom":
            values[v["name"]] = v["current"]["value"]
    return values


def panel_queries() -> list[PanelQuery]:
    out = []
    for path in FILES:
        model = load(path)
        values = variable_values(model)
        for p in panels(model):
            for t in p.get("targets", []):
                out.append(PanelQuery(path.name, p["title"], t["refId"], substitute(t["expr"], values)))
    return out


def variable_queries() -> list[tuple[str, str, str, str]]:
    """(dashboard, variable, selector, label) of every ``label_values(selector, label)`` variable."""
    out = []
    for path in FILES:
        model = load(path)
        values = variable_values(model)
        for v in model["templating"]["list"]:
            if v["type"] == "query":
                m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", v["query"])
                assert m, v["query"]
                out.append((path.name, v["name"], substitute(m.group(1), values), m.group(2)))
    return out


PANEL_QUERIES = panel_queries()


# --- the running system ---------------------------------------------------------------------------


def compose_scenario(dest: Path, processes: dict[int, list[dict[str, Any]]]) -> Path:
    """h200_fleet.toml with ``processes[gpu index]`` added at its ``#@processes:<index>`` lines and the
    capture path made absolute; written to ``dest``."""
    text = SCENARIO.read_text()
    text = re.sub(r'^capture = "(.+)"$', lambda m: f'capture = "{(SCENARIO.parent / m.group(1)).resolve()}"',
                  text, flags=re.M)

    def tables(m: re.Match[str]) -> str:
        return "".join("\n[[gpu.process]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in p.items())
                       for p in processes.get(int(m.group(1)), []))

    dest.write_text(re.sub(r"^#@processes:(\d+)$", tables, text, flags=re.M))
    return dest


def write_rootfs(root: Path, docker_cids: dict[str, str], k8s_cid: str) -> Path:
    """Runtime state files the exporter reads names, images and pods from (accelstats/attribution/metadata.py);
    ``docker_cids``: {name: id}, each with the image ``<name>:2``."""
    for name, cid in docker_cids.items():
        dock = root / "var/lib/docker/containers" / cid
        dock.mkdir(parents=True)
        (dock / "config.v2.json").write_text(json.dumps({"Name": f"/{name}", "Config": {"Image": f"{name}:2"}}))
    bundle = root / "run/containerd/io.containerd.runtime.v2.task/k8s.io" / k8s_cid
    bundle.mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps({"annotations": {
        "io.kubernetes.cri.sandbox-name": "trainer-0", "io.kubernetes.cri.sandbox-namespace": "ml",
        "io.kubernetes.cri.container-name": "trainer", "io.kubernetes.cri.image-name": "trainer:1"}}))
    return root


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "accelstats", *args], env=env, capture_output=True, text=True,
                          timeout=60, check=False)


def mps_stop(env: dict[str, str], config: Path) -> None:
    stopped = run_cli(env, "mps", "stop", "--config", str(config))
    assert stopped.returncode == 0, stopped.stderr


def docker_cgroupfs_path_id(container: RuncContainer) -> str:
    """The 64-hex docker id at the end of a ``/docker/<id>`` cgroup path."""
    return container.spec.cgroups_path.rsplit("/", 1)[1]


@contextlib.contextmanager
def exporter(config: Path, env: dict[str, str], log: Path) -> Iterator[str]:
    """``accelstats serve`` on a free loopback port; yields its ``host:port`` once /healthz answers."""
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "accelstats", "serve", "--listen", f"127.0.0.1:{port}",
                                 "--config", str(config)], env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(f"accelstats serve exited with {proc.returncode}: {log.read_text()[-2000:]}")
            with contextlib.suppress(OSError):
                if http_status(f"http://127.0.0.1:{port}/healthz") == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"accelstats serve not healthy after 30 s: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


SPECS_MADE: list[ContainerSpec] = []  # the containers the module's fixture made (their cgroup paths)


@pytest.fixture(scope="module")
def prom(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    """Containers, MPS daemon, exporter and Prometheus, up and scraped SCRAPES times."""
    require_runc()
    missing = prometheus_unavailable()
    if missing:
        if in_ci():
            pytest.fail(f"root test cannot run under CI=true: {missing}", pytrace=False)
        pytest.skip(missing)
    tmp = tmp_path_factory.mktemp("e2e")
    with contextlib.ExitStack() as stack:
        state = tmp / "runc-state"
        state.mkdir()
        specs = {
            "docker": ContainerSpec("inference", docker_cgroupfs_path(), devices=[("c", 195, 0, "rw")]),
            "reserved": ContainerSpec("reserved", docker_cgroupfs_path(), devices=[("c", 195, 1, "rw")]),
            "k8s": ContainerSpec("trainer", f"/kubepods/burstable/pod{POD_UID}/{K8S_CID}", privileged=True),
            "nomad": ContainerSpec("web", f"/nomad/reserved/{ALLOC}.web", privileged=True),
        }
        ctr: dict[str, RuncContainer] = {}
        SPECS_MADE.extend(specs.values())
        for key, spec in specs.items():
            ctr[key] = stack.enter_context(RuncContainer(spec, state))
        scenario = compose_scenario(tmp / "scenario.toml", {
            0: [{"pid": ctr["docker"].pid, "used_memory_bytes": 2 * GIB, "sm_utilization_percent": 40},
                {"pid": ctr["k8s"].pid, "used_memory_bytes": 4 * GIB, "sm_utilization_percent": 30},
                {"pid": ctr["nomad"].pid, "used_memory_bytes": GIB, "sm_utilization_percent": 20, "type": "mps"}],
            1: [{"pid": ctr["k8s"].pid, "used_memory_bytes": 6 * GIB, "sm_utilization_percent": 50}],
        })
        rootfs = write_rootfs(tmp / "rootfs", {"inference": docker_cgroupfs_path_id(ctr["docker"]),
                                               "reserved": docker_cgroupfs_path_id(ctr["reserved"])}, K8S_CID)
        files = tmp / "file-devices"
        files.mkdir()
        (files / "dev0").write_text("ok")
        (files / "dev1").write_text("bad")
        (files / "dev1").chmod(0o777)  # the default unhealthy_perm, -rwxrwxrwx
        cdi = rootfs / "var/run/cdi"
        cdi.mkdir(parents=True)
        (cdi / "k8s.gpu.nvidia.com-claim.json").write_text(json.dumps({
            "cdiVersion": "0.6.0", "kind": "k8s.gpu.nvidia.com/device",
            "devices": [{"name": "gpu-1", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia1"}]}}]}))
        kubelet = stack.enter_context(kubelet_process(tmp / "kubelet.sock", KUBELET_PODS, tmp / "kubelet.log"))
        config = tmp / "config.toml"
        config.write_text(f'nvml_replay = "{scenario}"\nrootfs = "{rootfs}"\n'
                          'nvml_profiling_interval = 1.0\n'  # GPM metrics need two samples: within the scrapes
                          f'[kubernetes]\npod_resources_socket = "{kubelet}"\n'
                          f'[file_devices]\ndir = "{files}"\n'
                          f'[mps]\nroot = "{tmp / "mps"}"\ntimeout = 3\n'
                          f'[[mps.resources]]\nname = "nvidia.com/gpu"\nreplicas = 2\ndevices = ["{GPU0}"]\n')
        env = {**os.environ, "PATH": f"{DOUBLE}{os.pathsep}{os.environ['PATH']}"}
        started = run_cli(env, "mps", "start", "--config", str(config))
        assert started.returncode == 0, started.stderr
        stack.callback(mps_stop, env, config)
        (tmp / "mps" / "nvidia.com" / "gpu" / "pipe" / "double.clients").write_text(
            json.dumps({"777": [ctr["nomad"].pid]}))
        address = stack.enter_context(exporter(config, env, tmp / "exporter.log"))
        server = stack.enter_context(PrometheusServer([ScrapeTarget(address)], workdir=tmp / "prometheus",
                                                      rule_files=RULE_FILES))
        server.wait_for_scrapes(SCRAPES, timeout_s=30)
        yield server


# --- the checks ---------------------------------------------------------------------------------


def test_the_containers_are_attributed_as_set_up(prom: PrometheusServer) -> None:
    """The table of the module docstring, as Prometheus stored it: the dashboards below show these."""
    result = prom.query("accelstats_container_gpu_processes * on (instance, job, id) group_left (runtime, alloc_id) "
                        "accelstats_container_info")
    keys = ("runtime", "name", "namespace", "pod", "alloc_id", "uuid", "attribution", "image")
    ours = {f"/{spec.cgroups_path.lstrip('/')}" for spec in SPECS_MADE}
    # only the containers this module made: the host may run others that hold a GPU node
    seen = {tuple(s["metric"].get(k, "") for k in keys) for s in result.series  # Prometheus drops empty labels
            if s["metric"].get("id") in ours}
    assert seen == {
        ("docker", "inference", "", "", "", GPU0, "devices_cgroup", "inference:2"),
        ("docker", "reserved", "", "", "", GPU1, "devices_cgroup", "reserved:2"),  # allocated and idle
        ("containerd", K8S_CID, "ml", "trainer-0", "", GPU0, "process", "trainer:1"),  # name: the id, as cAdvisor
        ("containerd", K8S_CID, "ml", "trainer-0", "", GPU1, "process", "trainer:1"),
        ("nomad", "web", "", "", ALLOC, GPU0, "process", ""),
    }


def test_the_kubelets_allocations_and_the_use_without_one(prom: PrometheusServer) -> None:
    """The kubelet's allocation and DRA claim as published, and every (container, GPU) in use that the
    kubelet did not allocate: trainer's GPU 1, and the docker containers' GPUs (not Kubernetes)."""
    rows = prom.query("accelstats_kubernetes_gpu_allocation")
    assert {tuple(s["metric"].get(k, "") for k in ("namespace", "pod", "container", "resource", "uuid", "gpu"))
            for s in rows.series} == {("ml", "trainer-0", "trainer", "nvidia.com/gpu", GPU0, "0")}
    claims = prom.query("accelstats_kubernetes_gpu_claim_allocation")
    assert {tuple(s["metric"].get(k, "") for k in ("namespace", "pod", "claim", "device", "uuid", "gpu"))
            for s in claims.series} == {("batch", "dra-job", "dra-job-gpu", "gpu-1", GPU1, "1")}
    ours = {f"/{spec.cgroups_path.lstrip('/')}" for spec in SPECS_MADE}
    unallocated = prom.query("accelstats_container_gpu_unallocated == 1")
    assert {(s["metric"].get("name", ""), s["metric"]["uuid"], s["metric"]["attribution"])
            for s in unallocated.series if s["metric"].get("id") in ours} == {
        ("inference", GPU0, "devices_cgroup"), ("reserved", GPU1, "devices_cgroup"),
        (K8S_CID, GPU1, "process"), ("web", GPU0, "process")}
    assert [s["value"][1] for s in prom.query("accelstats_kubernetes_pod_resources_up").series] == ["1"]


@pytest.mark.parametrize("query", PANEL_QUERIES, ids=[f"{q.dashboard}:{q.panel}:{q.ref}" for q in PANEL_QUERIES])
def test_dashboard_query_returns_series(prom: PrometheusServer, query: PanelQuery) -> None:
    result = prom.query(query.expr)
    assert result.ok, f"{query.expr}\n{result.error_type}: {result.error}"
    assert result.result_type == "vector", query.expr
    assert result.series, f"no series for {query.expr}"


VARIABLE_QUERIES = variable_queries()


@pytest.mark.parametrize(("dashboard", "name", "selector", "label"), VARIABLE_QUERIES,
                         ids=[f"{d}:{n}" for d, n, _, _ in VARIABLE_QUERIES])
def test_template_variable_finds_values(prom: PrometheusServer, dashboard: str, name: str, selector: str,
                                        label: str) -> None:
    result = prom.query(f"group by ({label}) ({selector})")
    assert result.ok, result.error
    values = {s["metric"].get(label, "") for s in result.series} - {""}
    assert values, f"{dashboard}: ${name} would offer nothing (label {label} of {selector})"


def test_every_alert_rule_loads_and_evaluates(prom: PrometheusServer) -> None:
    assert RULE_FILES, "no prometheus/*.yml rule files (a file with a top-level groups: key)"
    expected = sum(len(re.findall(r"^\s*- (?:alert|record):", p.read_text(), re.M)) for p in RULE_FILES)
    rules = prom.rules()
    assert len(rules) == expected, f"Prometheus loaded {len(rules)} rules, the files declare {expected}"
    problems = []
    for rule in rules:
        if rule.get("lastEvaluation", "").startswith("0001-"):
            problems.append(f"{rule['name']}: never evaluated")
        if rule.get("health") == "err":
            problems.append(f"{rule['name']}: evaluation failed: {rule.get('lastError')}")
        result = prom.query(rule["query"])
        if not result.ok:
            problems.append(f"{rule['name']}: {result.error_type}: {result.error}")
    assert not problems, "\n".join(problems)
