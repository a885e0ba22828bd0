"""A sandbox's files as a tar stream and back, stdlib only: how the docker backend's
fork copies ``/work`` from one container into another without resolving a path on the
host (issue 45 #3).

Both ends run inside the containers, in children of the sandbox agent that are the
sandbox user (executor/backends/docker/agent.py, which imports this as ``tarcopy``):
:func:`pack` reads only what the sandbox's commands can read, in their own mount
namespace (an absolute link means what it means in the container, and is stored as a
link, never followed); :func:`unpack` writes only what they can write, as their files.
The host only carries the bytes between the two agents.

The working directory itself is not in the stream: the copy's keeps its own owner and
mode (a fresh sandbox's), not the source's.
"""

from __future__ import annotations

import os
import stat
import tarfile
from collections.abc import Iterator
from typing import BinaryIO

#: mode bits a copy never gets (a sandbox's setuid file is no one's to run as it)
DROPPED_BITS = stat.S_ISUID | stat.S_ISGID


class UnsafeMember(ValueError):
    """A member that would land outside the directory (or is a device)."""


def pack(out: BinaryIO, top: str = ".") -> int:
    """Write ``top``'s entries (not ``top`` itself) to ``out`` as an uncompressed tar
    stream; links stored as links, never followed; walked by a stack (any depth). The
    bytes of its regular files."""
    size = 0
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        stack = sorted(os.listdir(top), reverse=True)
        while stack:
            rel = stack.pop()
            path = os.path.join(top, rel)
            try:
                info = tar.gettarinfo(path, arcname=rel)
            except OSError:
                continue  # gone, or unreadable to the sandbox user itself
            if info is None:  # a socket: not copied (tar cannot hold one)
                continue
            if info.isreg():
                try:
                    with open(path, "rb") as f:
                        tar.addfile(info, f)
                except OSError:
                    continue
                size += info.size
                continue
            tar.addfile(info)
            if info.isdir():
                try:
                    names = os.listdir(path)
                except OSError:
                    continue
                stack.extend(os.path.join(rel, n) for n in sorted(names, reverse=True))
    return size


def _checked(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """The members of ``tar``, each checked to stay beneath the directory: a relative
    name without ``..``, no parent that is a link of the stream, no device node."""
    links: set[str] = set()
    for m in tar:
        parts = m.name.split("/")
        if m.name.startswith("/") or ".." in parts or not m.name:
            raise UnsafeMember(f"{m.name!r}: not beneath the directory")
        if any("/".join(parts[:i]) in links for i in range(1, len(parts))):
            raise UnsafeMember(f"{m.name!r}: below a link")
        if m.ischr() or m.isblk():
            raise UnsafeMember(f"{m.name!r}: a device node")
        if m.islnk() and (m.linkname.startswith("/") or ".." in m.linkname.split("/")):
            raise UnsafeMember(f"{m.name!r}: a hard link out of the directory")
        if m.issym():
            links.add(m.name)
        m.mode &= ~DROPPED_BITS
        yield m


def unpack(src: BinaryIO, dest: str) -> None:
    """Extract the tar stream ``src`` into ``dest`` (the copy's working directory) as the
    calling user; UnsafeMember for a member that would leave it."""
    with tarfile.open(fileobj=src, mode="r|") as tar:
        # the checks are ours (links kept as they are, absolute ones too: they mean what
        # they meant in the source's container); "fully_trusted" keeps tarfile's own
        # filters (python >= 3.12, backports) from rewriting them
        trusted = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") \
            else {}
        tar.extractall(dest, members=_checked(tar), numeric_owner=True, **trusted)
