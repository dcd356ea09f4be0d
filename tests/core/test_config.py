"""Settings: the TOML config file, its errors, and command-line precedence."""

from __future__ import annotations

from pathlib import Path

import pytest

from accelstats.config import check_perm, load_config, parse_listen
from accelstats.settings import ConfigError, Settings


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [
        ("127.0.0.1:9847", "127.0.0.1", 9847),
        (":9100", "", 9100),
        ("[::1]:9847", "::1", 9847),
        ("localhost:1", "localhost", 1),
    ],
)
def test_listen_parses(text: str, host: str, port: int) -> None:
    assert parse_listen(text) == (host, port)


@pytest.mark.parametrize("text", ["9847", "host:", "host:0", "host:65536", "host:http", ""])
def test_listen_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="--listen: expected HOST:PORT"):
        parse_listen(text)


def test_full_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        'listen = "127.0.0.1:9999"\n'
        'nvml_replay = "scenario.toml"\n'
        'cgroup_root = "/host/sys/fs/cgroup"\n'
        'proc_root = "/host/proc"\n'
        'log_level = "DEBUG"\n'
        "nvml_retry_interval = 5\n"
        'collectors = ["nvidia"]\n'
        "[file_devices]\n"
        'dir = "devs"\n'
        'unhealthy_perm = "-rw-------"\n'
        'vendor = "acme"\n'
    )
    s = load_config(cfg)
    assert (s.listen_host, s.listen_port) == ("127.0.0.1", 9999)
    assert s.nvml_replay == tmp_path / "scenario.toml"  # relative to the file
    assert s.cgroup_root == Path("/host/sys/fs/cgroup")
    assert s.proc_root == Path("/host/proc")
    assert s.log_level == "debug"
    assert s.nvml_retry_interval == 5.0
    assert s.collectors == ("nvidia",)
    assert s.file_devices.dir == tmp_path / "devs"
    assert s.file_devices.unhealthy_perm == "-rw-------"
    assert s.file_devices.vendor == "acme"
    assert s.file_devices.type == "file"  # untouched default


def test_empty_config_keeps_defaults(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("")
    assert load_config(cfg) == Settings()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('listen = "nope"', r"c\.toml: key 'listen': expected HOST:PORT"),
        ("listen = 9847", r"c\.toml: key 'listen': expected str, got int"),
        ('lissten = ":1"', r"c\.toml: unknown key 'lissten'"),
        ('log_level = "loud"', r"c\.toml: key 'log_level': expected one of"),
        ("nvml_retry_interval = -1", r"c\.toml: key 'nvml_retry_interval': must be a finite number > 0"),
        ("nvml_retry_interval = nan", r"c\.toml: key 'nvml_retry_interval': must be a finite number > 0"),
        ("nvml_deadline = inf", r"c\.toml: key 'nvml_deadline': must be a finite number > 0"),
        ("nvml_retry_interval = true", r"c\.toml: key 'nvml_retry_interval': expected int or float"),
        ('cgroup_root = ""', r"c\.toml: key 'cgroup_root': must not be empty"),
        ("collectors = [1]", r"c\.toml: key 'collectors\[0\]': expected str"),
        ("[file_devices]\ndirr = 'x'", r"c\.toml: unknown key 'file_devices\.dirr'"),
        ("[file_devices]\nunhealthy_perm = 'rwx'", r"c\.toml: key 'file_devices\.unhealthy_perm'"),
        ('listen = "a"\nx = = 1', r"c\.toml: invalid TOML: .*line 2, column 5"),
    ],
)
def test_config_errors_name_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(cfg)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"absent\.toml: cannot read"):
        load_config(tmp_path / "absent.toml")


@pytest.mark.parametrize("perm", ["-rwxrwxrwx", "----------", "-rw-r--r--", "drwxr-xr-x", "-rwsr-xr-t"])
def test_permission_strings_accepted(perm: str) -> None:
    assert check_perm(perm, "x") == perm


@pytest.mark.parametrize("perm", ["rwxrwxrwx", "-rwxrwxrwxx", "-xwrrwxrwx", "?rwxrwxrwx"])
def test_permission_strings_rejected(perm: str) -> None:
    with pytest.raises(ConfigError):
        check_perm(perm, "x")


def test_mps_table(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[mps]\nroot = "mps"\ntimeout = 2\n[[mps.resources]]\nname = "nvidia.com/gpu"\nreplicas = 4\n'
                   '[[mps.resources]]\nname = "small"\nreplicas = 2\ndevices = ["GPU-abc", 1]\n')
    mps = load_config(cfg).mps
    assert (mps.root, mps.timeout, mps.exclusive_process) == (tmp_path / "mps", 2.0, False)
    assert [(r.name, r.replicas, r.devices) for r in mps.resources] == [
        ("nvidia.com/gpu", 4, "all"), ("small", 2, ("GPU-abc", 1))]
    cfg.write_text("[mps]\nexclusive_process = true\n")
    assert load_config(cfg).mps.exclusive_process is True  # the opt-in (spec/mps.md, "Compute mode")


@pytest.mark.parametrize(("text", "message"), [
    ('[[mps.resources]]\nname = "a"\nreplicas = 1\n', r"resource 'a': replicas must be at least 2"),
    ('[[mps.resources]]\nname = "../x"\nreplicas = 2\n', r"'mps.resources\[0\].name': '../x' is not a usable"),
    ('[[mps.resources]]\nname = "a"\nreplicas = 2\ndevices = []\n', r"resource 'a': devices must be"),
    ('[[mps.resources]]\nname = "a"\nreplicas = 2\n[[mps.resources]]\nname = "a"\nreplicas = 3\n',
     r"resource 'a' is configured twice"),
    ("[mps]\ntimeout = 0\n", r"'mps.timeout': must be a finite number > 0"),
    ("[mps]\nroots = 1\n", r"unknown key 'mps.roots'"),
    ('[mps]\nexclusive_process = "yes"\n', r"'mps.exclusive_process'"),
])
def test_mps_table_errors_name_the_resource_and_rule(tmp_path: Path, text: str, message: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(cfg)
