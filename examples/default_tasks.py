"""Synthetic tasks the embedded default model is trained on, and checked with.

Every task is a *block*: a prompt and the answer a reader can check. Blocks of one task joined by a
separator form a few-shot prompt (the solved ones first, the question last), exactly as users send
them. Pure Python, seeded by ``random.Random``: the training script draws blocks with seed 0, the
tests and ``examples/check_default_model.py`` draw held-out blocks with other seeds.

- ``path``: bAbI-style (task 19) "how do you go from A to B": consistent room facts on a grid, the
  answer is two compass directions. The form of ``/work/shared/data/babi_fewshot.jsonl``.
- ``arith``: "Q: 12 + 7 =" -> " 19" (operands 0..20; subtraction never goes below zero).
- ``copy`` / ``reverse``: "Reverse: cat red sun ->" -> " sun red cat".
- ``owner``: "Mia has a red ball. ... Question: What does Sam have?\\nAnswer:" -> " a green box";
  also the multiple-choice (echo-scored) task: the candidates are every object in the passage.
- ``story``: templated "Once upon a time ..." sentences (plain text, no answer).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

ROOMS = ["office", "hallway", "bathroom", "bedroom", "garden", "kitchen", "cellar", "library", "attic"]
DIRS = {"north": (0, 1), "south": (0, -1), "east": (1, 0), "west": (-1, 0)}
OPPOSITE = {"north": "south", "south": "north", "east": "west", "west": "east"}
WORDS = ["cat", "dog", "owl", "fox", "sun", "moon", "red", "blue", "tree", "fish", "star", "cup", "hat",
         "bird", "rain", "rock"]
NAMES = ["Mia", "Sam", "Leo", "Ana", "Tom", "Zoe", "Ben", "Ivy", "Max", "Eva", "Jon", "Lily"]
COLORS = ["red", "blue", "green", "yellow", "black", "white", "pink", "brown"]
OBJECTS = ["ball", "box", "cup", "kite", "hat", "book", "bag", "coin", "drum", "lamp"]
ANIMALS = ["cat", "dog", "fox", "rabbit", "bear", "mouse", "duck", "owl", "frog", "lion"]
PLACES = ["forest", "village", "small house", "big garden", "farm", "castle", "meadow", "town"]
FEELINGS = ["happy", "sad", "brave", "sleepy", "curious", "kind", "shy", "hungry"]
FINDS = ["a shiny stone", "an old map", "a red apple", "a little key", "a lost bird", "a golden coin",
         "a magic hat", "a tiny boat"]
FRIENDS = ["a wise owl", "a little bird", "an old turtle", "a friendly dog", "a small mouse",
           "a kind bear"]

TASKS = ("path", "arith", "copy", "reverse", "owner")
SEPARATOR = {"path": "\n\n", "owner": "\n\n", "arith": "\n", "copy": "\n", "reverse": "\n"}


@dataclass(frozen=True)
class Block:
    """One solved example: ``prompt + answer`` is its text; ``choices`` only for ``owner``."""

    prompt: str
    answer: str
    choices: tuple[str, ...] = ()


def path_facts(rng: random.Random, min_facts: int = 2, max_facts: int = 4):
    """Rooms on a grid, a two-step path from ``a`` over ``m`` to ``b`` plus distractor rooms:
    ``(facts, a, m, b, d1, d2)``, each fact ``(x, d, y)`` = "The x is d of the y.".

    Path facts read "m is d1 of a", "b is d2 of m"; distractors hang off any placed room, stated
    either way round. Positions are unique, so the passage is consistent and the answer unique.
    """
    n_facts = rng.randint(min_facts, max_facts)
    rooms = rng.sample(ROOMS, n_facts + 1)
    a, m, b = rooms[:3]
    d1 = rng.choice(list(DIRS))
    d2 = rng.choice([d for d in DIRS if d != OPPOSITE[d1]])  # b never lands back on a
    pos = {a: (0, 0)}
    pos[m] = _step(pos[a], d1)
    pos[b] = _step(pos[m], d2)
    facts = [(m, d1, a), (b, d2, m)]
    for new in rooms[3:]:
        while True:  # some placed room always has a free side, the grid is unbounded
            old, d = rng.choice(sorted(pos)), rng.choice(list(DIRS))
            spot = _step(pos[old], d)
            if spot not in pos.values():
                break
        pos[new] = spot
        facts.append((new, d, old) if rng.random() < 0.5 else (old, OPPOSITE[d], new))
    rng.shuffle(facts)
    return facts, a, m, b, d1, d2


def path_block(rng: random.Random, min_facts: int = 2, max_facts: int = 4) -> Block:
    """A path question (:func:`path_facts`): "How do you go from a to b?" -> " d1 d2"."""
    facts, a, _, b, d1, d2 = path_facts(rng, min_facts, max_facts)
    lines = "".join(f"The {x} is {d} of the {y}.\n" for x, d, y in facts)
    prompt = f"Passage: {lines}Question: How do you go from the {a} to the {b}?\nAnswer:"
    return Block(prompt, f" {d1} {d2}")


def _step(p: tuple[int, int], d: str) -> tuple[int, int]:
    return p[0] + DIRS[d][0], p[1] + DIRS[d][1]


def arith_operands(rng: random.Random) -> tuple[int, str, int]:
    """``(x, op, y)`` of a sum or difference of numbers up to 20 (a difference never below zero)."""
    x, y = rng.randint(0, 20), rng.randint(0, 20)
    if rng.random() < 0.6:
        return x, "+", y
    return max(x, y), "-", min(x, y)


def arith_block(rng: random.Random) -> Block:
    x, op, y = arith_operands(rng)
    return Block(f"Q: {x} {op} {y} =", f" {x + y if op == '+' else x - y}")


def chat_question(task: str, rng: random.Random) -> tuple[str, str]:
    """A path question (``task`` "path") or a sum ("arith") as a user would ask it in a chat, and the
    expected answer: what the default model thinks about when asked to (its thinking tasks)."""
    if task == "path":
        facts, a, _, b, d1, d2 = path_facts(rng)
        lines = "".join(f"The {x} is {d} of the {y}.\n" for x, d, y in facts)
        return f"Passage: {lines}Question: How do you go from the {a} to the {b}?", f"{d1} {d2}"
    x, op, y = arith_operands(rng)
    return f"What is {x} {op} {y}?", str(x + y if op == "+" else x - y)


def list_items(rng: random.Random) -> list[str]:
    """The 2-5 distinct words of a copy or reverse block."""
    return rng.sample(WORDS, rng.randint(2, 5))


def list_block(rng: random.Random, kind: str) -> Block:
    items = list_items(rng)
    out = items if kind == "copy" else items[::-1]
    return Block(f"{kind.capitalize()}: {' '.join(items)} ->", " " + " ".join(out))


def owner_facts(rng: random.Random) -> tuple[list[str], list[str], list[str], int]:
    """``(names, colors, objects, ask)``: 2-4 people, each with a coloured object (the objects
    distinct, so every candidate answer is a different string), and the index of the one asked."""
    k = rng.randint(2, 4)
    names = rng.sample(NAMES, k)
    colors = [rng.choice(COLORS) for _ in range(k)]
    objects = rng.sample(OBJECTS, k)
    return names, colors, objects, rng.randrange(k)


def owner_block(rng: random.Random) -> Block:
    """Who has what; the question names one person, the candidates are every object in the passage."""
    names, colors, objects, ask = owner_facts(rng)
    things = [f" a {c} {o}" for c, o in zip(colors, objects)]
    passage = " ".join(f"{n} has{t}." for n, t in zip(names, things))
    prompt = f"Passage: {passage}\nQuestion: What does {names[ask]} have?\nAnswer:"
    return Block(prompt, things[ask], tuple(things))


def block(task: str, rng: random.Random) -> Block:
    """One block of ``task`` (one of ``TASKS``)."""
    if task == "path":
        return path_block(rng)
    if task == "arith":
        return arith_block(rng)
    if task in ("copy", "reverse"):
        return list_block(rng, task)
    if task == "owner":
        return owner_block(rng)
    raise ValueError(f"unknown task {task!r}")


def few_shot(task: str, rng: random.Random, shots: int) -> tuple[str, Block]:
    """``shots`` solved blocks then the question; returns (prompt, the question's block)."""
    solved = [block(task, rng) for _ in range(shots)]
    last = block(task, rng)
    sep = SEPARATOR[task]
    return "".join(b.prompt + b.answer + sep for b in solved) + last.prompt, last


def story(rng: random.Random) -> str:
    """A few templated sentences that start "Once upon a time" (or continue a story)."""
    name, animal = rng.choice(NAMES), rng.choice(ANIMALS)
    place, feel = rng.choice(PLACES), rng.choice(FEELINGS)
    find, friend = rng.choice(FINDS), rng.choice(FRIENDS)
    parts = [
        f"Once upon a time there was a {feel} little {animal} named {name}.",
        f"{name} lived in a {place} with {friend}.",
        f"Every morning {name} went for a walk and looked at the sky.",
        f"One day {name} found {find} under a big tree.",
        f"{name} showed it to {friend}, and they laughed together.",
        f"From that day on, {name} was never {rng.choice(['lonely', 'sad', 'afraid'])} again.",
        "The end.",
    ]
    keep = [parts[0]] + [p for p in parts[1:-1] if rng.random() < 0.75] + parts[-1:]
    return " ".join(keep)
