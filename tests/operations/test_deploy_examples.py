"""The deployment examples in docs/deploy.md, checked with the real tools where there are some.

| example | check |
|---|---|
| `prometheus-static.yml` | `promtool check config` succeeds (and fails on a misspelt key: control) |
| `prometheus-discovery.yml` | the same after swapping its k8s/Nomad SD blocks for file SD (*); keeps what we deploy |
| `deploy/kubernetes/daemonset.yaml` | `hostPID`; hostPaths read-only, where the flags point; port = `--listen` |
| `kubernetes-securitycontext-cgroup-v1.yaml` | drops ALL, adds exactly the systemd unit's capabilities |
| `nomad-*.hcl` | braces balance; flags are `serve` options; mounts match them; the unit's capabilities |

(*) Debian's promtool is built without `kubernetes_sd_configs` and `nomad_sd_configs`; the rest of
that file (TLS, basic auth, relabelling) is checked as written, and its `keep` rules must select the
DaemonSet's pods and the Nomad jobs' service. Every flag in a Kubernetes or Nomad example must be
one `accelstats serve --help` lists. The DaemonSet and the Dockerfile are files under deploy/
(schemas and the Dockerfile: tests/operations/test_deploy_manifests.py). No HCL
parser is installed, so the Nomad files are checked as text; none of the examples ran on a cluster.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO_ROOT, require_tool


def promtool() -> str:
    """promtool (skips without it; fails under CI=true)."""
    return require_tool("promtool", "prometheus")

DEPLOY = REPO_ROOT / "docs" / "deploy.md"
UNIT = REPO_ROOT / "systemd" / "accelstats.service"
MARKER = re.compile(r"<!-- example: (?P<name>[\w.-]+) -->\n```(?P<lang>\w*)\n(?P<body>.*?)\n```", re.S)
DAEMONSET = REPO_ROOT / "deploy" / "kubernetes" / "daemonset.yaml"
EXPECTED = {
    "nomad-raw-exec.nomad.hcl", "nomad-client-docker.hcl", "nomad-docker.nomad.hcl",
    "nomad-agent-plugin.hcl", "prometheus-static.yml", "prometheus-discovery.yml",
}
# Mounted at its own path, where the kubelet's socket is by default (issue 27's pod-resources client).
POD_RESOURCES = "/var/lib/kubelet/pod-resources"


def examples() -> dict[str, str]:
    found: dict[str, str] = {}
    for match in MARKER.finditer(DEPLOY.read_text()):
        assert match.group("name") not in found, f"example {match.group('name')} appears twice"
        found[match.group("name")] = match.group("body") + "\n"
    return found


def unit_capabilities() -> list[str]:
    """``CapabilityBoundingSet=`` of the systemd unit, without ``CAP_``: ``["DAC_READ_SEARCH", ...]``."""
    values = [line.split("=", 1)[1].split() for line in UNIT.read_text().splitlines()
              if line.startswith("CapabilityBoundingSet=")]
    assert len(values) == 1
    return sorted(cap.removeprefix("CAP_") for cap in values[0])


SERVE_HELP: list[str] = []


def serve_options() -> set[str]:
    """The long options ``accelstats serve --help`` lists."""
    if not SERVE_HELP:
        proc = subprocess.run([sys.executable, "-m", "accelstats", "serve", "--help"], capture_output=True,
                              text=True, timeout=60, cwd=REPO_ROOT)
        assert proc.returncode == 0, proc.stderr
        SERVE_HELP.append(proc.stdout)
    return set(re.findall(r"(--[a-z][a-z-]*)", SERVE_HELP[0]))


def flags(args: list[str]) -> dict[str, str]:
    """``["serve", "--a=1", "--b", "2"]`` → ``{"--a": "1", "--b": "2"}``; asserts the command is serve."""
    assert args[0] == "serve", args
    out: dict[str, str] = {}
    rest = iter(args[1:])
    for arg in rest:
        assert arg.startswith("--"), f"{arg!r} is not an option"
        name, sep, value = arg.partition("=")
        out[name] = value if sep else next(rest)
    return out


def test_every_example_is_marked_once() -> None:
    assert set(examples()) == EXPECTED


# --------------------------------------------------------------------------------------------
# Prometheus




# Service discovery mechanisms Debian's prometheus package leaves out of its build (promtool says
# "field kubernetes_sd_configs not found in type config.ScrapeConfig").
NOT_IN_DEBIAN_BUILD = ("kubernetes_sd_configs", "nomad_sd_configs")


def promtool_ready(text: str, folder: Path) -> str:
    """``text`` with every SD block Debian's promtool cannot parse replaced by a file_sd_configs
    block (everything else, TLS, basic auth and relabelling included, is left as written)."""
    config = yaml.safe_load(text)
    for job in config["scrape_configs"]:
        for key in NOT_IN_DEBIAN_BUILD:
            if job.pop(key, None) is not None:
                job["file_sd_configs"] = [{"files": [str(folder / f"{job['job_name']}.json")]}]
    return yaml.safe_dump(config, sort_keys=False)


@pytest.mark.parametrize("name", sorted(n for n in EXPECTED if n.startswith("prometheus-")))
def test_prometheus_config_passes_promtool(name: str, tmp_path: Path) -> None:
    path = tmp_path / name
    path.write_text(promtool_ready(examples()[name], tmp_path))
    proc = subprocess.run([promtool(), "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr


def test_promtool_rejects_a_misspelt_key(tmp_path: Path) -> None:
    """Control: the check above can fail."""
    path = tmp_path / "bad.yml"
    path.write_text(examples()["prometheus-static.yml"].replace("password_file:", "pasword_file:", 1))
    proc = subprocess.run([promtool(), "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "pasword_file" in proc.stdout + proc.stderr


def discovery_jobs() -> dict[str, dict[str, Any]]:
    return {job["job_name"]: job for job in yaml.safe_load(examples()["prometheus-discovery.yml"])["scrape_configs"]}


def kept(job: dict[str, Any], source: str) -> str:
    """The regex of the ``keep`` rule on ``source`` (one label)."""
    (rule,) = [r for r in job["relabel_configs"] if r.get("action") == "keep" and r["source_labels"] == [source]]
    regex: str = rule["regex"]
    return regex


def test_discovery_keeps_the_daemonset_pods() -> None:
    job = discovery_jobs()["accelstats-kubernetes"]
    ds = daemonset()
    (sd,) = job["kubernetes_sd_configs"]
    assert sd["role"] == "pod" and ds["metadata"]["namespace"] in sd["namespaces"]["names"]
    label = ds["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
    assert re.fullmatch(kept(job, "__meta_kubernetes_pod_label_app_kubernetes_io_name"), label)
    (port,) = ds["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert re.fullmatch(kept(job, "__meta_kubernetes_pod_container_port_name"), port["name"])
    assert job["scheme"] == "https" and "basic_auth" in job  # the DaemonSet passes --web-config


def test_discovery_keeps_the_nomad_service() -> None:
    job = discovery_jobs()["accelstats-nomad"]
    for name in ("nomad-raw-exec.nomad.hcl", "nomad-docker.nomad.hcl"):
        service = re.search(r'service\s*\{\s*name\s*=\s*"([^"]+)"\s*provider\s*=\s*"nomad"', examples()[name])
        assert service, f"{name}: no Nomad-provider service"
        assert re.fullmatch(kept(job, "__meta_nomad_service"), service.group(1))


def test_job_names_match_the_alert_rules() -> None:
    """docs/alerts.md's exporter-down rules select up{job=~"accelstats.*"}."""
    for name in ("prometheus-static.yml", "prometheus-discovery.yml"):
        for job in yaml.safe_load(examples()[name])["scrape_configs"]:
            assert job["job_name"].startswith("accelstats"), job["job_name"]


# --------------------------------------------------------------------------------------------
# Kubernetes


def daemonset() -> dict[str, Any]:
    doc = yaml.safe_load(DAEMONSET.read_text())
    assert isinstance(doc, dict)
    return doc


def test_daemonset_shape() -> None:
    ds = daemonset()
    assert (ds["apiVersion"], ds["kind"]) == ("apps/v1", "DaemonSet")
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    (container,) = pod["containers"]
    assert "resources" not in container or "nvidia.com/gpu" not in str(container["resources"])


def test_daemonset_mounts_are_read_only_and_match_the_flags() -> None:
    pod = daemonset()["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounted = {}
    for mount in container["volumeMounts"]:
        assert mount.get("readOnly") is True, f"{mount['name']} is not read-only"
        if mount["name"] in host_paths:
            mounted[host_paths[mount["name"]]] = mount["mountPath"]
    assert set(host_paths.values()) == set(mounted)
    opts = flags(container["args"])
    assert set(opts) <= serve_options()
    assert mounted["/proc"] == opts["--proc-root"]
    assert mounted["/sys/fs/cgroup"] == opts["--cgroup-root"]
    for host_path, target in mounted.items():  # state directories live under --rootfs at their host path
        if host_path not in ("/proc", "/sys/fs/cgroup", POD_RESOURCES):
            assert target == opts["--rootfs"].rstrip("/") + host_path
    assert mounted[POD_RESOURCES] == POD_RESOURCES
    (port,) = container["ports"]
    assert opts["--listen"] == f":{port['containerPort']}"


def test_daemonset_security_context_has_the_unit_capabilities() -> None:
    """Not privileged, on cgroup v1 and v2 alike (a private cgroup namespace is resolved:
    accelstats/attribution/cgroupns.py)."""
    (container,) = daemonset()["spec"]["template"]["spec"]["containers"]
    context = container["securityContext"]
    assert "privileged" not in context
    assert context["capabilities"]["drop"] == ["ALL"]
    assert sorted(context["capabilities"]["add"]) == unit_capabilities()
    assert context["allowPrivilegeEscalation"] is False and context["readOnlyRootFilesystem"] is True


# --------------------------------------------------------------------------------------------
# Nomad (text checks: no HCL parser)


def hcl_list(text: str, key: str) -> list[str]:
    """The quoted strings of ``key = [ ... ]`` (first occurrence)."""
    match = re.search(rf"\b{key}\s*=\s*\[(.*?)\]", text, re.S)
    assert match, f"no {key} = [...]"
    return re.findall(r'"([^"]*)"', match.group(1))


@pytest.mark.parametrize("name", sorted(n for n in EXPECTED if n.endswith(".hcl")))
def test_hcl_braces_and_quotes_balance(name: str) -> None:
    text = examples()[name]
    code = re.sub(r"<<-?EOT\n.*?\n\s*EOT", "", text, flags=re.S)  # heredocs hold YAML, not HCL
    code = re.sub(r'"(?:\\.|[^"\\])*"', '""', code)  # strings may hold braces
    code = re.sub(r"#.*", "", code)
    assert code.count('"') % 2 == 0
    depth = 0
    for char in code:
        depth += {"{": 1, "}": -1}.get(char, 0)
        assert depth >= 0, f"{name}: '}}' without '{{'"
    assert depth == 0, f"{name}: unbalanced braces"


def test_nomad_raw_exec_job_runs_the_installed_service_command() -> None:
    text = examples()["nomad-raw-exec.nomad.hcl"]
    assert re.search(r'type\s*=\s*"system"', text)
    assert re.search(r'command\s*=\s*"/opt/accelstats/bin/accelstats"', text)
    opts = flags(hcl_list(text, "args"))
    assert set(opts) <= serve_options()
    assert opts["--config"] == "/etc/accelstats/config.toml"


def test_nomad_docker_job_matches_the_unit_and_the_client_config() -> None:
    job = examples()["nomad-docker.nomad.hcl"]
    client = examples()["nomad-client-docker.hcl"]
    assert re.search(r'pid_mode\s*=\s*"host"', job) and re.search(r'cgroupns\s*=\s*"host"', job)
    assert re.search(r"readonly_rootfs\s*=\s*true", job)
    assert hcl_list(job, "cap_drop") == ["all"]
    added = hcl_list(job, "cap_add")
    assert sorted(c.upper() for c in added) == unit_capabilities()
    assert set(added) <= set(hcl_list(client, "allow_caps"))
    assert "nvidia" in hcl_list(client, "allow_runtimes")
    opts = flags(hcl_list(job, "args"))
    assert set(opts) <= serve_options()
    mounts = re.findall(r'mount\s*\{\s*type\s*=\s*"bind"\s*source\s*=\s*"([^"]+)"\s*target\s*=\s*"([^"]+)"\s*'
                        r"readonly\s*=\s*true\s*\}", job)
    assert len(mounts) == job.count("mount {"), "every mount is a read-only bind"
    targets = dict(mounts)
    assert targets["/proc"] == opts["--proc-root"] and targets["/sys/fs/cgroup"] == opts["--cgroup-root"]
    for source, target in targets.items():
        if source not in ("/proc", "/sys/fs/cgroup"):
            assert target == opts["--rootfs"].rstrip("/") + source
