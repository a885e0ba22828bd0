"""A sandbox's files as a tar stream and back, stdlib only: how the docker backend's
fork copies ``/work`` from one container into another without resolving a path on the
host.

Both ends run inside the containers, in children of the sandbox agent that are the
sandbox user (executor/backends/docker/agent.py, which imports this as ``tarcopy``):
:func:`pack` reads only what the sandbox's commands can read, in their own mount
namespace (an absolute link means what it means in the container, and is stored as a
link, never followed); :func:`unpack` writes only what they can write, as their files.
The host only carries the bytes between the two agents.

The working directory itself is not in the stream: the copy's keeps its own owner and
mode (a fresh sandbox's), not the source's.

Other places the sandbox user writes (``/tmp``, ``/var/tmp``, ``/dev/shm``, its ``$HOME``:
``pip install --user`` and a setup's ``/tmp`` files were lost in every copy)
follow in the same stream, each entry named relative to its place and carrying the place
in a PAX header (:data:`PLACE`); an entry without one is the working directory's (a
stream of the engine's archive API has none). :func:`unpack` extracts each into the same
place of the copy, only into the places it is given.
"""

from __future__ import annotations

import os
import stat
import tarfile
from collections.abc import Iterator
from typing import BinaryIO

#: mode bits a copy never gets (a sandbox's setuid file is no one's to run as it)
DROPPED_BITS = stat.S_ISUID | stat.S_ISGID
#: the PAX header naming an entry's place (absent: the working directory)
PLACE = "TANGRAM.place"


def places_beside(workdir: str, candidates: list[str]) -> tuple[str, ...]:
    """``candidates`` (absolute paths) less those inside ``workdir`` or inside another
    candidate (``$HOME`` = ``/tmp``: copied once), in their order."""
    def within(path: str, top: str) -> bool:
        return path == top or path.startswith(top.rstrip("/") + "/")

    norm = [os.path.normpath(c) for c in candidates if c.startswith("/")]
    out: list[str] = []
    for c in norm:
        if within(c, os.path.normpath(workdir)) or any(within(c, o) for o in out):
            continue
        if any(within(c, o) and o != c for o in norm):
            continue
        out.append(c)
    return tuple(out)


class UnsafeMember(ValueError):
    """A member that would land outside the directory (or is a device)."""


def pack(out: BinaryIO, top: str = ".", places: tuple[str, ...] = ()) -> int:
    """Write ``top``'s entries (not ``top`` itself), then each of ``places``' (absolute
    paths, marked with :data:`PLACE`), to ``out`` as an uncompressed tar stream; links
    stored as links, never followed; walked by a stack (any depth). The bytes of its
    regular files."""
    size = 0
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        size += _add(tar, top, None)
        for place in places:
            size += _add(tar, place, place)
    return size


def _add(tar: tarfile.TarFile, top: str, place: str | None) -> int:
    """``top``'s entries into ``tar`` (marked as ``place``'s); the bytes of its files."""
    size = 0
    try:
        stack = sorted(os.listdir(top), reverse=True)
    except OSError:  # (a place this image lacks, or the sandbox user cannot read)
        return 0
    while stack:
        rel = stack.pop()
        path = os.path.join(top, rel)
        try:
            info = tar.gettarinfo(path, arcname=rel)
        except OSError:
            continue  # gone, or unreadable to the sandbox user itself
        if info is None:  # a socket: not copied (tar cannot hold one)
            continue
        if place is not None:
            info.pax_headers = {**info.pax_headers, PLACE: place}
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


def _checked(tar: tarfile.TarFile, workdir: str,
             places: tuple[str, ...]) -> Iterator[tarfile.TarInfo]:
    """The members of ``tar``, each checked to stay beneath its place (the working
    directory, or the one of ``places`` its :data:`PLACE` header names): a relative name
    without ``..``, no parent that is a link of the stream, no device node; each renamed
    to its path below ``/`` (extraction is into ``/``)."""
    links: set[str] = set()
    for m in tar:
        parts = m.name.split("/")
        if m.name.startswith("/") or ".." in parts or not m.name:
            raise UnsafeMember(f"{m.name!r}: not beneath the directory")
        if m.ischr() or m.isblk():
            raise UnsafeMember(f"{m.name!r}: a device node")
        if m.islnk() and (m.linkname.startswith("/") or ".." in m.linkname.split("/")):
            raise UnsafeMember(f"{m.name!r}: a hard link out of the directory")
        place = m.pax_headers.get(PLACE, workdir)
        if place not in (workdir, *places):
            raise UnsafeMember(f"{m.name!r}: into {place!r}, no place a copy is given")
        top = os.path.normpath(place).strip("/")
        m.name = f"{top}/{m.name}" if top else m.name
        if m.islnk():  # (within its own place, as checked above)
            m.linkname = f"{top}/{m.linkname}" if top else m.linkname
        parts = m.name.split("/")
        if any("/".join(parts[:i]) in links for i in range(1, len(parts))):
            raise UnsafeMember(f"{m.name!r}: below a link")
        if m.issym():
            links.add(m.name)
        m.mode &= ~DROPPED_BITS
        yield m


def unpack(src: BinaryIO, dest: str, places: tuple[str, ...] = ()) -> None:
    """Extract the tar stream ``src`` into ``dest`` (the copy's working directory, an
    absolute path) and its marked entries into their ``places``, as the calling user;
    UnsafeMember for a member that would leave them."""
    with tarfile.open(fileobj=src, mode="r|") as tar:
        # the checks are ours (links kept as they are, absolute ones too: they mean what
        # they meant in the source's container); "fully_trusted" keeps tarfile's own
        # filters (python >= 3.12, backports) from rewriting them
        trusted = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") \
            else {}
        tar.extractall("/", members=_checked(tar, dest, places), numeric_owner=True,
                       **trusted)
