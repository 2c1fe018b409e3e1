"""A row's thinking on the last rank (pipeline/output/reasoning.py), without a model: the format chosen from
the chat template, where a row starts, markers found in the text whatever their tokens, the budget's
forced end, the split into reasoning and answer (for a whole text and for every streamed prefix of it),
the reasons a row is starved, and what a --retry-starved rerun asks for."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.output.reasoning import (ANSWER, IN, MAY, Reasoning, ReasoningError, Thinking, choose, split,
                                       starved)
from pipeline.output.results import Candidate, Detokenizer, IncrementalText
from pipeline.loading.default_model import build_tokenizer
from tests.reasoning_models import thinking_tokenizer
from tests.utils import local_tokenizer

QWEN = thinking_tokenizer("qwen3")
DEEPSEEK = thinking_tokenizer("deepseek")
LOCAL = local_tokenizer()  # the default model's: <think> is four BPE tokens
words = st.text(alphabet="abc xyz\n.:19", min_size=0, max_size=30)


def reasoning(tok) -> Reasoning:
    return Reasoning(choose(tok, "auto"), Detokenizer(tok))


def prompt(tok, **kw) -> list[int]:
    out = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                  tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def feed(r: Reasoning, tok, th: Thinking, ids: list[int], context: list[int]) -> SimpleNamespace:
    """The row state after ``ids`` were taken one by one (as the head does it)."""
    row = SimpleNamespace(thinking=th, matcher=None, text=IncrementalText(r.detok, context))
    for n, t in enumerate(ids, 1):
        before = len(row.text.text)
        row.text.add(t)
        r.after(row, before, n)
    return row


def test_format_from_the_chat_template():
    for tok in (QWEN, DEEPSEEK):
        fmt = choose(tok, "auto")
        assert fmt.name == "qwen3" and fmt.start_id == tok.convert_tokens_to_ids("<think>")
        assert tok.decode(list(fmt.forced)) == "\n</think>\n\n"
    assert choose(LOCAL, "auto").start_id is None  # several tokens: found in the text all the same
    assert choose(QWEN, "none") is None and choose(QWEN, "deepseek_r1").always
    assert choose(thinking_tokenizer("harmony"), "auto") is None  # gpt-oss's channels: not parsed, said in the log
    with pytest.raises(ReasoningError, match="harmony"):
        choose(QWEN, "gpt_oss")
    plain = build_tokenizer()  # a copy: the shared one stays as it is
    plain.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert choose(plain, "auto") is None


def test_where_a_row_starts():
    q, d = reasoning(QWEN), reasoning(DEEPSEEK)
    assert d.admit(prompt(DEEPSEEK), None, True).phase == IN  # R1's template opens the thinking
    assert q.admit(prompt(QWEN), None, True).phase == MAY  # Qwen3's: the model may open it
    assert q.admit(prompt(QWEN), None, False).phase == ANSWER  # a completion thinks only inside one
    assert q.admit(prompt(QWEN, enable_thinking=False), None, True).phase == ANSWER  # an empty thinking: closed
    assert q.admit(QWEN("go <think>\n")["input_ids"], None, False).phase == IN
    r1 = Reasoning(choose(QWEN, "deepseek_r1"), Detokenizer(QWEN))
    assert r1.admit(prompt(QWEN), None, True).phase == IN
    assert r1.admit(QWEN("Q: why?")["input_ids"], None, False).phase == ANSWER  # a completion: only inside <think>
    assert r1.admit(prompt(QWEN, enable_thinking=False), None, True).phase == ANSWER
    local = reasoning(LOCAL)
    assert local.admit(prompt(LOCAL, enable_thinking=True), None, True).phase == IN
    assert local.admit(prompt(LOCAL), None, True).phase == MAY


@settings(max_examples=40, deadline=None)
@given(thought=words, answer=words, family=st.sampled_from(["deepseek", "local"]))
def test_split_of_a_thinking_then_an_answer(thought, answer, family):
    """Whatever the text and the markers' tokens: reasoning and answer apart, reasoning_tokens up to the end
    marker, and every streamed prefix (stream_limit) splits into prefixes of the final parts."""
    tok = DEEPSEEK if family == "deepseek" else LOCAL
    r = reasoning(tok)
    ctx = prompt(tok, enable_thinking=True) if family == "local" else prompt(tok)
    th = r.admit(ctx, None, True)
    ids = tok(f"{thought}\n</think>\n\n{answer}", add_special_tokens=False)["input_ids"]
    row = SimpleNamespace(thinking=th, matcher=None, text=IncrementalText(r.detok, ctx))
    sent = []
    for n, t in enumerate(ids, 1):
        before = len(row.text.text)
        row.text.add(t)
        r.after(row, before, n)
        sent.append(split(th, row.text.text[: r.stream_limit(th, len(row.text.text))]))
    text = row.text.text
    assert text == f"{thought}\n</think>\n\n{answer}"
    assert split(th, text) == (thought.strip(), answer.lstrip("\r\n"))
    end = text.index("</think>") + len("</think>")
    assert th.tokens(len(ids)) == len(tok(text[:end], add_special_tokens=False)["input_ids"])
    final_r, final_a = split(th, text)
    for rs, a in sent:
        assert final_r.startswith(rs) and final_a.startswith(a)
    assert starved(th, "length", text) == (None if answer.strip() else "no_answer_after_thinking")
    assert starved(th, "stop", text) is None


def test_a_chat_answer_may_open_a_thinking():
    r = reasoning(QWEN)
    th = r.admit(prompt(QWEN), None, True)
    row = feed(r, QWEN, th, QWEN("<think>\nhm\n</think>\n\nfive", add_special_tokens=False)["input_ids"], prompt(QWEN))
    assert split(th, row.text.text) == ("hm", "five")
    th2 = r.admit(prompt(QWEN), None, True)
    row2 = feed(r, QWEN, th2, QWEN("five <think> no", add_special_tokens=False)["input_ids"], prompt(QWEN))
    assert th2.phase == ANSWER and not th2.thought and split(th2, row2.text.text) == (None, "five <think> no")


@pytest.mark.parametrize("budget", [0, 1, 5])
@pytest.mark.parametrize("family", ["deepseek", "local"])
def test_the_budget_forces_the_end(budget, family):
    """A model that never ends its thinking: after ``budget`` tokens of its own the format's closing ids
    are forced one by one, the phase turns to the answer, and the thinking holds ``budget`` tokens."""
    tok = DEEPSEEK if family == "deepseek" else LOCAL
    r = reasoning(tok)
    ctx = prompt(tok, enable_thinking=True) if family == "local" else prompt(tok)
    th = r.admit(ctx, budget, True)
    row = SimpleNamespace(thinking=th, matcher=None, text=IncrementalText(r.detok, ctx))
    own = tok(" a", add_special_tokens=False)["input_ids"][0]
    taken = []
    for n in range(1, budget + len(r.fmt.forced) + 3):
        tok_id = r.fmt.forced[th.forcing] if th.forcing >= 0 else own
        taken.append(tok_id)
        before = len(row.text.text)
        row.text.add(tok_id)
        r.after(row, before, n)
    assert taken[budget: budget + len(r.fmt.forced)] == list(r.fmt.forced)
    assert th.spent == budget and th.forced_end and th.phase == ANSWER and th.forcing == -1
    reasoning_text, answer = split(th, row.text.text)
    assert reasoning_text == ("a " * budget).strip() and answer == " a a"


def test_mask_forces_one_token_and_lets_a_constrained_row_open_its_thinking():
    r = reasoning(QWEN)
    forcing = Thinking(IN, 0, forcing=1)
    may = Thinking(MAY, None)
    vocab = len(QWEN)
    allowed = torch.zeros(3, vocab, dtype=torch.bool)
    allowed[:, 5] = True
    out = r.mask([forcing, may, None], allowed, vocab, torch.device("cpu"))
    assert out[0].nonzero().flatten().tolist() == [r.fmt.forced[1]]
    assert out[1].nonzero().flatten().tolist() == sorted([5, r.fmt.start_id])
    assert out[2].nonzero().flatten().tolist() == [5]
    none = r.mask([None, Thinking(IN, None)], None, vocab, torch.device("cpu"))
    assert none is None
    alone = r.mask([forcing, None], None, vocab, torch.device("cpu"))
    assert alone[0].sum() == 1 and bool(alone[1].all())


def test_a_grammar_waits_for_the_answer():
    r = reasoning(DEEPSEEK)
    th = r.admit(prompt(DEEPSEEK), 2, True)
    matcher = object()
    assert r.hold(th, matcher) is None and th.grammar is matcher  # held while thinking
    row = SimpleNamespace(thinking=th, matcher=None, text=IncrementalText(r.detok, prompt(DEEPSEEK)))
    own = DEEPSEEK(" a", add_special_tokens=False)["input_ids"][0]
    for n in range(1, 20):
        before = len(row.text.text)
        row.text.add(r.fmt.forced[th.forcing] if th.forcing >= 0 else own)
        r.after(row, before, n)
        if th.phase == ANSWER and th.forcing >= 0:
            assert row.matcher is None  # not before the forced blank line is written
        if row.matcher is not None:
            break
    assert row.matcher is matcher and th.grammar is None and th.forcing == -1
    local = reasoning(LOCAL)  # <think> of several tokens: a constrained chat row cannot open one
    th2 = local.admit(prompt(LOCAL), None, True)
    assert local.hold(th2, matcher) is matcher and th2.phase == ANSWER


def test_starved_reasons_and_the_rerun():
    r = reasoning(QWEN)
    th = Thinking(IN, None, spent=7)
    assert starved(th, "length", "thinking...") == "thinking_unfinished"
    assert starved(Thinking(ANSWER, None, answer_char=0, answer_token=0), "length", "") is None  # never thought
    assert starved(th, "length", "", generated=0) is None  # max_tokens 0: a prompt scored, nothing to answer
    cands = [Candidate(0, reasoning=th), Candidate(1, reasoning=Thinking(IN, None, spent=3))]
    budget, max_tokens, room = r.retry(cands, 10, None)
    assert budget == 14 and room == 10 + len(r.fmt.forced) and max_tokens == budget + room
    assert r.retry(cands, 10, 20)[0] == 20  # never below its own budget
    assert r.retry([Candidate(0, reasoning=Thinking(IN, 0, spent=0))], 2, 0)[0] == 1


def test_gpt_oss_is_refused_before_loading():
    from pipeline.config.options import parse_options

    with pytest.raises(SystemExit):
        parse_options(["--reasoning-parser", "gpt_oss"])
    assert parse_options(["--reasoning-parser", "deepseek_r1", "--retry-starved"]).retry_starved
