"""The web page in a real browser: headless Chromium, driven over the W3C WebDriver protocol by chromedriver,
against a live server on the tiny random Llama. It chats through the playground (first without the API key,
then with it) and checks that the reply streams in and that the dashboard counts the request.

Screenshots land in test-artifacts/web/ (git-ignored). Chromium and chromedriver are required, not optional:
    apt-get install -y chromium chromium-driver
The WebDriver client is the few HTTP calls below (httpx), so no Python browser package is needed.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import httpx
import pytest

from proc_util import free_port, stop_process
from server_process import ServerProcess

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts" / "web"
API_KEY = "tm-browser-key"
ELEMENT = "element-6066-11e4-a52e-4f735466cecf"  # the W3C key of an element reference
ENTER = "\ue007"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1440,1000"]


def _find_browser() -> tuple[str, str]:
    chromium = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    driver = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists()
                                              else None)
    if chromium is None or driver is None:
        pytest.fail("the browser test needs Chromium and chromedriver on PATH "
                    "(Debian/Ubuntu: apt-get install -y chromium chromium-driver); "
                    f"found chromium={chromium}, chromedriver={driver}", pytrace=False)
    return chromium, driver


class WebDriver:
    """Just enough of the W3C WebDriver protocol: navigate, find, type, click, run a script, screenshot."""

    def __init__(self, driver_path: str, chromium_path: str, log_dir: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self._log = open(log_dir / f"chromedriver-{self.port}.log", "wb")
        self.proc = subprocess.Popen([driver_path, f"--port={self.port}"], stdout=self._log,
                                     stderr=subprocess.STDOUT)
        self.http = httpx.Client(timeout=60)
        self.profile = tempfile.mkdtemp(prefix="tokenmill-chromium-")
        self.session: Optional[str] = None
        self._wait(lambda: self._ready(), 20, "chromedriver did not start")
        caps = {"browserName": "chrome", "goog:loggingPrefs": {"browser": "ALL"},
                "goog:chromeOptions": {"binary": chromium_path,
                                       "args": CHROMIUM_FLAGS + [f"--user-data-dir={self.profile}"]}}
        self.session = self._call("POST", "/session", {"capabilities": {"alwaysMatch": caps}})["sessionId"]

    def _ready(self) -> bool:
        try:
            return self.http.get(self.base + "/status").json()["value"]["ready"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False

    def _call(self, method: str, path: str, body: Optional[dict] = None) -> Any:
        response = self.http.request(method, self.base + path, json=body)
        value = response.json().get("value")
        if response.status_code != 200:
            raise AssertionError(f"WebDriver {method} {path} failed: {value}")
        return value

    def _s(self, path: str) -> str:
        return f"/session/{self.session}{path}"

    @staticmethod
    def _wait(predicate: Callable[[], Any], timeout_s: float, message: str) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(message)

    def get(self, url: str) -> None:
        self._call("POST", self._s("/url"), {"url": url})

    def find(self, css: str) -> str:
        return self._call("POST", self._s("/element"), {"using": "css selector", "value": css})[ELEMENT]

    def type(self, css: str, text: str, clear: bool = False) -> None:
        element = self.find(css)
        if clear:
            self._call("POST", self._s(f"/element/{element}/clear"), {})
        self._call("POST", self._s(f"/element/{element}/value"), {"text": text})

    def click(self, css: str) -> None:
        self._call("POST", self._s(f"/element/{self.find(css)}/click"), {})

    def script(self, source: str, *args: Any) -> Any:
        return self._call("POST", self._s("/execute/sync"), {"script": source, "args": list(args)})

    def text(self, css: str) -> Optional[str]:
        return self.script("const e = document.querySelector(arguments[0]); return e ? e.textContent : null;", css)

    def wait_for(self, source: str, timeout_s: float, message: str, *args: Any) -> Any:
        return self._wait(lambda: self.script(source, *args), timeout_s, message)

    def screenshot(self, path: Path) -> None:
        import base64

        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(self._call("GET", self._s("/screenshot"))))

    def console_errors(self) -> list[dict]:
        entries = self._call("POST", self._s("/se/log"), {"type": "browser"}) or []
        return [e for e in entries if e.get("level") == "SEVERE"]

    def quit(self) -> None:
        try:
            if self.session is not None:
                self.http.delete(self.base + f"/session/{self.session}", timeout=20)
        except httpx.HTTPError:
            pass
        self.http.close()
        stop_process(self.proc, 10)
        self._log.close()
        shutil.rmtree(self.profile, ignore_errors=True)


@pytest.fixture
def browser(tmp_path):
    chromium, driver = _find_browser()
    web = WebDriver(driver, chromium, tmp_path)
    try:
        yield web
    finally:
        web.quit()


@pytest.fixture
def live_server(tiny_llama_dir, tmp_path):
    server = ServerProcess(
        ["--model", str(tiny_llama_dir), "--served-model-name", "tiny-web", "--max-model-len", "512",
         "--num-kv-blocks", "64", "--api-key", API_KEY, "--disable-access-log", "--disable-log-stats",
         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}'],
        tmp_path, api_key=API_KEY)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


_REPLY_DONE = """
const replies = document.querySelectorAll('.msg.assistant');
const last = replies[replies.length - 1];
return replies.length === arguments[0] && last.dataset.done === 'true';
"""


@pytest.mark.slow
def test_playground_chat_and_live_dashboard(live_server, browser):
    browser.get(live_server.url + "/")
    browser.wait_for("return document.getElementById('health-text').textContent === 'serving'", 15,
                     "the dashboard never loaded /stats")
    assert browser.text("#model-name") == "tiny-web"
    assert browser.text("#engine-device") == "cpu"  # the device the engine runs on, its reason in the title
    assert browser.text("#stat-finished") == "0"
    browser.screenshot(ARTIFACTS / "01-dashboard-idle.png")

    # Without the key the server answers 401, and the playground says what to do.
    browser.type("#max-tokens", "16", clear=True)
    browser.type("#temperature", "0", clear=True)
    browser.type("#chat-input", "Hello there!")
    browser.click("#send-btn")
    browser.wait_for(_REPLY_DONE, 20, "the refused request never finished", 1)
    error = browser.text(".msg.assistant:last-child .text")
    assert "401" in error and "API key" in error, error
    assert browser.script("return document.querySelector('.msg.assistant').classList.contains('error')")

    # With the key the reply streams in, with its TTFT and tokens per second.
    browser.type("#api-key", API_KEY)
    browser.type("#chat-input", "Tell me a story." + ENTER)  # Enter sends
    browser.wait_for(_REPLY_DONE, 60, "the reply never finished streaming", 2)
    last = ".msg.assistant:last-child"
    assert not browser.script(f"return document.querySelector('{last}').classList.contains('error')"), \
        browser.text(last)
    reply = browser.text(f"{last} .text")
    assert reply and reply.strip(), "the reply is empty"
    meta = browser.text(f"{last} .meta")
    assert "TTFT" in meta and "tok/s" in meta and "16 tokens" in meta and "finish: length" in meta, meta
    assert float(browser.script(f"return document.querySelector('{last}').dataset.ttftMs")) > 0

    # The dashboard's next poll counts the request and shows throughput and latency.
    browser.wait_for("return document.getElementById('stat-finished').textContent === '1'", 10,
                     "the dashboard never counted the finished request")
    assert float(browser.text("#stat-output-tps")) > 0
    assert "ms" in browser.text("#stat-ttft") or " s" in browser.text("#stat-ttft")
    assert browser.text("#stat-ttft-count") == "1"
    assert "length 1" in browser.text("#stat-reasons")
    assert browser.text("#stat-kv") == "0.0%"
    # The speculative card says what /stats says (n-gram drafts are on; the tiny model may repeat itself).
    spec = httpx.get(live_server.url + "/stats", timeout=10).json()["spec_decode"]
    detail = browser.text("#stat-spec-detail")
    if spec["num_drafts"]:
        assert detail.startswith(f"{spec['num_accepted_tokens']} of {spec['num_draft_tokens']} · by position"), detail
    else:
        assert detail == "no drafts verified" and browser.text("#stat-spec-rate") == "–"
    # Let a few chart points accumulate, then keep the picture.
    time.sleep(2.5)
    browser.screenshot(ARTIFACTS / "02-after-chat.png")
    # The refused request is the only thing the console may complain about.
    errors = [e for e in browser.console_errors() if "status of 401" not in e.get("message", "")]
    assert errors == [], errors


@pytest.fixture
def two_model_server(tiny_llama_dir, tmp_path):
    models = tmp_path / "models.json"
    models.write_text(json.dumps({"models": [
        {"model": str(tiny_llama_dir), "served_model_name": "tiny-first"},
        {"model": str(tiny_llama_dir), "served_model_name": "tiny-second"},
    ]}))
    server = ServerProcess(["--models-config", str(models), "--max-model-len", "512", "--num-kv-blocks", "64",
                            "--disable-access-log", "--disable-log-stats"], tmp_path)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.mark.slow
def test_a_server_of_several_models_lets_the_page_pick_one(two_model_server, browser):
    url = two_model_server.url
    browser.get(url + "/")
    browser.wait_for("return document.getElementById('model-picker').options.length === 2", 15,
                     "the model picker never listed both models")
    assert browser.script("return document.getElementById('model-picker').hidden") is False
    assert browser.script("return document.getElementById('model-picker').value") == "tiny-first"

    # Picking the second model switches the dashboard to it, and the playground talks to it.
    browser.script("const p = document.getElementById('model-picker'); p.value = 'tiny-second';"
                   "p.dispatchEvent(new Event('change'));")
    browser.type("#max-tokens", "8", clear=True)
    browser.type("#chat-input", "Hello there!" + ENTER)
    browser.wait_for(_REPLY_DONE, 60, "the reply never finished streaming", 1)
    assert not browser.script("return document.querySelector('.msg.assistant').classList.contains('error')")
    browser.wait_for("return document.getElementById('stat-finished').textContent === '1'", 10,
                     "the dashboard never counted the request on the picked model")
    assert browser.script("return document.getElementById('model-picker').value") == "tiny-second"
    finished = {name: httpx.get(url + "/stats", params={"model": name}, timeout=10).json()["num_finished_requests"]
                for name in ("tiny-first", "tiny-second")}
    assert finished == {"tiny-first": 0, "tiny-second": 1}
    browser.screenshot(ARTIFACTS / "03-two-models.png")
    assert browser.console_errors() == []
