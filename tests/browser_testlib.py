"""Headless Chromium for the browser tests (selenium; the OS packages `chromium` and
`chromium-driver`, which `.ci/run` installs). Without them a test is skipped, or fails
where `JAXAGENT_BROWSER=require` (CI)."""

import os
import shutil

import pytest


def chromium_driver():
    from selenium import webdriver  # a test dependency (pyproject's `test` extra)

    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not binary or not driver_path:
        if os.environ.get("JAXAGENT_BROWSER") == "require":
            pytest.fail("JAXAGENT_BROWSER=require but chromium or chromedriver is not on PATH")
        pytest.skip("headless Chromium is not installed (apt-get install chromium chromium-driver; .ci/run does)")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--allow-file-access-from-files",
        "--window-size=1400,1000",
        "--disable-background-networking",
        "--disable-component-update",
        "--no-first-run",
    ):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(driver_path), options=opts)
