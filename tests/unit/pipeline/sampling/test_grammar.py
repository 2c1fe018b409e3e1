"""pipeline.sampling.grammar and step: compiled once per spec, masks that allow exactly the grammar's
next tokens (EOS only where it may end), masks applied before penalties and sampling, logprobs of the
raw distribution."""

import pytest
import torch

import random

from pipeline.sampling.grammar import GrammarError, Grammars, MasksAhead, allowed_mask, masks_on_thread, spec_key
from pipeline.sampling.step import draw
from tasks.requests import Params
from tests.utils import local_tokenizer

CHOICE = {"kind": "choice", "value": ["yes", "no"]}


@pytest.fixture(scope="module")
def grammars():
    tok = local_tokenizer()
    return Grammars(tok, len(tok) + 7)  # the model's logits may be wider than the tokenizer


def test_each_spec_compiles_once(grammars):
    before = grammars.compiled
    a, b = grammars.matcher(CHOICE), grammars.matcher({"value": ["yes", "no"], "kind": "choice"})
    assert grammars.compiled == before + 1 and spec_key(CHOICE) == spec_key(dict(reversed(CHOICE.items())))
    assert a is not b  # each row its own state
    with pytest.raises(GrammarError):
        grammars.compile({"kind": "json", "value": {"type": "no-such-type"}})
    with pytest.raises(GrammarError):  # the error is cached with the spec
        grammars.compile({"kind": "json", "value": {"type": "no-such-type"}})


def test_mask_allows_the_grammar_and_eos_only_at_its_end(grammars):
    tok = local_tokenizer()
    vocab, eos = grammars.vocab_size, {tok.eos_token_id}
    m = grammars.matcher({"kind": "regex", "value": "ab?"})
    allowed = allowed_mask([m, None], eos, grammars.tok.vocab_size, vocab, torch.device("cpu"))
    assert allowed.shape == (2, vocab) and allowed[1].all()
    assert not allowed[0, tok.eos_token_id] and not allowed[0, len(tok):].any()
    assert all(tok.decode([t]).lstrip() in ("a", "ab") for t in allowed[0].nonzero().flatten().tolist())
    a = tok.convert_tokens_to_ids("a") if "a" in tok.get_vocab() else allowed[0].nonzero()[0, 0].item()
    assert m.consume_token(a)
    after = allowed_mask([m], eos, grammars.tok.vocab_size, vocab, torch.device("cpu"))
    assert after[0, tok.eos_token_id]  # "a" may end the output


def test_draw_samples_inside_the_mask_and_reports_raw_logprobs(grammars):
    vocab = 50
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    allowed = torch.zeros(3, vocab, dtype=torch.bool)
    allowed[:, [5, 9]] = True
    allowed[2] = True  # a free row in the same micro-batch
    ps = [Params(temperature=0.0, logprobs=2), Params(temperature=1.0, top_k=3, logit_bias={7: 100.0}),
          Params(temperature=0.0)]
    d = draw(logits, ps, [{}, {}, {}], [0.0, 0.99, 0.0], allowed)
    assert d.chosen[0] in (5, 9) and d.chosen[1] in (5, 9)  # a logit_bias cannot lift a masked token
    assert d.chosen[2] == int(logits[2].argmax())
    raw = torch.log_softmax(logits, -1)
    assert d.chosen_lp[0] == pytest.approx(raw[0, d.chosen[0]].item(), abs=1e-6)
    assert d.top_i[0] == raw[0].topk(2).indices.tolist()  # the raw distribution's top tokens, masked or not


def masks_agree_then_step(ahead, live: list, rows: list, eos: set, width: int, vocab: int, rng) -> list:
    """The masks of the ``live`` (ahead, alone) twins are equal through ``ahead`` and computed alone;
    each pair then takes one random allowed token (a pair with none leaves ``rows``, forgotten).
    Returns the matchers that took a token."""
    dev = torch.device("cpu")
    got = allowed_mask([a for a, _ in live], eos, width, vocab, dev, ahead)
    want = allowed_mask([b for _, b in live], eos, width, vocab, dev)
    assert torch.equal(got, want)
    stepped = []
    for i, (a, b) in enumerate(live):
        choices = [t for t in got[i].nonzero().flatten().tolist() if t not in eos and t < width]
        if not choices:
            ahead.forget(a)
            rows.remove((a, b))
            continue
        t = rng.choice(choices)
        assert a.consume_token(t) and b.consume_token(t)
        stepped.append(a)
    return stepped


@pytest.mark.parametrize("mode", ["thread", "idle", "take"])
def test_masks_computed_ahead_equal_masks_computed_on_the_step(grammars, mode):
    """Rows walking a JSON schema token by token: the mask computed ahead (started when the row was
    fed, taken at its next step) is the one computed on the step, for every row and step; a finished
    row's pending mask is forgotten and nothing leaks. Ahead on the thread; without one, in the last
    rank's idle time after each pass (``idle``), or, where nothing called idle, at take (``take``)."""
    tok = local_tokenizer()
    vocab, eos = grammars.vocab_size, {tok.eos_token_id}
    spec = {"kind": "json", "value": {"type": "object", "properties": {"n": {"type": "integer"},
                                                                         "s": {"type": "string", "maxLength": 5}},
                                      "required": ["n", "s"]}}
    rng = random.Random(0)
    rows = [(grammars.matcher(spec), grammars.matcher(spec)) for _ in range(4)]  # (ahead, inline) twins
    ahead, width = MasksAhead(mode == "thread"), grammars.tok.vocab_size
    for m, _ in rows:
        ahead.start(m)
    ahead.flush(width)  # one batch, as the head sends a pass's rows
    for _ in range(40):
        if mode == "idle":
            ahead.idle()
        live = [(a, b) for a, b in rows if not b.is_stopped()]  # (a may be busy on the thread)
        if not live:
            break
        for a in masks_agree_then_step(ahead, live, rows, eos, width, vocab, rng):
            ahead.start(a)
        ahead.flush(width)
    for a, _ in rows:
        ahead.forget(a)
    if mode != "take":
        ahead.idle()
        assert not ahead.flushed
    assert not ahead._pending and (ahead.ahead_seconds > 0) == (mode != "take")


def test_idle_time_skips_forgotten_rows(grammars):
    """Without a thread, a row that finished between its pass and the idle time is not computed."""
    ahead, width = MasksAhead(on_thread=False), grammars.tok.vocab_size
    kept, gone = grammars.matcher(CHOICE), grammars.matcher(CHOICE)
    ahead.start(kept)
    ahead.start(gone)
    ahead.flush(width)
    batch = ahead.flushed[0]
    ahead.forget(gone)
    ahead.idle()
    assert batch.done.tolist() == [True, False] and not ahead.flushed
    got = ahead.take([kept], width)
    assert (got[0] == batch.words[0]).all() and got[0].any() and not ahead._pending


def test_masks_go_on_a_thread_only_where_a_core_is_free(monkeypatch):
    """A thread computes masks ahead on a GPU, and on a CPU only when torch's threads (times the
    processes on the host: stages or data groups) leave a core free: otherwise it would contend with
    the layers."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    cpu = torch.device("cpu")
    assert masks_on_thread(torch.device("cuda", 0), 1, 4) and masks_on_thread(torch.device("cuda", 1), 8, 4)
    assert not masks_on_thread(cpu, 1, 4) and masks_on_thread(cpu, 1, 5)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert masks_on_thread(cpu, 1, 4) and not masks_on_thread(cpu, 2, 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert masks_on_thread(cpu, 3, 4) and not masks_on_thread(cpu, 4, 4)  # P = 4 on 4 cores: none free


def test_a_batch_of_masks_equals_each_rows_own_mask(grammars):
    """MasksAhead computes a pass's masks as one batch (llguidance's executor, on the thread): each row's
    mask is the one its matcher computes alone, for several schemas, a regex and a choice at every
    step; a row that ended (its grammar stopped) is not started; a row taken before the flush (admitted
    in the same pass) and a forgotten row leave the batch right; nothing stays pending."""
    tok = local_tokenizer()
    vocab, eos, width = grammars.vocab_size, {tok.eos_token_id}, grammars.tok.vocab_size
    specs = [{"kind": "json", "value": {"type": "object", "properties": {"a": {"type": "integer", "maximum": 99}},
                                        "required": ["a"]}},
             {"kind": "json", "value": {"type": "array", "items": {"enum": ["x", "yz"]}, "maxItems": 2}},
             {"kind": "json_object"}, {"kind": "regex", "value": "[a-c]{1,4}"}, CHOICE]
    rng = random.Random(1)
    rows = [(grammars.matcher(s), grammars.matcher(s)) for s in specs * 2]  # (batched, alone) twins
    ahead = MasksAhead()
    for step in range(30):
        live = [(a, b) for a, b in rows if not b.is_stopped()]
        if not live:
            break
        for a, b in rows:
            ahead.start(a)  # an ended row is never started
        assert all(id(a) not in ahead._pending for a, b in rows if b.is_stopped())
        if step == 1:
            ahead.forget(live[-1][0])  # a row that finished before the flush: not computed
        if step != 2:  # at step 2 every row is taken before its flush (computed alone, on the step)
            ahead.flush(width)
        masks_agree_then_step(ahead, live, rows, eos, width, vocab, rng)
    ahead.flush(width)  # nothing queued is left behind a taken or forgotten row
    assert any(b.is_stopped() for _, b in rows) or len(rows) < 2 * len(specs)
    for a, _ in rows:
        ahead.forget(a)
    assert not ahead._pending and ahead.ahead_seconds > 0
