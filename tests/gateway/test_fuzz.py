"""The gateway's API (its proxied routes included, described in its OpenAPI), fuzzed: no
input gives a 5xx or a non-JSON error, through to the replicas, which stay healthy."""

from __future__ import annotations

import httpx

from tests.fuzz import fuzz_api, naming_model
from tests.gateway.conftest import Fleet
from tests.processes import idle_with_every_block_free, wait_for


def test_no_input_breaks_the_gateway_or_its_replicas(fleet: Fleet) -> None:
    described = httpx.get(f"{fleet.gateway.url}/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions"} <= described.keys()
    report = fuzz_api(fleet.gateway.url, examples_per_operation=16, prepare=naming_model("tiny"))
    assert not report.failures, "\n".join(report.failures[:10])
    assert report.statuses.get(200, 0) > 15 and report.statuses.get(400, 0) > 15, report.statuses
    assert httpx.get(f"{fleet.gateway.url}/health").status_code == 200
    for replica in fleet.replicas.values():
        assert httpx.get(f"{replica.url}/health").status_code == 200
        wait_for(lambda replica=replica: idle_with_every_block_free(replica))
