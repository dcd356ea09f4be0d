"""Every shell command of README.md and docs/*.md runs as written, in a fresh clone, with Debian's python3.

The commands are read as a reader copies them (``support/doc_commands.py``). Each is either run or
in ``NOT_HERE`` with the reason it cannot run in CI; a command that is neither fails
``test_every_command_is_classified``. How each runnable command is run:

| command | run | passes when |
|---|---|---|
| ends in ``accelstats serve`` (README's Quick start) | in the clone, port 9847 free | ``/metrics`` answers 200 |
| any other in ``SANDBOXED`` | ``bash -o pipefail -c``, stdin ``s3cret`` | exit status 0, no traceback |

A server is stopped with SIGTERM to its session; "no traceback" also means no missing module or
command on stderr, which a failing ``$(...)`` inside an argument would otherwise hide.

The clone is ``git clone`` of this checkout's HEAD (commit a doc change before running this), made
once per session with the virtual environment README's test command makes
(``python3 -m venv .venv && .venv/bin/python -m pip install -q -c systemd/constraints.txt '.[test]'``,
its pytest run left out). Every command runs with a Debian login shell's ``PATH`` (so ``python3`` is Debian's
``/usr/bin/python3``, which has neither accelstats' dependencies nor pytest, and refuses ``pip
install`` outside a virtual environment), without this test's ``PYTHONPATH`` or ``VIRTUAL_ENV``:
what a new user's shell has.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO_ROOT, in_ci
from support.doc_commands import DocCommand, commands, untagged_fences

pytestmark = pytest.mark.xdist_group("doc_examples")  # one worker makes the clone once

# Commands that cannot run in CI: the exact text (continuation lines joined) -> why. Keep it small;
# an entry that matches no command any more fails test_not_here_has_no_stale_entries.
_SERVICE_HOST = ("README 'Install as a service': installs Debian packages, writes /opt, /etc/accelstats and "
                 "/etc/systemd and starts the unit (systemd as PID 1); steps 2-4 run with /etc/accelstats in a "
                 "temporary directory in tests/operations/test_systemd_unit.py"
                 "::test_readme_install_serves_tls_in_the_sandbox")
NOT_HERE: dict[str, str] = {
    # README's test command is the suite this test belongs to: .ci/run runs it as written (step 4), and
    # so does ../shared/tools/fresh-clone-check.sh
    "python3 -m venv .venv && .venv/bin/python -m pip install -q -c systemd/constraints.txt '.[test]'"
    " && .venv/bin/python -m pytest -q":
        "README's test command: the suite this test is part of (.ci/run step 4 runs it as written)",
    **{command: _SERVICE_HOST for command in (
        "apt-get install -y python3-venv openssl curl",
        "python3 -m venv /opt/accelstats && /opt/accelstats/bin/pip install -q -c systemd/constraints.txt .",
        "install -d -m 0700 /etc/accelstats",
        "install -m 0600 systemd/config.toml /etc/accelstats/config.toml",
        "host=$(hostname -f)",
        "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 825 "
        '-subj "/CN=$host" -addext "subjectAltName=DNS:$host" -keyout /etc/accelstats/tls.key '
        "-out /etc/accelstats/tls.crt",
        "hash=$(/opt/accelstats/bin/python -c 'import bcrypt, getpass; print(bcrypt.hashpw(getpass.getpass()"
        ".encode(), bcrypt.gensalt()).decode())')",
        "printf 'tls_server_config:\\n  cert_file: tls.crt\\n  key_file: tls.key\\nbasic_auth_users:\\n  "
        "prometheus: %s\\n' \"$hash\" > /etc/accelstats/web.yml",
        "install -m 0644 systemd/accelstats.service /etc/systemd/system/accelstats.service",
        "systemctl daemon-reload && systemctl enable --now accelstats",
        "curl -sS --cacert /etc/accelstats/tls.crt -u prometheus \"https://$host:9847/metrics\" "
        "| grep '^accelstats_gpu_up'",
    )},
    # docs/systemd.md: the installed service (systemd as PID 1)
    "install -D -m 0644 systemd/device-programs.conf /etc/systemd/system/accelstats.service.d/device-programs.conf":
        "writes /etc/systemd on the service host",
    "systemctl daemon-reload && systemctl restart accelstats": "restarts the installed unit (systemd as PID 1)",
    "diff <(curl -s --cacert /etc/accelstats/tls.crt -u prometheus https://$(hostname -f):9847/metrics "
    "| grep -v '^#' | sed 's/[{ ].*//' | sort -u) <(/opt/accelstats/bin/accelstats dump --config "
    "/etc/accelstats/config.toml | grep -v '^#' | sed 's/[{ ].*//' | sort -u)":
        "compares the installed service's scrape with its dump: needs the service of README's install",
    "journalctl -u accelstats -b | grep -i -e error -e warning": "the installed unit's journal (systemd as PID 1)",
    # docs/deploy.md: the image (built and run by tests/kubernetes/test_image_e2e.py with a dockerd of its own,
    # not here: these need the host's docker) and a Kubernetes cluster
    **{command: "builds a container image with the host's docker (and debootstrap): tests/kubernetes/"
                "test_image_e2e.py builds it so with a dockerd of its own and the base from its cache"
       for command in (
        "docker build -f deploy/Dockerfile -t accelstats:0.1.0 .",
        "debootstrap --variant=minbase --include=python3,python3-venv bookworm rootfs http://deb.debian.org/debian",
        "tar -C rootfs -c . | docker import - debian-python:bookworm",
        "docker build -f deploy/Dockerfile --build-arg BASE=debian-python:bookworm --build-arg PIP_OPTS=\"--no-index "
        "--find-links /tmp/dist\" -t accelstats:0.1.0 .",
    )},
    **{command: "needs a Kubernetes cluster" for command in (
        "kubectl apply -f deploy/kubernetes/namespace.yaml",
        "kubectl apply -f deploy/kubernetes/daemonset.yaml -f deploy/kubernetes/service.yaml",
        "kubectl -n monitoring create secret generic accelstats-scrape-auth --from-literal=username=prometheus "
        "--from-file=password=scrape.password",
        "kubectl apply -f deploy/prometheus-operator/servicemonitor.yaml",
    )},
    "kubectl -n monitoring create secret generic accelstats-web-config --from-file=web.yml --from-file=tls.crt "
    "--from-file=tls.key": "needs a Kubernetes cluster",
    # docs/nomad.md: a Nomad client host
    "mkdir -p /opt/nomad/plugins": "the Nomad client's plugin_dir (/opt on a Nomad client)",
    "ln -s /opt/accelstats/bin/nomad-device-accelstats /opt/nomad/plugins/nomad-device-accelstats":
        "the Nomad client's plugin_dir (/opt on a Nomad client)",
    # docs/gpu-check.md: a real GPU
    "OUT=/tmp/gpu-check bash scripts/gpu-check.sh      # from the repository root, on the GPU host":
        "live NVML on a real GPU host",
    # docs/web-config.md: apache2-utils is not a test dependency, and htpasswd reads the password from a terminal
    "htpasswd -nBC 10 \"\" | tr -d ':\\n'        # Debian: apache2-utils":
        "apache2-utils' htpasswd (not installed by .ci/run) prompting on a terminal",
    # docs/fuzzing.md: by-hand runs sized in minutes to hours (the same tests run in the suite, ci profile)
    "ACCELSTATS_FUZZ_PROFILE=long .venv/bin/python -m pytest -q tests/fuzz -p no:cacheprovider "
    "--hypothesis-show-statistics --durations=0": "the long fuzz profile: about 2 hours (docs/fuzzing.md)",
    "ACCELSTATS_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest -q tests/fuzz/test_fuzz_mps.py   # any count, "
    "either profile": "20 000 examples per MPS target: minutes",
    ".venv/bin/python -m pip install atheris": "atheris from PyPI: a by-hand tool, not a dependency",
    **{f".venv/bin/python tests/fuzz/atheris/fuzz_{target}.py -max_total_time=180 /tmp/corpus-{corpus}":
       "an atheris run of 180 s (atheris is not a dependency)"
       for target, corpus in (("cgroup_text", "cgroup"), ("nvidia_smi_xml", "xml"), ("plugin_config", "config"))},
    "ACCELSTATS_FUZZ_PROFILE=long .venv/bin/python -m pytest -q tests/fuzz/test_fuzz_<target>.py -k '<tests>' "
    "-p no:cacheprovider --hypothesis-show-statistics --durations=0": "a template (<target>, <tests>), not a command",
    ".venv/bin/python tests/fuzz/atheris/fuzz_<target>.py [--allow-known] -max_total_time=180 -rss_limit_mb=2048 "
    "-timeout=10 -print_final_stats=1 /tmp/fz/corpus_<target>": "a template (<target>), not a command",
}

# What may run in the sandbox: commands that touch only the clone and its .venv (checked before any runs).
SANDBOXED = (
    re.compile(r"python3 -m venv \.venv && \.venv/bin/python -m pip install -q "
               r"(-c systemd/constraints\.txt )?(\.|'\.\[test\]')"
               r"( && \.venv/bin/.*|\s*#.*)?"),
    re.compile(r"\.venv/bin/(python|accelstats) .*"),
    re.compile(r"python3 -m accelstats (dump|devices|containers|--help) .*"),
    re.compile(r"openssl req -x509 .* -keyout tls\.key -out tls\.crt"),  # in the clone's root
    re.compile(r"printf .* > web\.yml"),  # in the clone's root
)
# A pytest command runs as written, in one process and with 3 fuzz examples per target (pytest's and
# docs/fuzzing.md's own knobs): the suite runs the same tests in full; here the command is what is checked.
PYTEST_ENV = {"PYTEST_ADDOPTS": "-n 0", "ACCELSTATS_FUZZ_EXAMPLES": "3"}
# Known to fail today, fixed by another row of issue 26: strict, so the fix turns this red until removed.
KNOWN_FAILING: dict[str, str] = {}  # command text -> why it is expected to fail (none now)
SERVE_PORT = 9847  # README: "listening on every interface ... at port 9847"
PASSWORD = "s3cret\n"  # for getpass, which reads stdin without a terminal
# On stderr, a failure even where the exit status is 0 (a failing $(...) inside an argument).
BROKEN = re.compile(r"Traceback \(most recent call last\)|ModuleNotFoundError|: command not found")

ALL = commands(REPO_ROOT)
RUNNABLE = [c for c in ALL if c.text not in NOT_HERE]


def sandboxed(command: DocCommand) -> bool:
    """Whether ``command`` is one SANDBOXED allows."""
    return any(rule.fullmatch(command.text) for rule in SANDBOXED)


def test_every_fence_names_its_language() -> None:
    """An untagged block could hold a command nobody runs: tag it (``text`` for output and listings)."""
    assert untagged_fences(REPO_ROOT) == []


def test_every_command_is_classified() -> None:
    unclassified = [f"{c.where}: {c.text}" for c in RUNNABLE if not sandboxed(c)]
    assert unclassified == [], "run it in the sandbox (SANDBOXED) or add it to NOT_HERE with the reason"


def test_not_here_has_no_stale_entries() -> None:
    texts = {c.text for c in ALL}
    assert sorted(set(NOT_HERE) - texts) == []
    assert sorted(set(KNOWN_FAILING) - texts) == []


def test_the_quick_start_commands_are_read() -> None:
    """Control: the extraction finds README's two Quick start lines and the continued openssl line."""
    readme = [c.text for c in ALL if c.doc == "README.md"]
    assert readme[:2] == [
        "python3 -m venv .venv && .venv/bin/python -m pip install -q -c systemd/constraints.txt ."
        " && .venv/bin/accelstats serve",
        "python3 -m venv .venv && .venv/bin/python -m pip install -q -c systemd/constraints.txt '.[test]'"
        " && .venv/bin/python -m pytest -q"]
    assert any(t.startswith("openssl req -x509") and t.endswith("-out /etc/accelstats/tls.crt") for t in readme)


# A Debian login shell's PATH (/etc/login.defs: ENV_SUPATH for root, ENV_PATH for the others): python3
# is Debian's /usr/bin/python3, not an activated virtual environment's or a pyenv shim's.
DEBIAN_PATH = ("/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" if os.geteuid() == 0
               else "/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games")


def user_env() -> dict[str, str]:
    """A new user's environment: this test's, with Debian's PATH and without its virtual environment and
    PYTHONPATH (which carries the test support's start-up hook)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER",
                        "PYTEST_XDIST_WORKER_COUNT", "PYTEST_CURRENT_TEST")}
    env["PATH"] = DEBIAN_PATH
    return env


def _fail_or_skip(why: str) -> None:
    if in_ci():
        pytest.fail(why, pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="session")
def fresh_clone(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """(clone, environment): HEAD cloned as a new user would, with README's test command's .venv."""
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        _fail_or_skip("not a git checkout: the doc examples run in a clone of it")
    python3 = shutil.which("python3", path=DEBIAN_PATH)
    if python3 is None or not Path(python3).resolve().is_relative_to("/usr/bin"):
        _fail_or_skip(f"no Debian python3 (/usr/bin/python3) on {DEBIAN_PATH}: found {python3}")
    base = tmp_path_factory.mktemp("doc-examples")
    clone = base / "accelstats"
    env = user_env()  # with the user's HOME: pip's configuration and cache (offline wheels) as theirs
    subprocess.run(["git", "clone", "-q", str(REPO_ROOT), str(clone)], check=True, timeout=120, env=env)
    test_command = next(c.text for c in ALL if c.doc == "README.md" and "pytest" in c.text)
    make_venv = test_command.split(" && .venv/bin/python -m pytest", 1)[0]
    assert make_venv != test_command, test_command
    made = subprocess.run(["bash", "-c", make_venv], cwd=clone, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    if made.returncode != 0:
        _fail_or_skip(f"README's venv could not be made ({make_venv}): {made.stderr.strip()[-800:]}")
    return clone, env


def port_free(port: int) -> bool:
    """Whether nothing listens on ``port`` (IPv4 wildcard bind succeeds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def started(command: str, clone: Path, env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``bash -c command`` in a session of its own; at exit SIGTERM to the session, SIGKILL after 30 s."""
    with log.open("wb") as out:
        proc = subprocess.Popen(["bash", "-c", command], cwd=clone, env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def serve_answers(command: str, clone: Path, env: dict[str, str], log: Path) -> None:
    """Start ``command``; passes once ``/metrics`` on SERVE_PORT answers 200, and the session stops on SIGTERM."""
    if not port_free(SERVE_PORT):
        _fail_or_skip(f"port {SERVE_PORT} is in use here: README's serve command cannot be tried")
    url = f"http://127.0.0.1:{SERVE_PORT}/metrics"
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through an http_proxy
    with started(command, clone, env, log) as proc:
        deadline = time.monotonic() + 180  # it installs first
        while True:
            assert proc.poll() is None, f"exited {proc.returncode} before answering:\n{log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"no answer on {url}:\n{log.read_text()[-2000:]}"
            try:
                with direct.open(url, timeout=5) as answer:
                    status, body = answer.status, answer.read().decode()
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.2)  # not listening yet: it is still installing or starting
    assert status == 200 and "accelstats_scrape_collector_success" in body
    assert proc.returncode is not None and port_free(SERVE_PORT)


@pytest.mark.slow
@pytest.mark.parametrize("command", RUNNABLE, ids=[c.where for c in RUNNABLE])
def test_doc_command_runs_in_a_fresh_clone(command: DocCommand, fresh_clone: tuple[Path, dict[str, str]],
                                           tmp_path: Path) -> None:
    assert sandboxed(command), "unclassified: see test_every_command_is_classified"
    clone, env = fresh_clone
    if command.text.endswith("accelstats serve"):
        serve_answers(command.text, clone, env, tmp_path / "serve.log")
        return
    extra = PYTEST_ENV if " -m pytest" in command.text else {}
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command.text], cwd=clone, env={**env, **extra},
                          input=PASSWORD, capture_output=True, text=True, timeout=300, check=False,
                          start_new_session=True)
    failed = done.returncode != 0 or BROKEN.search(done.stderr) is not None
    if command.text in KNOWN_FAILING:
        assert failed, f"passes now: remove it from KNOWN_FAILING ({KNOWN_FAILING[command.text]})"
        pytest.xfail(f"{KNOWN_FAILING[command.text]}: {done.stderr.strip().splitlines()[-1:]}")
    assert not failed, f"{command.where}: exit {done.returncode}\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}"
