"""Which input lines each of D data-parallel pipelines answers.

Lines go in runs of ``CHUNK`` consecutive lines, dealt round-robin: line ``i`` belongs to share
``(i // CHUNK) % D``. Runs keep neighbouring requests together (a multiple-choice context's
continuations, a batch of questions after one few-shot prefix), so one pipeline's prefix cache
serves them instead of every pipeline computing the prefix; dealing runs keeps the loads even on
files of more than a few runs. With D = 1 every line is share 0's, in order.
"""

from __future__ import annotations

CHUNK = 64


def share_of(index: int, shares: int) -> int:
    """The share that answers input line ``index``."""
    return (index // CHUNK) % shares


def index_of(share: int, k: int, shares: int) -> int:
    """Input index of share ``share``'s k-th line."""
    return ((k // CHUNK) * shares + share) * CHUNK + k % CHUNK


def position_of(index: int, shares: int) -> int:
    """Where input line ``index`` comes among its share's lines (the inverse of :func:`index_of`)."""
    return (index // (CHUNK * shares)) * CHUNK + index % CHUNK


def share_size(share: int, total: int, shares: int) -> int:
    """How many of ``total`` lines share ``share`` answers."""
    rounds, rest = divmod(total, CHUNK * shares)
    return rounds * CHUNK + min(CHUNK, max(0, rest - share * CHUNK))
