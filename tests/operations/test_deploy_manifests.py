"""The files under deploy/, checked offline against the schemas and the code they name.

| file | check |
|---|---|
| `deploy/kubernetes/*.yaml` | Kubernetes 1.27's and 1.37's schemas, strict (`kubernetes-validate`) |
| `deploy/prometheus-operator/servicemonitor.yaml` | the ServiceMonitor CRD's schema (operator 0.93.0), strict |
| either, with a misspelt field or a bad value | fails the same check (control) |
| the DaemonSet's `args` | parsed by the real `accelstats serve` (click); values fit the mounts and port |
| Service, ServiceMonitor, DaemonSet | namespace.yaml's namespace; selectors select; ports chain to `--listen` |
| the DaemonSet's `pod-resources` mount | read-only; a socket behind a read-only bind mount accepts `connect()` |
| `deploy/Dockerfile` | `COPY` sources exist (or are the wheel docs/deploy.md builds) and the context keeps them |
| `deploy/Dockerfile` | `BASE` is an `ARG`; pinned install; non-root `USER`; `ENTRYPOINT` is a console script |

"Strict" means an unknown field fails, as ``kubectl apply --validate=strict`` does. The CRD schema
(``tests/operations/data/servicemonitor-v1.schema.yaml``) says where it comes from. Nothing here
builds the image or runs a cluster: the image's end-to-end test is another part of issue 27.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import jsonschema
import kubernetes_validate
import pytest
import tomllib
import yaml
from conftest import REPO_ROOT

from accelstats.cli import serve

DEPLOY = REPO_ROOT / "deploy"
KUBERNETES = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
SERVICE_MONITOR = DEPLOY / "prometheus-operator" / "servicemonitor.yaml"
SERVICE_MONITOR_SCHEMA = Path(__file__).parent / "data" / "servicemonitor-v1.schema.yaml"
DOCKERFILE = DEPLOY / "Dockerfile"
# The oldest Kubernetes minor release still commonly run by managed services and the newest that
# kubernetes-validate 1.37 bundles.
K8S_VERSIONS = ("1.27.0", "1.37.0")


def load(path: Path) -> dict[str, Any]:
    """The one YAML document of ``path`` (a manifest file holds one object)."""
    (doc,) = list(yaml.safe_load_all(path.read_text()))
    assert isinstance(doc, dict), path
    return doc


def by_kind() -> dict[str, dict[str, Any]]:
    """Every manifest under deploy/ by its ``kind`` (one object per kind)."""
    docs = [load(p) for p in [*KUBERNETES, SERVICE_MONITOR]]
    kinds = {d["kind"]: d for d in docs}
    assert len(kinds) == len(docs), "two manifests of one kind"
    return kinds


def strict(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists ``properties`` and does
    not say ``x-kubernetes-preserve-unknown-fields``: what the API server's strict field validation
    (``kubectl apply --validate=strict``) refuses, where the default only prunes and warns."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def validate_crd(doc: dict[str, Any]) -> None:
    """Raises jsonschema.ValidationError where ``doc`` breaks the ServiceMonitor CRD's schema, strictly."""
    schema = yaml.safe_load(SERVICE_MONITOR_SCHEMA.read_text())
    schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta: checked by the API server, not the CRD
    jsonschema.validate(doc, strict(schema))


# --------------------------------------------------------------------------------------------
# Schemas


def test_the_deploy_files_are_the_expected_ones() -> None:
    assert [p.name for p in KUBERNETES] == ["daemonset.yaml", "namespace.yaml", "service.yaml"]
    assert set(by_kind()) == {"DaemonSet", "Namespace", "Service", "ServiceMonitor"}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", KUBERNETES, ids=lambda p: p.name)
def test_manifest_is_valid_against_the_kubernetes_schema(path: Path, version: str) -> None:
    try:
        kubernetes_validate.validate(load(path), version, strict=True)
    except jsonschema.ValidationError as error:  # its text holds the whole schema: say where, in one line
        pytest.fail(f"{path.name}, Kubernetes {version}: {error.message} at {error.json_path}")


def test_kubernetes_schema_check_rejects_a_misspelt_field() -> None:
    """Control: strict mode refuses a field the schema does not have."""
    ds = load(DEPLOY / "kubernetes" / "daemonset.yaml")
    ds["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(kubernetes_validate.ValidationError, match="hostPid"):
        kubernetes_validate.validate(ds, K8S_VERSIONS[-1], strict=True)


def test_service_monitor_is_valid_against_its_crd_schema() -> None:
    doc = load(SERVICE_MONITOR)
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    try:
        validate_crd(doc)
    except jsonschema.ValidationError as error:
        pytest.fail(f"{SERVICE_MONITOR.name}: {error.message} at {error.json_path}")


@pytest.mark.parametrize(("where", "bad"), [
    ("endpoint", {"port": "metrics", "sheme": "https"}),            # misspelt key
    ("endpoint", {"port": "metrics", "scheme": "gopher"}),          # value outside the enum
    ("spec", {"endpoints": [{"port": "metrics"}]}),                 # selector is required
])
def test_crd_schema_check_rejects_a_broken_service_monitor(where: str, bad: dict[str, Any]) -> None:
    """Control: the CRD schema is strict enough to catch each of these."""
    doc = load(SERVICE_MONITOR)
    if where == "endpoint":
        doc["spec"]["endpoints"] = [bad]
    else:
        doc["spec"] = bad
    with pytest.raises(jsonschema.ValidationError):
        validate_crd(doc)


# --------------------------------------------------------------------------------------------
# What the manifests say against each other and against the exporter


def container() -> dict[str, Any]:
    (only,) = by_kind()["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    assert isinstance(only, dict)
    return only


def test_daemonset_args_parse_with_the_real_cli() -> None:
    args = container()["args"]
    assert args[0] == "serve"
    params = serve.make_context("serve", list(args[1:])).params
    mounts = {m["mountPath"] for m in container()["volumeMounts"]}
    assert str(params["proc_root"]) in mounts and str(params["cgroup_root"]) in mounts
    assert str(params["rootfs"]) == "/host"
    assert Path(params["web_config"]).parent.as_posix() in mounts
    (port,) = container()["ports"]
    assert params["listen"] == f":{port['containerPort']}" == ":9847"  # docs/deploy.md: the default port


def test_the_cli_check_rejects_an_unknown_option() -> None:
    """Control: click refuses an option ``serve`` does not have."""
    with pytest.raises(click.NoSuchOption):
        serve.make_context("serve", ["--pod-resource-sockets=/x"])


def test_names_namespaces_selectors_and_ports_chain() -> None:
    kinds = by_kind()
    namespace = kinds["Namespace"]["metadata"]["name"]
    ds, service, monitor = kinds["DaemonSet"], kinds["Service"], kinds["ServiceMonitor"]
    for doc in (ds, service, monitor):
        assert doc["metadata"]["namespace"] == namespace, doc["kind"]
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [namespace]
    (container_port,) = container()["ports"]
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] == container_port["name"]
    assert service_port["port"] == container_port["containerPort"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service_port["name"] and endpoint["path"] == "/metrics"
    assert endpoint["scheme"] == "https"  # the DaemonSet passes --web-config
    assert service["metadata"]["name"].startswith("accelstats")  # the job label the alert rules select


def test_pod_resources_dir_is_mounted_read_only_where_the_kubelet_keeps_it() -> None:
    pod = by_kind()["DaemonSet"]["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "pod-resources"]
    (mount,) = [m for m in container()["volumeMounts"] if m["name"] == "pod-resources"]
    assert volume["hostPath"]["path"] == mount["mountPath"] == "/var/lib/kubelet/pod-resources"
    assert mount["readOnly"] is True


@pytest.mark.root
def test_a_socket_behind_a_read_only_bind_mount_accepts_connections(tmp_path: Path) -> None:
    """The kernel checks write permission on the socket inode, not on the mount (EROFS is for regular
    files, directories and links): the DaemonSet's read-only pod-resources mount still reaches the kubelet."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("util-linux unshare not installed")
    host, view = tmp_path / "host", tmp_path / "view"
    host.mkdir()
    view.mkdir()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(host / "kubelet.sock"))
    server.listen(1)
    client = (f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({str(view / 'kubelet.sock')!r}); "
              f"open({str(view / 'probe')!r}, 'w')")
    script = f"mount --bind -o ro {host} {view} && {sys.executable} -c {client!r}"
    try:
        proc = subprocess.run([unshare, "--mount", "--propagation", "private", "sh", "-c", script],
                              capture_output=True, text=True, timeout=30)
        server.settimeout(10)
        accepted, _ = server.accept()  # the connect() got through
        accepted.close()
    finally:
        server.close()
    assert "Read-only file system" in proc.stderr, proc.stderr  # ... and the mount really is read-only


# --------------------------------------------------------------------------------------------
# Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    """``(INSTRUCTION, rest)`` per instruction, continuation lines joined, comments left out."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines
            if line and not line.startswith("#")]


def dockerignore_keeps(path: str) -> bool:
    """Whether deploy/Dockerfile.dockerignore leaves ``path`` in the build context (last match wins)."""
    kept = True
    for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines():
        pattern = line.strip()
        if pattern and not pattern.startswith("#"):
            negated = pattern.startswith("!")
            if fnmatch.fnmatch(path, pattern.removeprefix("!")):
                kept = negated
    return kept


def test_dockerfile_copies_files_that_exist_and_the_context_keeps() -> None:
    wheel_command = re.search(r"^\.venv/bin/python -m pip wheel .* -w (\S+) \.$",
                              (REPO_ROOT / "docs" / "deploy.md").read_text(), re.M)
    assert wheel_command, "docs/deploy.md builds the wheel"
    built = wheel_command.group(1).rstrip("/")
    copies = [rest.split()[:-1] for instruction, rest in dockerfile_instructions() if instruction == "COPY"]
    assert copies
    for sources in copies:
        for source in sources:
            if source.rstrip("/") == built:  # made by the documented wheel command, not in a clone
                assert dockerignore_keeps(f"{built}/accelstats-0.1.0-py3-none-any.whl")
            else:
                assert (REPO_ROOT / source).exists(), source
                assert dockerignore_keeps(source), source
    assert not dockerignore_keeps(".venv") and not dockerignore_keeps(".git")


def test_dockerfile_base_is_an_arg_and_it_runs_the_console_script() -> None:
    instructions = dockerfile_instructions()
    assert instructions[0][0] == "ARG" and instructions[0][1].startswith("BASE=")
    assert ("FROM", "${BASE}") in instructions
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    (entry,) = [rest for instruction, rest in instructions if instruction == "ENTRYPOINT"]
    assert re.fullmatch(r'\["([^"]+)"\]', entry) and entry[2:-2] in scripts
    assert any(i == "RUN" and "-c /tmp/constraints.txt" in rest for i, rest in instructions), "pinned install"
    (user,) = [rest for instruction, rest in instructions if instruction == "USER"]
    assert not user.startswith("0") and not user.startswith("root")
