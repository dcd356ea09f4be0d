"""One manager factory for both front ends, and its errors named by the setting at fault.

:func:`accelstats.manager.build_manager` builds the manager for ``accelstats`` and for the Nomad
plugin. A setting that loads but cannot be set up is a :class:`accelstats.settings.SetupError` whose
``field`` is the setting (``nvml_replay``, ``file_devices.dir``, ``collectors``), and each front end
words it as its own input names it: ``<file>: key '<field>': …`` for the TOML file, the plain reason
for a command-line flag, ``config: <field>: …`` for the plugin's block. Before, the plugin labelled
every setup error ``file_devices.dir``.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from support.nomadclient.ctymsgpack import encode_for_spec

from accelstats.manager import build_manager
from accelstats.nomad import config as plugin_config
from accelstats.nomad.plugin import DevicePluginState
from accelstats.nomad.proto import hclspec_pb2
from accelstats.settings import ConfigError, FileDevicesSettings, Settings, SetupError

CLI = [sys.executable, "-m", "accelstats"]
BAD_CAPTURE = "<nvidia_smi_log>\n  <gpu>\n</nvidia_smi_log>\n"  # does not parse: line 3


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, check=False)


def set_plugin_config(config: dict[str, Any]) -> DevicePluginState:
    """A plugin's state after SetConfig with ``config`` (encoded as a Nomad client does)."""
    state = DevicePluginState(threading.Event())
    state.set_config(encode_for_spec(plugin_config.schema(hclspec_pb2), config))
    return state


@pytest.fixture
def bad_replay(tmp_path: Path) -> Path:
    path = tmp_path / "bad.xml"
    path.write_text(BAD_CAPTURE)
    return path


# ---------------------------------------------------------------------------- the factory itself


def test_the_factory_names_the_setting_of_each_setup_error(tmp_path: Path, bad_replay: Path,
                                                           fixtures_dir: Path) -> None:
    h200 = fixtures_dir / "h200" / "nvidia-smi-q.xml"
    cases = [
        (Settings(nvml_replay=bad_replay), "nvml_replay", f"{bad_replay}"),
        (Settings(nvml_replay=h200, file_devices=FileDevicesSettings(dir=tmp_path / "absent")),
         "file_devices.dir", f"file-devices directory {tmp_path / 'absent'} does not exist"),
        (Settings(nvml_replay=h200, collectors=("nvidia", "gpus")), "collectors", "unknown collector 'gpus'"),
    ]
    for settings, field, reason in cases:
        with pytest.raises(SetupError) as err:
            build_manager(settings)
        assert err.value.field == field and reason in err.value.reason, (field, err.value)
        assert str(err.value) == f"{field}: {err.value.reason}"


def test_the_factory_builds_a_working_manager_for_both_front_ends(fixtures_dir: Path, tmp_path: Path) -> None:
    """The same function, given the settings each front end decodes, gives a manager that collects."""
    h200 = fixtures_dir / "h200" / "nvidia-smi-q.xml"
    config = tmp_path / "config.toml"
    config.write_text(f'nvml_replay = "{h200}"\n')
    from accelstats.config import load_config

    for settings in (load_config(config),
                     plugin_config.decode(encode_for_spec(plugin_config.schema(hclspec_pb2),
                                                          {"nvml_replay": str(h200)}))):
        manager = build_manager(settings)
        try:
            assert [d.name for d in manager.collect().snapshot.devices] == ["NVIDIA H200"]
        finally:
            manager.destroy()
            manager.close()


# ---------------------------------------------------------------------------- the Nomad plugin


def test_a_replay_that_does_not_parse_is_named_nvml_replay_by_the_plugin(bad_replay: Path) -> None:
    with pytest.raises(ConfigError) as err:
        set_plugin_config({"nvml_replay": str(bad_replay)})
    message = str(err.value)
    assert message.startswith("config: nvml_replay: ") and str(bad_replay) in message and "line 3" in message, message
    assert "file_devices" not in message


def test_a_missing_file_devices_dir_is_named_file_devices_dir_by_the_plugin(tmp_path: Path,
                                                                             fixtures_dir: Path) -> None:
    with pytest.raises(ConfigError) as err:
        set_plugin_config({"nvml_replay": str(fixtures_dir / "h200" / "nvidia-smi-q.xml"),
                           "file_devices": {"dir": str(tmp_path / "absent")}})
    assert str(err.value) == f"config: file_devices.dir: file-devices directory {tmp_path / 'absent'} does not exist"


def test_plugin_field_words_settings_paths_as_the_block_does() -> None:
    assert [plugin_config.plugin_field(p) for p in (
        "nvml_replay", "file_devices.dir", "collectors", "web_config", "listen_port", "nomad.fingerprint_period",
        "mps.resources", "mps.resources[3].replicas", "mps.timeout")] == [
        "nvml_replay", "file_devices.dir", "enabled", "metrics_web_config", "metrics_listen", "fingerprint_period",
        "mps.resource", "mps.resource[3].replicas", "mps.timeout"]


# ---------------------------------------------------------------------------- the accelstats command


def test_a_replay_from_the_config_file_that_does_not_parse_names_the_file_and_key(tmp_path: Path,
                                                                                  bad_replay: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'nvml_replay = "{bad_replay}"\n')
    proc = cli("dump", "--config", str(config))
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"accelstats: error: {config}: key 'nvml_replay': {bad_replay}"), proc.stderr
    assert "line 3" in proc.stderr and proc.stderr.count("\n") == 1


def test_a_missing_file_devices_dir_names_the_key_when_the_file_set_it_and_the_flag_when_given(
        tmp_path: Path, fixtures_dir: Path) -> None:
    h200 = fixtures_dir / "h200" / "nvidia-smi-q.xml"
    absent = tmp_path / "absent"
    config = tmp_path / "config.toml"
    config.write_text(f'nvml_replay = "{h200}"\n[file_devices]\ndir = "{absent}"\n')
    proc = cli("dump", "--config", str(config))
    assert proc.returncode == 2
    assert proc.stderr == (f"accelstats: error: {config}: key 'file_devices.dir': file-devices directory {absent} "
                           "does not exist\n")
    flagged = tmp_path / "flagged"
    proc = cli("dump", "--config", str(config), "--file-devices", str(flagged))  # the flag wins, and is named so
    assert proc.returncode == 2
    assert proc.stderr == f"accelstats: error: file-devices directory {flagged} does not exist\n"


def test_a_setconfig_failure_that_is_no_settings_fault_is_internal_and_names_no_field(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What no setting caused is not pinned on one: INTERNAL with the error, not INVALID_ARGUMENT."""
    import grpc

    from accelstats.nomad import plugin
    from accelstats.nomad.proto import base_pb2

    class AbortedError(Exception):
        pass

    class Context:
        def abort(self, code: grpc.StatusCode, details: str) -> None:
            raise AbortedError(code, details)

    def broken(settings: Settings) -> None:
        raise RuntimeError("a bug, not a setting")

    monkeypatch.setattr(plugin, "build_manager", broken)
    servicer = plugin.BasePluginServicer(DevicePluginState(threading.Event()))
    with pytest.raises(AbortedError) as err:
        servicer.SetConfig(base_pb2.SetConfigRequest(msgpack_config=b""), Context())
    code, details = err.value.args
    assert code == grpc.StatusCode.INTERNAL and "a bug, not a setting" in details and "config:" not in details
