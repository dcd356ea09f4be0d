"""Nomad external device plugin for accelstats (go-plugin gRPC server)."""
