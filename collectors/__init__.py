"""Device collectors: read NVIDIA GPUs (NVML or its replay), file devices and MPS daemons.

Nothing here knows about cgroups, Prometheus or gRPC (docs/design.md): collectors fill
:class:`collectors.model.DeviceSnapshot` with plain dataclasses and the ``accelstats`` package
renders them. Imports go one way: ``accelstats`` -> ``collectors``.
"""
