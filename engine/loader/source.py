"""Resolve what the user named (built-in name, HF directory, GGUF file) to an HF directory."""

from __future__ import annotations

from pathlib import Path

from pagefleet.engine.errors import ModelNotFoundError
from pagefleet.engine.loader.builtins import BUILTIN_MODELS, find_builtin_gguf
from pagefleet.engine.loader.gguf_cache import converted_dir


def gguf_file(model: str) -> Path | None:
    """The GGUF file `model` names (a built-in's, or a `.gguf` path), else None."""
    if model in BUILTIN_MODELS:
        return find_builtin_gguf(model)
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def resolve_model_dir(model: str) -> Path:
    """A local directory with config.json, safetensors weights and a tokenizer.

    Raises:
        ModelNotFoundError: nothing on this machine matches `model` (weights are never
            downloaded at run time).
    """
    gguf = gguf_file(model)
    if gguf is not None:
        return converted_dir(gguf)
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ModelNotFoundError(
        f"model {model!r} is neither a built-in name ({', '.join(BUILTIN_MODELS)}), "
        "a local Hugging Face directory with config.json, nor a .gguf file"
    )
