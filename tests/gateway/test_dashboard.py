"""The dashboard in a real headless Chromium: it shows the fleet's model and replicas, and
its charts fill while the fleet is under load."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pagefleet.operator.metrics import OperatorMetrics
from tests.gateway.conftest import Fleet
from tests.processes import free_port, running_prometheus, wait_for


@pytest.fixture
def browser():  # type: ignore[no-untyped-def]
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.fail(
            "chromium and chromedriver are missing: apt-get install chromium chromium-driver (scripts/test.sh does)"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1500"):
        options.add_argument(flag)
    session = webdriver.Chrome(service=Service(driver), options=options)
    yield session
    session.quit()


# Where the screenshot is kept after the run (CI keeps the folder as an artefact).
ARTIFACTS = Path(os.environ.get("PAGEFLEET_TEST_ARTIFACTS", Path(__file__).parents[2] / "test-artifacts"))
# The charts that load must fill: engine figures, gateway figures and latency percentiles.
CHARTS_UNDER_LOAD = (
    "kv_usage",
    "free_blocks",
    "output_tokens",
    "requests_in_engine",
    "ttft",
    "itl",
    "requests",
    "routing",
)


@pytest.fixture
def load(fleet: Fleet) -> Iterator[None]:
    """Two clients streaming completions through the gateway until the test ends."""
    done = threading.Event()

    def client() -> None:
        with httpx.Client(base_url=fleet.gateway.url, timeout=60) as http:
            while not done.is_set():
                body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 24, "stream": True}
                with http.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    for _ in response.iter_bytes():
                        pass

    threads = [threading.Thread(target=client, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    yield
    done.set()
    for thread in threads:
        thread.join(timeout=60)


# What the page shows, read in one script: the page re-renders every second, so elements
# found in one call may be gone by the next.
READ_PAGE = """
const text = selector => [...document.querySelectorAll(selector)].map(element => element.textContent.trim());
return {
  status: document.getElementById("status").textContent,
  window: document.getElementById("window").textContent,
  models: text("h2.model"),
  replicas: [...document.querySelectorAll("tr.replica")].map(row => row.dataset.replica),
  restarts: text("td.restarts"),
  charts: Object.fromEntries([...document.querySelectorAll("h2.model + table + .charts svg.chart")]
    .map(svg => [svg.dataset.chart, {points: Number(svg.dataset.points), legend: svg.nextElementSibling.textContent}])),
};
"""


def test_dashboard_shows_models_and_replicas_and_charts_under_load(fleet: Fleet, load: None, browser) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{fleet.gateway.url}/dashboard")
    page = WebDriverWait(browser, 20).until(lambda b: (seen := b.execute_script(READ_PAGE))["replicas"] and seen)
    assert set(page["replicas"]) >= {"tiny-a", "tiny-b"}
    assert any("tiny" in model for model in page["models"])
    assert page["status"] == "live"
    assert page["restarts"][:2] == ["0", "0"]

    def filled(b) -> dict | None:  # type: ignore[no-untyped-def,type-arg]
        charts = b.execute_script(READ_PAGE)["charts"]
        return charts if all(charts.get(name, {}).get("points", 0) >= 3 for name in CHARTS_UNDER_LOAD) else None

    charts = WebDriverWait(browser, 40).until(filled)
    assert set(charts) >= {*CHARTS_UNDER_LOAD, "preemptions", "errors", "failovers"}
    routing = charts["routing"]["legend"]
    assert "tiny-a" in routing and "tiny-b" in routing  # one line per replica, in the legend
    assert "rates and percentiles over 2" in page["window"]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    screenshot = ARTIFACTS / "dashboard.png"
    assert browser.save_screenshot(str(screenshot)) and screenshot.stat().st_size > 1000


def exported_names(text: str) -> set[str]:
    """Every series name a Prometheus scrape of this text can hold, labelled children or not."""
    from prometheus_client.parser import text_string_to_metric_families

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {family.name + suffix for suffix in suffixes.get(family.type, ("",))}
    return names


DASHBOARD = Path(__file__).parents[2] / "charts/pagefleet/dashboards/pagefleet-fleet.json"


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of the chart's Grafana dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel.get("targets", [])]


def test_every_metric_in_the_grafana_dashboard_is_exported(fleet: Fleet) -> None:
    """The Helm chart's Grafana dashboard names only metrics a replica, the gateway or the
    operator export, so renaming one fails here rather than blanking a panel."""
    from prometheus_client import generate_latest

    replica = fleet.replicas["tiny-a"]
    exported = exported_names(httpx.get(f"{replica.url}/metrics").text)
    exported |= exported_names(httpx.get(f"{fleet.gateway.url}/metrics").text)
    exported |= exported_names(generate_latest(OperatorMetrics().registry).decode())
    queries = [expr for _, expr in dashboard_queries()]
    queries.append(json.loads(DASHBOARD.read_text())["templating"]["list"][1]["query"]["query"])
    used = {name for query in queries for name in re.findall(r"\bpagefleet[a-z_]*:[a-zA-Z0-9_:]+", query)}
    assert len(used) >= 15
    assert used <= exported, f"not exported: {sorted(used - exported)}"


@pytest.mark.alone  # beside another worker's tests, its scrapes of the fleet timed out
def test_every_grafana_panel_shows_data_from_a_real_prometheus_scraping_the_fleet(
    fleet: Fleet, load: None, tmp_path: Path
) -> None:
    """Debian's Prometheus scrapes the replicas, the gateway and an operator's metrics as the
    chart's monitors would; every query of the Grafana dashboard parses, and every panel but
    failovers (there are none) has data while the fleet is under load."""
    operator, operator_port = OperatorMetrics(), free_port()
    operator.serve(operator_port)
    operator.replicas.labels("models", "smol", "").set(2)
    operator.kv_utilization.labels("models", "smol", "").set(0.4)
    operator.scaling_events.labels("models", "smol", "", "ScaleUp").inc()
    address = lambda url: url.split("://", 1)[1]  # noqa: E731
    jobs = {
        "engines": [address(replica.url) for replica in fleet.replicas.values()],
        "gateway": [address(fleet.gateway.url)],
        "operator": [f"127.0.0.1:{operator_port}"],
    }
    # Grafana's variables as a user would set them: one model, a rate window of a few scrapes.
    queries = [
        (title, expr.replace("$model", "tiny").replace("$__rate_interval", "15s"))
        for title, expr in dashboard_queries()
    ]
    try:
        with running_prometheus(jobs, tmp_path) as prometheus:

            def panels_without_data() -> set[str]:
                httpx.post(
                    f"{fleet.gateway.url}/v1/completions", json={"model": "tiny", "prompt": "x", "n": 0}
                )  # a 400
                filled = set()
                for title, expr in queries:
                    answer = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}).json()
                    if answer["status"] != "success":
                        pytest.fail(f"{title}: {expr} does not run: {answer}")
                    if answer["data"]["result"]:
                        filled.add(title)
                empty = {title for title, _ in queries} - filled
                # Failovers have data only if a replica of this session's fleet failed earlier
                # (the tests share it, in whatever order a worker runs them).
                assert empty <= {"Failovers/s"}, f"no data yet: {sorted(empty)}"
                return empty

            wait_for(panels_without_data, timeout=120, interval=2.0)
            models = httpx.get(f"{prometheus}/api/v1/label/model_name/values").json()["data"]
            assert "tiny" in models  # the dashboard's model selector
    finally:
        operator.close()
