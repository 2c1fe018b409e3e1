"""A request's way in, before the pipeline thread sees it: per-request caps, then tokenizing on worker
threads (each with its own copy of the tokenizer), so nothing a client sends makes the pipeline thread
wait. Refused without tokenizing: more prompts than ``--max-prompts-per-request``, more rows than
``--max-pending-rows``, and a prompt whose text cannot fit the context window whatever its tokens (a
token covers at most ``max_token_bytes`` bytes, the longest entry of the vocabulary).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pipeline.loading.tokenizer import own_copy
from pipeline.runtime.sources import rows_of
from tasks.requests import Request
from tasks.protocol import RequestError

WORKERS = 2  # tokenizing threads (HF fast tokenizers release the GIL while they encode)


@dataclass(frozen=True)
class Caps:
    max_prompts: int  # --max-prompts-per-request
    max_rows: int  # --max-pending-rows: one request can never need more
    context: int  # the model's context window in tokens
    max_token_bytes: int  # bytes of text one token covers at most (0: unknown, no text check)
    truncate: bool  # --truncate-prompts: over-long prompts are cut, not refused


def check_caps(req: Request, caps: Caps) -> None:
    """RequestError (400) for a request refused before tokenizing."""
    if len(req.prompts) > caps.max_prompts:
        raise RequestError(f"{len(req.prompts)} prompts in one request; this server takes at most {caps.max_prompts} "
                           "(--max-prompts-per-request): split the request", "prompt")
    rows = rows_of(req)
    if rows > caps.max_rows:
        raise RequestError(f"this request needs {rows} rows (prompts x best_of), more than this server holds at once "
                           f"(--max-pending-rows {caps.max_rows}): send fewer prompts or a lower n/best_of", "prompt")
    if caps.truncate or not caps.max_token_bytes:
        return
    room = caps.context - req.params.max_tokens
    for prompt in req.prompts:
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            least = len(prompt)  # token ids
        else:
            least = -(-text_bytes(prompt) // caps.max_token_bytes)
        if least > room:
            raise RequestError(
                f"the prompt has at least {least} tokens, and with max_tokens {req.params.max_tokens} it exceeds the "
                f"model's context window of {caps.context} tokens; shorten the prompt or lower max_tokens",
                "messages" if req.kind == "chat" else "prompt", reason="context_window")


def text_bytes(prompt) -> int:
    """UTF-8 bytes of a prompt's text: a string, or a chat's message contents (strings or text parts)."""
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8", "surrogatepass"))
    total = 0
    for m in prompt if isinstance(prompt, list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            total += len(content.encode("utf-8", "surrogatepass"))
        elif isinstance(content, list):
            total += sum(text_bytes(p.get("text", "")) for p in content if isinstance(p, dict))
    return total


def max_token_bytes(tokenizer) -> int:
    """The most bytes of text one token of this tokenizer stands for (an upper bound: byte-level and
    SentencePiece vocabularies spell some bytes with longer characters); 0 when it cannot be read."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without a readable vocabulary: no text check
        return 0
    return max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=0)


class Tokenizing:
    """A few worker threads, each with its own copy of the tokenizer, running ``encode(req, tok)``."""

    def __init__(self, tokenizer, encode, workers: int = WORKERS):
        self.tokenizer, self.encode = tokenizer, encode
        self.local = threading.local()
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="tokenize")

    def _tok(self):
        """This worker thread's copy of the tokenizer (made on its first use)."""
        if not hasattr(self.local, "tok"):
            self.local.tok = own_copy(self.tokenizer)
        return self.local.tok

    async def __call__(self, req: Request) -> list[list[int]]:
        """Every prompt's token ids; RequestError when a prompt cannot be tokenized (no chat template, ...)."""
        return await self.call(lambda tok: self.encode(req, tok))

    async def call(self, fn):
        """``fn(tokenizer)`` on a worker thread, with that thread's copy of the tokenizer (/tokenize, /detokenize)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, lambda: fn(self._tok()))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
