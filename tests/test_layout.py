"""The repository's packaging rules: folders map to pagefleet.*, nothing shadows the stdlib."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_stdlib_operator_stays_importable_from_the_repository_root() -> None:
    code = "import operator, pagefleet.engine; print(operator.__file__); print(pagefleet.engine.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    operator_file, engine_file = out.stdout.split()
    assert not operator_file.startswith(str(ROOT)), "a top-level module shadows the stdlib operator"
    assert engine_file == str(ROOT / "engine" / "__init__.py")


def test_subpackages_map_to_their_folders() -> None:
    pairs = [("pagefleet.engine", "engine"), ("pagefleet.kernels", "kernels"), ("pagefleet.cli", "cli")]
    for name, folder in pairs + [("pagefleet.protocol", "protocol")]:
        module = importlib.import_module(name)
        assert Path(module.__file__).parent == ROOT / folder


def test_no_top_level_python_module_is_named_after_a_part() -> None:
    for forbidden in ("operator.py", "engine.py", "gateway.py"):
        assert not (ROOT / forbidden).exists()


def test_shared_contracts_import_without_torch() -> None:
    """The gateway and the operator import pagefleet.protocol; it must stay light."""
    code = "import sys, pagefleet.protocol.openai, pagefleet.protocol.replica; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_gateway_imports_without_torch() -> None:
    code = (
        "import sys, pagefleet.gateway.app, pagefleet.cli.up, pagefleet.cli.gateway; "
        "print(sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
