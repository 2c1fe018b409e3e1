"""The chat page at / in headless Chromium: it lists the model, sends a message and shows the answer as
it streams, with and without an API key; Undo after a failed message takes back the right bubbles, so
the page shows the conversation it sends; at phone width the settings panel folds away behind a button
(skipped when chromium is not installed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.browser import CHROMIUM, Browser
from tests.utils import RUNNER, _env, free_port, wait_served

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium: apt-get install chromium to run the "
                                                         "chat page in a browser")
pytest.importorskip("websocket", reason="websocket-client drives chromium (requirements-test.txt)")

KEY = "page-test-key"
PATH_QUESTION = ("The kitchen is north of the hallway.\\nThe garden is west of the kitchen.\\n"
                 "Question: How do you go from the hallway to the garden?")
# the default model is a base model: its path questions as the shell's --user-msg-fmt would write them
PLAIN = ("const f = document.getElementById('format'); f.value = 'plain'; f.dispatchEvent(new Event('change'));"
         " document.getElementById('user_fmt').value = 'Passage: {}\\\\nAnswer:';"
         " document.getElementById('assistant_fmt').value = '{}\\\\n\\\\n'; true")
SHOT = os.environ.get("CHAT_PAGE_SCREENSHOT")  # set: the screenshot for the docs goes there


@pytest.fixture
def server(tmp_path, request):
    log = tmp_path / "serve.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, str(RUNNER), "--serve", "0", "--num-threads", "1",
                                 *request.param], stdout=f, stderr=f, start_new_session=True,
                                env=_env({"DIST_INFER_LOG": "WARNING"}))
    try:
        yield wait_served(proc, log, 300) + "/"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def browser():
    b = Browser(free_port())
    yield b
    b.close()


def send(b: Browser, text: str) -> None:
    """Count the answer's updates (a streamed answer grows several times), then send ``text``."""
    b.js("""window.updates = 0;
            new MutationObserver((records) => {
              for (const m of records) if (m.target.classList && m.target.classList.contains('assistant')) window.updates += 1;
            })
              .observe(document.getElementById('log'), {subtree: true, characterData: true, childList: true});""")
    b.js(f"document.getElementById('input').value = '{text}'; document.getElementById('go').click(); true")


def answers(b: Browser) -> list[str]:
    return b.js("Array.from(document.querySelectorAll('.assistant[data-done]')).map(e => e.textContent)")


@pytest.mark.parametrize("server", [[]], indirect=True)
def test_page_streams_an_answer(server, browser):
    browser.open(server)
    assert browser.wait("document.getElementById('model').options.length") == 1
    model = browser.js("document.getElementById('model').value")
    assert model.startswith("tiny-llama-default")
    browser.js("document.getElementById('temperature').value = '0'; document.getElementById('max_tokens').value = '40';"
               " true")
    send(browser, "Once upon a time")
    browser.wait("document.querySelectorAll('.assistant[data-done]').length == 1")
    first = answers(browser)[0]
    assert len(first.split()) >= 3, first
    # the chunks arrived one by one: the answer was shown growing, not once at the end
    assert browser.js("window.updates") >= 3, first
    browser.js("document.getElementById('max_tokens').value = '6'; document.getElementById('stop').value = '\\\\n';"
               " true")
    browser.js("document.getElementById('reset').click(); true")
    browser.js(PLAIN)
    send(browser, PATH_QUESTION)
    browser.wait("document.querySelectorAll('.assistant[data-done]').length == 1")
    assert answers(browser)[0] == " north west"
    browser.js("document.getElementById('show').click(); true")
    shown = browser.js("document.getElementById('prompt').textContent")
    assert shown.startswith("POST /v1/completions, the exact prompt:\nPassage: The kitchen is north"), shown
    assert shown.endswith("the garden?\nAnswer:"), shown
    if SHOT:
        browser.screenshot(SHOT)
    png = Path(browser.profile) / "shot.png"
    browser.screenshot(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("server", [["--api-key", KEY]], indirect=True)
def test_page_with_api_key(server, browser):
    browser.open(server)  # the page itself needs no key; its API calls do
    browser.wait("document.body.innerText.includes('missing or wrong API key')")
    browser.js("document.getElementById('temperature').value = '0'; document.getElementById('max_tokens').value = '6';"
               " document.getElementById('stop').value = '\\\\n'; true")
    browser.js(PLAIN)
    send(browser, PATH_QUESTION)
    browser.wait("document.querySelectorAll('.error').length >= 2")  # refused without the key
    assert answers(browser) == []
    browser.js(f"const k = document.getElementById('key'); k.value = '{KEY}';"
               " k.dispatchEvent(new Event('change')); true")
    assert browser.wait("document.getElementById('model').options.length") == 1
    send(browser, PATH_QUESTION)
    browser.wait("document.querySelectorAll('.assistant[data-done]').length == 1")
    assert answers(browser) == [" north west"]


@pytest.fixture(scope="module")
def inprocess_server(tmp_path_factory):
    """A server in this process (every rank a thread): only the browser is a process here."""
    from tests.runs.inprocess_server import Server

    s = Server(tmp_path_factory.mktemp("page"))
    yield s.url("/")
    s.close()


def shown(b: Browser) -> list[str]:
    """The bubbles of the conversation as the page shows them: 'user:' / 'assistant:' / 'failed:' + text."""
    return b.js("Array.from(document.querySelectorAll('#log .user, #log .assistant')).map(e => "
                "(e.classList.contains('failed') ? 'failed' : e.classList.contains('user') ? 'user' : 'assistant')"
                " + ':' + e.textContent)")


def test_undo_after_a_failed_message_and_a_phone_width(inprocess_server, browser):
    b = browser
    b.call("Emulation.setDeviceMetricsOverride", width=390, height=844, deviceScaleFactor=2, mobile=True)
    b.open(inprocess_server)
    # a phone: the conversation has the screen; the settings are behind the Settings button
    assert b.wait("document.getElementById('model').options.length") == 1
    width = b.js("window.innerWidth")
    assert width == 390
    assert b.js("document.getElementById('side').getBoundingClientRect().right") <= 0
    assert b.js("document.getElementById('input').getBoundingClientRect().width") > 300
    assert b.js("document.getElementById('go').getBoundingClientRect().bottom") <= 844
    b.js("document.getElementById('panel').click(); true")
    b.wait("document.getElementById('side').getBoundingClientRect().left >= 0")
    assert 0 < b.js("document.getElementById('side').getBoundingClientRect().width") < width
    b.js("document.getElementById('temperature').value = '0'; document.getElementById('max_tokens').value = '6';"
         " document.getElementById('hide').click(); true")
    b.wait("document.getElementById('side').getBoundingClientRect().right <= 0")

    send(b, "Tom has 3 apples.")
    b.wait("document.querySelectorAll('.assistant[data-done]').length == 1")
    first = answers(b)[0]
    b.js("document.getElementById('temperature').value = '5'; true")  # the server refuses it: 400
    send(b, "Who has the ball?")
    b.wait("document.querySelectorAll('.error').length == 1")
    assert shown(b) == ["user:Tom has 3 apples.", f"assistant:{first}", "failed:Who has the ball?"]
    assert "temperature" in b.js("document.querySelector('.error').textContent")
    assert b.js("document.getElementById('input').value") == "Who has the ball?"  # back to edit
    b.js("document.getElementById('undo').click(); true")  # takes back the failed message, not the exchange
    assert shown(b) == ["user:Tom has 3 apples.", f"assistant:{first}"]
    assert b.js("document.querySelectorAll('.error').length") == 0

    b.js("document.getElementById('temperature').value = '0'; document.getElementById('input').value = ''; true")
    send(b, "And Ann?")
    b.wait("document.querySelectorAll('.assistant[data-done]').length == 2")
    sent = b.js("lastBody.messages")  # what the page sent is what it shows
    assert [(m["role"], m["content"]) for m in sent] == [("user", "Tom has 3 apples."), ("assistant", first),
                                                           ("user", "And Ann?")]
    b.js("document.getElementById('undo').click(); true")
    assert shown(b) == ["user:Tom has 3 apples.", f"assistant:{first}"]
    assert b.js("turns.length") == 1
