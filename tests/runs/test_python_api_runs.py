"""The Python API (python_api) against file mode on the same request files, at P = 1 and P = 2 (every
stage a thread of this process: ``in_process=True``), plus per-row parameters and bad requests. Worker
processes and a killed worker: tests/integration/test_python_api_workers.py; torchrun:
tests/integration/test_python_api.py."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest

from dist_inference_runner import LLM, RequestFailed, SamplingParams
from tests.utils import DATA, read_jsonl, run_local, strip_volatile

FILES = ("babi_fewshot.jsonl", "mixed_params.jsonl", "helm_scoring.jsonl", "bad_lines.jsonl")
HEAD = 12  # lines of each shared file (a 2-core machine shared by many runs: the first lines make the point)
FLAGS = {"budget": 8192, "no_progress": True}
CHATS = [
    [{"role": "user", "content": "What is 2 plus 3?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Who has the ball?"}],
    [{"role": "user", "content": "Tell me a story."}],
]


def _lines(name: str) -> list[bytes]:
    lines = [x for x in (DATA / name).read_bytes().split(b"\n") if x.strip()]
    return lines if name == "bad_lines.jsonl" else lines[:HEAD]


@pytest.fixture(scope="module")
def file_mode(tmp_path_factory) -> dict[str, list[dict]]:
    """File mode's output for each shared file and a chat file (Batch API lines), at P = 1."""
    tmp = tmp_path_factory.mktemp("file_mode")
    chat = tmp / "chat.jsonl"
    chat.write_text("".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                        "body": {"messages": m, "max_tokens": 8, "temperature": 0}}) + "\n"
                            for i, m in enumerate(CHATS)))
    for f in FILES:
        (tmp / f).write_bytes(b"".join(x + b"\n" for x in _lines(f)))
    inputs = [str(tmp / f) for f in FILES] + [str(chat)]
    out = tmp / "out"
    r = run_local(["--infer-data", *inputs, "--output-path", str(out), "--budget", str(FLAGS["budget"]), "--no-progress"])
    assert r.returncode == 0, r.stderr[-3000:]
    return {Path(i).name: read_jsonl(out / f"output_{Path(i).name}") for i in inputs}


@pytest.fixture(scope="module", params=[1, 2], ids=["P1", "P2"])
def llm(request):
    """One LLM per pipeline size, every stage in this process."""
    with LLM(pipeline_size=request.param, in_process=True, **FLAGS) as llm:
        yield llm


def _same(api_line: dict, file_line: dict, where: str, ids: bool = True) -> None:
    """The API's result is file mode's, ids and timing aside; logprobs to float rounding (the two runs
    batch requests differently)."""
    a, b = strip_volatile(_without_ids(api_line, ids)), strip_volatile(file_line)
    assert _rounded(a) == _rounded(b), where


def _without_ids(line: dict, ids: bool) -> dict:
    """An API line without what only the API asks for (``return_token_ids``), after checking the ids
    are one per token listed."""
    line = json.loads(json.dumps(line))
    if isinstance(line.get("request"), dict):
        line["request"].pop("return_token_ids", None)
        if isinstance(line["request"].get("body"), dict):
            line["request"]["body"].pop("return_token_ids", None)
    for choice in (line.get("result") or {}).get("choices", []):
        got = choice.pop("token_ids", None)
        if not ids:  # generate_file runs file mode exactly: its lines are the file's
            assert got is None
            continue
        tokens = (choice.get("logprobs") or {}).get("tokens")
        assert got is not None and all(isinstance(i, int) for i in got), choice
        if tokens is not None:
            assert len(got) == len(tokens), choice
    return line


def _rounded(x):
    if isinstance(x, float):
        return round(x, 3)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def _as_line(result) -> dict:
    return {"request": result.request, **({"error": result.error} if result.error else {"result": result.raw})}


@pytest.mark.parametrize("name", ["babi_fewshot.jsonl", "mixed_params.jsonl", "helm_scoring.jsonl"])
def test_generate_matches_file_mode(llm, file_mode, name):
    requests = [orjson.loads(x) for x in _lines(name)]
    results = llm.generate(requests)
    assert [r.index for r in results] == list(range(len(requests)))
    for i, (r, line) in enumerate(zip(results, file_mode[name], strict=True)):
        _same(_as_line(r), line, f"{name} line {i}")
        if r.ok:
            c = line["result"]["choices"][0]
            assert r.text == c["text"] and r.finish_reason == c["finish_reason"]
            assert r.choices[0].tokens == c["logprobs"]["tokens"]
            assert r.usage["completion_tokens"] == line["result"]["usage"]["completion_tokens"]


def test_bad_lines_match_file_mode(llm, file_mode):
    """Every line that is a request object gets file mode's answer in its place (errors included), in one
    call so that each keeps its position (a sampled request's stream depends on it)."""
    values = []
    for raw in _lines("bad_lines.jsonl"):
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError:
            value = None  # not JSON: file mode's own case; the API takes Python values
        values.append(value if isinstance(value, dict) else {"placeholder": True})
    results = llm.generate(values)
    checked = 0
    for i, (value, r, line) in enumerate(zip(values, results, file_mode["bad_lines.jsonl"], strict=True)):
        if "placeholder" in value:
            assert r.error is not None and r.error["param"] == "prompt"
            continue
        checked += 1
        if "error" in line:
            assert r.error is not None and r.error["message"] == line["error"]["message"], f"line {i}"
        else:
            assert r.ok and r.text == line["result"]["choices"][0]["text"], f"line {i}"
    assert checked >= 20


def test_chat_matches_file_mode(llm, file_mode):
    results = llm.chat(CHATS, SamplingParams(max_tokens=8, temperature=0))
    for i, (r, line) in enumerate(zip(results, file_mode["chat.jsonl"], strict=True)):
        body = line["response"]["body"]
        assert r.ok and r.text == body["choices"][0]["message"]["content"], f"conversation {i}"
        assert r.usage == body["usage"]
    one = llm.chat(CHATS[0], {"max_tokens": 8, "temperature": 0})  # one conversation alone
    assert len(one) == 1 and one[0].text == results[0].text


def test_score_matches_file_mode(llm, file_mode):
    """score(text) sums the echoed logprobs file mode reports for that prompt (all but the first token)."""
    requests = [orjson.loads(x) for x in _lines("helm_scoring.jsonl")]
    scores = llm.score([r["prompt"] for r in requests])
    for i, (s, line) in enumerate(zip(scores, file_mode["helm_scoring.jsonl"], strict=True)):
        lps = line["result"]["choices"][0]["logprobs"]["token_logprobs"]
        assert s.error is None and s.logprob == pytest.approx(sum(x for x in lps[1:]), abs=1e-3), f"line {i}"
    # lm-eval's loglikelihood: (context, continuation) -> (sum over the continuation, is_greedy)
    context = requests[0]["prompt"][:200]
    greedy = llm.generate(context, SamplingParams(max_tokens=3, temperature=0))[0]
    logprob, is_greedy = llm.score([(context, greedy.text)])[0]
    assert is_greedy is True and logprob < 0
    assert llm.score([(context, " zebra quantum")])[0].is_greedy is False


def test_per_row_params_and_streaming(llm):
    prompt = "Once upon a time"
    longest = llm.generate(prompt, SamplingParams(max_tokens=5, temperature=0, logprobs=0))[0]
    results = llm.generate([prompt] * 3, [SamplingParams(max_tokens=k, temperature=0, logprobs=0) for k in (1, 3, 5)])
    for k, r in zip((1, 3, 5), results, strict=True):
        assert r.usage["completion_tokens"] == k
        assert r.choices[0].tokens == longest.choices[0].tokens[:k]
    seen = {r.index: r.text for r in llm.stream([prompt, "The cat", [0, 5, 6]], {"max_tokens": 4, "temperature": 0})}
    assert seen == {i: r.text for i, r in enumerate(llm.generate([prompt, "The cat", [0, 5, 6]],
                                                                 {"max_tokens": 4, "temperature": 0}))}


def test_bad_request_in_the_middle(llm):
    good = SamplingParams(max_tokens=4, temperature=0)
    alone = llm.generate(["Hello", "The dog"], good)
    results = llm.generate(["Hello", {"prompt": "x", "temperature": 5}, [5, 99999], {"prompt": "The dog"}], good)
    assert [r.ok for r in results] == [True, False, False, True]
    assert results[1].error["param"] == "temperature"
    assert "vocabulary" in results[2].error["message"]
    assert [results[0].text, results[3].text] == [r.text for r in alone]
    with pytest.raises(RequestFailed) as e:
        llm.generate(["Hello", {"prompt": "x", "temperature": 5}], good, raise_errors=True)
    assert e.value.index == 1
    assert llm.generate("Hello", good)[0].text == alone[0].text  # the engine goes on
    # what a line or an HTTP body cannot hold: an integer beyond 64 bits (a float, as orjson reads a
    # line), an object, a tuple key; the stages are sent every request's fields at P > 1
    odd = llm.generate([{"prompt": "Hello", "user": 2**64}, {"prompt": "x", "meta": object()},
                        {"prompt": "x", "meta": {(1, 2): 3}}, {"prompt": "x", "n": 2**70}, "The dog"], good)
    assert [r.ok for r in odd] == [True, False, False, False, True]
    assert odd[0].text == alone[0].text and odd[4].text == alone[1].text
    assert odd[1].error["param"] is None and "object" in odd[1].error["message"]
    assert odd[3].error["param"] == "n"


def test_generate_file_is_file_mode(llm, file_mode, tmp_path):
    src = tmp_path / "babi_fewshot.jsonl"
    src.write_bytes(b"".join(x + b"\n" for x in _lines("babi_fewshot.jsonl")))
    out = llm.generate_file(src, tmp_path / "out.jsonl")
    lines = read_jsonl(out)
    assert len(lines) == len(file_mode["babi_fewshot.jsonl"])
    for i, (a, b) in enumerate(zip(lines, file_mode["babi_fewshot.jsonl"], strict=True)):
        _same(a, b, f"line {i}", ids=False)
