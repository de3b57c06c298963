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
from urllib.parse import quote

import pytest
import redis

from pspf import App, Context, NonRetryableError, Producer, Settings, Worker, codec
from pspf.errors import NotFound
from pspf.keys import ORIGINAL_ID_HEADER, dlq_key, stream_key
from pspf.service import Service
from tests.browser.conftest import serve
from tests.conftest import Names
from tests.integration.failures_support import WorkerThread
from tests.support import wait_until

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
        lag = service.apps.lag(app)
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
    health = Service(settings).topics.health()
    assert f"{health.server} {health.redis_version}" in text_of(driver, "health")
    shoot(driver, screenshots, "overview", taken)

    # An app's lag per partition, from the same records the API gives.
    click(driver, f'#apps tr[data-app="{app}"] a')
    assert driver.current_url == f"{base_url}/ui/#/apps/{app}"
    wait(driver, lambda d: len(rows(d, "lag")) == PARTITIONS, "the lag table")
    expected = {(d.topic, d.partition): d for d in service.apps.lag(app).detail}
    assert sum(d.dead_letters for d in expected.values()) == bad
    for row in rows(driver, "lag"):
        detail = expected[(row.get_attribute("data-topic"), int(row.get_attribute("data-partition") or -1))]
        assert row.find_element("css selector", "td.lag").text == str(detail.lag)
        assert row.find_element("css selector", "td.owner").text == "nobody"  # the app stopped
    outbox = service.outbox.outbox_list(app)
    assert outbox  # one receipt per good order
    wait(driver, lambda d: len(rows(d, "outbox")) == len(outbox), "the outbox rows")
    assert text_of(driver, "outbox-summary").startswith("outbox rows:")
    shoot(driver, screenshots, "app-lag", taken, show="app-detail")

    # The live app: each partition shows the worker that owns it.
    click(driver, f'#apps tr[data-app="{live}"] a')
    owner = service.apps.lag(live).owners[0]
    wait(
        driver,
        lambda d: [r.find_element("css selector", "td.owner").text for r in rows(d, "lag")] == [owner] * 2,
        "the owners",
    )
    assert owner in text_of(driver, "members")

    # The DLQ of the topic, its values shown as text, never as HTML.
    click(driver, f'#topics tr[data-topic="{orders}"] a')
    sources = {d.dlq_id: d.source_id for d in service.dlq.dlq_list(orders)}
    listed = list(sources)
    assert len(listed) == bad
    wait(driver, lambda d: len(rows(d, "dlq")) == bad, "the DLQ rows")
    assert [r.get_attribute("data-dlq-id") for r in rows(driver, "dlq")] == listed
    assert "is <b>bad</b> & <script>alert(1)</script>" in text_of(driver, "dlq")
    assert "<i>u" in text_of(driver, "dlq")
    assert not driver.find_elements("css selector", "#dlq b, #dlq i, #dlq script")
    assert len(rows(driver, "partitions")) == PARTITIONS

    # One entry whole, with its traceback.
    click(driver, f'#dlq tr[data-dlq-id="{listed[0]}"] a')
    wait(driver, lambda d: "Traceback" in text_of(d, "dlq-traceback"), "the traceback")
    assert driver.current_url == f"{base_url}/ui/#/topics/{orders}/dlq/{quote(listed[0], safe='')}"
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
    assert [d.dlq_id for d in service.dlq.dlq_list(orders)] == listed[2:]
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


def entry_ids(driver: WebDriver) -> list[str]:
    return [str(r.get_attribute("data-entry-id")) for r in rows(driver, "entries")]


def shown(driver: WebDriver, element_id: str) -> bool:
    return bool(driver.find_element("id", element_id).is_displayed())


def test_each_view_has_an_address_that_reload_back_and_forward_keep(
    driver: WebDriver,
    base_url: str,
    service: Service,
    settings: Settings,
    names: Names,
    make_topic: Callable[[int], str],
    redis_url: str,
    screenshots: Path,
) -> None:
    orders, app = make_topic(PARTITIONS), names.app()
    with Producer(settings=Settings.load({"PSPF_BROKER": redis_url}, environ={})) as producer:
        for n in range(30):
            value = {"n": n, "note": "<b>x</b>"}
            producer.send(orders, value, key=f"<i>u{n}</i>", headers={"src": "web"})
    Worker(watcher(app, orders), settings).run(until_idle=True)
    taken: list[Path] = []

    # A topic's address, opened directly: that view, with its latest entries, newest first.
    driver.get(f"{base_url}/ui/#/topics/{orders}")
    wait(driver, lambda d: len(rows(d, "entries")) == 20, "the latest entries")
    assert text_of(driver, "topic-name") == orders
    assert shown(driver, "topic-detail") and not shown(driver, "app-detail")
    latest, _ = service.reading.read_topic(orders, None, None, 20)
    assert entry_ids(driver) == [e.id for e in reversed(latest)]
    newest = rows(driver, "entries")[0]
    cells = [c.text for c in newest.find_elements("css selector", "td")]
    value = latest[-1].value
    assert cells == [
        latest[-1].id,
        str(latest[-1].partition),
        latest[-1].key,
        json.dumps(value, separators=(",", ":")),
        '{"src":"web"}',
    ]
    assert not driver.find_elements("css selector", "#entries b, #entries i")  # shown as text
    assert "the latest 20 entries of the topic, newest first" in text_of(driver, "entries-status")
    shoot(driver, screenshots, "latest-entries", taken, show="topic-detail")

    # The partition filter, then a refresh that shows an entry produced since.
    in_one = [e.id for e in reversed(service.reading.read_topic(orders, 1, None, 20)[0])]
    assert in_one and in_one != entry_ids(driver)  # thirty keys: both partitions have entries
    driver.find_element("css selector", "#entries-partition option[value='1']").click()
    wait(driver, lambda d: entry_ids(d) == in_one, "the entries of partition 1")
    assert {r.get_attribute("data-partition") for r in rows(driver, "entries")} == {"1"}
    driver.find_element("css selector", "#entries-partition option[value='']").click()
    wait(driver, lambda d: len({r.get_attribute("data-partition") for r in rows(d, "entries")}) == 2, "all")
    with Producer(settings=Settings.load({"PSPF_BROKER": redis_url}, environ={})) as producer:
        producer.send(orders, {"n": 999}, key="late")
    click(driver, "#entries-refresh")
    wait(driver, lambda d: '{"n":999}' in rows(d, "entries")[0].text, "the new entry on top")

    # A reload keeps the view.
    driver.refresh()
    wait(driver, lambda d: len(rows(d, "entries")) == 20, "the entries after the reload")
    assert text_of(driver, "topic-name") == orders and '{"n":999}' in rows(driver, "entries")[0].text

    # An app's link changes the address; back and forward go between the two views.
    wait(driver, lambda d: d.find_elements("css selector", f'#apps tr[data-app="{app}"] a'), "the app's link")
    click(driver, f'#apps tr[data-app="{app}"] a')
    wait(driver, lambda d: shown(d, "app-detail") and len(rows(d, "lag")) == PARTITIONS, "the app view")
    assert driver.current_url == f"{base_url}/ui/#/apps/{app}" and not shown(driver, "topic-detail")
    driver.back()
    wait(driver, lambda d: shown(d, "topic-detail") and not shown(d, "app-detail"), "the topic again")
    assert driver.current_url == f"{base_url}/ui/#/topics/{orders}"
    assert text_of(driver, "topic-name") == orders
    driver.forward()
    wait(driver, lambda d: shown(d, "app-detail") and not shown(d, "topic-detail"), "the app again")
    assert text_of(driver, "app-name") == app

    # An address that names no view shows the overview and says so.
    driver.get(f"{base_url}/ui/#/nowhere/at/all")
    driver.refresh()
    wait(driver, lambda d: "no view at #/nowhere/at/all" in text_of(d, "route-status"), "the unknown address")
    assert not shown(driver, "topic-detail") and not shown(driver, "app-detail")
    wait(
        driver,
        lambda d: d.find_elements("css selector", f'#topics tr[data-topic="{orders}"]'),
        "the overview",
    )
    assert_pngs(taken)


def test_an_app_is_reset_and_deleted_from_its_page_each_after_a_dry_run(
    driver: WebDriver,
    base_url: str,
    service: Service,
    settings: Settings,
    names: Names,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    screenshots: Path,
) -> None:
    orders, app = make_topic(PARTITIONS), names.app()
    produce(orders, [(f"u{n % 5}", {"n": n}) for n in range(ENTRIES)])
    Worker(watcher(app, orders), settings).run(until_idle=True)
    seen = {f"u{k}": service.state_get(app, f"u{k}") for k in range(5)}
    assert sum(s["seen"] for s in seen.values()) == ENTRIES
    taken: list[Path] = []

    driver.get(f"{base_url}/ui/#/apps/{app}")
    wait(driver, lambda d: len(rows(d, "lag")) == PARTITIONS, "the app view")
    document = driver.find_element("id", "app-asyncapi").get_attribute("href")
    assert document == f"{base_url}/apps/{app}/asyncapi"
    assert service.apps.asyncapi(app)["channels"][orders]["address"] == orders  # what the link serves
    driver.find_element("id", "token").send_keys(TOKEN)
    click(driver, "#token-save")

    # Reset to the start: the dry run says what would happen, and nothing moves.
    click(driver, "#app-dry-run")
    wait(driver, lambda d: "dry run: would reset" in text_of(d, "app-result"), "the reset dry run")
    result = text_of(driver, "app-result")
    assert (
        f"{ENTRIES} entries to process" in result
        and "state deleted" in result
        and "nothing changed" in result
    )
    assert "state: deleted" in text_of(driver, "app-plan")
    assert service.apps.lag(app).lag == 0 and service.state_get(app, "u1") == seen["u1"]
    confirm = driver.find_element("id", "app-confirm")
    assert confirm.is_enabled() and confirm.text == "Reset to the start"
    shoot(driver, screenshots, "reset-dry-run", taken, show="app-actions")
    confirm.click()
    wait(driver, lambda d: text_of(d, "app-result").startswith(f"reset {app} to the start"), "the reset")
    assert service.apps.lag(app).lag == ENTRIES
    with pytest.raises(NotFound):  # the state went with the reset
        service.state_get(app, "u1")
    lags = lambda d: sum(int(r.find_element("css selector", "td.lag").text) for r in rows(d, "lag"))  # noqa: E731
    wait(driver, lambda d: lags(d) == ENTRIES, "the lag table after the reset")
    assert not driver.find_element("id", "app-confirm").is_enabled()

    # While a worker runs, the API refuses and the page shows why.
    with WorkerThread(watcher(app, orders), settings):
        wait_until(lambda: caught_up(service, app), 20, "the worker to catch up")
        click(driver, "#app-dry-run")
        wait(driver, lambda d: "failed (409)" in text_of(d, "app-result"), "the refusal")
        assert "stop it first" in text_of(driver, "app-result")
        assert not driver.find_element("id", "app-confirm").is_enabled()
    assert {f"u{k}": service.state_get(app, f"u{k}") for k in range(5)} == seen  # rebuilt once

    # Delete: the dry run lists the groups and keys; then the app leaves the server and the page.
    driver.find_element("css selector", "#app-action option[value=delete]").click()
    assert not driver.find_element("id", "app-keep-state").is_enabled()
    click(driver, "#app-dry-run")
    wait(driver, lambda d: "dry run: would remove" in text_of(d, "app-result"), "the delete dry run")
    plan = text_of(driver, "app-plan").splitlines()
    assert len([line for line in plan if line.startswith(f"group {app} of ")]) == PARTITIONS
    assert any(line.startswith("key ") for line in plan)
    assert service.apps.lag(app).app == app
    shoot(driver, screenshots, "delete-dry-run", taken, show="app-actions")
    confirm = driver.find_element("id", "app-confirm")
    assert confirm.text == f"Delete app {app}"
    confirm.click()
    wait(driver, lambda d: d.current_url == f"{base_url}/ui/#/", "the overview")
    wait(driver, lambda d: f"removed app {app}" in text_of(d, "apps-status"), "the deletion said")
    assert not driver.find_elements("css selector", f'#apps tr[data-app="{app}"]')
    assert not shown(driver, "app-detail")
    with pytest.raises(NotFound):
        service.apps.lag(app)

    # The topic no app reads any more: deleted from its page, after a dry run.
    driver.get(f"{base_url}/ui/#/topics/{orders}")
    click(driver, "#topic-dry-run")
    wait(driver, lambda d: "dry run: would remove topic" in text_of(d, "topic-result"), "the topic dry run")
    assert stream_key(orders, 0) in text_of(driver, "topic-plan")
    assert service.topics.describe_topic(orders).partitions
    shoot(driver, screenshots, "topic-delete-dry-run", taken, show="topic-actions")
    click(driver, "#topic-confirm")
    wait(
        driver, lambda d: f"removed topic {orders}" in text_of(d, "topics-status"), "the topic deletion said"
    )
    with pytest.raises(NotFound):
        service.topics.describe_topic(orders)
    assert_pngs(taken)


def test_a_topics_page_shows_its_schema_or_that_it_has_none(
    driver: WebDriver, base_url: str, service: Service, make_topic: Callable[[int], str]
) -> None:
    with_schema, without = make_topic(1), make_topic(1)
    schema = {"type": "object", "properties": {"amount": {"type": "integer"}}, "required": ["amount"]}
    service.schemas.set_schema(with_schema, schema)

    driver.get(f"{base_url}/ui/#/topics/{with_schema}")
    wait(driver, lambda d: "version 1 (backward)" in text_of(d, "schema-status"), "the schema's version")
    assert json.loads(text_of(driver, "schema")) == schema
    driver.get(f"{base_url}/ui/#/topics/{without}")
    wait(driver, lambda d: text_of(d, "schema-status") == "no schema: values are not checked", "no schema")
    assert not shown(driver, "schema")


def test_an_apps_savepoints_are_taken_restored_as_a_fork_after_a_dry_run_and_deleted(
    driver: WebDriver,
    base_url: str,
    service: Service,
    make_settings: Callable[..., Settings],
    names: Names,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    tmp_path: Path,
    screenshots: Path,
) -> None:
    orders, app, fork = make_topic(PARTITIONS), names.app(), names.app()
    produce(orders, [(f"u{n % 5}", {"n": n}) for n in range(ENTRIES)])
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "a"))
    Worker(watcher(app, orders), settings).run(until_idle=True)
    taken: list[Path] = []

    driver.get(f"{base_url}/ui/#/apps/{app}")
    wait(driver, lambda d: text_of(d, "savepoints-status") == "no savepoints yet", "the empty list")
    driver.find_element("id", "token").send_keys(TOKEN)
    click(driver, "#token-save")

    # Taking one asks where to write it; the list then shows it.
    click(driver, "#savepoint-take")
    wait(driver, lambda d: "say where to write it" in text_of(d, "savepoint-result"), "the question")
    driver.find_element("id", "savepoint-to").send_keys(str(tmp_path / "sp"))
    driver.find_element("id", "savepoint-name").send_keys("before")
    click(driver, "#savepoint-take")
    wait(driver, lambda d: "took savepoint before" in text_of(d, "savepoint-result"), "the savepoint")
    assert "app stopped" in text_of(driver, "savepoint-result")
    row = '#savepoints tr[data-savepoint="before"]'
    wait(driver, lambda d: d.find_elements("css selector", row), "its row")
    cells = [c.text for c in driver.find_elements("css selector", f"{row} td")]
    assert cells[0] == "before" and cells[2] == "complete" and cells[3] == "5"
    assert cells[4] == str(tmp_path / "sp" / "before")
    assert (tmp_path / "sp" / "before" / "manifest.json").exists()
    shoot(driver, screenshots, "savepoint-taken", taken, show="savepoints")

    # The app goes on; a fork restored from the savepoint, after a dry run, handles what came since.
    produce(orders, [(f"u{n % 5}", {"n": n}) for n in range(ENTRIES, ENTRIES + 10)])
    Worker(watcher(app, orders), settings).run(until_idle=True)
    driver.find_element("id", "restore-as").send_keys(fork)
    click(driver, f"{row} button.savepoint-restore")
    wait(driver, lambda d: "dry run: would restore fork" in text_of(d, "savepoint-result"), "the dry run")
    assert "10 entries to handle after the cut" in text_of(driver, "savepoint-result")
    assert f"into the new app {fork}" in text_of(driver, "savepoint-plan")
    with pytest.raises(NotFound):  # a dry run changes nothing
        service.apps.lag(fork)
    confirm = driver.find_element("id", "savepoint-confirm")
    assert confirm.is_enabled() and confirm.text == f"Restore fork {fork}"
    shoot(driver, screenshots, "restore-dry-run", taken, show="savepoints")
    confirm.click()
    wait(driver, lambda d: text_of(d, "savepoint-result").startswith(f"restored fork {fork}"), "the restore")
    assert service.apps.lag(fork).lag == 10
    wait(driver, lambda d: d.find_elements("css selector", f'#apps tr[data-app="{fork}"]'), "the fork listed")
    fork_settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "fork"))
    assert Worker(watcher(fork, orders), fork_settings).run(until_idle=True).handled == 10
    assert [service.state_get(fork, f"u{k}") for k in range(5)] == [
        service.state_get(app, f"u{k}") for k in range(5)
    ]

    # The app itself, back at the cut: the dry run says so, and nothing changes without the confirm.
    driver.find_element("id", "restore-as").clear()
    click(driver, f"{row} button.savepoint-restore")
    wait(driver, lambda d: "dry run: would restore app" in text_of(d, "savepoint-result"), "the rollback")
    assert driver.find_element("id", "savepoint-confirm").text == f"Restore app {app}"
    assert service.apps.lag(app).lag == 0

    # Deleting: the dry run names it and keeps its files; then it goes with them.
    click(driver, f"{row} button.savepoint-delete")
    wait(driver, lambda d: "dry run: would delete savepoint before" in text_of(d, "savepoint-result"), "dry")
    assert (tmp_path / "sp" / "before").exists()
    assert driver.find_element("id", "savepoint-confirm").text == "Delete savepoint before"
    click(driver, "#savepoint-confirm")
    wait(driver, lambda d: "deleted savepoint before" in text_of(d, "savepoint-result"), "the deletion")
    wait(driver, lambda d: text_of(d, "savepoints-status") == "no savepoints yet", "the empty list again")
    assert not (tmp_path / "sp" / "before").exists() and service.savepoints.listed(app) == []
    assert_pngs(taken)
