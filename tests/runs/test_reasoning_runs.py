"""Reasoning models through the runner, every stage a thread of this process (P = 1 and 2), on tiny random
thinking models (tests/reasoning_models.py): DeepSeek-R1's template starts every answer inside ``<think>``,
Qwen3's lets the model open one. A random model never closes its thinking, so every thinking here ends at
its budget, forced (a model that ends its own: the default model, tests/runs/test_default_model_runs.py).

File mode: reasoning apart from the answer, the thinking within its budget and the answer after it, usage's
reasoning_tokens, stop strings and a grammar that apply to the answer alone, with n, best_of, logprobs, LoRA,
the prefix cache (on and off) and chunked prefill; starved rows flagged, counted and failing --strict, then run again by --retry-starved
(the same seed: the first try's tokens are the rerun's first tokens). The Python API: the same, and a live
request run again. Streaming over HTTP: tests/runs/test_reasoning_serve_runs.py."""

from __future__ import annotations

import json

import jsonschema
import pytest

from dist_inference_runner import LLM
from tests.reasoning_models import thinking_tokenizer, tiny_thinking_model
from tests.unit.pipeline.models.test_lora import make_adapter
from tests.utils import assert_consistent_results, read_jsonl, run_local

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
TOK = thinking_tokenizer("deepseek")
END = TOK.convert_tokens_to_ids("</think>")
FORCED = TOK("\n</think>\n\n", add_special_tokens=False)["input_ids"]


def chat(i: int, content: str, **body) -> dict:
    return {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "system", "content": "Think, then answer."},
                                  {"role": "user", "content": content}], "temperature": 0, "logprobs": True, **body}}


# (request line, what it shows); the budget each chat line's thinking must keep to
CASES = [
    (chat(0, "Pick a number.", thinking_token_budget=0, max_tokens=12, return_token_ids=True), "no thinking"),
    (chat(1, "Say hi.", thinking_token_budget=3, max_tokens=16, stop=["\n"], logprobs=True, top_logprobs=2,
          return_token_ids=True), "stop string and logprobs"),
    (chat(2, "Two tries.", thinking_token_budget=5, max_tokens=18, n=2, temperature=0.8, seed=7,
          return_token_ids=True), "n = 2, sampled"),
    (chat(3, "Best of three.", thinking_token_budget=4, max_tokens=16, best_of=3, temperature=0.9, seed=3,
          return_token_ids=True), "best_of"),
    (chat(4, "Medium effort.", reasoning_effort="medium", max_tokens=20, return_token_ids=True), "effort: 10"),
    (chat(5, "Think long.", max_tokens=6, return_token_ids=True), "starved"),
    (chat(6, "Is it ok?", thinking_token_budget=4, max_tokens=40, return_token_ids=True,
          response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": SCHEMA}}), "json"),
    (chat(7, "Yes or no?", thinking_token_budget=2, max_tokens=20, structured_outputs={"choice": ["yes", "no"]},
          return_token_ids=True), "choice"),
    (chat(8, "With the adapter.", thinking_token_budget=3, max_tokens=14, model="a1", return_token_ids=True), "LoRA"),
    (chat(9, "Think long, twice.", max_tokens=5, n=2, temperature=1.0, seed=11, return_token_ids=True),
     "starved, n = 2"),
    ({"prompt": "Question: why?<think>\n", "max_tokens": 12, "thinking_token_budget": 3, "return_token_ids": True},
     "a completion keeps the raw text"),
]
BUDGET = {0: 0, 1: 3, 2: 5, 3: 4, 4: 10, 6: 4, 7: 2, 8: 3, 10: 3}
STARVED = {5: 1, 9: 2}  # line: starved choices


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reasoning")
    model = tiny_thinking_model(tmp / "deepseek", "deepseek", seed=1)
    adapter = make_adapter(model, tmp / "a1", ["q_proj", "v_proj"], seed=2)
    data = tmp / "requests.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line, _ in CASES))
    return tmp, model, adapter, data


def _run(setup, name: str, stages: int, *flags) -> tuple[list[dict], dict, int, str]:
    tmp, model, adapter, data = setup
    out = tmp / f"{name}.jsonl"
    r = run_local(["--model-name", model, "--lora", f"a1={adapter}", "--infer-data", str(data), "--output-path",
                   str(out), "--no-progress", "--budget", "4096", "--strict", *flags], stages)
    summary = json.loads((tmp / f"{name}.jsonl.summary.json").read_text()) if out.exists() else {}
    return read_jsonl(out) if out.exists() else [], summary, r.returncode, r.stderr


@pytest.fixture(scope="module")
def first(setup):
    """Without --retry-starved, at P = 1 and P = 2."""
    return {p: _run(setup, f"first-p{p}", p) for p in (1, 2)}


@pytest.fixture(scope="module")
def retried(setup):
    """--retry-starved at P = 2 with prompts chunked (8 tokens a pass), and at P = 1 with the prefix cache off."""
    return {2: _run(setup, "retry-p2", 2, "--retry-starved", "--prefill-chunk", "8"),
            1: _run(setup, "retry-p1", 1, "--retry-starved", "--prefix-cache", "off")}


def body(line: dict) -> dict:
    return line["response"]["body"] if "response" in line else line["result"]


def comparable(lines: list[dict]) -> list[dict]:
    """Chat lines in the shape tests.utils.assert_consistent_results compares (tokens and logprobs per choice)."""
    out = []
    for line in lines:
        res, req = body(line), line.get("request") or line.get("body") or {}
        choices = []
        for c in res["choices"]:
            lp, msg = c["logprobs"], c.get("message")
            if msg is not None:
                lp = {"tokens": [t["token"] for t in lp["content"]], "token_logprobs": [t["logprob"] for t in lp["content"]]}
            choices.append({"text": msg["content"] if msg else c["text"], "logprobs": lp, "finish_reason": c["finish_reason"],
                            "reasoning": msg and msg["reasoning_content"], "starved": c.get("starved")})
        out.append({"request": {"temperature": CASES[len(out)][0].get("body", CASES[len(out)][0]).get("temperature", 1.0)},
                    "result": {"choices": choices, "usage": {k: v for k, v in res["usage"].items()
                                                             if k != "prompt_tokens_details"}}})  # (the cache's share)
    return out


def check_line(i: int, line: dict, budget: int | None) -> None:
    """A chat line's choices: the reasoning apart, within its budget, the answer after it; usage counts."""
    res = body(line)
    details = res["usage"]["completion_tokens_details"]
    thinking = 0
    for c in res["choices"]:
        ids = c.get("token_ids") or []
        msg = c.get("message")
        if msg is None:  # the completion: raw text, the markers in it
            assert "</think>" in c["text"] and c["token_ids"].index(END) <= budget + 1
            thinking += c["token_ids"].index(END) + 1
            continue
        assert msg["reasoning_content"] is not None and "<think>" not in msg["content"]
        assert "</think>" not in msg["content"] and "</think>" not in msg["reasoning_content"]
        if END in ids:
            k = ids.index(END)
            if budget is not None:
                assert k <= budget + 1, (i, k, budget)  # the model's own tokens, then the forced "\n</think>"
                if k == budget + 1:
                    assert ids[k - 1: k - 1 + len(FORCED)] == FORCED[: len(ids) - k + 1]
            thinking += k + 1
            assert TOK.decode(ids[:k], skip_special_tokens=True).strip() == msg["reasoning_content"]
            assert TOK.decode(ids[k + 1:], skip_special_tokens=True).lstrip("\n").startswith(msg["content"])
        else:
            thinking += len(ids)
            assert c["finish_reason"] == "length" and msg["content"] == "" and c["starved"] == "thinking_unfinished"
        if c.get("logprobs"):
            assert len(c["logprobs"]["content"]) == len(ids)
    if i != 3:  # (best_of: the candidates not returned thought too, and count)
        assert details["reasoning_tokens"] == thinking, (i, details, thinking)


@pytest.mark.parametrize("stages", [1, 2])
def test_budgets_separation_and_starved_rows(first, stages):
    lines, summary, code, err = first[stages]
    assert code == 1, err[-2000:]  # --strict: starved answers fail the run, loudly
    assert "WARNING: 3 choice(s) with no answer: the thinking used max_tokens" in err
    assert len(lines) == len(CASES) and all("error" not in line or line["error"] is None for line in lines)
    for i, line in enumerate(lines):
        check_line(i, line, BUDGET.get(i))
        starved = [c for c in body(line)["choices"] if "starved" in c]
        assert len(starved) == STARVED.get(i, 0), (i, body(line)["choices"])
    one = body(lines[1])["choices"][0]
    assert "\n" not in one["message"]["content"] and one["finish_reason"] in ("stop", "length")
    ok = body(lines[6])["choices"][0]
    if ok["finish_reason"] == "stop":
        jsonschema.validate(json.loads(ok["message"]["content"]), SCHEMA)  # valid after a free thinking
    assert body(lines[7])["choices"][0]["message"]["content"] in ("yes", "no")
    assert body(lines[8])["model"] == "a1"
    f = summary["reasoning"]
    assert f["starved"] == 3 and f["retried"] == 0 and f["thinking_rows"] == 15 and f["forced_ends"] >= 9
    assert_consistent_results(*(comparable(first[p][0]) for p in (1, 2)))  # whatever P and what shares a pass


@pytest.mark.parametrize("stages", [2, 1])
def test_retry_starved_repairs_in_the_same_job(first, retried, stages):
    lines, summary, code, err = retried[stages]
    assert code == 0, err[-2000:]
    before = first[1][0]
    for i, line in enumerate(lines):
        check_line(i, line, BUDGET.get(i))
        res = body(line)
        if i not in STARVED:  # untouched lines: the first run's
            assert "retry" not in res
            continue
        case = CASES[i][0]["body"]
        old = body(before[i])["choices"]
        spent = max(len(c["token_ids"]) for c in old)
        assert res["retry"] == {"reason": "starved", "thinking_token_budget": 2 * spent,
                                "max_tokens": 2 * spent + len(FORCED) + case["max_tokens"]}
        for new, was in zip(res["choices"], old):
            assert "starved" not in new and new["message"]["content"]  # an answer now
            if not case.get("seed"):  # greedy: the same start (a sampled row's could flip on float rounding)
                assert new["token_ids"][: len(was["token_ids"])] == was["token_ids"]
    f = summary["reasoning"]
    assert f["starved"] == 0 and f["retried"] == 2 and f["repaired"] == 2
    rest = [i for i in range(len(CASES)) if i not in STARVED]
    a, b = comparable(lines), comparable(before)
    assert_consistent_results([a[i] for i in rest], [b[i] for i in rest])


def test_qwen3_answers_may_open_a_thinking(tmp_path):
    """Qwen3's template: a chat answer that does not open a thinking is all content (the same text as with
    --reasoning-parser none); one that does (logit_bias on <think>) thinks to its budget, then a choice
    grammar constrains the answer alone; enable_thinking false writes a closed thinking: none to parse."""
    model = tiny_thinking_model(tmp_path / "qwen3", "qwen3", seed=3)
    think = thinking_tokenizer("qwen3").convert_tokens_to_ids("<think>")
    msgs = [{"role": "user", "content": "Answer."}]
    lines = [chat(0, "Free.", max_tokens=8), chat(1, "Free.", max_tokens=8, chat_template_kwargs={"enable_thinking": False}),
             chat(2, "Pick.", max_tokens=16, thinking_token_budget=3, logit_bias={str(think): 100},
                  structured_outputs={"choice": ["red", "blue"]})]
    lines[2]["body"]["messages"] = msgs
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    outs = {}
    for parser in ("auto", "none"):
        r = run_local(["--model-name", model, "--infer-data", str(data), "--output-path", str(tmp_path / parser),
                       "--reasoning-parser", parser, "--no-progress"], 2 if parser == "auto" else 1)
        assert r.returncode == 0, r.stderr[-2000:]
        outs[parser] = read_jsonl(tmp_path / parser)
    for i in (0, 1):
        a, b = body(outs["auto"][i])["choices"][0], body(outs["none"][i])["choices"][0]
        assert a["message"]["reasoning_content"] is None and a["message"]["content"] == b["message"]["content"]
    c = body(outs["auto"][2])["choices"][0]
    assert c["message"]["reasoning_content"] == "<think><think><think>"  # its own 3 tokens (the bias), then forced
    assert c["message"]["content"] in ("red", "blue")
    assert body(outs["auto"][2])["usage"]["completion_tokens_details"]["reasoning_tokens"] == 1 + 3 + 2


def test_python_api_reruns_a_live_request(setup):
    """LLM.chat at P = 2 with retry_starved: a starved answer is run again in the call, and the thinking is
    apart from the text in the API's results."""
    _, model, _, _ = setup
    with LLM(model, pipeline_size=2, in_process=True, retry_starved=True, no_progress=True, budget=4096) as llm:
        msgs = [{"role": "user", "content": "Think long."}]
        starved, budgeted = llm.chat([msgs, msgs], [{"max_tokens": 6, "temperature": 0},
                                                    {"max_tokens": 12, "thinking_token_budget": 2, "temperature": 0}])
    assert starved.raw["retry"]["thinking_token_budget"] == 12 and starved.choices[0].starved is None
    assert starved.text and starved.reasoning_content
    assert budgeted.reasoning_content and "retry" not in budgeted.raw
    assert budgeted.raw["usage"]["completion_tokens_details"]["reasoning_tokens"] == 2 + 2  # own + "\n</think>"
