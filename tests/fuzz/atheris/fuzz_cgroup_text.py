"""atheris harness: the cgroup text parsers on arbitrary bytes (docs/fuzzing.md).

``devices.list``, ``mig-minors``, ``/proc/<pid>/cgroup`` and cgroup paths, read as the exporter reads
them (UTF-8 with surrogateescape: a file's bytes are never refused). None of these parsers may
raise at all; the invariants of tests/fuzz/test_fuzz_devices_list.py are checked on each input.
"""

from __future__ import annotations

import sys

import atheris
from _common import seed_corpus

with atheris.instrument_imports(include=["accelstats.cgroups"]):
    from accelstats.cgroups.devices_list import format_rule, gpu_grant, parse_devices_list, parse_mig_minors, parse_rule
    from accelstats.cgroups.identity import identify_with_root, is_host_cgroup, parse_proc_cgroup

SEEDS = [
    b"c 195:0 rwm\nc 195:1 rwm\nc 195:255 rwm\n",
    b"a *:* rwm\n",
    b"c 136:* rwm\nc 10:200 rwm\nc *:* m\nb *:* m\nc 195:255 rw\nc 508:0 rw\nc 195:7 rw\n",
    b"config 1\nmonitor 2\ngpu0/gi11/access 102\ngpu0/gi11/ci0/access 103\n",
    b"12:devices:/docker/" + b"a" * 64 + b"\n0::/kubepods.slice/kubepods-pod1_2.slice/cri-containerd-" + b"b" * 64
    + b".scope\n",
    b"0::/machine.slice/systemd-nspawn@web\\x2d1.service\n1:name=systemd:/nomad/reserved/x.y\n",
]


def test_one_input(data: bytes) -> None:
    text = data.decode("utf-8", "surrogateescape")
    parsed = parse_devices_list(text)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(parsed.rules) + len(parsed.skipped_lines) != len(lines):
        raise AssertionError("a devices.list line is neither a rule nor skipped")
    for rule in parsed.rules:
        if parse_rule(format_rule(rule)) != rule:
            raise AssertionError(f"{rule} does not round-trip")
    gpu_grant(parsed, range(8), caps_major=511, known_caps_minors=range(100, 120))
    caps, skipped = parse_mig_minors(text)
    if len(caps) + len(skipped) != len(lines):
        raise AssertionError("a mig-minors line is neither a capability nor skipped")
    for path in [*parse_proc_cgroup(text).values(), text]:
        identify_with_root(path)
        is_host_cgroup(path)


if __name__ == "__main__":
    seed_corpus(sys.argv, SEEDS)
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
