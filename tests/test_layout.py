"""The repository's packaging rules: folders map to pagefleet.*, nothing shadows the stdlib."""

from __future__ import annotations

import ast
import importlib
import re
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


def test_the_operator_folder_never_shadows_the_stdlib_even_without_site() -> None:
    """operator/ has no __init__.py on purpose: as a namespace portion it loses to any
    regular module, so `import operator` finds the stdlib even when nothing preloaded it."""
    assert not (ROOT / "operator" / "__init__.py").exists()
    code = "import operator; print(operator.__file__)"
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert not out.stdout.strip().startswith(str(ROOT))


def test_subpackages_map_to_their_folders() -> None:
    pairs = [("pagefleet.engine", "engine"), ("pagefleet.kernels", "kernels"), ("pagefleet.cli", "cli")]
    for name, folder in pairs + [("pagefleet.protocol", "protocol"), ("pagefleet.runtime", "runtime")]:
        module = importlib.import_module(name)
        assert Path(module.__file__).parent == ROOT / folder
    assert str(ROOT / "operator") in list(importlib.import_module("pagefleet.operator").__path__)


def test_no_top_level_python_module_is_named_after_a_part() -> None:
    for forbidden in ("operator.py", "engine.py", "gateway.py"):
        assert not (ROOT / forbidden).exists()


def test_shared_contracts_import_without_torch() -> None:
    """The gateway and the operator import pagefleet.protocol; it must stay light."""
    code = (
        "import sys, pagefleet.protocol.openai, pagefleet.protocol.replica, pagefleet.runtime.http, "
        "pagefleet.runtime.chat_prompt; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_gateway_and_picker_import_without_torch() -> None:
    code = (
        "import sys, pagefleet.gateway.app, pagefleet.cli.up, pagefleet.cli.gateway; "
        "import pagefleet.gateway.picker_server, pagefleet.cli.picker; "
        "print(sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_operator_imports_neither_torch_nor_the_engine() -> None:
    code = (
        "import sys, pagefleet.operator.main, pagefleet.cli.kube_operator; "
        "heavy = ('torch', 'transformers', 'pagefleet.engine', 'pagefleet.gateway'); "
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _project_imports(folder: Path) -> dict[str, set[str]]:
    """Every `pagefleet.*` module each file under `folder` imports, lazily or not."""
    imports: dict[str, set[str]] = {}
    for path in folder.rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        imports[str(path.relative_to(ROOT))] = {name for name in names if name.startswith("pagefleet")}
    return imports


def test_kernels_import_nothing_else_of_the_project() -> None:
    """Kernels are leaves: the engine uses them, never the other way round."""
    outside = {
        path: sorted(name for name in names if not name.startswith("pagefleet.kernels"))
        for path, names in _project_imports(ROOT / "kernels").items()
    }
    assert {path: names for path, names in outside.items() if names} == {}


def test_the_engine_core_never_imports_its_server() -> None:
    """The HTTP server is a client of the engine core; the core runs without it."""
    core = {
        path: sorted(name for name in names if name.startswith("pagefleet.engine.server"))
        for path, names in _project_imports(ROOT / "engine").items()
        if not path.startswith("engine/server/")
    }
    assert {path: names for path, names in core.items() if names} == {}


def test_the_runner_and_the_sampler_never_see_a_request_or_a_sequence() -> None:
    """The runner is handed plain data (engine/worker/step_input.py), not the scheduler's
    live objects: it can run where the scheduler does not (another process, another rank)."""
    live = ("pagefleet.engine.core.request", "pagefleet.engine.core.scheduler")
    reaching = {
        path: sorted(name for name in names if name in live)
        for folder in ("worker", "sample")
        for path, names in _project_imports(ROOT / "engine" / folder).items()
    }
    assert {path: names for path, names in reaching.items() if names} == {}


# What the engine's server (and, through it, the KV connectors' users: its pulls and the
# blocks it serves) may import of the engine: its public API. The scheduler, the KV cache,
# the connectors, the runner and the model are reached only through AsyncEngine.
SERVER_MAY_IMPORT = {
    "pagefleet.engine",
    "pagefleet.engine.config",
    "pagefleet.engine.errors",
    "pagefleet.engine.front.async_engine",
    "pagefleet.engine.front.chat_template",
    "pagefleet.engine.front.inputs",
    "pagefleet.engine.front.outputs",
    "pagefleet.engine.front.stats",
    "pagefleet.engine.lora.request",
    "pagefleet.engine.sample.sampling_params",
    "pagefleet.engine.sample.structured_outputs",
}


def test_the_server_imports_only_the_engines_public_modules() -> None:
    internal = {
        path: sorted(
            name
            for name in names
            if name.startswith("pagefleet.engine")
            and name not in SERVER_MAY_IMPORT
            and not name.startswith(("pagefleet.engine.server", "pagefleet.engine.kv_transfer"))
        )
        for path, names in _project_imports(ROOT / "engine" / "server").items()
    }
    assert {path: names for path, names in internal.items() if names} == {}


def test_every_subpackage_is_listed_for_a_wheel() -> None:
    """An editable install finds folders by itself; a wheel (the images) ships only the
    packages pyproject.toml lists."""
    import tomllib

    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(settings["packages"])
    for package, folder in settings["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            name = ".".join([package, *relative.parts])
            assert name in listed, f"{name} is missing from [tool.setuptools] packages"


def test_the_http_layer_reaches_the_engine_only_through_async_engine() -> None:
    """AsyncEngine is the engine's one door: only its thread touches the engine, so code
    that reaches past it (`x.engine.engine`) races the steps."""
    outside = [ROOT / "engine" / "server", ROOT / "cli", ROOT / "gateway", ROOT / "operator", ROOT / "bench"]
    reaching = [
        f"{path.relative_to(ROOT)}:{number}"
        for folder in outside
        for path in sorted(folder.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bengine\.engine\b", line)
    ]
    assert not reaching, reaching


def test_no_function_in_the_engine_the_gateway_or_the_operator_runs_past_60_lines() -> None:
    """Small functions with one job (STYLE.md): a function of 60 lines or more is split."""
    long = []
    for folder in ("engine", "gateway", "operator"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    length = (node.end_lineno or node.lineno) - node.lineno + 1
                    if length >= 60:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    assert not long, long
