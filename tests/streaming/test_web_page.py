"""The live web page (``GET /``) in a real headless Chromium against the whole stack.

`tidegate up` runs API, gateway and a worker per model on the session's redis-server: the real
default model with a LoRA adapter (random, so it visibly changes the answer) and a random tiny
second model, for the page's Model and Adapter selects. Selenium drives the system's Chromium through the system's chromedriver (Debian's
``chromium`` and ``chromium-driver``, installed by ``make test``), so nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch
from safetensors.torch import save_file
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
ADAPTER = "terse"  # the default model's adapter
SECOND_MODEL = "tiny"
# SmolLM2-135M's attention shapes: hidden 576, 9 query heads and 3 KV heads of 64, 30 layers.
HIDDEN, KV_WIDTH, LAYERS = 576, 192, 30


def write_adapter(folder: Path, rank: int = 4) -> Path:
    """A PEFT LoRA adapter of SmolLM2-135M's q and v projections with random A and B (PEFT
    would start B at zero, a no-op): large enough that the answer shows it ran."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(LAYERS):
        for projection, out in (("q_proj", HIDDEN), ("v_proj", KV_WIDTH)):
            key = f"base_model.model.model.layers.{layer}.self_attn.{projection}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, HIDDEN, generator=gen) / 24
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=gen) / 2
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": ["q_proj", "v_proj"]}))
    return folder


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_adapter(tmp_path_factory.mktemp("lora") / ADAPTER)


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, adapter_dir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The default model (first) with its adapter, and a second model."""
    models_file = tmp_path_factory.mktemp("models") / "models.json"
    models_file.write_text(json.dumps([
        {"spec": "smollm2", "loras": {ADAPTER: str(adapter_dir)}},
        {"name": SECOND_MODEL, "spec": "random:tiny"}]))
    with ExitStack() as up:
        # `tidegate up` takes one --model; a models file (which overrides it) serves both. The
        # variable lives only while the process starts, so no other test's Settings sees it.
        with pytest.MonkeyPatch.context() as env:
            env.setenv("TIDEGATE_MODELS_FILE", str(models_file))
            url = up.enter_context(tidegate_up(redis_server))
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


def _options(driver: webdriver.Chrome, id_: str) -> list[str]:
    """A select's option values, in order."""
    return driver.execute_script(
        "return [...document.getElementById(arguments[0]).options].map(o => o.value)", id_)


def _record_frames(driver: webdriver.Chrome) -> None:
    """Keep a copy of every frame the page sends on a WebSocket (``window.sentFrames``)."""
    driver.execute_script("""
        window.sentFrames = [];
        const send = WebSocket.prototype.send;
        WebSocket.prototype.send = function (data) {
          window.sentFrames.push(JSON.parse(data));
          return send.call(this, data);
        };""")


def _sent_request(driver: webdriver.Chrome) -> dict:
    """The request of the last ``generate`` frame the page sent."""
    frames = driver.execute_script("return window.sentFrames")
    return [f for f in frames if f["type"] == "generate"][-1]["request"]


def _served(base: str) -> tuple[list[str], dict[str, list[str]]]:
    """GET /v1/models: the base models in order, and each one's adapters."""
    response = httpx.get(f"{base}/v1/models", timeout=10)
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    bases = [m["id"] for m in data if "parent" not in m]
    adapters = {b: [m["id"].removeprefix(f"{b}:") for m in data if m.get("parent") == b]
                for b in bases}
    return bases, adapters


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


def test_the_model_and_adapter_selects_are_filled_from_v1_models(page: webdriver.Chrome,
                                                                stack: str) -> None:
    bases, adapters = _served(stack)
    default = bases[0]
    assert len(bases) == 2 and bases[1] == SECOND_MODEL and adapters[default] == [ADAPTER]
    WebDriverWait(page, 10).until(lambda d: _options(d, "model") == bases)
    model, adapter = Select(_element(page, "model")), Select(_element(page, "adapter"))
    assert model.first_selected_option.get_attribute("value") == default
    assert _options(page, "adapter") == ["", ADAPTER] and adapter.first_selected_option.text == "none"
    assert _element(page, "adapter").is_enabled()
    assert not _element(page, "models-note").is_displayed()

    model.select_by_value(SECOND_MODEL)  # a model without adapters: only "none", disabled
    assert _options(page, "adapter") == [""] and not _element(page, "adapter").is_enabled()
    model.select_by_value(default)
    assert _options(page, "adapter") == ["", ADAPTER] and _element(page, "adapter").is_enabled()


def test_a_job_runs_on_the_chosen_model_and_adapter(page: webdriver.Chrome, stack: str,
                                                    tmp_path: Path) -> None:
    bases, _ = _served(stack)
    default = bases[0]
    WebDriverWait(page, 10).until(lambda d: _options(d, "model") == bases)
    _record_frames(page)
    model, adapter = Select(_element(page, "model")), Select(_element(page, "adapter"))
    prompt = "What is the capital of France?"
    answers = {}
    for chosen_model, chosen_adapter in ((default, ""), (default, ADAPTER), (SECOND_MODEL, "")):
        model.select_by_value(chosen_model)
        adapter.select_by_value(chosen_adapter)
        _ask(page, prompt, max_tokens=16)
        status = _final_status(page)
        assert status == "done", f"{chosen_model}/{chosen_adapter}: {status}: {_text(page, 'error')}"
        sent = _sent_request(page)
        assert sent["model"] == chosen_model and sent.get("lora") == (chosen_adapter or None)
        result = _stored_result(stack, _text(page, "job-id"))
        assert (result["model"], result["adapter"]) == (chosen_model, chosen_adapter or None)
        assert _text(page, "output") == result["text"]
        answers[chosen_model, chosen_adapter] = result["text"]
        if chosen_adapter:
            _screenshot(page, tmp_path, "web_page_models.png")
    # Greedy both times: only the adapter's weights can make the answer differ.
    assert answers[default, ADAPTER] != answers[default, ""]


def test_an_adapter_registered_later_appears_in_the_select(page: webdriver.Chrome, stack: str,
                                                           adapter_dir: Path) -> None:
    default = _served(stack)[0][0]
    WebDriverWait(page, 10).until(lambda d: _options(d, "adapter") == ["", ADAPTER])
    added = httpx.post(f"{stack}/v1/adapters", timeout=60,
                       json={"model": default, "name": "again", "path": str(adapter_dir)})
    assert added.status_code == 201, added.text
    # The queue panel sees the workers' adapters change and the page reloads the models.
    WebDriverWait(page, 10).until(lambda d: _options(d, "adapter") == ["", "again", ADAPTER])


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
    # No models to choose without the key: the default model runs, as the note says.
    WebDriverWait(page, 5).until(lambda d: "(401)" in _text(d, "models-note"))
    assert _options(page, "model") == [""] and not _element(page, "model").is_enabled()
    assert not _element(page, "adapter").is_enabled()
    # The reload button asks again with the key now in the box (set without an input event,
    # which would reload the models by itself).
    page.execute_script("document.getElementById('api-key').value = arguments[0]", API_KEY)
    _element(page, "models-refresh").click()
    WebDriverWait(page, 5).until(lambda d: "No model is served" in _text(d, "models-note"))
    page.execute_script("document.getElementById('api-key').value = ''")
    _element(page, "models-refresh").click()
    WebDriverWait(page, 5).until(lambda d: "(401)" in _text(d, "models-note"))

    _ask(page, "Hi", max_tokens=8)
    assert _final_status(page) == "error"
    assert "401" in _text(page, "error")

    _element(page, "api-key").send_keys(API_KEY)
    WebDriverWait(page, 5).until(lambda d: _text(d, "queue-note") == "live")
    assert _text(page, "workers") == "0"  # no worker in this stack
    page.refresh()
    WebDriverWait(page, 10).until(lambda d: _text(d, "queue-note") == "live")
    assert _element(page, "api-key").get_attribute("value") == API_KEY  # from localStorage
    # The key lists the models, but none has a live worker here: still no model to choose.
    WebDriverWait(page, 5).until(lambda d: "No model is served" in _text(d, "models-note"))
    assert _options(page, "model") == [""]

    _record_frames(page)
    _ask(page, "Hi", max_tokens=8)
    WebDriverWait(page, 10).until(lambda d: _text(d, "status").startswith("queued"))
    sent = _sent_request(page)
    assert "model" not in sent and "lora" not in sent, sent
    job_id = _text(page, "job-id")
    stored = httpx.get(f"{keyed_stack}/v1/jobs/{job_id}", timeout=10,
                       headers={"Authorization": f"Bearer {API_KEY}"})
    assert stored.status_code == 200 and stored.json()["status"] == "queued", stored.text
    assert stored.json()["model"] == "random_tiny"  # the deployment's default
    WebDriverWait(page, 5).until(lambda d: "interactive 1 0" in _lane_rows(d))  # lane, waiting, pending
    page.get("about:blank")  # close the socket before the server goes
