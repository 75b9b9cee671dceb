"""Find, build and fill a model: an HF checkpoint directory, a GGUF file (with llama.cpp's vision
projector file beside it or named), or the embedded default.

The module is built directly on the target device in the target dtype (no fp32 CPU detour), then
every tensor is copied from the memory-mapped checkpoint one at a time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from ..config import QWEN_ARCHS, GenerationDefaults, ModelConfig, load_config
from ..errors import ModelLoadError, NinferError
from ..hub.catalog import locate
from ..hub.fit import count_params
from ..tokenizer import Tokenizer
from ..weights.checkpoint import open_checkpoint
from ..weights.gguf_mmproj import MmprojFile
from ..weights.gguf_reader import GGUFCheckpoint, open_gguf
from ..weights.mmproj_files import find_mmproj
from ..weights import quant_cache
from ..weights.text_weights import TextWeights
from .default_model import default_model_path
from .llama import LlamaForCausalLM
from .quantize import QuantRecipe, apply_recipe_, fill_quantized_, resolve_recipe
from .qwen3_5 import Qwen3_5ForCausalLM

log = logging.getLogger(__name__)

# GGUF files carry no generation_config: llama.cpp's defaults, so an unflagged run is not a raw
# temperature-1 draw from the whole vocabulary (which makes small models ramble).
GGUF_SAMPLING_DEFAULTS = GenerationDefaults(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    name: str
    source: Path
    config: ModelConfig
    model: nn.Module
    tokenizer: Tokenizer
    generation_defaults: GenerationDefaults
    device: torch.device
    dtype: torch.dtype
    load_seconds: float
    recipe: QuantRecipe = QuantRecipe("bf16")
    mmproj: MmprojFile | None = None  # a GGUF model's vision projector


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:  # "gpu", "cuda:x": torch's message lists every backend it knows
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise NinferError(f"unsupported device '{device}' (use cpu, cuda, cuda:N or auto)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise NinferError(f"--device {device} was asked for, but PyTorch sees no CUDA GPU (use --device cpu)")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise NinferError(f"--device {device}: there are {torch.cuda.device_count()} CUDA GPUs (cuda:0 ...)")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on the GPU, fp32 on the CPU (CPU bf16 matmuls are slow and less exact)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise NinferError(f"unsupported dtype '{dtype}' (use auto, {', '.join(DTYPES)})")
    return DTYPES[dtype]


def model_class(config: ModelConfig) -> type[nn.Module]:
    return Qwen3_5ForCausalLM if config.arch in QWEN_ARCHS else LlamaForCausalLM


# torch.nn.init's in-place initialisers, which module constructors call (nn.Linear, nn.Embedding)
_ONE_BUILD = threading.Lock()
_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "xavier_uniform_",
                 "xavier_normal_", "kaiming_uniform_", "kaiming_normal_")


@contextmanager
def _building_on(device: torch.device, dtype: torch.dtype):
    """Create parameters directly on `device` in `dtype`, without the constructors' random
    initialisation: every weight is loaded (or `init_random_`-ed) afterwards, and initialising
    costs seconds for a large model on the CPU, and on the meta device imports torch._dynamo
    (torch's reference kernels: 2 s of every start). Both the default dtype and nn.init are
    process-wide: one build at a time (a server loads models on demand from several threads; two
    overlapping builds could leave the no-op initialisers installed for good)."""
    with _ONE_BUILD:
        previous = torch.get_default_dtype()
        saved = {name: getattr(nn.init, name) for name in _INITIALISERS}
        torch.set_default_dtype(dtype)
        for name in _INITIALISERS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        try:
            with device:
                yield
        finally:
            torch.set_default_dtype(previous)
            for name, function in saved.items():
                setattr(nn.init, name, function)


def build_model(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, recipe: QuantRecipe = QuantRecipe("bf16")
) -> nn.Module:
    """An (uninitialised-weight) model of the config's class (`build_module`)."""
    model = build_module(lambda: model_class(config)(config), device, dtype, recipe)
    if recipe.quantized:
        model.tie_weights()  # the copy gave a tied lm_head its own tensors
    return model


def build_module(
    build: Callable[[], nn.Module], device: torch.device, dtype: torch.dtype, recipe: QuantRecipe = QuantRecipe("bf16")
) -> nn.Module:
    """`build()`'s module with uninitialised weights, on device, in dtype, in eval mode, its modules
    swapped for the recipe's quantized ones (built on meta first: no full-precision copy)."""
    if not recipe.quantized:
        with _building_on(device, dtype):
            return build().eval()
    with _building_on(torch.device("meta"), dtype):
        module = build()
        apply_recipe_(module, recipe)
    # Module.to_empty without its empty_like of meta tensors, which runs torch's Python reference
    # ops (importing sympy: ~0.7 s of a start)
    return module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device)).eval()


@torch.no_grad()
def random_model(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, recipe: QuantRecipe, seed: int = 0
) -> nn.Module:
    """The model with random weights (`init_random_`'s draws, in its order), quantized by the recipe:
    full-size shapes without a checkpoint (benchmarks, `--random-weights`). Built on meta and drawn
    module by module, each decoder layer quantized as soon as it is drawn: the peak is the quantized
    model and one full-precision layer, not the whole full-precision model (the 35B's 70 GB of bf16:
    more than a 32 or 48 GB card holds, for a model whose int4 form is 19 GB)."""
    model = build_model(config, torch.device("meta"), dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    # a meta parameter two modules share (a tied lm_head) -> its drawn one, drawn once. Nothing else
    # may hold a drawn parameter or a swapped-out module (named_modules' memo would): that would keep
    # the full-precision layers alive to the end.
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    shared: dict[int, nn.Parameter] = {}

    def draw(root: nn.Module, recurse: bool = True) -> None:
        for module in root.modules() if recurse else (root,):
            for key, meta in list(module.named_parameters(recurse=False)):
                if not meta.is_meta:  # a module reached twice
                    continue
                param = shared.get(id(meta))
                if param is None:
                    weight = torch.empty(meta.shape, dtype=meta.dtype, device=device)
                    param = nn.Parameter(weight.normal_(0, 0.02, generator=generator), requires_grad=meta.requires_grad)
                    if uses[id(meta)] > 1:
                        shared[id(meta)] = param
                setattr(module, key, param)

    draw(model, recurse=False)
    for name, child in model.named_children():  # init_random_'s order (model.parameters())
        if name != "layers":
            draw(child)
            continue
        for i, layer in enumerate(child):
            draw(layer)
            apply_recipe_(model, recipe, within=f"layers.{i}")
    apply_recipe_(model, recipe)  # the rest: embedding, lm_head, MTP and vision towers
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"random_model left tensors undrawn: {left[:4]}")
    return model


@torch.no_grad()
def init_random_(model: nn.Module, seed: int = 0) -> None:
    """Small normal weights (std 0.02): exact shapes without a download, finite through 60+ bf16 layers."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for p in model.parameters():
        p.normal_(0, 0.02, generator=generator)


class WeightSource(Protocol):
    """A checkpoint directory, a GGUF file: tensors by canonical name, converted to a dtype."""

    def names(self) -> set[str]: ...
    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor: ...


def _fill(
    model: nn.Module, tensors: WeightSource, dtype: torch.dtype, device: torch.device, fp8_source: bool,
    recipe: QuantRecipe,
) -> None:
    """Fill the quantized modules' buffers, then copy every plain parameter.

    An FP8 checkpoint's weights reach the quantizer in fp32 (e4m3 x block scale is exact there):
    rounding them to the model dtype first would quantize twice. A GGUF under the gguf recipe
    hands its quantized tensors over as they are."""
    def get(name: str) -> torch.Tensor:
        return tensors.get(name, dtype)

    def get_exact(name: str) -> torch.Tensor:
        return tensors.get(name, torch.float32)

    names = tensors.names()
    for linear, order in getattr(tensors, "input_orders", dict)().items():  # weights kept in the file's column order
        parent, child = linear.rsplit(".", 1)
        model.get_submodule(parent).set_input_order(child, torch.from_numpy(order))
    consumed = fill_quantized_(model, get_exact if fp8_source else get, names, device, recipe,
                               getattr(tensors, "get_quantized", None), getattr(tensors, "get_blocks", None),
                               getattr(tensors, "get_expert_blocks", None))
    model.load_weights(get, names - consumed)


def read_config_and_tokenizer(path: Path) -> tuple[ModelConfig, Tokenizer]:
    """What a model's files say without its weights: its config and tokenizer (chat template
    included), from a GGUF file's metadata or a checkpoint directory's JSON files."""
    if path.is_file():
        gguf, config, _ = open_gguf_model(path, None)
        return config, gguf.load_tokenizer()
    return load_config(path), Tokenizer.from_model_dir(path)


def vision_projector(model_file: Path, explicit: str | Path | None, config: ModelConfig) -> MmprojFile | None:
    """A GGUF model's vision projector: the file named, else an `mmproj*.gguf` in the model's folder
    (one that does not fit this model is passed over with a warning: the text model still runs)."""
    if explicit is not None:
        return MmprojFile(Path(explicit).expanduser(), config.hidden_size)
    found = find_mmproj(model_file)
    if found is None:
        return None
    try:
        projector = MmprojFile(found, config.hidden_size)
    except ModelLoadError as e:
        log.warning("not using %s as the vision projector: %s", found.name, e)
        return None
    log.info("vision projector: %s", found)
    return projector


def open_gguf_model(path: Path, mmproj: str | Path | None) -> tuple[GGUFCheckpoint, ModelConfig, MmprojFile | None]:
    """A GGUF model file, its config (vision: whether a projector goes with it) and its projector."""
    gguf = open_gguf(path)
    projector = vision_projector(path, mmproj, gguf.config)
    return gguf, gguf.config if projector is None else replace(gguf.config, has_vision=True), projector


def load_model(
    spec: str | None, device: str = "auto", dtype: str = "auto", random_weights: bool = False, weights: str = "auto",
    mmproj: str | Path | None = None,
) -> LoadedModel:
    """spec: an HF checkpoint directory, a .gguf file, or None for the embedded default model.

    `random_weights`: take config and tokenizer from the directory but no tensors (benchmarks of
    full-size shapes from a config.json alone). `weights`: the quantization recipe
    (`models/quantize.py`); a quantized HF checkpoint is cached on disk after its first load
    (`weights/quant_cache.py`) and later starts read that artifact directly. `mmproj`: a GGUF
    model's vision projector file (default: the one in the model's folder, if any)."""
    started = time.perf_counter()
    dev = resolve_device(device)
    path = default_model_path() if spec is None else locate(spec)
    tensors: WeightSource | None = None
    gguf_formats = None
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path}: a model is a checkpoint directory (with config.json) or a .gguf file")
        gguf, config, projector = open_gguf_model(path, mmproj)
        tokenizer, defaults = gguf.load_tokenizer(), GGUF_SAMPLING_DEFAULTS
        tensors = gguf
        gguf_formats = {name: gguf.quant_format(name) for name in gguf.names()}
    else:
        if mmproj is not None:
            raise ModelLoadError(f"{path}: --mmproj goes with a GGUF model (a checkpoint directory has its own "
                                 "vision tower)")
        projector = None
        config = load_config(path)
        tokenizer = Tokenizer.from_model_dir(path)
        defaults = GenerationDefaults.from_model_dir(path)
        if not random_weights:
            tensors = TextWeights(open_checkpoint(path, config.quantization))
    torch_dtype = resolve_dtype(dtype, dev)
    recipe = resolve_recipe(weights, dev, torch_dtype, count_params(config), exact=dtype != "auto",
                            gguf_formats=gguf_formats)
    if tensors is None:
        model = random_model(config, dev, torch_dtype, recipe)
    else:
        model = build_model(config, dev, torch_dtype, recipe)
        artifact = quant_cache.artifact_path(path, recipe.key, torch_dtype) if recipe.quantized and path.is_dir() else None
        if artifact is None or not quant_cache.load(model, artifact):
            _fill(model, tensors, torch_dtype, dev, fp8_source=bool(config.quantization), recipe=recipe)
            if artifact is not None:
                quant_cache.save(model, artifact)
    name = path.stem if path.is_file() else path.name
    return LoadedModel(
        recipe=recipe,
        name=name,
        source=path,
        config=config,
        model=model,
        tokenizer=tokenizer,
        generation_defaults=defaults,
        device=dev,
        dtype=torch_dtype,
        load_seconds=time.perf_counter() - started,
        mmproj=projector,
    )
