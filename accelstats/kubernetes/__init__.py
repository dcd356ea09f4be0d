"""Kubernetes: the kubelet's pod-resources API (podresources.py) and what its device IDs name here (device_ids.py).

Not wired into attribution or the metrics catalog yet (issue 27).
"""
