"""The live web page (``GET /``) in a real headless Chromium against the whole stack.

`tidegate up` runs API, gateway and a worker with the real default model on the session's
redis-server; Selenium drives the system's Chromium through the system's chromedriver (Debian's
``chromium`` and ``chromium-driver``, installed by ``make test``), so nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import Select, WebDriverWait

from tests.asgi_server import serve
from tests.conftest import RedisServer
from tests.stack_process import tidegate_up
from tidegate.commands.launcher import combined_app
from tidegate.settings import Settings

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
MISSING = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(MISSING), reason=f"{' and '.join(MISSING)} not installed: "
                       "apt-get install -y chromium chromium-driver (make test does)"),
]

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
FINAL = {"done", "error", "rejected", "disconnected"}
ANSWER_TIMEOUT_S = 90
API_KEY = "page-test-key"


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer) -> Iterator[str]:
    with tidegate_up(redis_server) as url:
        yield url


@pytest.fixture
def keyed_stack(redis_server: RedisServer) -> Iterator[str]:
    """API and gateway on one port with API keys on, no worker (jobs stay queued), on a
    database of its own so the module's stack is left alone."""
    settings = Settings(redis_url=f"redis://127.0.0.1:{redis_server.port}/2",
                        model="random:tiny", api_keys=[API_KEY])
    with serve(combined_app(settings)) as url:
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,900", "--force-prefers-reduced-motion"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # The system chromedriver, by path: Selenium Manager never runs, nothing is downloaded.
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


@pytest.fixture
def page(stack: str, browser: webdriver.Chrome) -> webdriver.Chrome:
    """The page freshly loaded, its queue panel showing a live worker."""
    browser.get(stack + "/")
    WebDriverWait(browser, 15).until(lambda d: _text(d, "workers") not in ("", "–"))
    return browser


def _element(driver: webdriver.Chrome, id_: str) -> WebElement:
    return driver.find_element(By.ID, id_)


def _text(driver: webdriver.Chrome, id_: str) -> str:
    """An element's exact textContent (Selenium's ``.text`` normalises whitespace)."""
    return driver.execute_script("return document.getElementById(arguments[0]).textContent",
                                 id_)


def _lane_rows(driver: webdriver.Chrome) -> list[str]:
    """The queue panel's lane rows as "lane waiting pending", read at once (it re-renders)."""
    return driver.execute_script(
        "return [...document.querySelectorAll('#lanes tr')].map(tr => "
        "[...tr.cells].slice(0, 3).map(td => td.textContent).join(' '))")


def _ask(driver: webdriver.Chrome, prompt: str, max_tokens: int, *, enter: bool = False) -> None:
    """Fill the form and send it: the Send button, or Enter in the prompt box."""
    limit = _element(driver, "max-tokens")
    limit.clear()
    limit.send_keys(str(max_tokens))
    box = _element(driver, "prompt")
    box.clear()
    if prompt:
        box.send_keys(prompt)
    if enter:
        box.send_keys(Keys.ENTER)
    else:
        _element(driver, "send").click()


def _final_status(driver: webdriver.Chrome) -> str:
    WebDriverWait(driver, ANSWER_TIMEOUT_S, poll_frequency=0.2).until(
        lambda d: _text(d, "status") in FINAL)
    return _text(driver, "status")


def _stored_result(base: str, job_id: str) -> dict:
    response = httpx.get(f"{base}/v1/jobs/{job_id}", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def _console_errors(driver: webdriver.Chrome) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def _screenshot(driver: webdriver.Chrome, tmp_path: Path, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    for folder in (ARTIFACTS, tmp_path):
        assert driver.save_screenshot(str(folder / name))


def test_page_streams_the_answer_and_shows_the_queue(page: webdriver.Chrome, stack: str,
                                                     tmp_path: Path) -> None:
    _ask(page, "What is the capital of France?", max_tokens=24)
    status = _final_status(page)
    assert status == "done", f"{status}: {_text(page, 'error')}"

    output = _text(page, "output")
    job_id = _text(page, "job-id")
    result = _stored_result(stack, job_id)
    assert output.strip(), "the page showed no answer"
    assert result["status"] == "done" and output == result["text"]
    assert _text(page, "finish-reason") == result["finish_reason"]
    assert str(result["usage"]["completion_tokens"]) in _text(page, "usage")
    assert int(_text(page, "workers")) >= 1
    assert _text(page, "queue-note") == "live"
    assert _element(page, "error").get_attribute("hidden") is not None
    assert not _console_errors(page)
    _screenshot(page, tmp_path, "web_page.png")


def test_the_page_asks_for_json_that_follows_a_schema(page: webdriver.Chrome, stack: str,
                                                     tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {
        "capital": {"type": "string", "maxLength": 30},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["capital", "population_millions"], "additionalProperties": False}
    Select(_element(page, "output-format")).select_by_value("json_schema")
    box = _element(page, "json-schema")
    assert box.is_displayed()
    box.clear()
    box.send_keys(json.dumps(schema))
    _ask(page, "What is the capital of France?", max_tokens=60)
    status = _final_status(page)
    assert status == "done", f"{status}: {_text(page, 'error')}"
    output = _text(page, "output")
    jsonschema.validate(json.loads(output), schema)  # only the grammar's mask allows this
    assert _text(page, "finish-reason") == "stop"
    assert output == _stored_result(stack, _text(page, "job-id"))["text"]
    Select(_element(page, "output-format")).select_by_value("text")
    assert not box.is_displayed() and not _element(page, "json-schema-label").is_displayed()
    _screenshot(page, tmp_path, "web_page_json.png")


def test_empty_prompt_shows_the_servers_validation_error(page: webdriver.Chrome,
                                                         tmp_path: Path) -> None:
    _ask(page, "", max_tokens=24, enter=True)
    assert _final_status(page) == "error"
    error = _text(page, "error")
    assert "messages" in error and "must not be empty" in error and "422" in error, error
    assert _text(page, "output") == "" and _text(page, "job-id") == "–"
    assert _element(page, "send").is_enabled()
    _screenshot(page, tmp_path, "web_page_error.png")


def test_a_dropped_socket_resumes_after_the_last_event(page: webdriver.Chrome,
                                                       stack: str) -> None:
    _ask(page, "Count from 1 to 100, separated by commas.", max_tokens=64)
    # Drop the socket from inside the page once two tokens have arrived, mid-stream.
    page.set_script_timeout(70)
    dropped = page.execute_async_script("""
        const done = arguments[arguments.length - 1];
        const started = Date.now();
        const poll = () => {
          const job = window.tidegate.job;
          if (job && job.finished) return done("finished first");
          if (job && job.tokens >= 2) { job.socket.close(); return done("dropped"); }
          if (Date.now() - started > 60000) return done("no tokens");
          setTimeout(poll, 5);
        };
        poll();
    """)
    assert dropped == "dropped"
    assert _final_status(page) == "done", _text(page, "error")
    assert page.execute_script("return window.tidegate.job.resumes") == 1
    assert "resuming after event" in _text(page, "note")
    result = _stored_result(stack, _text(page, "job-id"))
    assert _text(page, "output") == result["text"]


def test_with_api_keys_the_page_asks_for_one_and_remembers_it(keyed_stack: str,
                                                               browser: webdriver.Chrome) -> None:
    page = browser
    page.get(keyed_stack + "/")
    WebDriverWait(page, 10).until(lambda d: _text(d, "queue-note") == "auth needed")
    assert _text(page, "workers") == "–"

    _ask(page, "Hi", max_tokens=8)
    assert _final_status(page) == "error"
    assert "401" in _text(page, "error")

    _element(page, "api-key").send_keys(API_KEY)
    WebDriverWait(page, 5).until(lambda d: _text(d, "queue-note") == "live")
    assert _text(page, "workers") == "0"  # no worker in this stack
    page.refresh()
    WebDriverWait(page, 10).until(lambda d: _text(d, "queue-note") == "live")
    assert _element(page, "api-key").get_attribute("value") == API_KEY  # from localStorage

    _ask(page, "Hi", max_tokens=8)
    WebDriverWait(page, 10).until(lambda d: _text(d, "status").startswith("queued"))
    job_id = _text(page, "job-id")
    stored = httpx.get(f"{keyed_stack}/v1/jobs/{job_id}", timeout=10,
                       headers={"Authorization": f"Bearer {API_KEY}"})
    assert stored.status_code == 200 and stored.json()["status"] == "queued", stored.text
    WebDriverWait(page, 5).until(lambda d: "interactive 1 0" in _lane_rows(d))  # lane, waiting, pending
    page.get("about:blank")  # close the socket before the server goes
