"""Fixtures of the server tests: a Redis and a `pagefleet serve` on a tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.processes import EngineServer, start_server, stop_server


@pytest.fixture(scope="module")
def tiny_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    log = tmp_path_factory.mktemp("serve") / "tiny.log"
    server = start_server(str(tiny_llama), log, "--dtype", "float32", "--num-kv-blocks", "512", "--block-size", "8")
    yield server
    stop_server(server)
