"""A repository's files as the hub describes them, and the subset inference needs.

Every file is verified: LFS files (weights, GGUF) against the sha256 in the hub's LFS metadata,
regular git files (configs, tokenizer) against their git blob id, which is a sha1 of the content.
The digest is also the file's blob name in the Hugging Face cache, as huggingface_hub names them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Literal

from ..weights.gguf_split import first_shard, is_later_shard, shard_name, sibling_shards
from ..weights.mmproj_files import is_mmproj, pick_mmproj
from .errors import HubError

# Files `ninfer run` reads from a safetensors checkpoint, besides the weights themselves.
INFERENCE_FILES = frozenset({
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
})


@dataclass(frozen=True)
class RemoteFile:
    name: str  # path inside the repository
    size: int
    digest: str  # sha256 (LFS) or git blob sha1 (regular file), lower-case hex
    lfs: bool

    @property
    def algorithm(self) -> Literal["sha256", "git-sha1"]:
        return "sha256" if self.lfs else "git-sha1"


@dataclass(frozen=True)
class RepoSnapshot:
    """One commit of a repository: every file with its size and digest."""

    repo_id: str
    revision: str  # what the user asked for: a branch, tag or commit
    commit: str  # the full commit hash it resolved to
    files: tuple[RemoteFile, ...]

    def file(self, name: str) -> RemoteFile | None:
        return next((f for f in self.files if f.name == name), None)


def _is_gguf(name: str) -> bool:
    return name.lower().endswith(".gguf")


def _shards(snapshot: RepoSnapshot, model: RemoteFile) -> list[RemoteFile]:
    """A GGUF model's files: the one file, or a split model's shards (`model` the first) in order."""
    names = sibling_shards(model.name, [f.name for f in snapshot.files])
    return [model, *(f for name in names if (f := snapshot.file(name)) is not None)]


def _describe(snapshot: RepoSnapshot, files: list[RemoteFile]) -> str:
    def one(f: RemoteFile) -> str:
        shards = _shards(snapshot, f)
        parts = f"{len(shards)} files, " if len(shards) > 1 else ""
        return f"{f.name} ({parts}{sum(s.size for s in shards) / 1e9:.1f} GB)"

    return ", ".join(one(f) for f in files)


def _model_ggufs(snapshot: RepoSnapshot) -> list[RemoteFile]:
    """The repository's GGUF models (not their vision projectors; a split model by its first shard)."""
    return [f for f in snapshot.files if _is_gguf(f.name) and not is_mmproj(f.name) and not is_later_shard(f.name)]


def pick_gguf(snapshot: RepoSnapshot, wanted: str) -> RemoteFile:
    """The GGUF file `wanted` names: an exact path, else the one file whose name contains it (e.g. Q4_K_M)."""
    ggufs = _model_ggufs(snapshot)
    exact = snapshot.file(wanted)
    if exact is not None:
        if not _is_gguf(exact.name):
            raise HubError(f"{snapshot.repo_id}: --file takes a .gguf file, not '{wanted}'")
        if is_mmproj(exact.name):
            raise HubError(f"{snapshot.repo_id}: '{wanted}' is a vision projector, not a model: pull a model file "
                           f"({_describe(snapshot, ggufs)}); its projector comes with it")
        if is_later_shard(exact.name):  # a split model comes whole, by its first shard
            first = snapshot.file(str(first_shard(PurePosixPath(exact.name))))
            if first is None:
                raise HubError(f"{snapshot.repo_id}: '{wanted}' is a shard of a split model whose first shard "
                               "is not in the repository")
            return first
        return exact
    matches = [f for f in ggufs if wanted.lower() in PurePosixPath(f.name).name.lower()]
    if len(matches) == 1:
        return matches[0]
    if not ggufs:
        raise HubError(f"{snapshot.repo_id}: no .gguf files in this repository (at {snapshot.commit[:12]})")
    which = "matches several files" if matches else "matches no file"
    raise HubError(f"{snapshot.repo_id}: '{wanted}' {which}; GGUF files: {_describe(snapshot, matches or ggufs)}")


def select_files(snapshot: RepoSnapshot, gguf: str | None = None) -> list[RemoteFile]:
    """What a pull downloads: one GGUF model when `gguf` is given (its file first, then a split model's
    other shards) and the vision projector in its folder, if any (llama.cpp's mmproj file: images
    work as with the checkpoint); else config, tokenizer and safetensors."""
    if gguf is not None:
        model = pick_gguf(snapshot, gguf)
        folder = PurePosixPath(model.name).parent
        projector = pick_mmproj(f.name for f in snapshot.files if PurePosixPath(f.name).parent == folder)
        shards = _shards(snapshot, model)
        split = shard_name(PurePosixPath(model.name).name)
        if split is not None and len(shards) != split.count:
            raise HubError(f"{snapshot.repo_id}: '{model.name}' is the first of {split.count} shards, but the "
                           f"repository holds {len(shards)} of them (at {snapshot.commit[:12]})")
        return shards + ([snapshot.file(projector)] if projector else [])
    top_level = [f for f in snapshot.files if "/" not in f.name]
    weights = [f for f in top_level if f.name.endswith(".safetensors")]
    if not weights:
        ggufs = _model_ggufs(snapshot)
        if ggufs:
            raise HubError(f"{snapshot.repo_id} holds GGUF files; choose one with --file: {_describe(snapshot, ggufs)}")
        raise HubError(
            f"{snapshot.repo_id}: no .safetensors weights at the top of the repository "
            "(ninfer reads safetensors checkpoints and GGUF files)"
        )
    if snapshot.file("config.json") is None:
        raise HubError(f"{snapshot.repo_id}: no config.json, so this is not a checkpoint ninfer can run")
    chosen = [f for f in top_level if f.name in INFERENCE_FILES] + weights
    # Small files first: config.json is checked before any weights are fetched.
    return sorted(chosen, key=lambda f: (f.lfs, f.size, f.name))
