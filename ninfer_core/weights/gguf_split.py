"""llama.cpp's split GGUF models: one model in N files `NAME-00001-of-0000N.gguf` .. `-0000N-of-0000N`.

Large quantizations are published this way (a hub file stays under 50 GB). `gguf-split` and the
converter's `--split-max-*` write every metadata key to the first shard, `split.no` /
`split.count` / `split.tensors.count` to each, and spread the tensors over the shards in order.
llama.cpp opens a split model by its first shard and finds the others by name
(`llama_split_path`: "%s-%05d-of-%05d.gguf"); so do we, and any shard's name leads to the first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePath, PurePosixPath
from typing import TypeVar

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
PathT = TypeVar("PathT", bound=PurePath)

_SHARD_NAME = re.compile(r"(?P<prefix>.+)-(?P<number>\d{5})-of-(?P<count>\d{5})(?P<suffix>\.gguf)", re.IGNORECASE)


@dataclass(frozen=True)
class ShardName:
    """What a shard's file name says: NAME-{number:05d}-of-{count:05d}.gguf (number from 1)."""

    prefix: str
    number: int
    count: int
    suffix: str

    def sibling(self, number: int) -> str:
        return f"{self.prefix}-{number:05d}-of-{self.count:05d}{self.suffix}"


def shard_name(name: str) -> ShardName | None:
    """The shard a file name (a path's last part) names, or None for an ordinary file name."""
    m = _SHARD_NAME.fullmatch(name)
    if m is None or not 1 <= int(m["number"]) <= int(m["count"]):
        return None
    return ShardName(m["prefix"], int(m["number"]), int(m["count"]), m["suffix"])


def first_shard(path: PathT) -> PathT:
    """The file to open for a model: the first shard where `path` names a later one (a local path or
    a repository's)."""
    shard = shard_name(path.name)
    return path if shard is None or shard.number == 1 else path.with_name(shard.sibling(1))


def model_files(path: Path) -> list[Path]:
    """Every file of the model at `path` by name: its shards in order, or the file itself."""
    shard = shard_name(path.name)
    return [path] if shard is None else [path.with_name(shard.sibling(i)) for i in range(1, shard.count + 1)]


def model_bytes(path: Path) -> int:
    """Bytes on disk of the model file at `path`, all its shards for a split model."""
    return sum(f.stat().st_size for f in model_files(path) if f.is_file())


def is_later_shard(name: str) -> bool:
    """Whether a (repository) file name is shard 2 or later of a split model: not a model by itself."""
    shard = shard_name(PurePosixPath(name).name)
    return shard is not None and shard.number > 1


def sibling_shards(name: str, names: list[str]) -> list[str]:
    """A repository's other shards of the model whose first shard is `name`, in order (those present)."""
    path = PurePosixPath(name)
    shard = shard_name(path.name)
    if shard is None:
        return []
    siblings = {str(path.with_name(shard.sibling(i))) for i in range(2, shard.count + 1)}
    return sorted(n for n in names if n in siblings)
