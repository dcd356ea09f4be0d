"""Protobuf/gRPC code for the kubelet's pod-resources API (v1); regenerate with scripts/gen-protos.sh."""
