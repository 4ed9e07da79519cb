"""The chat + monitor page (strata_ray/serve/static/index.html) in headless Chromium, driven over the DevTools
protocol: it loads, a chat round trip renders the engine's greedy text, the monitor shows numbers. A
screenshot is saved to tests/artifacts/serve_page.png."""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import requests

from strata_ray.engine.engine import GenerationRequest

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PROMPT = "What is a Python dictionary?"
MAX_TOKENS = 16

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")


class DevTools:
    """A minimal Chrome DevTools Protocol client over one page's websocket."""

    def __init__(self, ws):
        self.ws = ws
        self.ids = itertools.count(1)

    def call(self, method: str, **params):
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=30))
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def js(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.js(expression)
            if value:
                return value
            time.sleep(0.25)
        raise AssertionError(f"timed out waiting for {expression}")


@pytest.fixture
def browser(tmp_path):
    profile = tmp_path / "chromium-profile"
    proc = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1280,860",
         f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.is_file() or not port_file.read_text().strip():
            assert proc.poll() is None, f"chromium exited with {proc.returncode}"
            assert time.monotonic() < deadline, "chromium did not open its DevTools port"
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages = requests.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        page = next(p for p in pages if p["type"] == "page")
        from websockets.sync.client import connect

        with connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=20) as ws:
            yield DevTools(ws)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_page_chat_round_trip_and_monitor(server, engine, browser):
    browser.call("Page.enable")
    browser.call("Page.navigate", url=server.url + "/")
    browser.wait_for("document.readyState === 'complete' && !!document.getElementById('send')")
    browser.js(f"""
        document.getElementById('apikey').value = {json.dumps(server.api_key)};
        document.getElementById('max_tokens').value = '{MAX_TOKENS}';
        document.getElementById('temperature').value = '0';
        document.getElementById('prompt').value = {json.dumps(PROMPT)};
        document.getElementById('send').click();
    """)
    browser.wait_for("document.querySelector('.msg.assistant[data-done=\"1\"]') !== null")
    shown = browser.js("document.querySelector('.msg.assistant').childNodes[0].textContent")
    expected = engine.generate(GenerationRequest(prompt=PROMPT, chat=True, max_tokens=MAX_TOKENS))
    assert shown == expected.text
    assert browser.js("document.querySelector('.msg.assistant').classList.contains('error')") is False
    # the monitor polls /metrics every second: numbers, and this request counted
    browser.wait_for("Number(document.getElementById('m-requests').textContent) >= 1")
    for stat in ("m-tok-s", "m-tok-s-mean", "m-prefill", "m-queued", "m-output", "m-rss"):
        text = browser.js(f"document.getElementById('{stat}').textContent")
        assert float(text) >= 0, (stat, text)
    assert browser.js("document.getElementById('m-state').textContent") in ("idle", "reading", "generating")
    tier_rows = browser.js("Array.from(document.querySelectorAll('#tiers tbody tr')).map(r => r.innerText)")
    assert tier_rows and "%" in tier_rows[0]
    ARTIFACTS.mkdir(exist_ok=True)
    shot = browser.call("Page.captureScreenshot", format="png")
    (ARTIFACTS / "serve_page.png").write_bytes(base64.b64decode(shot["data"]))


def test_a_prompt_in_the_link_fills_the_box_and_is_not_sent(server, browser):
    # sent on load, a link from anywhere made the browser send a prompt with the API key it keeps
    browser.call("Page.enable")
    browser.call("Page.navigate", url=server.url + "/?prompt=hello%20there")
    browser.wait_for("document.readyState === 'complete' && !!document.getElementById('send')")
    assert browser.js("document.getElementById('prompt').value") == "hello there"
    time.sleep(1.5)
    assert browser.js("document.querySelectorAll('.msg').length") == 0
