"""Generated requests (Hypothesis, seeded and bounded) at every layer that sees them: parsing and
validation, chat templates of real model families, the sampler, a whole run in-process, and a running
server. Each must give one answer per request (a result or an error naming its field), never an
exception that escapes or a dead process. bench/fuzz.py runs the same generators for longer."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, Phase, assume, example, given, settings
from hypothesis import strategies as st

from pipeline.scheduling.driver import Driver
from pipeline.scheduling.intake import chat_ids
from pipeline.runtime.messages import Admission, PassHeader, decode, encode
from pipeline.sampling.processors import process, prompt_tokens
from pipeline.sampling.sampler import logprob_info, sample
from pipeline.scheduling.scheduler import Scheduler, SchedulerConfig
from tasks.requests import GREEDY_BELOW, as_json, parse_body, parse_params, parse_request
from tasks.protocol import RequestError
from tests import fuzz_requests as gen
from tests.structured_cases import ENDLESS
from tests.utils import REPO, run_inprocess

DEFAULT_MODEL = REPO / "examples" / "tiny-llama-default"
FAST = settings(derandomize=True, database=None, max_examples=150, deadline=None,
                suppress_health_check=list(HealthCheck))
# whole runs and a server: few examples, no shrinking (each example costs seconds; a failure prints its lines)
SLOW = settings(derandomize=True, database=None, max_examples=6, deadline=None, suppress_health_check=list(HealthCheck),
                phases=(Phase.explicit, Phase.reuse, Phase.generate))
VOCAB = 1024  # the default model's embedding rows (= its tokenizer's length)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEFAULT_MODEL))


def _driver(tok) -> Driver:
    return Driver(tok, VOCAB, 2048, Scheduler(SchedulerConfig(65536, 2, 64)))


def _check_error(e: RequestError) -> None:
    d = e.to_dict()
    assert isinstance(d["message"], str) and d["message"]
    assert d["param"] is None or d["param"] in gen.FIELDS, d
    assert d["type"] in ("invalid_request_error", "server_error")


def _admission(req, ids=(1, 2)) -> Admission:
    return Admission(0, req.index, 0, len(req.prompts), list(ids), req.params, req.kind, req.custom_id, None, [0],
                     raw=req.raw)


# -- (a) parsing and validation, with and without the model --------------------------------------
@FAST
@given(body=gen.bodies(nonfinite=True) | gen.batch_line(nonfinite=True) | gen.any_json(nonfinite=True))
def test_parse_answers_every_body_with_a_request_or_a_named_error(body):
    try:  # as every entry point sees a request: orjson's values (a line, a body), as_json's (the Python API)
        req = parse_request(as_json(body), 3)
    except RequestError as e:
        _check_error(e)
        return
    p = req.params
    assert p.temperature == 0.0 or GREEDY_BELOW <= p.temperature <= 2.0
    assert all(math.isfinite(x) for x in (p.temperature, p.top_p, p.presence_penalty, p.frequency_penalty))
    assert 0 < p.top_p <= 1 and 1 <= p.n <= p.best_of <= 128 and 0 <= p.max_tokens < 2**31
    assert all(0 <= t < 2**31 and -100 <= v <= 100 for t, v in p.logit_bias.items())
    # what rank 0 sends down the pipeline can always be encoded (a huge seed or id could not)
    hdr = PassHeader(0, 1, None, [], [], [], [], admit=[_admission(req)])
    assert decode(encode(hdr)).admit[0].params == p


@FAST
@given(body=gen.bodies(chat=True, nonfinite=True))
def test_chat_bodies_are_parsed_or_refused_by_field(body):
    try:
        req = parse_body(body, chat=True)
    except RequestError as e:
        _check_error(e)
        return
    assert req.kind == "chat" and isinstance(req.prompts[0], list)


@settings(FAST, max_examples=150)
@given(body=gen.bodies(), chat=st.booleans(), data=st.data())
def test_the_driver_prepares_or_refuses_every_request(tokenizer, body, chat, data):
    """Model-aware checks (vocabulary, context window, budget, chat template) and tokenizing: a request
    becomes scheduler groups whose ids fit the model, or an error that names its field."""
    if chat:
        body = dict(body, messages=data.draw(gen.messages()))
    tokenizer.chat_template = data.draw(st.sampled_from(sorted(gen.TEMPLATES.values())))
    d = _driver(tokenizer)
    try:
        req = parse_body(body, chat)
        groups = d.submit_live(req)
    except RequestError as e:
        _check_error(e)
        return
    for gid in groups:
        ids = d.prompts[gid]
        assert ids and all(0 <= t < VOCAB for t in ids)
    assert all(t < VOCAB for t in req.params.logit_bias)


@pytest.mark.parametrize("family", sorted(gen.TEMPLATES))
def test_each_template_refusal_is_the_requests_error_in_the_templates_words(tokenizer, family):
    tokenizer.chat_template = gen.TEMPLATES[family]
    refused = {"mistral-instruct": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
               "llama-2-chat": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
               "gemma": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    ok = [{"role": "user", "content": "hi"}]
    assert all(0 <= t < VOCAB for t in chat_ids(tokenizer, ok))
    if family in refused:
        with pytest.raises(RequestError) as e:
            chat_ids(tokenizer, refused[family])
        assert e.value.param == "messages" and e.value.message.startswith("the model's chat template cannot render")
        assert ("roles must alternate" in e.value.message or "not supported" in e.value.message)
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    if family in ("mistral-instruct", "llama-2-chat", "chatml-qwen"):  # they add strings: a list cannot be
        with pytest.raises(RequestError) as e:
            chat_ids(tokenizer, parts)
        assert e.value.param == "messages" and "the template raised" in e.value.message
    else:  # `| trim` renders the list's text
        assert all(0 <= t < VOCAB for t in chat_ids(tokenizer, parts))



def test_a_template_that_renders_nothing_is_the_requests_error(tokenizer):
    """Llama 2's template renders a lone system message as nothing: an error naming messages, not a row
    of no tokens (found by the generated driver test)."""
    tokenizer.chat_template = gen.TEMPLATES["llama-2-chat"]
    with pytest.raises(RequestError) as e:
        chat_ids(tokenizer, [{"role": "system", "content": ""}])
    assert e.value.param == "messages" and "empty prompt" in e.value.message


# -- (b) the sampler ---------------------------------------------------------------------------
@settings(FAST, max_examples=200)  # (most bodies() are refused by parse_params: valid ones drawn beside them)
@given(body=gen.bodies() | gen.valid_bodies(), rows=st.integers(1, 4), vocab=st.sampled_from([2, 7, 64, 1024]),
       scale=st.sampled_from([1e-3, 1.0, 30.0, 1e4, 1e30]), seed=st.integers(0, 2**32 - 1))
def test_the_sampler_takes_every_valid_setting_without_nan(body, rows, vocab, scale, seed):
    try:
        p = parse_params(body)
    except RequestError:
        assume(False)
    assume(all(t < vocab for t in p.logit_bias))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * scale
    logits[0, 0] = scale * 10  # a spike: the top token far above the others
    raw = logits.clone()
    assume(all(t < vocab for t in p.stop_token_ids))
    counts = [{t: 3 for t in range(min(vocab, 3))} for _ in range(rows)]
    seen = [prompt_tokens([0, vocab - 1], vocab, logits.device)] * rows
    logits = process(logits, [p] * rows, counts, list(range(rows)), seen, {0})
    temp = torch.full((rows,), p.temperature)
    uniforms = torch.rand(rows, generator=g)
    chosen = sample(logits, temp, torch.full((rows,), min(p.top_k, vocab), dtype=torch.long),
                    torch.full((rows,), p.top_p), uniforms, min_p=torch.full((rows,), p.min_p))
    assert chosen.shape == (rows,) and bool(((chosen >= 0) & (chosen < vocab)).all())
    lp, top_v, _ = logprob_info(raw, chosen, min(p.logprobs or 0, vocab))
    assert not torch.isnan(lp).any() and (top_v is None or not torch.isnan(top_v).any())
    if p.temperature == 0:
        assert torch.equal(chosen, logits.argmax(-1))


# -- (c) whole runs, in-process (the embedded default model, P = 1) -------------------------------
@SLOW
@given(lines=st.lists(gen.lines(), min_size=1, max_size=8))
def test_a_run_answers_every_generated_line_once(tmp_path_factory, lines):
    folder = tmp_path_factory.mktemp("fuzz")
    src, out = folder / "in.jsonl", folder / "out.jsonl"
    src.write_bytes(b"".join(line.replace(b"\n", b" ") + b"\n" for line in lines))
    expected = [line for line in src.read_bytes().split(b"\n") if line.strip()]
    code = run_inprocess(["--model-name", str(DEFAULT_MODEL), "--infer-data", str(src), "--output-path", str(out),
                          "--no-progress", "--budget", "8192"])
    assert code == 0
    answers = [json.loads(x) for x in out.read_bytes().split(b"\n") if x.strip()]  # U+0085 is not a line end
    assert len(answers) == len(expected)
    for a in answers:
        assert ("result" in a) != ("error" in a) or ("custom_id" in a and ("response" in a))
        if a.get("error") is not None and "custom_id" not in a:
            assert a["error"]["message"]



def constrained_lines() -> st.SearchStrategy:
    """A request line with a valid generated constraint (schema, json_object, regex, choice) and the sampling
    fields that change what a constrained row computes: greedy or seeded, n, logprobs, a stop string."""
    fields = st.fixed_dictionaries({"prompt": gen.TEXT.filter(str.strip), "max_tokens": st.integers(1, 24),
                                    "temperature": st.sampled_from([0, 0.7, 1.5])},
                                   optional={"seed": st.integers(0, 99), "n": st.just(2), "logprobs": st.just(1),
                                             "stop": st.sampled_from(["}", "\n", "a"])})
    return st.tuples(fields, gen.constraints()).map(lambda fc: ({**fc[0], **fc[1][0]}, fc[1][1], fc[1][2]))


def valid(kind: str, value, text: str) -> bool:
    import re

    import jsonschema

    if kind == "regex":
        return re.fullmatch(value, text) is not None
    if kind == "choice":
        return text in value
    try:
        jsonschema.validate(json.loads(text), value, format_checker=None)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@SLOW
@given(cases=st.lists(constrained_lines(), min_size=1, max_size=6))
@example(cases=[  # ENDLESS (tests.structured_cases): found by this test; the line's error naming its field
    ({"prompt": "ø", "max_tokens": 19, "temperature": 0, "structured_outputs": {"choice": ["籟\x86e"]}},
     "choice", ["籟\x86e"]),
    ({"prompt": "x", "max_tokens": 3, "temperature": 0, "response_format": {
        "type": "json_schema", "json_schema": {"name": "endless", "schema": ENDLESS}}}, "json", ENDLESS)])
def test_generated_constraints_give_valid_outputs_wherever_a_row_stops(tmp_path_factory, cases):
    """Every generated constraint compiles or is its line's error, and each choice that finished with
    "stop" satisfies its constraint (unless a stop string cut it short: the text before the stop)."""
    folder = tmp_path_factory.mktemp("fuzz_structured")
    src, out = folder / "in.jsonl", folder / "out.jsonl"
    src.write_text("".join(json.dumps(body) + "\n" for body, _, _ in cases))
    code = run_inprocess(["--model-name", str(DEFAULT_MODEL), "--infer-data", str(src), "--output-path", str(out),
                          "--no-progress", "--budget", "8192", "--num-threads", "1"])
    assert code == 0
    answers = [json.loads(x) for x in out.read_bytes().split(b"\n") if x.strip()]  # U+0085 is not a line end
    assert len(answers) == len(cases)
    for (body, kind, value), a in zip(cases, answers, strict=True):
        if a.get("error"):
            assert a["error"]["param"] in ("response_format", "structured_outputs"), a["error"]
            continue
        for c in a["result"]["choices"]:
            cut = "stop" in body and c["finish_reason"] == "stop" and not valid(kind, value, c["text"])
            assert c["finish_reason"] == "length" or valid(kind, value, c["text"]) or cut, (body, c["text"])


# -- (d) a running server ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The default model served as "tiny" in this process (every rank a thread: tests/servers.py)."""
    from tests.servers import LocalServer

    s = LocalServer(["--model-name", str(DEFAULT_MODEL), "--served-model-name", "tiny", "--max-pending", "40",
                     "--max-request-bytes", "200000"], tmp_path_factory.mktemp("fuzzserve"), name="fuzz")
    s.mark = s.log.mark()
    s.start()
    yield s
    s.stop(check=False)


@settings(SLOW, max_examples=40)
@given(chat=st.booleans(), data=st.data())
def test_a_server_answers_every_generated_request_with_a_result_or_an_error(server, chat, data):
    from tests.servers import httpx

    body = data.draw(gen.bodies(chat=chat, cheap=True))
    r = httpx.post(server.url("/v1/chat/completions" if chat else "/v1/completions"),
                   content=json.dumps(body).encode(), headers={"Authorization": f"Bearer {server.keys[0]}",
                                                        "Content-Type": "application/json"}, timeout=120)
    assert r.status_code in (200, 400, 404), r.text  # 404: OpenAI's model_not_found
    answer = r.json()
    if r.status_code == 404:
        assert answer["error"]["param"] == "model"
    elif r.status_code == 400:
        assert answer["error"]["message"] and (answer["error"]["param"] is None
                                               or answer["error"]["param"] in gen.FIELDS + ("stream",))
    else:
        assert answer["choices"]
    assert server.running


def test_the_server_is_alive_after_the_generated_requests(server):
    from tests.servers import httpx

    assert httpx.get(server.url("/health"), timeout=10).status_code == 200
    assert server.running
    assert "Traceback" not in server.log.since(server.mark)
