"""The dashboard in a real headless Chromium: it shows the fleet's model and replicas."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.gateway.conftest import Fleet


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
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,700"):
        options.add_argument(flag)
    session = webdriver.Chrome(service=Service(driver), options=options)
    yield session
    session.quit()


def test_dashboard_shows_models_and_replicas(fleet: Fleet, browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{fleet.gateway.url}/dashboard")
    rows = WebDriverWait(browser, 20).until(
        lambda b: (found := b.find_elements(By.CSS_SELECTOR, "tr.replica")) and len(found) >= 2 and found
    )
    assert {row.get_attribute("data-replica") for row in rows} >= {"tiny-a", "tiny-b"}
    assert "tiny" in browser.find_element(By.CSS_SELECTOR, "h2.model").text
    assert browser.find_element(By.ID, "status").text == "live"
    assert [cell.text for cell in browser.find_elements(By.CSS_SELECTOR, "td.restarts")][:2] == ["0", "0"]
    screenshot = tmp_path / "dashboard.png"
    assert browser.save_screenshot(str(screenshot)) and screenshot.stat().st_size > 1000
