"""The interactive flags' checks (exit 2 before loading) and the request fields they give."""

from __future__ import annotations

import pytest

from pipeline.config.interactive_options import sampling_body, unescape
from pipeline.config.options import parse_options


@pytest.mark.parametrize("argv, words", [
    (["--prompts", "a", "--chat"], "pass only one of them"),
    (["--prompts", "a", "--serve", "8000"], "--chat --url"),
    (["--chat", "--infer-data", "x.jsonl"], "drop --infer-data"),
    (["--url", "http://127.0.0.1:8000"], "add --chat"),
    (["--chat", "--url", "127.0.0.1:8000"], "expected http://HOST:PORT"),
    (["--prompts-file", "/no/such/file"], "no such file"),
    (["--prompts", "a", "--system-prompt", "hi"], "add --chat"),
    (["--chat", "--user-msg-fmt", "no placeholder"], "must hold {} exactly once"),
    (["--chat", "--assistant-msg-fmt", "{}"], "needs --user-msg-fmt"),
    (["--prompts", "a", "--temperature", "3"], "--temperature must be in [0, 2]"),
    (["--prompts", "a", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--prompts", "a", "--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--prompts", "a", *["--stop", "x"] * 5], "at most 4 stop strings"),
    (["--prompts", "a", "--repetition-penalty", "0"], "--repetition-penalty must be above 0"),
    (["--prompts", "a", "--min-p", "1.5"], "--min-p must be in [0, 1]"),
])
def test_refused_before_loading(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        parse_options(argv)
    assert e.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("content, words", [(b"\n  \n", "no prompts in it"), (b"caf\xe9\n", "not UTF-8 text")])
def test_a_prompts_file_without_prompts_is_refused_before_loading(tmp_path, content, words, capsys):
    (tmp_path / "p.txt").write_bytes(content)
    for path, said in ((tmp_path / "p.txt", words), (tmp_path, "is a directory")):
        with pytest.raises(SystemExit) as e:
            parse_options(["--prompts-file", str(path)])
        assert e.value.code == 2 and said in capsys.readouterr().err


def test_accepted_and_request_fields():
    opts = parse_options(["--prompts", "a", "b", "--temperature", "0.5", "--stop", r"\n", "--top-k", "5"])
    assert opts.prompts == ["a", "b"]
    body = sampling_body(opts)
    assert body == {"max_tokens": 128, "temperature": 0.5, "top_p": 1.0, "top_k": 5, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0, "stop": ["\n"]}
    opts = parse_options(["--prompts", "a", "--repetition-penalty", "1.2", "--min-p", "0.1"])
    assert sampling_body(opts)["repetition_penalty"] == 1.2 and sampling_body(opts)["min_p"] == 0.1
    chat = parse_options(["--chat", "--url", "http://127.0.0.1:8000", "--user-msg-fmt", "Q: {}", "--system-prompt", "s"])
    assert chat.chat and chat.url == "http://127.0.0.1:8000"


def test_unescape():
    assert unescape(r"a\nb\tc\\n") == "a\nb\tc\\n"
    assert unescape("plain\\") == "plain\\"


def test_yaml_float(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("prompts: [hi]\ntemperature: 0\ntop-p: 0.9\n")
    opts = parse_options(["--config", str(cfg)])
    assert opts.temperature == 0 and opts.top_p == 0.9
