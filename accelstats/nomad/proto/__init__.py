"""Protobuf/gRPC code for Nomad's device-plugin protocol; regenerate with scripts/gen-protos.sh."""
