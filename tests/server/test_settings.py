"""`pagefleet serve` settings: flags, PAGEFLEET_ENGINE_* variables, and the engine config."""

from __future__ import annotations

import pytest

from pagefleet.cli.flags import parse_flags
from pagefleet.engine.server.settings import ServerSettings


def test_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEFLEET_ENGINE_REDIS_URL", "redis://cache:6379/1")
    monkeypatch.setenv("PAGEFLEET_ENGINE_BLOCK_SIZE", "32")
    settings = ServerSettings(_cli_parse_args=["--model", "/models/x", "--port", "9000", "--num-kv-blocks", "64"])  # type: ignore[call-arg]
    assert settings.redis_url == "redis://cache:6379/1"
    assert settings.model_name == "/models/x" and settings.url == "http://127.0.0.1:9000"
    config = settings.engine_config()
    assert (config.model, config.block_size, config.num_kv_blocks) == ("/models/x", 32, 64)


def test_api_keys_from_flags_or_vllms_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert ServerSettings(_cli_parse_args=["--model", "x"]).api_key == []  # type: ignore[call-arg]
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert ServerSettings(_cli_parse_args=["--model", "x"]).api_key == ["from-env"]  # type: ignore[call-arg]
    settings = parse_flags(ServerSettings, ["--model", "x", "--api-key", "a", "b", "--root-path", "/llm"], "serve")
    assert settings is not None and settings.api_key == ["a", "b"] and settings.root_path == "/llm"


def test_invalid_engine_setting_fails_clearly() -> None:
    """Refused when the flags are parsed, naming the flag, not later inside the loader."""
    with pytest.raises(ValueError, match="--preemption-mode: must be 'recompute' or 'swap'"):
        ServerSettings(_cli_parse_args=["--preemption-mode", "sometimes"])  # type: ignore[call-arg]


def test_a_bad_flag_stops_serve_at_start_with_its_name() -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "pagefleet.cli.main", "serve", "--model", "x", "--block-size", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "--block-size: must be a power of two, got 3" in result.stderr
    assert "Traceback" not in result.stderr
