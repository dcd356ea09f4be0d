"""Who could have made a cgroup: a runtime (root), or any user with a delegated subtree.

A container's identity is only believed for a cgroup that only root could have created: anyone with
a delegated cgroup subtree (systemd delegates ``user@<uid>.service`` to every logged-in user's
manager; an operator may chown any cgroup to a user, cgroup-v2.rst "Delegation") can name a cgroup
``docker-<someone else's id>.scope``.  docs/containers.md, "No spoofing".
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_USER_MANAGER_RE = re.compile(r"user@[0-9]+\.service")


def untrusted_because(hierarchy: Path, path: str, root_fd: int | None = None,
                      parents: dict[str, str | None] | None = None) -> str | None:
    """Why the cgroup ``path`` (as the kernel names it, in the hierarchy mounted at ``hierarchy``)
    may have been made by a user rather than a runtime; ``""`` when only root could have made it;
    ``None`` when its parent is gone (removed during the collection, or pulled away on purpose).

    Untrusted: a ``user@<uid>.service`` component, or a parent cgroup a user may write to (owned by
    another uid than root, or writable by group or others).  The parent, not the cgroup itself, says
    who could create it: runtimes chown a container's own cgroup to its user-namespaced root user
    (unprivileged LXC, runc with a user namespace), which must not make the container untrusted.
    The parent of podman's ``container`` payload child is looked at for its parent.  The parent is
    ``stat``-ed relative to the hierarchy (``root_fd``: an ``O_PATH`` descriptor of it, opened here
    when None), so no ``PATH_MAX`` limit applies to the whole path; any error but "gone" is an
    untrusted answer, never a trusted one.  ``parents``: answers already found for parent cgroups in
    this collection, by parent path (filled here): the containers of a host share a few parents, so one
    ``stat`` each; a caller keeps it for one collection only, so a changed owner or mode is seen at the
    next one.  Never raises ``OSError``.
    """
    if "user@" in path:
        for comp in path.split("/"):
            if _USER_MANAGER_RE.fullmatch(comp):
                return f"it is under {comp}"
    if parents is None:
        return parent_untrusted_because(hierarchy, path, root_fd)
    parent = _parent(path)
    try:
        return parents[parent]
    except KeyError:
        found = parents[parent] = parent_untrusted_because(hierarchy, path, root_fd)
        return found


def _parent(path: str) -> str:
    """The parent cgroup whose owner and mode :func:`parent_untrusted_because` looks at (relative to the
    hierarchy, ``.`` for its root)."""
    if "//" not in path:  # the kernel's form (one slash between names): no empty names to drop
        head, _, last = path.strip("/").rpartition("/")
        if last == "container":  # podman's payload child: its parent is what was named
            head = head.rpartition("/")[0]
        return head or "."
    comps = [c for c in path.split("/") if c]
    if comps and comps[-1] == "container":  # podman's payload child: its parent is what was named
        comps = comps[:-1]
    return "/".join(comps[:-1]) or "."


def parent_untrusted_because(hierarchy: Path, path: str, root_fd: int | None = None) -> str | None:
    """:func:`untrusted_because` without its ``user@<uid>.service`` rule: only who may write to the
    parent cgroup of ``path`` (``""``: root alone; ``None``: the parent is gone).  Used for the
    ``user@<uid>.service`` cgroup itself, which systemd creates in the root-owned
    ``user-<uid>.slice``.  Never raises ``OSError``."""
    parent = _parent(path)
    try:
        root = root_fd if root_fd is not None else os.open(hierarchy, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            st = os.stat(parent, dir_fd=root, follow_symlinks=False)
        finally:
            if root_fd is None:
                os.close(root)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        return f"who made its parent cgroup cannot be checked ({exc.strerror or exc})"
    if st.st_uid != 0:
        return f"its parent cgroup is owned by uid {st.st_uid} (a delegated subtree)"
    if st.st_mode & 0o022:
        return "its parent cgroup is writable by group or others"
    return ""
