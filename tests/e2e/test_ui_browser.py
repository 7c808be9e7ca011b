"""The status page in a real browser: headless Chromium through selenium, against a live gateway in
front of simulated replicas (one of them a closed port)."""

from __future__ import annotations

import base64
import contextlib
import io
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest
from prometheus_client import CollectorRegistry
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from gateway import __version__
from gateway.app import build_gateway, create_app
from gateway.ops.accesslog import AccessLog
from gateway.routing.table import parse_table
from gateway.settings import Settings
from gateway.simulator import SimConfig
from gateway.simulator import create_app as sim_app
from tests.support.harness import Running, run_gateway
from tests.support.servers import ThreadServer, free_port

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = os.environ.get("CHROMEDRIVER") or shutil.which("chromedriver") or "/usr/bin/chromedriver"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
HELLO = [{"role": "user", "content": "hello"}]
DASH = "\u2013"  # what the page shows for a missing figure
LAPTOP, PHONE = (1280, 900), (375, 800)


@pytest.fixture(scope="module")
def sims() -> Iterator[dict[str, ThreadServer]]:
    servers = {
        "chat": ThreadServer(sim_app(SimConfig(engine="vllm", model="chat-served", time_scale=0))).start(),
        "think": ThreadServer(
            sim_app(SimConfig(engine="llamacpp", model="thinker-served", time_scale=0, reasoning_tokens=300))
        ).start(),
    }
    yield servers
    for server in servers.values():
        server.stop()


def table(sims: dict[str, ThreadServer]) -> str:
    closed = free_port()  # nothing listens here: the replica is down from the first probe
    return f"""
health: {{interval: 1, timeout: 0.5}}
presets:
  chat:
    served_model: chat-served
    aliases: [talk]
    replicas:
      - {{name: chat-a, url: "{sims["chat"].url}", engine: vllm}}
      - {{name: chat-dead, url: "http://127.0.0.1:{closed}", engine: vllm}}
  thinker:
    served_model: thinker-served
    thinking: true
    min_max_tokens: 0
    replicas: [{{name: think-a, url: "{sims["think"].url}", engine: llamacpp}}]
routing: {{default: chat}}
"""


@pytest.fixture(scope="module")
def gw(sims: dict[str, ThreadServer]) -> Iterator[Running]:
    with run_gateway(table(sims)) as running:
        yield running


@pytest.fixture
def client(gw: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.skip(f"needs {CHROMIUM} and {CHROMEDRIVER}")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    with tempfile.TemporaryDirectory(prefix="ui-chromium-") as profile:
        for flag in (
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--window-size={LAPTOP[0]},{LAPTOP[1]}",
            f"--user-data-dir={profile}",
        ):
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        driver.set_page_load_timeout(15)
        try:
            yield driver
        finally:
            driver.quit()


@pytest.fixture
def page(browser: Any) -> Any:
    """The browser at laptop size, light scheme, with a clean localStorage per test."""
    size(browser, *LAPTOP)
    browser.execute_cdp_cmd(
        "Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": "light"}]}
    )
    yield browser
    with contextlib.suppress(Exception):
        browser.execute_script("localStorage.clear()")


def size(driver: Any, width: int, height: int) -> None:
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 600},
    )


def wait(driver: Any, condition: Callable[[Any], Any], timeout: float = 10, what: str = "") -> Any:
    """Poll the page (every 0.1 s, at most `timeout` s) until `condition` holds."""
    try:
        # The page re-renders every 2 s: an element a condition holds may be replaced under it.
        return WebDriverWait(
            driver, timeout, poll_frequency=0.1, ignored_exceptions=(StaleElementReferenceException,)
        ).until(condition)
    except TimeoutException:
        body = driver.find_element(By.TAG_NAME, "body").text
        raise AssertionError(f"timed out waiting for {what or condition}; page says:\n{body}") from None


def text(driver: Any, css: str) -> str:
    return str(driver.find_element(By.CSS_SELECTOR, css).text)


def rows(driver: Any) -> dict[str, str]:
    # One script, so a re-render between two element reads cannot leave a stale handle.
    found: dict[str, str] = driver.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('tr.replica')]"
        ".map(r => [r.dataset.replica, r.dataset.state]))"
    )
    return found


def open_ui(driver: Any, url: str, presets: int = 2) -> None:
    driver.get(url + "/ui")
    wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, "article.preset")) == presets, what="cards")


def screenshot(driver: Any, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
    (ARTIFACTS / name).write_bytes(base64.b64decode(shot["data"]))


def test_cards_and_replica_rows_show_the_fleet(page: Any, gw: Running) -> None:
    page.get_log("browser")  # drop what earlier tests left in the console
    open_ui(page, gw.url)
    cards = page.find_elements(By.CSS_SELECTOR, "article.preset")
    assert [c.get_attribute("data-preset") for c in cards] == ["chat", "thinker"]
    assert [c.find_element(By.TAG_NAME, "h3").text for c in cards] == ["chat", "thinker"]
    for card, words in zip(cards, (["chat-served", "talk", "thinking off"], ["thinking on"]), strict=True):
        assert all(word in card.text for word in words), card.text
    assert rows(page) == {"chat-a": "up", "chat-dead": "down", "think-a": "up"}
    for row in page.find_elements(By.CSS_SELECTOR, "tr.replica"):
        badge = row.find_element(By.CSS_SELECTOR, ".badge")
        assert badge.text.endswith(row.get_attribute("data-state"))  # the state in words, not only colour
    dead = page.find_element(By.CSS_SELECTOR, 'tr[data-replica="chat-dead"]')
    assert "0 / " in dead.text
    assert text(page, "#version") == f"v{__version__}"
    assert text(page, "#conn") == "live"
    assert not page.find_element(By.ID, "banner").is_displayed()
    assert not page.find_element(By.ID, "auth").is_displayed()
    body = text(page, "body")
    for bad in ("null", "NaN", "undefined", "[object"):
        assert bad not in body
    errors = [e for e in page.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors


def test_the_request_count_follows_traffic(page: Any, gw: Running, client: openai.OpenAI) -> None:
    open_ui(page, gw.url)
    before = int(text(page, "#t-requests").replace(",", ""))
    for _ in range(3):
        client.chat.completions.create(model="talk", messages=HELLO, max_tokens=10)
    for chunk in client.chat.completions.create(model="chat", messages=HELLO, max_tokens=10, stream=True):
        assert chunk.id
    wait(page, lambda d: text(d, "#t-requests") == str(before + 4), what="the request count to update")
    state = httpx2.get(gw.url + "/ui/state").json()
    assert text(page, "#t-requests") == str(state["totals"]["requests"])
    assert text(page, "#t-rate") != "0.00"
    # The stream gave a time to first token, shown for the whole gateway and for its replica.
    wait(page, lambda d: text(d, "#t-p50") != DASH, what="TTFT p50")
    chat_a = page.find_element(By.CSS_SELECTOR, 'tr[data-replica="chat-a"] td[data-label="TTFT p50"]')
    assert chat_a.text.endswith("ms")


def test_a_thinking_trap_shows_in_the_warnings(page: Any, gw: Running, client: openai.OpenAI) -> None:
    open_ui(page, gw.url)
    raw = client.chat.completions.with_raw_response.create(model="thinker", messages=HELLO, max_tokens=50)
    assert raw.headers["x-gateway-warning"] == "reasoning consumed max_tokens"
    warning = wait(
        page,
        lambda d: d.find_elements(By.CSS_SELECTOR, 'li.warning[data-kind="thinking_trap"]'),
        what="the thinking_trap warning",
    )[0]
    assert "thinker / think-a" in warning.text
    assert "reasoning consumed max_tokens" in warning.text
    assert warning.find_element(By.TAG_NAME, "time").text.count(":") == 2


def test_polling_pauses_while_the_tab_is_hidden(page: Any, gw: Running) -> None:
    open_ui(page, gw.url)
    count = "return performance.getEntriesByType('resource').filter(e => e.name.endsWith('/ui/state')).length"
    page.execute_script(
        "Object.defineProperty(document, 'hidden', {configurable: true, get: () => true});"
        "document.dispatchEvent(new Event('visibilitychange'));"
    )
    wait(page, lambda d: d.execute_script("return timer === 0 && !busy"), what="polling to stop")
    seen = page.execute_script(count)
    page.execute_script(
        "Object.defineProperty(document, 'hidden', {configurable: true, get: () => false});"
        "document.dispatchEvent(new Event('visibilitychange'));"
    )
    wait(page, lambda d: d.execute_script(count) > seen, what="polling to resume")
    wait(page, lambda d: d.execute_script("return timer !== 0"), what="the next poll to be scheduled")


def test_a_key_form_on_401_and_the_key_is_remembered(page: Any, sims: dict[str, ThreadServer]) -> None:
    with run_gateway(table(sims), api_keys="k1") as keyed:
        page.get(keyed.url + "/ui")
        form = page.find_element(By.ID, "auth")
        wait(page, lambda d: form.is_displayed(), what="the key form")
        assert "needs an API key" in form.text
        assert not page.find_elements(By.CSS_SELECTOR, "article.preset")
        assert not page.find_element(By.ID, "banner").is_displayed()
        key = page.find_element(By.ID, "key")
        assert key.get_attribute("type") == "password"
        key.send_keys("wrong")
        page.find_element(By.CSS_SELECTOR, "#auth button[type=submit]").click()
        wait(page, lambda d: "refused" in text(d, "#auth-msg") and form.is_displayed(), what="a refusal")
        page.find_element(By.ID, "key").send_keys("k1")
        page.find_element(By.CSS_SELECTOR, "#auth button[type=submit]").click()
        wait(page, lambda d: len(d.find_elements(By.CSS_SELECTOR, "article.preset")) == 2, what="cards")
        assert not form.is_displayed()
        assert page.execute_script("return localStorage.getItem('fleet-gateway.api-key')") == "k1"
        assert rows(page) == {"chat-a": "up", "chat-dead": "down", "think-a": "up"}
        open_ui(page, keyed.url)  # a reload goes straight to the state with the stored key
        assert not page.find_element(By.ID, "auth").is_displayed()


@contextlib.contextmanager
def gateway_on(port: int, routes: str) -> Iterator[ThreadServer]:
    gateway = build_gateway(
        Settings(),
        parse_table(routes, "test-routes.yaml"),
        registry=CollectorRegistry(),
        access_log=AccessLog(stream=io.BytesIO()),
    )
    server = ThreadServer(create_app(gateway), port=port, http="httptools").start()
    try:
        yield server
    finally:
        server.stop()


def test_a_banner_while_the_gateway_is_unreachable(page: Any, sims: dict[str, ThreadServer]) -> None:
    port, routes = free_port(), table(sims)
    with gateway_on(port, routes) as first:
        open_ui(page, first.url)
    banner = page.find_element(By.ID, "banner")
    wait(page, lambda d: banner.is_displayed(), what="the unreachable banner")
    assert "unreachable" in banner.text
    assert text(page, "#conn") == "offline"
    assert len(page.find_elements(By.CSS_SELECTOR, "article.preset")) == 2  # the last figures stay
    assert "stale" in page.find_element(By.ID, "main").get_attribute("class")
    with gateway_on(port, routes):
        wait(page, lambda d: not banner.is_displayed(), what="recovery")
        assert text(page, "#conn") == "live"
        assert "stale" not in page.find_element(By.ID, "main").get_attribute("class")


def test_laptop_and_phone_widths(page: Any, gw: Running, client: openai.OpenAI) -> None:
    client.chat.completions.create(model="thinker", messages=HELLO, max_tokens=50)  # a warning to show
    for chunk in client.chat.completions.create(model="chat", messages=HELLO, max_tokens=10, stream=True):
        assert chunk.id
    open_ui(page, gw.url)
    wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, "li.warning"), what="a warning")
    screenshot(page, "ui-laptop.png")

    size(page, *PHONE)
    open_ui(page, gw.url)
    wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, "li.warning"), what="a warning")
    assert page.execute_script("return innerWidth") == PHONE[0]
    assert page.execute_script("return document.documentElement.scrollWidth <= innerWidth")
    wider = page.execute_script(
        "return [...document.querySelectorAll('body *')]"
        ".filter(e => e.getBoundingClientRect().right > innerWidth + 0.5)"
        ".map(e => e.tagName + '.' + e.className)"
    )
    assert wider == []
    # Replica rows stack inside their card rather than scroll: every cell is inside the card.
    # Measured in one script: the page re-renders every 2 s, which would leave Python's handles stale.
    cells, outside = page.execute_script(
        "const cards = [...document.querySelectorAll('article.preset')];"
        "const cells = cards.flatMap(card => [...card.querySelectorAll('tr.replica > *')]"
        "  .map(cell => [cell, card.getBoundingClientRect().right]));"
        "return [cells.length, cells.filter(([cell, right]) =>"
        "  cell.getBoundingClientRect().right > right + 0.5).map(([cell]) => cell.textContent)];"
    )
    assert cells > 0 and outside == [], outside
    screenshot(page, "ui-phone.png")
