"""Debian's headless chromium driven by Selenium, for the tests of the server's page (`bash utils/setup.sh`
installs chromium and chromium-driver)."""
import contextlib
import os
import time

import pytest

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@contextlib.contextmanager
def chromium(profile_dir):
    """A headless chromium with its own profile in `profile_dir`, nothing fetched in the background."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.fail("chromium / chromium-driver missing: `bash utils/setup.sh` installs them "
                    "(as root or with sudo: apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={profile_dir}", "--window-size=1200,1100"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver, condition, timeout=60, what=""):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}: status {driver.find_element('id', 'status-text').text!r}")
