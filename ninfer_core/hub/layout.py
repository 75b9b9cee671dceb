"""The Hugging Face cache layout, so pulled models are shared with transformers and `hf`:

    {HF_HUB_CACHE}/models--{org}--{name}/blobs/{digest}            file contents
                                        /blobs/{digest}.incomplete  a partial download (resumed by Range)
                                        /snapshots/{commit}/{path}  relative symlinks to blobs
                                        /refs/{branch or tag}       the commit it pointed to
    {HF_HUB_CACHE}/.locks/models--{org}--{name}/{digest}.lock
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants  # (a module of constants: cheap, unlike file_download)


def hub_cache_dir() -> Path:
    """HF_HUB_CACHE (default $HF_HOME/hub), read when called so tests may point it elsewhere."""
    return Path(constants.HF_HUB_CACHE)


def is_commit_hash(revision: str) -> bool:
    return len(revision) == 40 and all(c in "0123456789abcdef" for c in revision)


@dataclass(frozen=True)
class RepoCache:
    cache_dir: Path
    repo_id: str

    @property
    def root(self) -> Path:
        """models--{org}--{name}: huggingface_hub's repo_folder_name, spelled out (importing it costs 0.2 s)."""
        return self.cache_dir / "--".join(["models", *self.repo_id.split("/")])

    def blob(self, digest: str) -> Path:
        return self.root / "blobs" / digest

    def incomplete(self, digest: str) -> Path:
        return self.root / "blobs" / f"{digest}.incomplete"

    @property
    def locks_dir(self) -> Path:
        return self.cache_dir / ".locks" / self.root.name

    def lock(self, digest: str) -> Path:
        return self.locks_dir / f"{digest}.lock"

    def snapshot(self, commit: str) -> Path:
        return self.root / "snapshots" / commit

    def write_ref(self, revision: str, commit: str) -> None:
        """Record which commit a branch or tag pointed to (nothing to record for a commit hash)."""
        if is_commit_hash(revision):
            return
        ref = self.root / "refs" / revision
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
        tmp.write_text(commit)
        os.replace(tmp, ref)

    def link(self, commit: str, name: str, digest: str) -> Path:
        """Point snapshots/{commit}/{name} at the blob (relative symlink; a copy where links are unsupported)."""
        pointer = self.snapshot(commit) / name
        pointer.parent.mkdir(parents=True, exist_ok=True)
        blob = self.blob(digest)
        if pointer.is_symlink() or pointer.exists():
            pointer.unlink()
        try:
            pointer.symlink_to(os.path.relpath(blob, pointer.parent))
        except OSError:
            shutil.copyfile(blob, pointer)
        return pointer

    def referenced_blobs(self) -> set[str]:
        """Names of the blobs some snapshot still links to."""
        snapshots = self.root / "snapshots"
        if not snapshots.is_dir():
            return set()
        return {Path(os.readlink(p)).name for p in snapshots.rglob("*") if p.is_symlink()}

    def remove_files(self, commit: str, files: dict[str, str]) -> int:
        """Remove files ({name: digest}) from a snapshot, with their blobs unless another snapshot
        links to them, and their partial downloads. Returns the bytes freed.

        When no snapshot is left, the repository's folder goes entirely (refs included).
        """
        snapshot = self.snapshot(commit)
        freed = 0
        for name in files:
            pointer = snapshot / name
            if pointer.is_file() and not pointer.is_symlink():  # a copy (no symlink support)
                freed += pointer.stat().st_size
            if pointer.is_symlink() or pointer.exists():
                pointer.unlink()
        if snapshot.is_dir():
            for directory in sorted((p for p in snapshot.rglob("*") if p.is_dir()), reverse=True):
                _rmdir_if_empty(directory)
        _rmdir_if_empty(snapshot)
        _rmdir_if_empty(self.root / "snapshots")
        still_used = self.referenced_blobs()
        for digest in set(files.values()) - still_used:
            for path in (self.blob(digest), self.incomplete(digest)):
                if path.exists():
                    freed += path.stat().st_size
                    path.unlink()
        if self.root.is_dir() and not (self.root / "snapshots").exists():
            freed += sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file() and not p.is_symlink())
            shutil.rmtree(self.root, ignore_errors=True)
            shutil.rmtree(self.locks_dir, ignore_errors=True)
        return freed


def _rmdir_if_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass
