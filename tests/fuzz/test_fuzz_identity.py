"""Fuzzing container identity from cgroup paths and ``/proc/<pid>/cgroup`` (accelstats/cgroups/identity.py).

Documented error type: none. :func:`identify`, :func:`identify_with_root`, :func:`is_host_cgroup` and
:func:`parse_proc_cgroup` "never raise" on any string; a path no rule recognises gives ``None``.
Paths are built from the formats of spec/cgroups.md §3 with random ids, pod UIDs, Nomad allocations
and task names, LXC/nspawn names, and the sub-cgroups containers create below their own.
"""

from __future__ import annotations

import subprocess
from typing import NamedTuple

import pytest
from conftest import require_tool
from hypothesis import example, given, settings
from hypothesis import strategies as st

from accelstats.cgroups.identity import (
    RUNTIMES,
    ContainerIdentity,
    cgroup_path_for,
    identify,
    identify_with_root,
    is_host_cgroup,
    parse_proc_cgroup,
)

from .profiles import fuzz_settings

hex64 = st.text("0123456789abcdef", min_size=64, max_size=64)
uuids = st.uuids().map(str)
qos = st.sampled_from(["burstable", "besteffort"])
# Nomad task names: letters, digits and the punctuation job files use (dots included: the task is
# everything after the alloc UUID's '.').
tasks = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.", min_size=1, max_size=30).filter(
    lambda t: not t.endswith(".mount"))
# LXC/nspawn names: no '/', no surrounding whitespace; not "lxc" (then "/lxc/lxc/<x>" names <x>).
names = st.text(st.characters(blacklist_characters="/", blacklist_categories=("Cs", "Zs", "Cc", "Zl", "Zp")),
                min_size=1, max_size=20).filter(lambda n: n != "lxc" and not n.endswith(".mount"))
# What a container may create below its own cgroup (podman/crun's "container", systemd in the container).
subcgroups = st.sampled_from(["", "/container", "/init.scope", "/app/worker", "/system.slice/cron.service"])


class Case(NamedTuple):
    """A generated path, the container's own cgroup (the path without sub-cgroups) and its identity."""

    path: str
    root: str
    identity: ContainerIdentity


@st.composite
def container_paths(draw: st.DrawFn) -> Case:
    """One path of a §3 format, with random ids, and the identity the spec gives it."""
    cid, pod, alloc, task, name = draw(hex64), draw(uuids), draw(uuids), draw(tasks), draw(names)
    pod_ = pod.replace("-", "_")
    q = draw(qos)
    kube_slices = draw(st.sampled_from([
        f"/kubepods.slice/kubepods-{q}.slice/kubepods-{q}-pod{pod_}.slice",
        f"/kubepods.slice/kubepods-pod{pod_}.slice",
    ]))
    kube_dirs = draw(st.sampled_from([f"/kubepods/{q}/pod{pod}", f"/kubepods/pod{pod}"]))
    nomad = ContainerIdentity("nomad", f"{alloc}.{task}", alloc_id=alloc, task=task)
    formats = [
        (f"/docker/{cid}", ContainerIdentity("docker", cid)),
        (f"/system.slice/docker-{cid}.scope", ContainerIdentity("docker", cid)),
        (f"{kube_dirs}/{cid}", ContainerIdentity("containerd", cid, pod_uid=pod)),
        (f"{kube_dirs}/docker-{cid}", ContainerIdentity("docker", cid, pod_uid=pod)),
        (f"{kube_slices}/cri-containerd-{cid}.scope", ContainerIdentity("containerd", cid, pod_uid=pod)),
        (f"{kube_slices}/crio-{cid}.scope", ContainerIdentity("cri-o", cid, pod_uid=pod)),
        (f"{kube_slices}/docker-{cid}.scope", ContainerIdentity("docker", cid, pod_uid=pod)),
        (f"/system.slice/containerd.service/system.slice:cri-containerd:{cid}", ContainerIdentity("containerd", cid)),
        (f"/system.slice/containerd.service/kubepods-{q}-pod{pod_}.slice:cri-containerd:{cid}",
         ContainerIdentity("containerd", cid, pod_uid=pod)),
        (f"/machine.slice/libpod-{cid}.scope", ContainerIdentity("podman", cid)),
        (f"/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{cid}.scope",
         ContainerIdentity("podman", cid)),
        (f"/libpod_parent/libpod-{cid}", ContainerIdentity("podman", cid)),
        (f"/nomad.slice/{draw(st.sampled_from(['share', 'reserve']))}.slice/{alloc}.{task}.scope", nomad),
        (f"/nomad.slice/{alloc}.{task}.scope", nomad),
        (f"/nomad{draw(st.sampled_from(['', '/reserved', '/shared']))}/{alloc}.{task}", nomad),
        (f"/lxc.payload.{name}", ContainerIdentity("lxc", name, name=name)),
        (f"/lxc/{name}", ContainerIdentity("lxc", name, name=name)),
        (f"/machine.slice/systemd-nspawn@{systemd_escape(name)}.service",
         ContainerIdentity("systemd-nspawn", name, name=name)),
    ]
    root, identity = draw(st.sampled_from(formats))
    return Case(root + draw(subcgroups), root, identity)


def systemd_escape(name: str) -> str:
    """``systemd-escape``: '-' and every byte outside [A-Za-z0-9:_.] as ``\\xNN`` (non-ASCII: each
    UTF-8 byte); a leading '.' too."""
    out = []
    for i, byte in enumerate(name.encode()):
        ch = chr(byte)
        safe = ch.isascii() and (ch.isalnum() or ch in ":_.") and not (i == 0 and ch == ".")
        out.append(ch if safe else f"\\x{byte:02x}")
    return "".join(out)


@settings(fuzz_settings(), max_examples=25)
@given(names)
def test_systemd_escape_helper_agrees_with_systemd(name: str) -> None:
    """The generator's escaping is the real ``systemd-escape``'s (names here hold no '/'); skipped
    without it, failed under CI=true (.ci/run installs Debian's systemd)."""
    escape = require_tool("systemd-escape", "systemd")
    out = subprocess.run([escape, "--", name], capture_output=True, text=True, check=True).stdout
    assert out.rstrip("\n") == systemd_escape(name)


def test_nspawn_name_with_non_ascii_characters() -> None:
    """Regression (found by fuzzing): systemd escapes each UTF-8 byte, so ``\\xc2\\xa1`` is ``¡``, not ``Â¡``."""
    found = identify("/machine.slice/systemd-nspawn@\\xc2\\xa1\\x2dx.service")
    assert found == ContainerIdentity("systemd-nspawn", "¡-x", name="¡-x")
    assert identify("/machine.slice/systemd-nspawn@a\\xff.service") == ContainerIdentity(
        "systemd-nspawn", "a\\xff", name="a\\xff")  # not UTF-8: the escape is kept


# spec/cgroups.md §3, the rows that are not containers: (path, is_host_cgroup)
SPEC_NOT_CONTAINERS = [
    (f"/system.slice/var-lib-docker-overlay2-{'0' * 64}-merged.mount", True),  # docker overlay mount unit
    ("/user.slice/user-1000.slice/session-3.scope", True),
    ("/system.slice/nginx.service", True),
    ("/", True),
    (f"/kubepods.slice/kubepods-besteffort.slice/crio-{'0' * 64}", False),  # CRI-O pod sandbox (no .scope)
    # conmon, CRI-O's container monitor: not a container, and never listed as an unknown one either
    (f"/kubepods.slice/kubepods-besteffort.slice/crio-conmon-{'0' * 64}.scope", True),
]


@pytest.mark.parametrize(("path", "host"), SPEC_NOT_CONTAINERS)
def test_spec_rows_that_are_not_containers(path: str, host: bool) -> None:
    assert identify(path) is None
    assert is_host_cgroup(path) is host


# ---------------------------------------------------------------------------- properties


@fuzz_settings()
@given(container_paths())
@example(Case(f"/docker/{'a' * 64}", f"/docker/{'a' * 64}", ContainerIdentity("docker", "a" * 64)))
def test_identity_from_a_generated_path_gives_back_its_ids(case: Case) -> None:
    assert identify(case.path) == case.identity
    assert identify_with_root(case.path) == (case.root, case.identity)


@fuzz_settings()
@given(container_paths(), st.sampled_from(["", " ", "\t", "\n"]), st.booleans(), st.booleans(), st.booleans())
def test_documented_spellings_change_nothing(case: Case, space: str, double: bool, trailing: bool,
                                             deleted: bool) -> None:
    """Empty components, trailing slashes, surrounding whitespace and the kernel's `` (deleted)``."""
    spelled = (case.path.replace("/", "//") if double else case.path) + ("/" if trailing else "")
    spelled = space + spelled + (" (deleted)" if deleted else "") + space
    assert identify_with_root(spelled) == (case.root, case.identity)


@fuzz_settings()
@given(container_paths(), st.sampled_from([".mount", "-merged.mount"]))
def test_a_mount_unit_is_never_a_container(case: Case, suffix: str) -> None:
    assert identify(case.path + "/var-lib-docker-overlay2-x" + suffix) is None


path_texts = st.one_of(
    st.text(),
    st.lists(st.one_of(st.text(max_size=12), st.sampled_from(
        ["docker", "nomad", "lxc", "kubepods", "libpod_parent", "reserved", "system.slice", "x.slice", "a.mount",
         "lxc.payload.", "systemd-nspawn@.service", "pod", "init.scope", "container", ""])), max_size=70).map("/".join),
    container_paths().map(lambda c: c.path).flatmap(
        lambda p: st.integers(0, len(p)).flatmap(lambda i: st.text(max_size=4).map(lambda t: p[:i] + t + p[i + 1:]))),
)


@fuzz_settings()
@given(path_texts)
@example("/" + "/".join(["docker"] * 65) + "/" + "a" * 64)
@example("/lxc/x/\\x")
@example("/machine.slice/systemd-nspawn@\\xff\\xzz.service")
def test_no_path_raises(path: str) -> None:
    """Any string: a known runtime or None; the root is the path up to a component of it."""
    found = identify_with_root(path)
    assert identify(path) == (None if found is None else found[1])
    assert isinstance(is_host_cgroup(path), bool)
    if found is not None:
        root, identity = found
        assert identity.runtime in RUNTIMES and identity.id
        components = [c for c in root.split("/") if c]
        assert root == "/" + "/".join(components)
        given_components = [c for c in path.strip().removesuffix(" (deleted)").split("/") if c]
        assert given_components[: len(components)] == components


# ---------------------------------------------------------------------------- /proc/<pid>/cgroup

controllers = st.sampled_from(["cpu,cpuacct", "devices", "memory", "name=systemd", "pids", "cpuset", "blkio"])


@fuzz_settings()
@given(st.lists(st.tuples(controllers, container_paths().map(lambda c: c.path)), max_size=8, unique_by=lambda t: t[0]),
       st.one_of(st.none(), container_paths().map(lambda c: c.path)))
def test_proc_cgroup_round_trip(v1: list[tuple[str, str]], v2: str | None) -> None:
    lines = [f"{i + 1}:{ctl}:{path}" for i, (ctl, path) in enumerate(v1)]
    lines += [] if v2 is None else [f"0::{v2}"]
    parsed = parse_proc_cgroup("\n".join(lines) + "\n")
    expected = {key: path for ctl, path in v1 for key in ctl.split(",")}
    expected |= {} if v2 is None else {"": v2}
    assert parsed == expected
    assert cgroup_path_for(parsed) == (expected.get("devices", v2))


@fuzz_settings()
@given(st.one_of(st.text(), st.lists(st.tuples(st.text("0123456789", max_size=3), st.text(max_size=10),
                                               path_texts), max_size=6).map(
    lambda ls: "\n".join(":".join(t) for t in ls))))
@example("0::/docker/x\n0::/second\n12:devices:/a:b:c\nx:cpu:/\n3:cpu\n\u0663:cpu:/unicode-digit")
def test_proc_cgroup_never_raises(text: str) -> None:
    """Any text: each key/path pair comes from one well-formed line, and the first line for a key wins."""
    parsed = parse_proc_cgroup(text)
    for key, path in parsed.items():
        first = next(line.strip().split(":", 2) for line in text.splitlines()
                     if (f := line.strip().split(":", 2)) and len(f) == 3 and f[0].isdigit() and f[2].startswith("/")
                     and key in ([""] if f[0] == "0" and not f[1] else f[1].split(",")))
        assert path == first[2]
    assert cgroup_path_for(parsed) == parsed.get("devices", parsed.get(""))
