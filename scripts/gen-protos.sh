#!/usr/bin/env bash
# Regenerate the Python protobuf/gRPC modules of Nomad's device-plugin protocol
# (accelstats/nomad/proto/*_pb2.py, *_pb2_grpc.py, *_pb2.pyi) from the .proto
# files next to them. Run from anywhere; it works from the repo root so that
# the generated modules import each other as `from accelstats.nomad.proto import ...`.
#
# Pinned generator: grpcio-tools==1.63.2 (bundled protoc 26.1, "Protobuf Python
# Version: 5.26.1"). Its output carries no protobuf runtime-version check and
# only a warning (not an error) when grpcio < 1.63.2, so it loads on
# protobuf >= 5.26.1 (also 6.x) and grpcio >= 1.63.2; pyproject.toml's runtime
# bounds match. A different grpcio-tools version writes different bytes, which
# tests/nomad/test_protos.py reports as stale: install the pinned one
#   python3 -m pip install 'grpcio-tools==1.63.2'
# (it is in the `test` extra), or bump the pin here, in pyproject.toml and in
# tests/nomad/test_protos.py together with the runtime lower bounds.
set -euo pipefail

GRPCIO_TOOLS_VERSION=1.63.2
PY=${PYTHON:-python3}

cd "$(dirname "$0")/.."

have=$("$PY" -c 'from importlib.metadata import version; print(version("grpcio-tools"))' 2>/dev/null || true)
if [ "$have" != "$GRPCIO_TOOLS_VERSION" ]; then
  echo "gen-protos: need grpcio-tools==$GRPCIO_TOOLS_VERSION, found '${have:-none}'." >&2
  echo "  $PY -m pip install 'grpcio-tools==$GRPCIO_TOOLS_VERSION'" >&2
  exit 1
fi

"$PY" -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. accelstats/nomad/proto/*.proto
echo "gen-protos: regenerated accelstats/nomad/proto with grpcio-tools $have"
