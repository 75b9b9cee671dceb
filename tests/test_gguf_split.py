"""Split GGUF models (`NAME-00001-of-0000N.gguf` ..), as gguf-py's writer (the one llama.cpp's converter
and gguf-split's layout share) writes them: opened by any shard, the same model as the one file."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFValueType
from test_gguf import QTYPES, TINY, random_state
from tiny_gguf import write_gguf

from ninfer_core.engine.sampling import SamplingParams
from ninfer_core.errors import ModelLoadError
from ninfer_core.hub.catalog import cached_summary
from ninfer_core.hub.summary import summarize_gguf
from ninfer_core.llm import LLM, EngineOptions
from ninfer_core.weights.gguf_reader import open_gguf
from ninfer_core.weights.gguf_split import first_shard, is_later_shard, model_bytes, shard_name, sibling_shards


def _shards(directory: Path, stem: str) -> list[Path]:
    return sorted(directory.glob(f"{stem}-*-of-*.gguf"))


@pytest.fixture(scope="module")
def tiny_split(tmp_path_factory):
    """The tiny llama model as one file and split 8 tensors a shard: (one file, shards)."""
    directory = tmp_path_factory.mktemp("split")
    state = random_state(TINY)
    write_gguf(directory / "tiny.gguf", TINY, state, QTYPES)
    (directory / "parts").mkdir()
    write_gguf(directory / "parts" / "tiny.gguf", TINY, state, QTYPES, split_max_tensors=8)
    shards = _shards(directory / "parts", "tiny")
    return directory / "tiny.gguf", shards


def test_the_writer_split_it(tiny_split):
    """What the tests below rely on: several shards, metadata in the first only, tensors spread."""
    _, shards = tiny_split
    assert len(shards) == 3 and shards[0].name == "tiny-00001-of-00003.gguf"
    readers = [gguf.GGUFReader(s) for s in shards]
    assert "general.architecture" in readers[0].fields and "llama.block_count" in readers[0].fields
    assert "llama.block_count" not in readers[1].fields
    assert [len(r.tensors) for r in readers] == [8, 8, 5]


@pytest.mark.parametrize("opened", [0, 2])
def test_a_split_model_is_the_one_file(tiny_split, opened):
    """Any shard opens the whole model: config, names and every tensor (quantized ones as blocks too)."""
    whole, shards = tiny_split
    one, split = open_gguf(whole), open_gguf(shards[opened])
    assert split.path == shards[0]
    assert split.config == one.config
    assert split.names() == one.names() and len(split.names()) == 21
    for name in sorted(one.names()):
        assert torch.equal(split.get(name), one.get(name)), name
        if one.quant_format(name) is not None:
            a, b = one.get_quantized(name), split.get_quantized(name)
            assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales), name
    assert split.build_tokenizer is not None and split.metadata("llama.context_length") == 2048


def test_summary_and_sizes_count_every_shard(tiny_split, tmp_path):
    whole, shards = tiny_split
    assert summarize_gguf(shards[0]) == summarize_gguf(whole)
    assert model_bytes(shards[0]) == sum(s.stat().st_size for s in shards) > whole.stat().st_size // 2
    assert cached_summary(shards[0], tmp_path / "summaries.json") == summarize_gguf(whole)


def test_missing_foreign_and_renamed_shards_are_named(tiny_split, tmp_path):
    _, shards = tiny_split
    folder = tmp_path / "m"
    folder.mkdir()
    for s in shards:
        shutil.copy(s, folder / s.name)
    names = [s.name for s in shards]
    (folder / names[2]).unlink()
    with pytest.raises(ModelLoadError, match=r"shard 3 of 3 is missing \(tiny-00003-of-00003.gguf\)"):
        open_gguf(folder / names[0])
    shutil.copy(shards[1], folder / names[2])  # shard 2's file where shard 3 belongs
    with pytest.raises(ModelLoadError, match=r"tiny-00003-of-00003.gguf: not shard 3 of 3 .* 1 / 3"):
        open_gguf(folder / names[0])
    shutil.copy(shards[0], folder / "renamed.gguf")
    with pytest.raises(ModelLoadError, match=r"the first of 3 shards, but its name does not end in -00001-of-00003"):
        open_gguf(folder / "renamed.gguf")
    shutil.copy(shards[1], folder / "second.gguf")
    with pytest.raises(ModelLoadError, match="shard 2 of a split model whose name does not say so"):
        open_gguf(folder / "second.gguf")


def test_a_wrong_tensor_count_is_refused(tiny_split, tmp_path):
    """split.tensors.count is checked against what the shards hold (here one less than written)."""
    _, shards = tiny_split
    folder = tmp_path / "c"
    shutil.copytree(shards[0].parent, folder)
    first = folder / shards[0].name
    field = gguf.GGUFReader(first).fields["split.tensors.count"]
    assert field.types == [GGUFValueType.INT32]
    data = bytearray(first.read_bytes())
    at = data.find(b"split.tensors.count") + len(b"split.tensors.count") + 4  # the key, then its type
    assert int(np.frombuffer(data[at:at + 4], np.int32)[0]) == 21
    data[at:at + 4] = np.int32(22).tobytes()
    first.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="its 3 shards hold 21 tensors, split.tensors.count says 22"):
        open_gguf(first)


def _copy_split(source: Path, target: Path, max_tensors: int) -> list[Path]:
    """A GGUF file written again as a split model (every key and tensor as stored)."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, str(reader.fields["general.architecture"].contents()),
                             split_max_tensors=max_tensors)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the header's own fields; the writer adds the architecture
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_shape=None, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return _shards(target.parent, target.stem)


def test_the_readme_model_split_generates_the_same_tokens(smollm_path, tmp_path):
    shards = _copy_split(smollm_path, tmp_path / "smollm.gguf", max_tensors=100)
    assert len(shards) == 3
    prompt = list(range(1000, 1024))
    sampling = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = []
    for path in (smollm_path, shards[0]):
        llm = LLM.load(str(path), EngineOptions(device="cpu"))
        tokens.append([t for out in llm.complete(prompt, sampling) for t in out.new_token_ids])
    assert tokens[0] == tokens[1] and len(tokens[0]) == 12


def test_shard_names():
    assert shard_name("Qwen3.6-35B-A3B-Q8_0-00002-of-00003.gguf").number == 2
    assert shard_name("model-00004-of-00003.gguf") is None and shard_name("model.gguf") is None
    assert first_shard(Path("/m/a-00003-of-00003.gguf")) == Path("/m/a-00001-of-00003.gguf")
    assert first_shard(Path("/m/a.gguf")) == Path("/m/a.gguf")
    assert is_later_shard("Q8_0/a-00002-of-00002.gguf") and not is_later_shard("Q8_0/a-00001-of-00002.gguf")
    names = ["Q8_0/a-00002-of-00003.gguf", "Q8_0/a-00003-of-00003.gguf", "Q4/a-00002-of-00003.gguf", "x.gguf"]
    assert sibling_shards("Q8_0/a-00001-of-00003.gguf", names) == names[:2]
    assert sibling_shards("x.gguf", names) == []
