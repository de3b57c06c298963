"""The operator's page and Swagger UI in a real headless Chromium, against a real server.

Every check reads what the browser shows, and every change the page makes is checked again in
Redis through the service: what the operator saw is what happened.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis

from pspf import App, Context, NonRetryableError, Settings, Worker, codec
from pspf.errors import NotFound
from pspf.keys import ORIGINAL_ID_HEADER, dlq_key, stream_key
from pspf.service import Service
from tests.browser.conftest import serve
from tests.conftest import Names

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.remote.webelement import WebElement

pytestmark = [pytest.mark.integration, pytest.mark.browser]

TOKEN = "tok-web-5c1f0e9a"
ENTRIES = 24
PARTITIONS = 2


def shop(name: str, orders: str, receipts: str) -> App:
    """Emits a receipt per order (so the app has an outbox); orders marked bad fail at once."""
    app = App(name)

    @app.handler(orders)
    def receipt(order: dict[str, Any], ctx: Context) -> None:
        if order["bad"]:
            raise NonRetryableError(f"order {order['n']} is <b>bad</b> & <script>alert(1)</script>")
        ctx.state["count"] = ctx.state.get("count", 0) + 1
        ctx.emit(receipts, {"n": order["n"]})

    return app


def watcher(name: str, orders: str) -> App:
    """Reads the orders and never fails: a live worker that owns partitions while the test runs."""
    app = App(name)

    @app.handler(orders)
    def seen(order: dict[str, Any], ctx: Context) -> None:
        ctx.state["seen"] = ctx.state.get("seen", 0) + 1

    return app


@pytest.fixture
def base_url(service: Service) -> Iterator[str]:
    yield from serve(service, TOKEN)


def wait(driver: WebDriver, condition: Callable[[WebDriver], Any], what: str, timeout_s: float = 15) -> Any:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # A table the page fills again while the condition reads it is read again.
    waiting = WebDriverWait(driver, timeout_s, ignored_exceptions=[StaleElementReferenceException])
    return waiting.until(condition, message=what)


def text_of(driver: WebDriver, element_id: str) -> str:
    return str(driver.find_element("id", element_id).text)


def rows(driver: WebDriver, table_id: str) -> list[WebElement]:
    return list(driver.find_elements("css selector", f"#{table_id} tbody tr"))


def click(driver: WebDriver, css: str) -> None:
    driver.find_element("css selector", css).click()


def shoot(driver: WebDriver, directory: Path, name: str, taken: list[Path], show: str | None = None) -> None:
    """Save a screenshot, with the element of id ``show`` scrolled into view."""
    if show is not None:
        driver.execute_script("document.getElementById(arguments[0]).scrollIntoView()", show)
    path = directory / f"{len(taken) + 1:02d}-{name}.png"
    assert driver.save_screenshot(str(path))
    taken.append(path)


def assert_pngs(taken: list[Path]) -> None:
    for path in taken:
        data = path.read_bytes()
        assert len(data) > 1000 and data.startswith(b"\x89PNG\r\n\x1a\n"), path


def dlq_length(rclient: redis.Redis, topic: str) -> int:
    return sum(int(rclient.xlen(dlq_key(topic, p))) for p in range(PARTITIONS))


def stream_length(rclient: redis.Redis, topic: str) -> int:
    return sum(int(rclient.xlen(stream_key(topic, p))) for p in range(PARTITIONS))


def caught_up(service: Service, app: str) -> bool:
    """Whether a worker of ``app`` owns every partition and has read everything."""
    try:
        lag = service.lag(app)
    except NotFound:  # not registered yet
        return False
    return bool(lag.detail) and all(d.owner for d in lag.detail) and lag.lag == 0


def test_the_operator_page_shows_lag_and_redrives_and_purges_the_dlq(
    driver: WebDriver,
    base_url: str,
    service: Service,
    settings: Settings,
    names: Names,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    running: Callable[[Worker], None],
    rclient: redis.Redis,
    screenshots: Path,
) -> None:
    orders, receipts = make_topic(PARTITIONS), make_topic(1)
    app, live = names.app(), names.app()
    produce(orders, [(f"<i>u{n % 5}</i>", {"n": n, "bad": n % 4 == 0}) for n in range(ENTRIES)])
    bad = ENTRIES // 4
    assert Worker(shop(app, orders, receipts), settings).run(until_idle=True).dead_lettered == bad
    running(Worker(watcher(live, orders), settings))
    deadline = time.monotonic() + 20
    while not caught_up(service, live):
        assert time.monotonic() < deadline, "the live worker never took its partitions"
        time.sleep(0.05)
    taken: list[Path] = []

    # The overview: topics and apps; from / the page is one redirect away.
    driver.get(base_url + "/")
    assert driver.current_url == base_url + "/ui/"
    wait(driver, lambda d: d.find_elements("css selector", f'#topics tr[data-topic="{orders}"]'), "topics")
    wait(driver, lambda d: d.find_elements("css selector", f'#apps tr[data-app="{app}"]'), "apps")
    assert "Read-only" in text_of(driver, "mode")
    # The server under test by its own name and version (Valkey 9.1 is not "Redis 9.1").
    health = Service(settings).health()
    assert f"{health.server} {health.redis_version}" in text_of(driver, "health")
    shoot(driver, screenshots, "overview", taken)

    # An app's lag per partition, from the same records the API gives.
    click(driver, f'#apps tr[data-app="{app}"] button')
    wait(driver, lambda d: len(rows(d, "lag")) == PARTITIONS, "the lag table")
    expected = {(d.topic, d.partition): d for d in service.lag(app).detail}
    assert sum(d.dead_letters for d in expected.values()) == bad
    for row in rows(driver, "lag"):
        detail = expected[(row.get_attribute("data-topic"), int(row.get_attribute("data-partition") or -1))]
        assert row.find_element("css selector", "td.lag").text == str(detail.lag)
        assert row.find_element("css selector", "td.owner").text == "nobody"  # the app stopped
    outbox = service.outbox_list(app)
    assert outbox  # one receipt per good order
    wait(driver, lambda d: len(rows(d, "outbox")) == len(outbox), "the outbox rows")
    assert text_of(driver, "outbox-summary").startswith("outbox rows:")
    shoot(driver, screenshots, "app-lag", taken, show="app-detail")

    # The live app: each partition shows the worker that owns it.
    click(driver, f'#apps tr[data-app="{live}"] button')
    owner = service.lag(live).owners[0]
    wait(
        driver,
        lambda d: [r.find_element("css selector", "td.owner").text for r in rows(d, "lag")] == [owner] * 2,
        "the owners",
    )
    assert owner in text_of(driver, "members")

    # The DLQ of the topic, its values shown as text, never as HTML.
    click(driver, f'#topics tr[data-topic="{orders}"] button')
    sources = {d.dlq_id: d.source_id for d in service.dlq_list(orders)}
    listed = list(sources)
    assert len(listed) == bad
    wait(driver, lambda d: len(rows(d, "dlq")) == bad, "the DLQ rows")
    assert [r.get_attribute("data-dlq-id") for r in rows(driver, "dlq")] == listed
    assert "is <b>bad</b> & <script>alert(1)</script>" in text_of(driver, "dlq")
    assert "<i>u" in text_of(driver, "dlq")
    assert not driver.find_elements("css selector", "#dlq b, #dlq i, #dlq script")
    assert len(rows(driver, "partitions")) == PARTITIONS

    # One entry whole, with its traceback.
    click(driver, f'#dlq tr[data-dlq-id="{listed[0]}"] button')
    wait(driver, lambda d: "Traceback" in text_of(d, "dlq-traceback"), "the traceback")
    traceback = text_of(driver, "dlq-traceback")
    assert "NonRetryableError" in traceback and "in receipt" in traceback
    shoot(driver, screenshots, "dlq-entry", taken, show="dlq-entry")

    # Without the token the API refuses, the page says so, and nothing moves.
    click(driver, f'#dlq tr[data-dlq-id="{listed[0]}"] input')
    click(driver, f'#dlq tr[data-dlq-id="{listed[1]}"] input')
    click(driver, "#dlq-dry-run")
    wait(driver, lambda d: "refused" in text_of(d, "dlq-result"), "the refusal")
    assert "refused (401)" in text_of(driver, "dlq-result") and "read-only" in text_of(driver, "dlq-result")
    assert not driver.find_element("id", "dlq-confirm").is_enabled()
    shoot(driver, screenshots, "refused", taken, show="dlq-actions")
    driver.find_element("id", "token").send_keys("not-the-token")
    click(driver, "#token-save")
    click(driver, "#dlq-dry-run")
    wait(driver, lambda d: "refused (403)" in text_of(d, "dlq-result"), "the wrong token refused")
    assert dlq_length(rclient, orders) == bad and stream_length(rclient, orders) == ENTRIES

    # With the token: a dry run says how many and moves nothing; then the redrive moves them.
    click(driver, "#token-forget")
    driver.find_element("id", "token").send_keys(TOKEN)
    click(driver, "#token-save")
    assert "Token in use" in text_of(driver, "mode")
    assert driver.execute_script("return sessionStorage.getItem('pspf-admin-token')") == TOKEN
    click(driver, "#dlq-dry-run")
    wait(driver, lambda d: "would redrive 2 entries" in text_of(d, "dlq-result"), "the dry run")
    assert dlq_length(rclient, orders) == bad and stream_length(rclient, orders) == ENTRIES
    confirm = driver.find_element("id", "dlq-confirm")
    assert confirm.is_enabled() and confirm.text == "Redrive 2 entries"
    shoot(driver, screenshots, "dry-run", taken, show="dlq-actions")
    confirm.click()
    wait(driver, lambda d: "redrove 2 of 2" in text_of(d, "dlq-result"), "the redrive")
    wait(driver, lambda d: len(rows(d, "dlq")) == bad - 2, "the shorter DLQ")
    assert dlq_length(rclient, orders) == bad - 2 and stream_length(rclient, orders) == ENTRIES + 2
    assert [d.dlq_id for d in service.dlq_list(orders)] == listed[2:]
    # The two entries are back in the topic, each once, as copies of the entries that failed.
    back = [
        codec.decode_headers(fields.get(codec.HEADERS)).get(ORIGINAL_ID_HEADER)
        for p in range(PARTITIONS)
        for _, fields in rclient.xrange(stream_key(orders, p))
    ]
    assert sorted(i for i in back if i) == sorted(sources[i] for i in listed[:2])
    shoot(driver, screenshots, "redriven", taken, show="dlq")

    # Purge: every entry left, dry run first.
    driver.find_element("css selector", "#dlq-action option[value=purge]").click()
    driver.find_element("css selector", "#dlq-scope option[value=all]").click()
    click(driver, "#dlq-dry-run")
    wait(driver, lambda d: f"would delete {bad - 2} entries" in text_of(d, "dlq-result"), "the purge dry run")
    assert dlq_length(rclient, orders) == bad - 2
    click(driver, "#dlq-confirm")
    wait(driver, lambda d: f"deleted {bad - 2} of {bad - 2}" in text_of(d, "dlq-result"), "the purge")
    wait(driver, lambda d: "the DLQ is empty" in text_of(d, "dlq-status"), "the empty DLQ")
    assert dlq_length(rclient, orders) == 0 and stream_length(rclient, orders) == ENTRIES + 2
    shoot(driver, screenshots, "purged", taken, show="topic-detail")

    assert len(taken) == 7
    assert_pngs(taken)


def test_swagger_ui_renders_every_operation_from_local_files(
    driver: WebDriver, base_url: str, screenshots: Path
) -> None:
    with urllib.request.urlopen(base_url + "/schema/openapi.json", timeout=10) as response:
        document = json.load(response)
    operations = sum(len(item) for item in document["paths"].values())
    assert operations >= 16

    driver.get(base_url + "/schema")
    wait(driver, lambda d: len(d.find_elements("css selector", ".opblock")) == operations, "the operations")
    assert "PSPF admin API" in driver.find_element("css selector", ".info .title").text
    resources = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert any(url.endswith("/swagger-ui-bundle.js") for url in resources), resources
    assert all(url.startswith(base_url + "/") for url in resources), resources
    taken: list[Path] = []
    shoot(driver, screenshots, "swagger-ui", taken)
    assert_pngs(taken)
