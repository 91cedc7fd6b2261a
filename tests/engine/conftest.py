"""Fixtures the engine tests share: SmolLM2 loaded once for every test that only reads it."""

from __future__ import annotations

import pytest

from pagefleet.engine import LLM


@pytest.fixture(scope="session")
def smollm2() -> LLM:
    """The real SmolLM2 dequantized to float32 (the weights transformers reads), 256 MiB of
    KV; tests must leave it as they found it (every block free: each module checks)."""
    return LLM("smollm2-135m-instruct", dtype="float32", quantization="none", kv_cache_memory=256 << 20)
