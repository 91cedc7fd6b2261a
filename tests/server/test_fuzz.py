"""The engine server's whole API, fuzzed from its OpenAPI description: no input gives a 5xx
or a non-JSON error, and the replica is healthy and idle afterwards."""

from __future__ import annotations

import httpx

from tests.fuzz import fuzz_api, naming_model
from tests.processes import EngineServer, idle_with_every_block_free, wait_for


def test_no_input_breaks_the_engine_server(tiny_server: EngineServer) -> None:
    report = fuzz_api(tiny_server.url, examples_per_operation=12, prepare=naming_model(tiny_server.model))
    assert not report.failures, "\n".join(report.failures[:10])
    assert report.statuses.get(200, 0) > 30 and report.statuses.get(400, 0) > 30, report.statuses
    assert httpx.get(f"{tiny_server.url}/health").status_code == 200
    wait_for(lambda: idle_with_every_block_free(tiny_server))
