#!/usr/bin/env bash
# Regenerate the Python protobuf/gRPC modules of Nomad's device-plugin protocol
# (accelstats/nomad/proto/*_pb2.py, *_pb2_grpc.py, *_pb2.pyi) and of the
# kubelet's pod-resources API (accelstats/kubernetes/proto/*) from the .proto
# files next to them (Nomad's unchanged; the kubelet's written from upstream's
# facts, see its header). Run from anywhere; it works from the repo root so
# that the generated modules import each other as
# `from accelstats.nomad.proto import ...`.
#
#   scripts/gen-protos.sh              regenerate in place
#   scripts/gen-protos.sh --out DIR    write DIR/accelstats/{nomad,kubernetes}/proto/* instead
#                                      (tests/nomad/test_protos.py and
#                                      tests/kubernetes/test_protos.py compare them byte for byte)
#
# Pinned generator: grpcio-tools==1.63.2 (bundled protoc 26.1, "Protobuf Python
# Version: 5.26.1"). It runs in the Python $PYTHON names (default python3) when
# that one has the pinned version, else in a throwaway virtual environment made
# from it here; never in the environment accelstats runs or is tested in:
# grpcio-tools 1.63.2 requires protobuf < 6, and the runtime dependencies must
# resolve as `pip install .` resolves them (protobuf 7 today; pyproject.toml).
#
# Why 1.63.2: its output carries no protobuf runtime-version check and only a
# warning (not an error) when grpcio < 1.63.2, so it loads on protobuf >= 5.26.1
# (it has run on 5.29 and 7.36; CI runs the suite on systemd/constraints.txt's)
# and grpcio >= 1.63.2: pyproject.toml's runtime lower bounds. A newer
# grpcio-tools writes a check that the protobuf runtime is at least its own
# version, which would raise those bounds. A different version writes different
# bytes, which tests/nomad/test_protos.py reports as stale: bump the pin here
# (the test reads it from this line) together with the runtime lower bounds.
set -euo pipefail

GRPCIO_TOOLS_VERSION=1.63.2

out=.
if [ "${1:-}" = "--out" ] && [ -n "${2:-}" ] && [ $# -eq 2 ]; then
  out=$(cd "$2" && pwd)
elif [ $# -ne 0 ]; then
  echo "usage: $0 [--out DIR]" >&2
  exit 2
fi

cd "$(dirname "$0")/.."

version_of() {
  "$1" -c 'from importlib.metadata import version; print(version("grpcio-tools"))' 2>/dev/null || true
}

PY=${PYTHON:-python3}
if [ "$(version_of "$PY")" != "$GRPCIO_TOOLS_VERSION" ]; then
  venv=$(mktemp -d "${TMPDIR:-/tmp}/gen-protos.XXXXXX")
  trap 'rm -rf "$venv"' EXIT
  echo "gen-protos: installing grpcio-tools==$GRPCIO_TOOLS_VERSION in a throwaway virtual environment of $PY" >&2
  "$PY" -m venv "$venv"
  if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check --only-binary=:all: \
       "grpcio-tools==$GRPCIO_TOOLS_VERSION"; then
    echo "gen-protos: could not install grpcio-tools==$GRPCIO_TOOLS_VERSION for $("$PY" --version) (pip's" \
         "error above; it has wheels for Python 3.8-3.12 only: set PYTHON to one of those)" >&2
    exit 1
  fi
  PY=$venv/bin/python
fi

"$PY" -m grpc_tools.protoc -I . --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" \
  accelstats/nomad/proto/*.proto accelstats/kubernetes/proto/*.proto
echo "gen-protos: generated accelstats/nomad/proto and accelstats/kubernetes/proto in $out with grpcio-tools $(version_of "$PY")" >&2
