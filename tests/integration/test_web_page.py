"""The chat page at / in headless Chromium (a process: the browser; the server is the shared in-process
"default" one, keyed): without its key the page says so and its sends fail; with it, it lists the model,
sends a message and shows the answer as it streams, keeps the conversation, shows the exact prompt; Undo
after a failed message takes back the right bubbles, so the page shows the conversation it sends; at phone
width the settings fold away behind a button (skipped when chromium is not installed). The page's HTTP side
alone: tests/runs/test_web_page_runs.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.integration.browser import CHROMIUM, Browser
from tests.utils import free_port

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium: apt-get install chromium to run the "
                                                         "chat page in a browser")
pytest.importorskip("websocket", reason="websocket-client drives chromium (requirements-test.txt)")

PATH_QUESTION = ("The kitchen is north of the hallway.\\nThe garden is west of the kitchen.\\n"
                 "Question: How do you go from the hallway to the garden?")
# the default model is a base model: its path questions as the shell's --user-msg-fmt would write them
PLAIN = ("const f = document.getElementById('format'); f.value = 'plain'; f.dispatchEvent(new Event('change'));"
         " document.getElementById('user_fmt').value = 'Passage: {}\\\\nAnswer:';"
         " document.getElementById('assistant_fmt').value = '{}\\\\n\\\\n'; true")
SHOT = os.environ.get("CHAT_PAGE_SCREENSHOT")  # set: the screenshot for the docs goes there


@pytest.fixture
def server(servers):
    return servers.get("default", 1)


@pytest.fixture
def browser():
    b = Browser(free_port())
    yield b
    b.close()


def send(b: Browser, text: str) -> None:
    """Count the answer's updates (a streamed answer grows several times), then send ``text``."""
    b.js("""window.updates = 0;
            if (!window.observed) {  // one observer for the page's life: each update counted once
              window.observed = true;
              new MutationObserver((records) => {
                for (const m of records) if (m.target.classList && m.target.classList.contains('assistant')) window.updates += 1;
              })
                .observe(document.getElementById('log'), {subtree: true, characterData: true, childList: true});
            }""")
    b.js(f"document.getElementById('input').value = '{text}'; document.getElementById('go').click(); true")


def answers(b: Browser) -> list[str]:
    return b.js("Array.from(document.querySelectorAll('.assistant[data-done]')).map(e => e.textContent)")


def test_page_with_an_api_key_streams_answers(server, browser):
    key = server.key()
    browser.open(server.url("/"))  # the page itself needs no key; its API calls do
    browser.wait("document.body.innerText.includes('missing or wrong API key')")
    browser.js("document.getElementById('temperature').value = '0'; document.getElementById('max_tokens').value = '6';"
               " document.getElementById('stop').value = '\\\\n'; true")
    browser.js(PLAIN)
    send(browser, PATH_QUESTION)
    browser.wait("document.querySelectorAll('.error').length >= 2")  # refused without the key
    assert answers(browser) == []
    browser.js(f"const k = document.getElementById('key'); k.value = '{key}';"
               " k.dispatchEvent(new Event('change')); true")
    assert browser.wait("document.getElementById('model').options.length") == 1
    assert browser.js("document.getElementById('model').value").startswith("tiny-llama-default")
    send(browser, PATH_QUESTION)
    browser.wait("document.querySelectorAll('.assistant[data-done]').length == 1")
    assert answers(browser) == [" north west"]
    browser.js("document.getElementById('show').click(); true")
    shown = browser.js("document.getElementById('prompt').textContent")
    assert shown.startswith("POST /v1/completions, the exact prompt:\nPassage: The kitchen is north"), shown
    assert shown.endswith("the garden?\nAnswer:"), shown
    prompt = browser.js("formatted('costs $& or $\\' or $$')")  # the message as typed, not as a pattern
    assert prompt.endswith(" north west\n\nPassage: costs $& or $' or $$\nAnswer:"), prompt
    # the model's chat template, a longer answer: shown growing as its chunks arrive, not once at the end
    browser.js("document.getElementById('reset').click(); { const f = document.getElementById('format');"
               " f.value = 'template'; f.dispatchEvent(new Event('change')); }"
               " document.getElementById('max_tokens').value = '40'; document.getElementById('stop').value = ''; true")
    send(browser, "Once upon a time")
    browser.wait("document.querySelectorAll('.assistant[data-done]').length == 1")
    first = answers(browser)[0]
    assert len(first.split()) >= 3, first
    assert browser.js("window.updates") >= 3, first
    if SHOT:
        browser.screenshot(SHOT)
    png = Path(browser.profile) / "shot.png"
    browser.screenshot(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def shown(b: Browser) -> list[str]:
    """The bubbles of the conversation as the page shows them: 'user:' / 'assistant:' / 'failed:' + text."""
    return b.js("Array.from(document.querySelectorAll('#log .user, #log .assistant')).map(e => "
                "(e.classList.contains('failed') ? 'failed' : e.classList.contains('user') ? 'user' : 'assistant')"
                " + ':' + e.textContent)")


def test_undo_after_a_failed_message_and_a_phone_width(server, browser):
    b = browser
    b.call("Emulation.setDeviceMetricsOverride", width=390, height=844, deviceScaleFactor=2, mobile=True)
    b.open(server.url("/"))
    # a phone: the conversation has the screen; the settings are behind the Settings button
    width = b.js("window.innerWidth")
    assert width == 390
    assert b.js("document.getElementById('side').getBoundingClientRect().right") <= 0
    assert b.js("document.getElementById('input').getBoundingClientRect().width") > 300
    assert b.js("document.getElementById('go').getBoundingClientRect().bottom") <= 844
    b.js("document.getElementById('panel').click(); true")
    b.wait("document.getElementById('side').getBoundingClientRect().left >= 0")
    assert 0 < b.js("document.getElementById('side').getBoundingClientRect().width") < width
    b.js(f"const k = document.getElementById('key'); k.value = '{server.key()}'; k.dispatchEvent(new Event('change'));"
         " document.getElementById('temperature').value = '0'; document.getElementById('max_tokens').value = '6';"
         " true")
    assert b.wait("document.getElementById('model').options.length") == 1
    b.js("document.getElementById('hide').click(); true")
    b.wait("document.getElementById('side').getBoundingClientRect().right <= 0")
    b.js("document.getElementById('log').innerHTML = ''; true")  # the keyless page's complaint about the models

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
