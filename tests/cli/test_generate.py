"""`pagefleet generate` as a user runs it: a real process, exit codes, output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _pagefleet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pagefleet.cli.main", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_answers_with_a_local_model(tiny_llama: Path) -> None:
    result = _pagefleet("generate", "--model", str(tiny_llama), "--max-tokens", "8", "Hello world")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), "a reply was printed"
    assert "8 completion tokens" in result.stderr or "completion tokens" in result.stderr


def test_generate_with_an_unknown_model_fails_clearly(tmp_path: Path) -> None:
    result = _pagefleet("generate", "--model", str(tmp_path / "nowhere"))
    assert result.returncode == 2
    assert "neither a built-in name" in result.stderr
