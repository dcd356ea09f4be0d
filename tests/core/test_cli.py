"""The ``accelstats`` command as a user runs it: serve, dump, devices, bad input and exit codes."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import in_ci
from prometheus_client.parser import text_string_to_metric_families
from support.ports import free_port

CLI = [sys.executable, "-m", "accelstats"]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, check=False)



def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture
def h200(fixtures_dir: Path) -> Path:
    return fixtures_dir / "h200" / "nvidia-smi-q.xml"


@pytest.fixture
def served(h200: Path, tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """`accelstats serve` on a free loopback port with the H200 replay and a file-devices dir."""
    devs = tmp_path / "devs"
    devs.mkdir()
    (devs / "dev0").write_text("hello")
    port = free_port()
    proc = subprocess.Popen([*CLI, "serve", "--listen", f"127.0.0.1:{port}", "--nvml-replay", str(h200),
                             "--file-devices", str(devs), "--pod-resources-socket", str(tmp_path / "kubelet.sock")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if get(url + "/healthz")[0] == 200:
                break
        except OSError:
            time.sleep(0.1)
    try:
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def test_serve_answers_metrics_healthz_and_landing(served: tuple[str, subprocess.Popen[str]]) -> None:
    url, _ = served
    status, body = get(url + "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(body)}
    up = families["accelstats_gpu_up"].samples
    assert [(s.labels["uuid"], s.value) for s in up] == [("GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c10", 1.0)]
    assert families["accelstats_file_device_size_bytes"].samples[0].value == 5
    assert get(url + "/healthz") == (200, "ok\n")
    status, page = get(url + "/")
    assert status == 200 and 'href="metrics"' in page
    assert get(url + "/nope")[0] == 404


def test_serve_without_a_web_config_loads_no_web_config_stack(served: tuple[str, subprocess.Popen[str]]) -> None:
    """docs/design.md: PyYAML, bcrypt and cryptography are imported only with --web-config (the three
    extension modules cost about 10 MiB of RSS); their shared objects are not mapped."""
    url, proc = served
    assert get(url + "/metrics")[0] == 200
    mapped = Path(f"/proc/{proc.pid}/maps").read_text()
    assert [m for m in ("/yaml/", "/bcrypt/", "/cryptography/", "_cffi_backend") if m in mapped] == []


def test_serve_without_a_kubelet_loads_no_grpc(served: tuple[str, subprocess.Popen[str]]) -> None:
    """Start-up (issue 29): the kubernetes collector imports gRPC and the generated protos when the
    pod-resources socket is there, not before (about 40 ms of the exec-to-first-answer time, and gRPC's
    threads and RSS, on every host without a kubelet)."""
    url, proc = served
    assert get(url + "/metrics")[0] == 200
    mapped = Path(f"/proc/{proc.pid}/maps").read_text()
    assert [m for m in ("/grpc/_cython/", "/google/_upb/") if m in mapped] == []


def test_sigterm_stops_serve_cleanly(served: tuple[str, subprocess.Popen[str]]) -> None:
    _, proc = served
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0


def test_listen_port_in_use_is_one_line_exit_2(h200: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run("serve", "--listen", f"127.0.0.1:{port}", "--nvml-replay", str(h200))
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == [f"accelstats: error: cannot listen on 127.0.0.1:{port}: Address already in use"]


def test_missing_file_devices_dir_exit_2(h200: Path, tmp_path: Path) -> None:
    proc = run("dump", "--nvml-replay", str(h200), "--file-devices", str(tmp_path / "absent"))
    assert proc.returncode == 2
    assert f"accelstats: error: file-devices directory {tmp_path / 'absent'} does not exist" in proc.stderr


@pytest.mark.parametrize(
    ("name", "content", "where"),
    [
        ("bad.xml", "<nvidia_smi_log>\n  <gpu>\n</nvidia_smi_log>\n", "line 3"),
        ("bad.toml", "[[gpu]]\ncapture = \n", "line 2"),
    ],
)
def test_replay_file_that_does_not_parse_names_file_and_position(
        tmp_path: Path, name: str, content: str, where: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    proc = run("dump", "--nvml-replay", str(path))
    assert proc.returncode == 2
    assert str(path) in proc.stderr and where in proc.stderr
    assert proc.stderr.count("accelstats: error:") == 1


def test_unknown_collector_in_config_names_file_and_key(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('collectors = ["nvidia", "gpus"]\n')
    proc = run("dump", "--config", str(cfg))
    assert proc.returncode == 2
    assert f"accelstats: error: {cfg}: key 'collectors': unknown collector 'gpus'" in proc.stderr


def test_bad_config_names_file_and_key(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('listen = "everywhere"\n')
    proc = run("dump", "--config", str(cfg))
    assert proc.returncode == 2
    assert f"accelstats: error: {cfg}: key 'listen': expected HOST:PORT" in proc.stderr


def test_command_line_wins_over_config(tmp_path: Path, h200: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'nvml_replay = "{tmp_path / "absent.xml"}"\n')
    proc = run("devices", "--json", "--config", str(cfg), "--nvml-replay", str(h200))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)[0]["name"] == "NVIDIA H200"


def test_devices_json_h200(h200: Path) -> None:
    proc = run("devices", "--json", "--nvml-replay", str(h200))
    assert proc.returncode == 0, proc.stderr
    (gpu,) = json.loads(proc.stdout)
    assert gpu["uuid"] == "GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c10"
    assert (gpu["index"], gpu["minor"], gpu["pci_bus_id"]) == (0, 0, "00000000:00:06.0")
    assert gpu["memory_total_bytes"] == 143771 * 2**20
    assert gpu["source"] == "replay" and gpu["up"] is True


def test_no_nvidia_here_still_serves_files_and_containers(tmp_path: Path) -> None:
    """This host has no NVIDIA PCI device: gpu families absent, one reason logged, files still there."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("")
    proc = run("dump", "--file-devices", str(tmp_path / "d"), "--sysfs-root", str(tmp_path / "sys"))
    assert proc.returncode == 0, proc.stderr
    assert "accelstats_gpu_" not in proc.stdout
    assert 'accelstats_file_device_info{device="f"' in proc.stdout
    assert 'accelstats_scrape_collector_success{collector="nvidia"} 0.0' in proc.stdout
    reasons = [line for line in proc.stderr.splitlines() if "NVIDIA GPUs not available" in line]
    assert len(reasons) == 1 and "no NVIDIA PCI device" in reasons[0]
    # said in /metrics too, as a state and not only a failure: the alert rules tell it from NVML broken
    assert (f'accelstats_nvml_state{{reason="no NVIDIA PCI device (vendor 0x10de) under {tmp_path}/sys/bus/pci/'
            f'devices",state="no_device"}} 1.0') in proc.stdout
    devices = run("devices", "--sysfs-root", str(tmp_path / "sys"))
    assert devices.returncode == 0 and "# NVIDIA: no NVIDIA PCI device" in devices.stderr


def test_the_landing_page_says_why_there_is_no_gpu(tmp_path: Path) -> None:
    port = free_port()
    server = subprocess.Popen([*CLI, "serve", "--listen", f"127.0.0.1:{port}", "--sysfs-root", str(tmp_path / "sys"),
                               "--cgroup-root", str(tmp_path), "--proc-root", str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                get(f"http://127.0.0.1:{port}/metrics")
                break
            except OSError:
                assert time.monotonic() < deadline, "serve did not answer"
                time.sleep(0.05)
        status, page = get(f"http://127.0.0.1:{port}/")
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert status == 200 and "NVIDIA: this host has no NVIDIA device (no NVIDIA PCI device" in page


@pytest.mark.parametrize("capture", ["h200/nvidia-smi-q.xml", "public/a100-sxm4-v12.xml",
                                     "public/dual_a5000-v13.xml", "public/tesla-t4.xml"])
def test_promtool_accepts_the_exposition(fixtures_dir: Path, capture: str) -> None:
    if shutil.which("promtool") is None:
        if in_ci():
            pytest.fail("promtool missing under CI=true: .ci/run must install Debian's prometheus")
        pytest.skip("promtool (Debian package prometheus) not installed")
    proc = run("dump", "--nvml-replay", str(fixtures_dir / capture))
    assert proc.returncode == 0, proc.stderr
    list(text_string_to_metric_families(proc.stdout))  # client_python's parser accepts it too
    check = subprocess.run(["promtool", "check", "metrics"], input=proc.stdout, capture_output=True, text=True,
                           timeout=60, check=False)
    assert check.returncode == 0, check.stdout + check.stderr


def test_head_on_metrics_answers_without_collecting(served: tuple[str, subprocess.Popen[str]]) -> None:
    url, _ = served
    req = urllib.request.Request(url + "/metrics", method="HEAD")
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200 and r.read() == b""


def test_listen_on_every_interface_answers_ipv4_and_ipv6(h200: Path) -> None:
    port = free_port()
    proc = subprocess.Popen([*CLI, "serve", "--listen", f":{port}", "--nvml-replay", str(h200)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        hosts = ["127.0.0.1"] + (["[::1]"] if socket.has_ipv6 and _ipv6_loopback() else [])
        for host in hosts:
            deadline = time.monotonic() + 30
            while True:
                try:
                    assert get(f"http://{host}:{port}/healthz") == (200, "ok\n")
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("option", ["--cgroup-root", "--proc-root"])
def test_roots_that_are_not_directories_exit_2(tmp_path: Path, option: str) -> None:
    proc = run("containers", option, str(tmp_path / "absent"))
    assert proc.returncode == 2
    assert "is not a directory" in proc.stderr and proc.stderr.count("accelstats: error:") == 1


def test_the_containers_table_shows_no_control_characters() -> None:
    """Names come from runtime state files; an escape sequence in one must not reach the terminal."""
    from accelstats.cli import _shown
    assert _shown("evil\x1b[2J\nname\u202e") == "evil?[2J?name?"
    assert _shown("plain-name_1.2") == "plain-name_1.2"


# (arguments, the one line of error it must print): click's own usage errors included
@pytest.mark.parametrize(("args", "message"), [
    (["serve", "--collector", "bogus"], "accelstats: error: Invalid value for '--collector': 'bogus' is not one of "),
    (["dump", "--log-level", "LOUD"], "accelstats: error: Invalid value for '--log-level': 'LOUD' is not one of "),
    (["dump", "--no-such-option"], "accelstats: error: No such option '--no-such-option'"),
    (["no-such-command"], "accelstats: error: No such command 'no-such-command'"),
    (["dump", "--config", "/nonexistent/config.toml"], "accelstats: error: /nonexistent/config.toml: cannot read"),
    (["dump", "--nvml-replay", "/nonexistent/capture.xml"], "accelstats: error: cannot read /nonexistent/capture.xml"),
])
def test_user_errors_are_one_line_exit_2(args: list[str], message: str) -> None:
    proc = run(*args)
    assert proc.returncode == 2
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stdout == ""


def test_a_replay_named_by_the_config_that_does_not_exist_names_the_file_and_key(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'nvml_replay = "{tmp_path}/absent.xml"\n')
    proc = run("dump", "--config", str(config))
    assert proc.returncode == 2
    assert proc.stderr == f"accelstats: error: {config}: key 'nvml_replay': {tmp_path}/absent.xml does not exist\n"


def test_roots_and_replays_that_hold_nothing_get_one_warning_each(tmp_path: Path) -> None:
    """A mis-mounted /host (an empty cgroup or proc root), a missing rootfs, an empty scenario: the
    command still runs, and says so once each."""
    empty = tmp_path / "empty"
    empty.mkdir()
    scenario = tmp_path / "none.toml"
    scenario.write_text("")
    proc = run("dump", "--cgroup-root", str(empty), "--proc-root", str(empty), "--rootfs", str(tmp_path / "absent"),
               "--nvml-replay", str(scenario))
    assert proc.returncode == 0, proc.stderr
    warnings = [line.split(" WARNING ", 1)[1] for line in proc.stderr.splitlines() if " WARNING " in line]
    for expected in (f"--cgroup-root {empty} is empty", f"--proc-root {empty} is empty",
                     f"--rootfs {tmp_path / 'absent'} does not exist", f"{scenario}: the replay holds no GPU"):
        assert sum(expected in w for w in warnings) == 1, (expected, warnings)


def test_serve_help_says_when_files_and_mps_run() -> None:
    text = " ".join(run("serve", "--help").stdout.split())
    assert "(default on when a file-devices directory is set)" in text
    assert "(default on when the config has [mps] resources)" in text


def test_one_shot_commands_do_not_promise_a_retry(tmp_path: Path) -> None:
    proc = run("dump", "--cgroup-root", str(tmp_path), "--proc-root", str(tmp_path))
    assert proc.returncode == 0
    said = [line for line in proc.stderr.splitlines() if "NVIDIA GPUs not available" in line]
    assert len(said) == 1 and "retrying" not in said[0], proc.stderr


@pytest.mark.parametrize("fmt", ["json", "logfmt"])
def test_log_formats_give_one_record_per_line(tmp_path: Path, fmt: str) -> None:
    import re

    proc = run("dump", "--log-format", fmt, "--cgroup-root", str(tmp_path), "--proc-root", str(tmp_path))
    assert proc.returncode == 0
    lines = proc.stderr.splitlines()
    assert any("NVIDIA GPUs not available" in line for line in lines)
    for line in lines:
        if fmt == "json":
            record = json.loads(line)
            assert set(record) >= {"time", "level", "logger", "msg"} and record["time"].endswith("Z")
        else:
            assert re.fullmatch(r'time=\S+Z level=(debug|info|warning|error) logger=\S+ msg=("(\\.|[^"\\])*"|\S+)'
                                r'( \w+=("(\\.|[^"\\])*"|\S+))*', line), line


def test_log_format_from_the_config(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'log_format = "json"\ncgroup_root = "{tmp_path}"\nproc_root = "{tmp_path}"\n')
    proc = run("dump", "--config", str(config))
    assert proc.returncode == 0 and all(json.loads(line)["msg"] for line in proc.stderr.splitlines())
    config.write_text('log_format = "xml"\n')
    proc = run("dump", "--config", str(config))
    assert proc.returncode == 2 and "key 'log_format': expected one of text, json, logfmt" in proc.stderr
