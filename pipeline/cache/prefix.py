"""Shared-prefix KV cache: a prompt prefix computed once serves every later request that starts with it.

Prompts are cut into blocks of ``block_size`` tokens, block ``b`` named by a digest chained over blocks
``0..b``. :class:`PrefixCache`, on rank 0, keeps the books (resident digests, their pool blocks, least
recently used first) and plans each prefill's loads and saves; :class:`PrefixStore` is every stage's pool
(keys and values; on the last stage also hidden states and echo scores), filled and read as the pass
headers say. Copy, not paging: a row copies its hit blocks when it enters and never reads the pool
again, so rank 0 may reuse a block id in any later pass (docs/design/prefix-cache.md). The pool grows in
steps announced in ``PassHeader.prefix_grow``, at most half of ``--budget``, and never shrinks (it may be
dropped whole).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from itertools import takewhile

import torch

from pipeline.cache.kv_cache import zeroed

MAX_SHARE = 2  # the pool takes at most budget / MAX_SHARE cells
RECENT = 4096  # digests of recently admitted prompts remembered as evidence of sharing


def block_digests(ids: list[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """Chained digest of each full block of ``ids``. ``salt`` starts the chain: a LoRA adapter's name,
    since its rows' keys and values differ from the base model's for the same tokens."""
    raw = array("l", ids).tobytes()  # one fixed-width integer per token
    step = block_size * array("l").itemsize
    out, prev = [], salt
    for b in range(len(ids) // block_size):
        prev = hashlib.blake2b(prev + raw[b * step : (b + 1) * step], digest_size=16).digest()
        out.append(prev)
    return out


class PrefixCache:
    """Rank 0's view of the pools: digest -> block id, LRU order, and the pool's capacity."""

    def __init__(self, block_size: int, budget: int):
        self.block_size = block_size
        self.max_blocks = budget // MAX_SHARE // block_size
        self.blocks: OrderedDict[bytes, int] = OrderedDict()  # resident, least recently used first
        self.free: list[int] = []  # ids below capacity not holding a block
        self.capacity = 0  # blocks allocated on every stage
        self.pending: Counter[bytes] = Counter()  # digests of queued (not yet admitted) prompts
        self.recent: OrderedDict[bytes, None] = OrderedDict()  # digests of admitted prompts
        self.grow_to: int | None = None  # a capacity to announce in the next header
        self.hit_tokens = 0
        self.prompt_tokens = 0

    @property
    def cells(self) -> int:
        """KV cells the pools hold on each stage (counted against --budget)."""
        return self.capacity * self.block_size

    def queued(self, digests: list[bytes]) -> None:
        self.pending.update(digests)

    def unqueued(self, digests: list[bytes]) -> None:
        """A queued prompt leaves without being admitted (serve mode: its client left)."""
        self.pending.subtract(digests)
        for d in digests:
            if self.pending[d] <= 0:
                del self.pending[d]

    def hits(self, digests) -> int:
        """Leading blocks of a prompt that are resident now."""
        return sum(1 for _ in takewhile(self.blocks.__contains__, digests))

    def reset(self) -> None:
        """Drop every block and the pools themselves (announced as a capacity of 0)."""
        self.blocks.clear()
        self.free, self.capacity, self.grow_to = [], 0, 0

    def plan(self, prompt_len: int, digests: list[bytes], room: int, pinned: set[int],
             saving: set[int] | None = None, chunk: int = 0) -> tuple[int, list[int], list[list[int]], int]:
        """For a group entering now (a prompt of ``prompt_len`` tokens): (cached tokens, block ids to load,
        [block index, block id] to save, how many leading blocks are worth keeping: another prompt showed them).

        The last prompt token is always computed (its hidden state samples the first token). ``room``:
        budget cells free for the pool to grow into; ``pinned`` (updated): block ids the pass being built
        loads or writes, not to be reused within it; ``saving`` (updated): those it writes, which its own
        groups cannot load yet (stages load before the prefill and write after it); ``chunk``: the pass
        computes only this many tokens after the cached ones, later blocks are saved by the passes that
        compute them (:meth:`plan_chunk`). A block already registered is not saved twice.
        """
        saving = set() if saving is None else saving
        self._room = room  # what growing may still take, during this call
        self.unqueued(digests)  # admitted now
        hits = []
        for d in digests:
            if d not in self.blocks or self.blocks[d] in saving:
                break  # not resident, or written by this very pass (after its loads)
            self.blocks.move_to_end(d)
            hits.append(self.blocks[d])
        pinned.update(hits)
        cached = min(len(hits) * self.block_size, prompt_len - 1)
        saves, shared = [], len(hits)
        end = cached + chunk if chunk else prompt_len
        for b in range(len(hits), len(digests)):
            d = digests[b]
            if not (self.pending[d] > 0 or d in self.recent):
                break  # nobody else has shown this block (nor, by the chain, any later one)
            if (b + 1) * self.block_size > end:
                shared = b + 1  # a later chunk computes it
                continue
            if not self._keep(b, d, pinned, saving, saves):
                break
            shared = b + 1
        for d in digests:
            self.recent[d] = None
            self.recent.move_to_end(d)
        while len(self.recent) > RECENT:
            self.recent.popitem(last=False)
        self.hit_tokens += cached
        self.prompt_tokens += prompt_len
        return cached, hits, saves, shared

    def plan_chunk(self, digests: list[bytes], start: int, end: int, shared: int, room: int, pinned: set[int],
                   saving: set[int]) -> list[list[int]]:
        """A later pass of a chunked prompt computes tokens ``start..end-1``: [block index, block id] to save
        for each shared block it completes (one of the prompt's first ``shared`` blocks, or one a prompt
        queued since shows; chunk ends need not be block ends). ``room``, ``pinned``, ``saving``: as for
        :meth:`plan`."""
        self._room = room
        saves = []
        for b in range(start // self.block_size, min(len(digests), end // self.block_size)):
            d = digests[b]
            if b >= shared and self.pending[d] <= 0:
                break  # nobody else shows this block (nor, by the chain, any later one)
            if not self._keep(b, d, pinned, saving, saves):
                break
        return saves

    def _keep(self, b: int, d: bytes, pinned: set[int], saving: set[int], saves: list[list[int]]) -> bool:
        """Register block ``b`` of a prompt (digest ``d``) in a pool block the pass being built writes;
        False when the pool has no block to give. A registered block stays where it is (same digest,
        same keys and values): re-registering it would lose its pool block."""
        if d in self.blocks:
            self.blocks.move_to_end(d)
            return True
        bid = self._allocate(pinned)
        if bid is None:
            return False
        self.blocks[d] = bid
        pinned.add(bid)
        saving.add(bid)
        saves.append([b, bid])
        return True

    def _allocate(self, pinned: set[int]) -> int | None:
        if self.free:
            return self.free.pop()
        if self.capacity < self.max_blocks and self._room >= self.block_size:
            step = min(self.max_blocks - self.capacity, max(16, self.capacity // 2), self._room // self.block_size)
            self._room -= step * self.block_size
            self.free = list(range(self.capacity + step - 1, self.capacity - 1, -1))
            self.capacity += step
            self.grow_to = self.capacity
            return self.free.pop()
        for d, bid in self.blocks.items():  # the least recently used block no queued prompt still needs
            if bid not in pinned and self.pending.get(d, 0) <= 0:
                del self.blocks[d]
                return bid
        return None  # every block is wanted: keep them rather than this one

    def take_grow(self) -> int | None:
        grow, self.grow_to = self.grow_to, None
        return grow


class PrefixStore:
    """One stage's pool: keys/values (layers, kv_heads, blocks x block, head_dim), block ``i`` at
    positions ``i*block .. (i+1)*block - 1``, so a run of consecutive blocks (a prefix saved in one
    go) copies in one slice; the last stage also keeps the final hidden states (blocks x block,
    hidden) for echo scoring."""

    def __init__(self, block_size: int, keep_hidden: bool):
        self.block_size, self.keep_hidden = block_size, keep_hidden
        self.k = self.v = self.h = None
        # Echo scores (last stage), per pool position: logprob of the next token of the same block
        # (a block's last position: unused, its next token lies in whichever block follows), the top
        # logprobs (``top_k`` wide); per block, how many top logprobs it holds (-1: not scored).
        self.lp = self.top_v = self.top_i = None
        self.top_k = 0
        self.scored: list[int] = []
        # Chunked prefill (last stage): (slot, row) -> final hidden states of the positions of a prompt's
        # unfinished last block computed so far, for the pass that completes and saves the block
        self.tails: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.shape[2] // self.block_size

    def resize(self, blocks: int, like_k: torch.Tensor, hidden: int, dtype: torch.dtype | None = None) -> None:
        """Grow to ``blocks`` keeping the content, or drop everything for 0 (the cache tensor
        ``like_k`` (layers, rows, kv_heads, cols, head_dim) gives shapes, dtype and device; the
        hidden states are kept in ``dtype``, default like_k's: the compute dtype of an int8 cache)."""
        if blocks == 0 or blocks < self.capacity:  # a reset (rank 0 dropped every block), maybe growing again
            self.k = self.v = self.h = self.lp = self.top_v = self.top_i = None
            self.scored, self.top_k = [], 0
            if blocks == 0:
                return
        layers, _, kvh, _, d = like_k.shape
        k = zeroed((layers, kvh, blocks * self.block_size, d), like_k.dtype, like_k.device)
        v = zeroed(k.shape, k.dtype, k.device)
        h = like_k.new_zeros(blocks * self.block_size, hidden, dtype=dtype) if self.keep_hidden else None
        n = self.capacity * self.block_size
        if n:
            k[:, :, :n], v[:, :, :n] = self.k, self.v
            if h is not None:
                h[:n] = self.h
        self.k, self.v, self.h = k, v, h
        if self.keep_hidden:
            self._resize_scores(blocks * self.block_size, self.top_k, h.device)
            self.scored += [-1] * (blocks - len(self.scored))

    def _resize_scores(self, positions: int, top_k: int, device) -> None:
        """(Re)allocate the echo score tables for ``positions`` and ``top_k``, keeping their content."""
        lp = torch.zeros(positions, device=device)
        top_v = torch.zeros(positions, top_k, device=device)
        top_i = torch.zeros(positions, top_k, dtype=torch.long, device=device)
        if self.lp is not None:  # a block keeps what it held (its ``scored`` width stays valid)
            n, k = min(positions, self.lp.shape[0]), self.top_k
            lp[:n], top_v[:n, :k], top_i[:n, :k] = self.lp[:n], self.top_v[:n], self.top_i[:n]
        self.lp, self.top_v, self.top_i, self.top_k = lp, top_v, top_i, top_k

    def _runs(self, blocks: list[int], tokens: int):
        """(first token in the row, first pool position, length) per run of consecutive blocks,
        covering the row's first ``tokens`` positions."""
        bs, start = self.block_size, 0
        i = 0
        while i < len(blocks) and start < tokens:
            j = i + 1
            while j < len(blocks) and blocks[j] == blocks[j - 1] + 1:
                j += 1
            n = min((j - i) * bs, tokens - start)
            yield start, blocks[i] * bs, n
            start, i = start + n, j

    def load(self, cache, row: int, blocks: list[int], cached: int) -> None:
        """Copy the first ``cached`` tokens of ``blocks`` into columns 0.. of cache row ``row``."""
        for at, pos, n in self._runs(blocks, cached):
            cache.k[:, row, :, at : at + n] = self.k[:, :, pos : pos + n]
            cache.v[:, row, :, at : at + n] = self.v[:, :, pos : pos + n]

    def save(self, cache, row: int, saves: list[list[int]], h: torch.Tensor | None, offset: int) -> None:
        """Keep block ``b`` of cache row ``row`` in pool block ``bid`` for each [b, bid]; ``h``: the
        row's final hidden states from prompt position ``offset`` on (last stage)."""
        bs = self.block_size
        for b, bid in saves:
            self.k[:, :, bid * bs : (bid + 1) * bs] = cache.k[:, row, :, b * bs : (b + 1) * bs]
            self.v[:, :, bid * bs : (bid + 1) * bs] = cache.v[:, row, :, b * bs : (b + 1) * bs]
            if self.h is not None and h is not None:
                assert b * bs >= offset, "a block begun by an earlier chunk needs its hidden states (chunk_hidden)"
                self.h[bid * bs : (bid + 1) * bs] = h[b * bs - offset : (b + 1) * bs - offset]
            if self.keep_hidden:
                self.scored[bid] = -1  # new content: not scored yet

    def save_pass(self, slot: int, prefill: list, cache, out: torch.Tensor | None) -> None:
        """Keep the blocks each prompt of a pass saves (its :class:`~pipeline.runtime.messages.Prefill` items'
        ``save``); the last stage keeps their final hidden states too (``out``: (b, t, hidden), from
        each prompt's first computed token). A block whose first positions an earlier chunk computed
        gets those from what that chunk kept (:meth:`chunk_hidden`)."""
        for i, p in enumerate(prefill):
            h, start = (out[i] if out is not None else None), p.cached
            if h is not None and (p.partial or p.resumed):
                h, start = self.chunk_hidden((slot, p.row), h, p.cached, p.len, p.resumed, p.partial)
            if p.save:
                self.save(cache, p.row, p.save, h, start)

    def chunk_hidden(self, key: tuple[int, int], h: torch.Tensor, start: int, end: int, resumed: bool,
                     partial: bool) -> tuple[torch.Tensor, int]:
        """Last stage: the final hidden states ``h`` (t >= end - start, hidden) of prompt positions
        ``start..end-1`` of the row ``key`` = (slot, row), preceded by those of the same block that the
        prompt's previous chunk kept (``resumed``); keeps those of its own unfinished last block when
        more chunks follow (``partial``). Returns (hidden states, the prompt position of the first)."""
        h = h[: end - start]
        held = self.tails.pop(key, None) if resumed else None
        if held is not None and start - held.shape[0] == start // self.block_size * self.block_size:
            h, start = torch.cat([held, h]), start - held.shape[0]
        first = end // self.block_size * self.block_size  # the unfinished block's first position
        if partial and start <= first < end:
            self.tails[key] = h[first - start :].clone()
        return h, start

    def forget(self, slots: list[int]) -> None:
        """Released slots' rows keep no hidden states for chunks that will not come."""
        for key in [k for k in self.tails if k[0] in slots]:
            del self.tails[key]

    def hidden(self, blocks: list[int], cached: int) -> torch.Tensor:
        """Final hidden states of the first ``cached`` prompt tokens held in ``blocks``."""
        return torch.cat([self.h[pos : pos + n] for _, pos, n in self._runs(blocks, cached)])

    # -- echo scores (last stage) ----------------------------------------------------------------
    def scores(self, blocks: list[int], cached: int, k: int):
        """Stored (logprob of the next token, top values, top ids) for the first ``cached`` positions,
        or None unless every block they cover holds scores with at least ``k`` top logprobs. A block's
        last position's logprob is not stored (the caller computes it: its next token is not the block's)."""
        bs = self.block_size
        if self.lp is None or any(self.scored[b] < k for b in blocks[: -(-cached // bs)]):
            return None
        runs = list(self._runs(blocks, cached))
        lp = torch.cat([self.lp[pos : pos + n] for _, pos, n in runs])
        if not k:
            return lp, None, None
        return (lp, torch.cat([self.top_v[pos : pos + n, :k] for _, pos, n in runs]),
                torch.cat([self.top_i[pos : pos + n, :k] for _, pos, n in runs]))

    def put_scores(self, blocks: list[tuple[int, int]], lp: torch.Tensor, top_v, top_i, k: int) -> None:
        """Keep the scores of whole blocks: [(block index in the prompt, pool block)]; ``lp[j]`` is
        prompt position ``j``'s logprob of token ``j + 1`` (top_v/top_i its top ``k``)."""
        bs = self.block_size
        blocks = [(b, bid) for b, bid in blocks if (b + 1) * bs <= lp.shape[0] + 1 and self.scored[bid] < k]
        if not blocks:
            return
        if k > self.top_k:
            self._resize_scores(self.lp.shape[0], k, self.lp.device)
        for b, bid in blocks:
            n = min(bs, lp.shape[0] - b * bs)  # a prompt's final block: its last position predicts nothing
            self.lp[bid * bs : bid * bs + n] = lp[b * bs : b * bs + n]
            if k:
                self.top_v[bid * bs : bid * bs + n, :k] = top_v[b * bs : b * bs + n]
                self.top_i[bid * bs : bid * bs + n, :k] = top_i[b * bs : b * bs + n]
            self.scored[bid] = k
