"""atheris harness: the Nomad plugin's SetConfig msgpack decoder on arbitrary bytes (docs/fuzzing.md).

``accelstats.nomad.config.decode`` may raise only ``accelstats.settings.ConfigError``. Seeds: valid
configs encoded as a Nomad client does (``ctymsgpack.encode_for_spec`` over the plugin's schema).

``--allow-known`` (first argument, before the libFuzzer flags) lets TypeError and ValueError pass: while
such an escape is known and unfixed (those of tests/fuzz/test_fuzz_plugin_config.py REGRESSIONS were,
until 26629fe), a run then looks for other escapes instead of stopping at it within seconds.
"""

from __future__ import annotations

import sys

import atheris
from _common import seed_corpus

with atheris.instrument_imports(include=["accelstats"]):
    from support.nomadclient.ctymsgpack import encode_for_spec

    from accelstats.nomad import config as plugin_config
    from accelstats.nomad.proto import hclspec_pb2
    from accelstats.settings import ConfigError

ALLOW_KNOWN = len(sys.argv) > 1 and sys.argv[1] == "--allow-known"
if ALLOW_KNOWN:
    del sys.argv[1]
KNOWN: tuple[type[Exception], ...] = (TypeError, ValueError) if ALLOW_KNOWN else ()
SEEDS = [
    {},
    {"enabled": False, "ignored_gpu_ids": ["GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c10"], "fingerprint_period": "30s"},
    {"metrics_listen": "127.0.0.1:9400", "file_devices": {"dir": "/dev/fake", "list_period": "1s"}},
    {"mps": {"timeout": "5s", "exclusive_process": True,
             "resource": [{"name": "nvidia.com/gpu", "replicas": 4, "devices": ["0", "GPU-1"]}]}},
]


def test_one_input(data: bytes) -> None:
    try:
        plugin_config.decode(data)
    except ConfigError:
        return
    except KNOWN:  # only with --allow-known: the known TypeError / ValueError escapes
        return


if __name__ == "__main__":
    schema = plugin_config.schema(hclspec_pb2)
    seed_corpus(sys.argv, (encode_for_spec(schema, s, number_mode=m) for s in SEEDS for m in ("cty", "string")))
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
