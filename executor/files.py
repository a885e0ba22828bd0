"""Files in and out of a trajectory's sandbox, confined to its working directory.

A path is relative to the sandbox's working directory; ``..``, absolute paths
and NUL bytes are refused before anything is touched. On the host (process
backend) every component is opened with ``O_NOFOLLOW`` relative to its parent's
descriptor, so a symlink planted by a command in the sandbox can never lead a
write or a read outside the working directory (no check-then-open race). The
docker backend hands the path to the engine, which resolves it inside the
container's own root filesystem: the docker backend sends them to the sandbox's
agent (executor/backends/docker/agent.py), which applies these same functions inside the
container, so no symlink is followed there either. Uploads arrive as a stream
(a file object) and are copied in chunks, never held whole in memory.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path
from typing import BinaryIO

#: the largest file one request may carry either way
MAX_FILE_BYTES = 64 << 20


class FileError(ValueError):
    """A refused file request; ``status`` is the HTTP status it maps to."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def clean_path(path: str) -> tuple[str, ...]:
    """The components of a sandbox-relative path, or a FileError saying why not."""
    if "\x00" in path:
        raise FileError(400, f"path {path!r}: contains a NUL byte")
    if path.startswith("/"):
        raise FileError(400, f"path {path!r}: must be relative to the sandbox's working directory")
    parts = tuple(p for p in path.split("/") if p not in ("", "."))
    if ".." in parts:
        raise FileError(400, f"path {path!r}: '..' is not allowed")
    if not parts:
        raise FileError(400, f"path {path!r}: names no file")
    if any(len(p.encode()) > 255 for p in parts) or len(path.encode()) > 4096:
        raise FileError(400, f"path {path!r}: too long")
    return parts


def _open_dir(root: Path, dirs: tuple[str, ...], create: bool, owner: int | None = None) -> int:
    """A descriptor of ``root/dirs...``, never following a symlink on the way."""
    # the working directory itself must not have been swapped for a symlink either
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise FileError(409, "the sandbox's working directory was replaced by a symlink "
                            "or a file") from None
        raise
    try:
        for i, name in enumerate(dirs):
            if create:
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                    if owner is not None:
                        os.chown(name, owner, owner, dir_fd=fd, follow_symlinks=False)
                except FileExistsError:
                    pass
            try:
                nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                raise FileError(404, f"{'/'.join(dirs[:i + 1])}: no such directory") from None
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise FileError(400, f"{'/'.join(dirs[:i + 1])}: is a symlink or not a "
                                    "directory (files stay inside the sandbox)") from None
                raise
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_file(root: Path, parts: tuple[str, ...], data: bytes | BinaryIO,
               owner: int | None = None) -> int:
    """Write ``data`` to ``root/parts`` atomically (a temporary file, then rename);
    ``owner``: the sandbox's user id (root server), which then owns what is made.
    ``data`` may be a file object, read in chunks. Returns the size written."""
    fd = _open_dir(root, parts[:-1], create=True, owner=owner)
    tmp = f".tangram-upload-{secrets.token_hex(6)}"
    try:
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=fd)
        try:
            if owner is not None:
                os.fchown(out, owner, owner)
            size = _copy(data, out)
        finally:
            os.close(out)
        if size > MAX_FILE_BYTES:
            raise FileError(413, f"{'/'.join(parts)}: over the {MAX_FILE_BYTES}-byte limit")
        try:  # replaces a symlink named like the target itself, never what it points to
            os.replace(tmp, parts[-1], src_dir_fd=fd, dst_dir_fd=fd)
        except IsADirectoryError:
            raise FileError(409, f"{'/'.join(parts)}: is a directory") from None
        except OSError as e:
            if e.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                raise FileError(409, f"{'/'.join(parts)}: is a directory") from None
            raise
    finally:
        try:
            os.unlink(tmp, dir_fd=fd)
        except FileNotFoundError:
            pass
        os.close(fd)
    return size


def _copy(data: bytes | BinaryIO, out: int) -> int:
    """Write ``data`` (bytes, or a file object read in 1 MiB chunks) to ``out``; stops
    one chunk past MAX_FILE_BYTES (the caller refuses that)."""
    size = 0
    while size <= MAX_FILE_BYTES:
        chunk = data if isinstance(data, bytes | bytearray) else data.read(1 << 20)
        if not chunk:
            break
        view = memoryview(chunk)
        size += len(view)
        while view:
            view = view[os.write(out, view):]
        if isinstance(data, bytes | bytearray):
            break
    return size


def read_file(root: Path, parts: tuple[str, ...], limit: int = MAX_FILE_BYTES,
              owner: int | None = None) -> bytes:
    """The bytes of the regular file ``root/parts`` (at most ``limit``). With ``owner``
    (the sandbox's user id, read by root), a hard link to someone else's file is refused:
    it could name a file the sandbox itself may not read."""
    fd = _open_dir(root, parts[:-1], create=False)
    try:
        try:
            f = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        except FileNotFoundError:
            raise FileError(404, f"{'/'.join(parts)}: no such file") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise FileError(400, f"{'/'.join(parts)}: is a symlink (files stay inside the "
                                "sandbox)") from None
            raise
    finally:
        os.close(fd)
    try:
        st = os.fstat(f)
        if stat.S_ISDIR(st.st_mode):
            raise FileError(409, f"{'/'.join(parts)}: is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise FileError(400, f"{'/'.join(parts)}: is not a regular file")
        if owner is not None and st.st_nlink > 1 and st.st_uid != owner:
            raise FileError(400, f"{'/'.join(parts)}: a hard link to a file the sandbox does "
                            "not own")
        if st.st_size > limit:
            raise FileError(413, f"{'/'.join(parts)}: {st.st_size} bytes, over the "
                            f"{limit}-byte limit")
    except BaseException:
        os.close(f)
        raise
    with os.fdopen(f, "rb") as fh:
        return fh.read(limit + 1)[:limit]
