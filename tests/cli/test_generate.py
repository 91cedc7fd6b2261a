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
    # The count is what the same greedy chat gives offline (8 unless the model says EOS first).
    from pagefleet.engine import LLM, SamplingParams

    expected = LLM(str(tiny_llama)).chat(
        [{"role": "user", "content": "Hello world"}], SamplingParams(max_tokens=8, temperature=0.0)
    )[0]
    usage = expected.usage
    assert f"[{usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens]" in result.stderr
    assert 1 <= usage.completion_tokens <= 8


def test_generate_with_an_unknown_model_fails_clearly(tmp_path: Path) -> None:
    result = _pagefleet("generate", "--model", str(tmp_path / "nowhere"))
    assert result.returncode == 2
    assert "neither a built-in name" in result.stderr
