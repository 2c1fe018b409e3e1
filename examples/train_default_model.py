"""Train the embedded default model (``examples/tiny-llama-default/``) from scratch, on CPU.

    python examples/train_default_model.py [--out DIR] [--steps 1500] [--threads 2] ...

Deterministic: fixed seeds, ``torch.use_deterministic_algorithms``, a fixed thread count; the same
command with the same torch/tokenizers versions on the same CPU writes the same files (the held-out
checks every ``--eval-every`` steps draw no torch random numbers and do not change the rows).

What it does:

1. trains a byte-level BPE (vocab 1024; ``<s> </s> <pad>`` are ids 0, 1, 2; BOS prepended) on
   ``examples/corpus.txt`` plus synthetic text from ``examples/default_tasks.py`` (it must equal the
   shipped tokenizer, which tests and benchmarks use: checked);
2. trains ``LlamaForCausalLM`` (6 layers, hidden 128, 4 heads of 32, tied embeddings, 1.41M
   parameters) with AdamW, warmup + cosine, on rows of one task each (``MIX``): several blocks of it
   packed into a row (so later blocks are few-shot prompts), or story text. Loss: next-token cross
   entropy with weight 1 on answers, ``CTX_WEIGHT`` on prompts, ``STORY_WEIGHT`` on stories, **plus
   attention supervision** (below);
3. every ``--eval-every`` steps: greedy exact match on 100 held-out path and owner questions (seed 1,
   zero- and 3-shot) and a save; at the end every task, then ``save_pretrained`` (float32
   safetensors, 5.6 MB).

Attention supervision. The path question ("from a to b": the path is a -> m -> b, with distractor
rooms that hang off a, m or b) and "who has what" both need the model to look up a fact by a room
or name it read elsewhere. Trained on answers alone, models of this size sat for thousands of steps
at the level of guessing one fact of the passage (sessions 2-8, with curricula, multi-question rows,
bare recall rows, induction-head pretraining, other inits and optimizers; see this file's git
history before this version): the lookup has two halves (bring the question's room to the answer
position; put each fact's direction at its room's position) and the answer gives neither a gradient
until both exist. So a few heads get a target for *where to look*, at a few positions, and an extra
loss ``-log(sum of the head's attention on its target positions)`` (weight ``--attn-weight``); what
they read and write, every other head, position and layer, and the answers themselves are learned
from the answer loss as usual. The circuit (``CIRCUIT``; fact "The x is d of the y.", the question's
rooms a and b, ":" predicts d1, the d1 token predicts d2):

- layer 0, at each fact's y: head 0 looks at its x, head 1 at its d (the fact gathered at y);
  at ":" and d1: head 2 looks at a, head 3 at b (the question's rooms brought to the answer);
- layer 1, at ":": head 0 at the y of facts "_ is _ of b", head 1 at those of "b is _ of _"
  (b's neighbours); at d1: heads 2 and 3 the same for a;
- layer 2, at ":": head 0 at the fact "m is d1 of a" (the only fact about a whose other room is a
  neighbour of b); at d1: head 1 at "b is d2 of m".
- "who has what" ("Mia has a red ball. ... What does Mia have?\\nAnswer: a red ball"): layer 0
  head 0 at each colour and object looks at its owner, head 2 at the answer's "a" and colour looks
  at the asked name; layer 1 head 0 at the answer's "a" looks at the asked person's colour, head 1
  at the answer's colour at their object.
- copy and reverse ("Copy: cat sun owl -> cat sun owl"): layer 0 head 1 at each listed word looks
  at the word before it (and at "->" at the last word); layer 1 head 2, at "->" and at each copied
  word, looks at the next word to say; head 3, at each reversed word, at that word's place in the
  list (where head 1 put the word before it).
- sums ("Q: 12 + 7 ="): layer 0 heads 2 and 3 at "=" look at the two numbers.

The model stays a plain ``LlamaForCausalLM``: the targets only shape training, the runner and
transformers load and run it like any Llama.

Thinking (v5: v4 fine-tuned with ``--think --init``). Chat rows in the chat template's form
(``MIX_THINK``: ``chat_path``, ``chat_arith``, beside less of every task above): asked to think (the
template's ``<think>\n``), the answer restates the question in the completion task's form and answers it
there (the trace: ``Question: How do you go from the a to the b?\nAnswer: d1 d2``, ``Q: x + y = r``), then
``\n</think>\n\n`` and the answer again (`` d1 d2``, `` r``); not asked, it answers at once. The trace
reuses the circuits above (their links at the trace's own positions); ``copy_next`` also points the trace
at the question's rooms and numbers, and the answer at the trace's. ``<think>`` stays plain text (4 BPE
tokens), so the tokenizer and the vocabulary are v4's and tiny test models built on it are unchanged.

Measured (the shipped v4: ``--steps 1500``, 40 minutes on the project's 2-core CPU, 2 threads):
train-time held-out exact match, path zero-/3-shot and owner zero-/3-shot: step 250 60/72/20/19%,
500 84/89/88/93%, 750 93/94/99/99%, 1000 94/93/99/97%, 1250 99/96/100/100%, 1500 98/96/100/100%;
at the end sums 99/100%, copy 100/100%, reverse 100/100%. An earlier run without the copy, reverse
and sum targets and with fewer of those rows (path 0.45, owner 0.25, sums 0.1, copy and reverse
0.05 each) reached path 99/97% and owner 100% but sums 55/52%, copy 70/46%, reverse 46/38%.
Through the runner: see docs/usage/default-model.md.

v5 (``--init`` v4 ``--think --steps 400 --batch 16 --lr 1e-3 --warmup 20 --threads 1``: 14.5 minutes on the
project's 2-core CPU, one thread, beside other work): train-time held-out exact match of the whole chat
answer (trace, end of thinking, answer, end of text) 0.97 for path questions and 0.83 for sums, 1.00 and
0.93 when answering at once; path zero-/3-shot 1.00/0.97, sums 1.00/0.97, copy, reverse and owner 1.00.
(Two threads on the loaded machine ran 5x slower: their OpenMP barriers waited for descheduled threads.)
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples import default_tasks as dt  # noqa: E402
from pipeline.loading.default_model import (  # noqa: E402
    BOS, CORPUS_PATH, EOS, PAD, SHIPPED_DIR, THINK_END, make_tokenizer)

SEED = 0
VOCAB_SIZE = 1024
ROW_TOKENS = 256  # a row packs blocks of one task up to about this many tokens
LONG_ROW_TOKENS, LONG_EVERY = 512, 4  # every 4th step: half as many rows of up to 512 tokens, so
# that 5-shot path prompts (~400 tokens) are not past every position the model has seen
CTX_WEIGHT = 0.05  # loss weight of task prompt tokens (answers weigh 1)
STORY_WEIGHT = 0.2  # loss weight of story and corpus text: a whole row of it would outweigh answers
ATTN_WEIGHT = 1.0  # weight of the attention-supervision loss (per supervised query, averaged)
P_MORE = 0.6  # after each block a row goes on with another with this probability (room allowing)
# Share of rows per task; path questions are the headline demo and the hardest, so they get the most.
MIX = {"path": 0.35, "owner": 0.15, "arith": 0.2, "copy": 0.1, "reverse": 0.1, "story": 0.07,
       "corpus": 0.03}
# The thinking fine-tune (``--think``, v4 -> v5): the same tasks, less of each, plus chat rows in the
# chat template's form (``chat_path``, ``chat_arith``): a conversation of 1-2 turns whose last answer
# thinks (THINK_P of them: "<think>\n" trace "\n</think>\n\n" answer) or answers at once.
MIX_THINK = {"path": 0.2, "owner": 0.07, "arith": 0.11, "copy": 0.05, "reverse": 0.05, "story": 0.02,
             "corpus": 0.01, "chat_path": 0.2, "chat_arith": 0.29}
THINK_P = 0.75
# (layer, head) of each supervised role: see the module docstring
CIRCUIT = {"fact_x": (0, 0), "fact_d": (0, 1), "ask_a": (0, 2), "ask_b": (0, 3),
           "b_as_y": (1, 0), "b_as_x": (1, 1), "a_as_y": (1, 2), "a_as_x": (1, 3),
           "first": (2, 0), "second": (2, 1),
           "owner_of": (0, 0), "ask_name": (0, 2), "colour": (1, 0), "object": (1, 1),
           "prev_word": (0, 1), "copy_next": (1, 2), "reverse_from": (1, 3),
           "operand_x": (0, 2), "operand_y": (0, 3)}


def tokenizer_texts(rng: random.Random) -> list[str]:
    """Corpus lines plus enough synthetic text that every task word becomes one token."""
    texts = CORPUS_PATH.read_text(encoding="utf-8").splitlines()
    for task in dt.TASKS:
        texts += [b.prompt + b.answer for b in (dt.block(task, rng) for _ in range(3000))]
    texts += [dt.story(rng) for _ in range(2000)]
    return texts


def train_tokenizer(rng: random.Random):
    """Byte-level BPE with the special tokens first (ids 0, 1, 2), wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: no <unk> needed
        show_progress=False)
    tok.train_from_iterator(tokenizer_texts(rng), trainer)
    return make_tokenizer(tok)


@dataclass
class RowText:
    """A row's text as it is built, with the character offsets that the supervision names.

    ``links``: (role, query char offset, [target char offsets]); ``answers``: weighted char spans."""

    text: str = ""
    links: list[tuple[str, int, list[int]]] = field(default_factory=list)
    answers: list[tuple[int, int]] = field(default_factory=list)

    def add(self, s: str) -> int:
        """Append ``s``; returns where it starts (a word's token starts at its leading space)."""
        self.text += s
        return len(self.text) - len(s)


def add_path(row: RowText, rng: random.Random) -> None:
    """One path block in ``dt.path_block``'s form, with the circuit's links."""
    facts, a, m, b, d1, d2 = dt.path_facts(rng)
    row.add("Passage:")
    at = []  # (x, y, char of x, of d, of y) per fact
    for i, (x, d, y) in enumerate(facts):
        row.add(" The" if i == 0 else "The")
        cx = row.add(f" {x}")
        row.add(" is")
        cd = row.add(f" {d}")
        row.add(" of the")
        cy = row.add(f" {y}")
        row.add(".\n")
        at.append((x, y, cx, cd, cy))
    row.add("Question: How do you go from the")
    ca = row.add(f" {a}")
    row.add(" to the")
    cb = row.add(f" {b}")
    row.add("?\nAnswer")
    colon = row.add(":")
    c1 = row.add(f" {d1}")
    row.add(f" {d2}{dt.SEPARATOR['path']}")
    row.answers.append((c1, len(row.text)))
    path_links(row, at, (a, m, b), ca, cb, colon, c1)


def path_links(row: RowText, at: list, rooms: tuple[str, str, str], ca: int, cb: int, colon: int,
               c1: int) -> None:
    """The path circuit's links: ``at`` the facts' (x, y, char of x, of d, of y); ``ca``, ``cb`` the
    question's rooms; ``colon`` the position that says d1, ``c1`` the d1 token (which says d2)."""
    a, m, b = rooms
    for x, y, cx, cd, cy in at:
        row.links += [("fact_x", cy, [cx]), ("fact_d", cy, [cd])]
    for q in (colon, c1):
        row.links += [("ask_a", q, [ca]), ("ask_b", q, [cb])]

    def ys(keep) -> list[int]:
        return [cy for x, y, _, _, cy in at if keep(x, y)]

    row.links += [("b_as_y", colon, ys(lambda x, y: y == b)), ("b_as_x", colon, ys(lambda x, y: x == b)),
                  ("a_as_y", c1, ys(lambda x, y: y == a)), ("a_as_x", c1, ys(lambda x, y: x == a)),
                  ("first", colon, ys(lambda x, y: (x, y) == (m, a))),
                  ("second", c1, ys(lambda x, y: (x, y) == (b, m)))]


def add_chat_path(row: RowText, rng: random.Random, last: bool, think: bool) -> None:
    """One turn of a chat about a path question, as the chat template renders it: ``user: Passage:
    ... Question: How do you go from the a to the b?\nassistant:`` then, thinking, ``<think>\n``
    (the template's) + the question again with its ``Answer: d1 d2`` (the trace: the completion
    task's own form, so its circuit answers it) + ``\n</think>\n\n d1 d2``; else `` d1 d2`` at once
    (the circuit reads ":" of "assistant:" as it reads "Answer:"). An earlier turn is history:
    ``assistant: d1 d2\n``. Only the last turn's answer is weighed as one."""
    facts, a, m, b, d1, d2 = dt.path_facts(rng)
    row.add("user: Passage:")
    at = []
    for i, (x, d, y) in enumerate(facts):
        row.add(" The" if i == 0 else "The")
        cx, _, cd, _, cy = row.add(f" {x}"), row.add(" is"), row.add(f" {d}"), row.add(" of the"), row.add(f" {y}")
        row.add(".\n")
        at.append((x, y, cx, cd, cy))
    row.add("Question: How do you go from the")
    ua, _, ub = row.add(f" {a}"), row.add(" to the"), row.add(f" {b}")
    row.add("?\nassistant")
    if not last or not think:
        colon = row.add(":")
        c1 = row.add(f" {d1}")
        row.add(f" {d2}\n" if not last else f" {d2}")
        if last:
            row.answers.append((c1, len(row.text)))
        path_links(row, at, (a, m, b), ua, ub, colon, c1)
        return
    row.add(":<think>\n")
    start = row.add("Question: How do you go from")
    qa, ca, _, qb, cb = row.add(" the"), row.add(f" {a}"), row.add(" to"), row.add(" the"), row.add(f" {b}")
    row.add("?\nAnswer")
    colon = row.add(":")
    c1, c2 = row.add(f" {d1}"), row.add(f" {d2}")
    row.add(f"\n{THINK_END}\n")
    q1 = row.add("\n")
    f1 = row.add(f" {d1}")
    row.add(f" {d2}")
    row.answers.append((start, len(row.text)))
    path_links(row, at, (a, m, b), ca, cb, colon, c1)
    # the trace copies the question's rooms, the answer copies the trace's directions
    row.links += [("copy_next", qa, [ua]), ("copy_next", qb, [ub]), ("copy_next", q1, [c1]), ("copy_next", f1, [c2])]


def add_chat_arith(row: RowText, rng: random.Random, last: bool, think: bool) -> None:
    """One turn of a chat about a sum: ``user: What is x + y?\nassistant:`` then, thinking,
    ``<think>\nQ: x + y = r\n</think>\n\n r`` (the trace in the completion task's form), else `` r``."""
    x, op, y = dt.arith_operands(rng)
    r = x + y if op == "+" else x - y
    row.add("user: What is")
    ux, uop, uy = row.add(f" {x}"), row.add(f" {op}"), row.add(f" {y}")
    row.add("?\nassistant")
    if not last or not think:
        eq = row.add(":")
        start = row.add(f" {r}")
        row.add("\n" if not last else "")
        if last:
            row.answers.append((start, len(row.text)))
        row.links += [("operand_x", eq, [ux]), ("operand_y", eq, [uy])]
        return
    row.add(":<think>\n")
    start = row.add("Q")
    qx = row.add(":")
    cx, cop, cy, eq = row.add(f" {x}"), row.add(f" {op}"), row.add(f" {y}"), row.add(" =")
    cr = row.add(f" {r}")
    row.add(f"\n{THINK_END}\n")
    q1 = row.add("\n")
    row.add(f" {r}")
    row.answers.append((start, len(row.text)))
    row.links += [("operand_x", eq, [cx]), ("operand_y", eq, [cy])]
    # the trace copies the question's numbers, the answer copies the trace's result
    row.links += [("copy_next", qx, [ux]), ("copy_next", cx, [uop]), ("copy_next", cop, [uy]), ("copy_next", q1, [cr])]


def add_chat(row: RowText, rng: random.Random, task: str) -> None:
    """A conversation of 1-2 turns of ``task`` (chat_path, chat_arith); the last one thinks with
    probability THINK_P."""
    turns = 1 if rng.random() < 0.6 else 2
    think = rng.random() < THINK_P
    for t in range(turns):
        (add_chat_path if task == "chat_path" else add_chat_arith)(row, rng, t == turns - 1, think)


def add_owner(row: RowText, rng: random.Random) -> None:
    """One "who has what" block in ``dt.owner_block``'s form, with the circuit's links."""
    names, colors, objects, ask = dt.owner_facts(rng)
    row.add("Passage:")
    at = []
    for n, c, o in zip(names, colors, objects):
        cn = row.add(f" {n}")
        row.add(" has a")
        cc, co = row.add(f" {c}"), row.add(f" {o}")
        row.add(".")
        at.append((cn, cc, co))
        row.links += [("owner_of", cc, [cn]), ("owner_of", co, [cn])]
    row.add("\nQuestion: What does")
    cq = row.add(f" {names[ask]}")
    row.add(" have?\nAnswer:")
    ca = row.add(" a")
    cc = row.add(f" {colors[ask]}")
    row.add(f" {objects[ask]}{dt.SEPARATOR['owner']}")
    row.answers.append((ca, len(row.text)))
    row.links += [("ask_name", ca, [cq]), ("ask_name", cc, [cq]),
                  ("colour", ca, [at[ask][1]]), ("object", cc, [at[ask][2]])]


def add_list(row: RowText, rng: random.Random, kind: str) -> None:
    """One copy/reverse block in ``dt.list_block``'s form, with the circuit's links."""
    items = dt.list_items(rng)
    row.add(f"{kind.capitalize()}:")
    at = [row.add(f" {w}") for w in items]
    arrow = row.add(" ->")
    out = items if kind == "copy" else items[::-1]
    said = [row.add(f" {w}") for w in out]
    row.add(dt.SEPARATOR[kind])
    row.answers.append((said[0], len(row.text)))
    row.links += [("prev_word", at[j], [at[j - 1]]) for j in range(1, len(at))]
    if kind == "copy":  # the next item sits right after the current one's place in the prompt
        row.links += [("copy_next", q, [at[j]]) for j, q in enumerate([arrow] + said[:-1])]
    else:  # the first is the arrow's previous word; each next one is the word before the current
        # one's place in the prompt (the head finds that place, prev_word put the word there)
        row.links += [("prev_word", arrow, [at[-1]])]
        row.links += [("reverse_from", said[k], [at[len(at) - 1 - k]]) for k in range(len(at) - 1)]


def add_arith(row: RowText, rng: random.Random) -> None:
    """One sum or difference in ``dt.arith_block``'s form; the operands are brought to "="."""
    x, op, y = dt.arith_operands(rng)
    row.add("Q:")
    cx = row.add(f" {x}")
    row.add(f" {op}")
    cy = row.add(f" {y}")
    eq = row.add(" =")
    start = row.add(f" {x + y if op == '+' else x - y}{dt.SEPARATOR['arith']}")
    row.answers.append((start, len(row.text)))
    row.links += [("operand_x", eq, [cx]), ("operand_y", eq, [cy])]


def add_block(row: RowText, rng: random.Random, task: str) -> None:
    if task == "path":
        add_path(row, rng)
    elif task == "owner":
        add_owner(row, rng)
    elif task in ("copy", "reverse"):
        add_list(row, rng, task)
    elif task == "arith":
        add_arith(row, rng)
    else:
        raise ValueError(f"unknown task {task!r}")


Row = tuple[list[int], list[float], list[tuple[str, int, list[int]]]]


class Rows:
    """Endless training rows from one seeded RNG: (token ids, weight of predicting each next token,
    attention links as token positions)."""

    def __init__(self, tokenizer, seed: int, mix: dict[str, float] | None = None) -> None:
        self.tok, self.rng = tokenizer, random.Random(seed)
        self.mix = mix or MIX
        self.corpus = CORPUS_PATH.read_text(encoding="utf-8").split("\n\n")
        self.step = 0

    def story_row(self, task: str, max_tokens: int) -> Row:
        ids = [self.tok.bos_token_id]
        while len(ids) < max_tokens:
            text = dt.story(self.rng) if task == "story" else self.rng.choice(self.corpus)
            ids += self.tok(text + "\n\n", add_special_tokens=False)["input_ids"]
        ids = ids[:max_tokens]
        return ids, [STORY_WEIGHT] * (len(ids) - 1), []

    def row(self, max_tokens: int) -> Row:
        """``ids[0]`` is ``<s>``; ``weights[i]`` weighs predicting ``ids[i + 1]``. Blocks are added
        while the text stays under ~4 characters a token of ``max_tokens``; the row is tokenized
        whole, as the runner tokenizes a prompt."""
        task = self.rng.choices(list(self.mix), list(self.mix.values()))[0]
        if task in ("story", "corpus"):
            return self.story_row(task, max_tokens)
        row = RowText()
        if task.startswith("chat_"):
            add_chat(row, self.rng, task)
        while not task.startswith("chat_"):
            before = (row.text, list(row.links), list(row.answers))
            add_block(row, self.rng, task)
            if len(row.text) > 4 * max_tokens and before[0]:
                row.text, row.links, row.answers = before
                break
            if self.rng.random() >= P_MORE:
                break
        enc = self.tok(row.text, add_special_tokens=False, return_offsets_mapping=True)
        spans = enc["offset_mapping"]
        ids = [self.tok.bos_token_id] + enc["input_ids"] + [self.tok.eos_token_id]
        token_at = {s: i + 1 for i, (s, _) in enumerate(spans)}  # char offset -> position in ids
        weights = [CTX_WEIGHT] * (len(ids) - 1)
        for s, e in row.answers:
            for i, (ts, te) in enumerate(spans):
                if s <= ts and te <= e:
                    weights[i] = 1.0  # predicting enc token i = ids[i + 1]
        if task.startswith("chat_"):  # a chat answer ends: the end of the text weighs as the answer
            weights[-1] = 1.0
        links = [(role, token_at[q], [token_at[k] for k in ks]) for role, q, ks in row.links if ks]
        return ids, weights, links

    def batch(self, size: int):
        """(inputs, targets, weights, links); links: {(layer, head): (rows, query positions,
        target mask (n, T))}. Padding is on the right and has weight 0."""
        long = self.step % LONG_EVERY == LONG_EVERY - 1
        self.step += 1
        rows = [self.row(LONG_ROW_TOKENS if long else ROW_TOKENS) for _ in range(size // 2 if long else size)]
        t = max(len(ids) for ids, _, _ in rows) - 1
        x = torch.full((len(rows), t), self.tok.pad_token_id, dtype=torch.long)
        y, w = x.clone(), torch.zeros(len(rows), t)
        by_head: dict[tuple[int, int], list[tuple[int, int, list[int]]]] = {}
        for r, (ids, wt, links) in enumerate(rows):
            n = len(ids) - 1
            x[r, :n], y[r, :n], w[r, :n] = torch.tensor(ids[:-1]), torch.tensor(ids[1:]), torch.tensor(wt)
            for role, q, ks in links:  # x[r, p] = ids[p]: a position in ids is one in x
                by_head.setdefault(CIRCUIT[role], []).append((r, q, ks))
        links = {}
        for head, items in by_head.items():
            mask = torch.zeros(len(items), t)
            for j, (_, _, ks) in enumerate(items):
                mask[j, ks] = 1.0
            links[head] = (torch.tensor([i[0] for i in items]), torch.tensor([i[1] for i in items]), mask)
        return x, y, w, links


def attention_loss(attentions, links) -> torch.Tensor:
    """Mean over supervised queries of ``-log(attention mass on the query's targets)``."""
    total, n = torch.zeros(()), 0
    for (layer, head), (rows, queries, mask) in links.items():
        probs = attentions[layer][rows, head, queries]  # (n, T)
        total = total - torch.log((probs * mask).sum(-1) + 1e-6).sum()
        n += len(rows)
    return total / max(n, 1)


def build_model(tokenizer, layers: int = 6, hidden: int = 128):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=hidden // 32, num_key_value_heads=4,  # full MHA: GQA would save only 16k params a layer
        max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6,
        initializer_range=0.1,  # 0.02 (HF's default) leaves a tiny model on a long plateau: it
        # took >1000 steps to start copying from context; 0.1 starts within 200 (measured)
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, dtype="float32")
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    model.generation_config.do_sample = False
    return model


@torch.no_grad()
def exact_match(model, tokenizer, task: str, n: int, seed: int, shots: int) -> float:
    """Greedy exact match of ``n`` held-out questions (teacher forcing gives the same verdict)."""
    rng = random.Random(seed)
    model.eval()
    hits = 0
    for _ in range(n):
        prompt, b = dt.few_shot(task, rng, shots)
        p = tokenizer(prompt)["input_ids"]
        a = tokenizer(b.answer, add_special_tokens=False)["input_ids"]
        logits = model(input_ids=torch.tensor([p + a])).logits[0, len(p) - 1: -1]
        hits += bool((logits.argmax(-1) == torch.tensor(a)).all())
    model.train()
    return hits / n



def accuracies(model, tokenizer, n: int = 100, tasks=dt.TASKS) -> dict[str, float]:
    return {f"{task}/{shots}-shot": exact_match(model, tokenizer, task, n, 1, shots)
            for task in tasks for shots in (0, 3)}


@torch.no_grad()
def chat_match(model, tokenizer, task: str, n: int, seed: int, think: bool) -> float:
    """Greedy exact match of ``n`` one-turn chats of ``task`` (chat_path, chat_arith), the whole
    answer (trace, end of thinking, answer, end of text) by teacher forcing."""
    rng = random.Random(seed)
    model.eval()
    hits = 0
    for _ in range(n):
        row = RowText()
        (add_chat_path if task == "chat_path" else add_chat_arith)(row, rng, True, think)
        cut = row.answers[-1][0] if not think else row.text.index("<think>\n") + len("<think>\n")
        p = tokenizer(row.text[:cut])["input_ids"]
        a = tokenizer(row.text[cut:], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        logits = model(input_ids=torch.tensor([p + a])).logits[0, len(p) - 1: -1]
        hits += bool((logits.argmax(-1) == torch.tensor(a)).all())
    model.train()
    return hits / n


def chat_accuracies(model, tokenizer, n: int = 100) -> dict[str, float]:
    return {f"{task}/{'think' if think else 'direct'}": chat_match(model, tokenizer, task, n, 1, think)
            for task in ("chat_path", "chat_arith") for think in (True, False)}


def report(acc: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in acc.items())


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, rows: Rows, steps: int, batch: int, peak_lr: float, attn_weight: float,
          log_every: int, eval_every: int = 0, save=None, warmup: int = 100, stop_after: int = 0) -> int:
    """AdamW on weighted next-token cross entropy plus ``attn_weight`` x the attention loss; logs
    both and tokens/s to stderr. Every ``eval_every`` steps: held-out path/owner exact match and
    ``save()``. Returns the number of steps run."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=peak_lr, betas=(0.9, 0.98), eps=1e-8)
    model.train()
    t0, seen = time.perf_counter(), 0
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, peak_lr, warmup=min(warmup, steps // 10))
        x, y, w, links = rows.batch(batch)
        out = model(input_ids=x, output_attentions=True)
        nll = F.cross_entropy(out.logits.flatten(0, 1), y.flatten(), reduction="none")
        answer = (nll * w.flatten()).sum() / w.sum()
        attn = attention_loss(out.attentions, links)
        loss = answer + attn_weight * attn
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        seen += x.numel()
        if step % log_every == 0 or step == steps - 1:
            el = time.perf_counter() - t0
            print(f"step {step:5d}  loss {answer.item():.4f}  attention {attn.item():.4f}  "
                  f"lr {opt.param_groups[0]['lr']:.2e}  {seen / el:.0f} tok/s  {el / 60:.1f} min",
                  file=sys.stderr, flush=True)
        if eval_every and step % eval_every == eval_every - 1:
            acc = accuracies(model, rows.tok, 100, ("path", "owner"))
            if "chat_path" in rows.mix:
                acc.update(chat_accuracies(model, rows.tok, 50))
            print(f"  held-out at step {step + 1}: {report(acc)}", file=sys.stderr, flush=True)
            if save is not None:
                save()
        if stop_after and step + 1 >= stop_after:
            return step + 1
    return steps


def main(argv: list[str] | None = None) -> None:
    """CLI: train the tokenizer and the model, report held-out accuracy, save to ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(SHIPPED_DIR), help="folder to save_pretrained into")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=32, help=f"rows of up to ~{ROW_TOKENS} tokens per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100, help="steps of linear lr warmup")
    ap.add_argument("--attn-weight", type=float, default=ATTN_WEIGHT,
                    help="weight of the attention-supervision loss (0: answers only)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the result depends on it)")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--init", help="start from this saved model instead of random weights")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--eval-every", type=int, default=200,
                    help="held-out path/owner accuracy (and a save) every N steps")
    ap.add_argument("--stop-after", type=int, default=0, help="stop after N steps (0: --steps)")
    ap.add_argument("--eval-n", type=int, default=100, help="held-out questions per task and shot count")
    ap.add_argument("--think", action="store_true",
                    help="the thinking fine-tune's mix (MIX_THINK: chat rows that think), with --init")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)
    t0 = time.perf_counter()
    tokenizer = train_tokenizer(random.Random(SEED))
    print(f"tokenizer: {len(tokenizer)} tokens ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    from transformers import AutoTokenizer

    for ref in [SHIPPED_DIR] + ([args.init] if args.init else []):
        if (Path(ref) / "tokenizer.json").is_file():  # tests and README figures depend on it
            assert AutoTokenizer.from_pretrained(ref).get_vocab() == tokenizer.get_vocab(), \
                f"the trained tokenizer differs from the one in {ref}"
    if args.init:  # continue from a saved model (same tokenizer: checked)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32)
    else:
        model = build_model(tokenizer, args.layers, args.hidden)
    model.config._attn_implementation = "eager"  # returns the attention weights the loss needs
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", file=sys.stderr)

    def save() -> None:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(out)
        model.save_pretrained(out, safe_serialization=True)

    rows = Rows(tokenizer, SEED + 1 + (100 if args.think else 0), MIX_THINK if args.think else MIX)
    done = train(model, rows, args.steps, args.batch, args.lr, args.attn_weight, args.log_every,
                 args.eval_every, save, args.warmup, args.stop_after)
    print(f"trained {done} steps in {(time.perf_counter() - t0) / 60:.1f} min", file=sys.stderr)
    model.eval()
    if args.eval_n:
        acc = accuracies(model, tokenizer, args.eval_n)
        if args.think:
            acc.update(chat_accuracies(model, tokenizer, args.eval_n))
        print("held-out greedy exact match: " + report(acc), file=sys.stderr)
    save()
    print(f"saved to {args.out} ({(time.perf_counter() - t0) / 60:.1f} min in all)", file=sys.stderr)


if __name__ == "__main__":
    main()
