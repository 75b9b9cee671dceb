"""The two digests the hub publishes: sha256 for LFS files, the git blob sha1 for regular files."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

from .errors import PullCancelled
from .files import RemoteFile

READ_BLOCK = 8 << 20


def new_hasher(file: RemoteFile) -> "hashlib._Hash":
    """An empty hasher for `file`; a git blob id is sha1(b"blob {size}\\0" + content)."""
    if file.lfs:
        return hashlib.sha256()
    hasher = hashlib.sha1()
    hasher.update(b"blob %d\0" % file.size)
    return hasher


def update_from_file(
    hasher: "hashlib._Hash",
    path: Path,
    on_bytes: Callable[[int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> int:
    """Feed a file's bytes to `hasher`; `on_bytes(total so far)` after each block. Returns the size read."""
    done = 0
    with open(path, "rb") as f:
        while block := f.read(READ_BLOCK):
            if should_stop is not None and should_stop():
                raise PullCancelled("cancelled")
            hasher.update(block)
            done += len(block)
            if on_bytes is not None:
                on_bytes(done)
    return done


def file_matches(
    file: RemoteFile,
    path: Path,
    on_bytes: Callable[[int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> tuple[bool, str]:
    """(matches, actual digest) of the file on disk against the hub's size and digest."""
    hasher = new_hasher(file)
    size = update_from_file(hasher, path, on_bytes, should_stop)
    actual = hasher.hexdigest()
    return size == file.size and actual == file.digest, actual
