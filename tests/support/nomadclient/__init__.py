"""A Nomad client emulator for tests and benchmarks: launches the device plugin as Nomad does
(go-plugin handshake, gRPC over a Unix socket, cty msgpack configuration). Not part of the product."""
