"""A headless Chromium driven by Selenium, and the admin API served on a free local port.

The browser is Debian's ``chromium`` with its ``chromedriver`` (``PSPF_CHROMIUM`` and
``PSPF_CHROMEDRIVER`` name others); without them the browser tests skip and say why.
Screenshots go to ``PSPF_SCREENSHOT_DIR`` when set, else under the test's tmp_path; the run's
summary lists where.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import uvicorn

from pspf.admin_api import create_app
from pspf.embedded import free_port
from pspf.service import Service

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

CHROMIUM = os.environ.get("PSPF_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("PSPF_CHROMEDRIVER", "/usr/bin/chromedriver")

_screenshot_dirs: list[Path] = []


def _missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install 'pspf[dev]')"
    for what, path in (("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER)):
        if not (Path(path).is_file() or shutil.which(path)):
            return f"no {what} at {path} (apt-get install chromium chromium-driver)"
    return None


@pytest.fixture(scope="session")
def browser_paths() -> tuple[str, str]:
    missing = _missing()
    if missing:
        pytest.skip(missing)
    return CHROMIUM, CHROMEDRIVER


@pytest.fixture
def driver(browser_paths: tuple[str, str]) -> Iterator[WebDriver]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service as DriverService

    binary, driver_binary = browser_paths
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(argument)
    found = webdriver.Chrome(options=options, service=DriverService(driver_binary))
    found.set_page_load_timeout(30)
    yield found
    found.quit()


@pytest.fixture
def screenshots(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    base = os.environ.get("PSPF_SCREENSHOT_DIR")
    directory = Path(base) / request.node.name if base else tmp_path / "screenshots"
    directory.mkdir(parents=True, exist_ok=True)
    _screenshot_dirs.append(directory)
    return directory


def serve(service: Service, token: str | None) -> Iterator[str]:
    """Run the admin API over ``service`` with uvicorn in a thread; yields its base URL."""
    port = free_port()
    config = uvicorn.Config(create_app(service, token), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the admin API did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for directory in _screenshot_dirs:
        pngs = sorted(p.name for p in directory.glob("*.png"))
        terminalreporter.write_line(f"screenshots in {directory}: {', '.join(pngs) or 'none'}")
