"""Headless chromium for the tests that read a page in a real browser (Debian's ``chromium`` and
``chromium-driver``, .ci/apt-packages; nothing is downloaded at run time)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


def chromium(profile: Path) -> Iterator[Any]:
    """A headless chromium driver with its profile in ``profile``, quit when the caller is done
    (a fixture's body: ``yield from chromium(tmp_path_factory.mktemp("chromium"))``)."""
    if not (CHROMIUM and DRIVER):
        pytest.fail("chromium and chromium-driver are needed (.ci/apt-packages)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1280,900", f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()
