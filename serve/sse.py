"""Server-sent events in OpenAI's chunk format for ``stream: true``: a chunk per text delta (with its
tokens' logprobs when asked; a thinking chat row's reasoning in ``delta.reasoning_content``, as vLLM),
then per choice the rest of its text and logprobs and its finish_reason, so a choice's chunks join to
exactly the non-streamed answer; then the usage chunk when asked and ``data: [DONE]``.
"""

from __future__ import annotations

import orjson

from pipeline.output.results import chat_logprobs


def event(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"


class ChunkMaker:
    def __init__(self, chat: bool, model: str, rid: str, created: int):
        self.chat, self.model, self.rid, self.created = chat, model, rid, created
        self.sent: dict[int, str] = {}  # choice index -> text sent so far
        self.reasoning_sent: dict[int, str] = {}  # choice index -> reasoning sent so far (a thinking chat row)
        self.lp_sent: dict[int, int] = {}  # choice index -> tokens whose logprobs were sent
        self.started: set[int] = set()

    def _chunk(self, choices: list[dict], usage=None) -> bytes:
        obj = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices}
        if self.chat:
            obj["system_fingerprint"] = None
        if usage is not None:
            obj["usage"] = usage
        return event(obj)

    def _choice(self, index: int, text: str, finish=None, logprobs=None, reasoning: str = "") -> dict:
        if not self.chat:
            return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}
        delta = {}
        if index not in self.started:
            self.started.add(index)
            delta["role"] = "assistant"
        if reasoning:  # a thinking model's reasoning apart from its answer, as vLLM streams it
            delta["reasoning_content"] = reasoning
        if text or not reasoning:
            delta["content"] = text
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def delta(self, index: int, text: str, logprobs: dict | None = None, reasoning: str = "") -> bytes:
        """Text produced while the request runs; ``logprobs`` (completion format) of its tokens;
        ``reasoning``: a thinking chat row's reasoning, apart from its answer."""
        self.sent[index] = self.sent.get(index, "") + text
        self.reasoning_sent[index] = self.reasoning_sent.get(index, "") + reasoning
        if logprobs is not None:
            self.lp_sent[index] = self.lp_sent.get(index, 0) + len(logprobs["tokens"])
            if self.chat:
                logprobs = chat_logprobs(logprobs)
        return self._chunk([self._choice(index, text, logprobs=logprobs, reasoning=reasoning)])

    def final(self, result: dict, include_usage: bool) -> list[bytes]:
        """The rest of every choice, with the logprobs of its tokens not sent yet and its finish_reason;
        then usage when asked."""
        out = []
        for c in result["choices"]:
            i = c["index"]
            text = c["message"]["content"] if self.chat else c["text"]
            sent = self.sent.get(i, "")
            rest = text[len(sent):] if text.startswith(sent) else ""  # deltas are a prefix by construction
            reasoning = (c["message"].get("reasoning_content") or "") if self.chat else ""
            rsent = self.reasoning_sent.get(i, "")
            rrest = reasoning[len(rsent):] if reasoning.startswith(rsent) else ""
            choice = self._choice(i, rest, c["finish_reason"], _rest(c.get("logprobs"), self.lp_sent.get(i, 0)), rrest)
            if "starved" in c:  # why the thinking left no answer (pipeline.output.reasoning)
                choice["starved"] = c["starved"]
            out.append(self._chunk([choice]))
        if include_usage:
            out.append(self._chunk([], usage=result["usage"]))
        out.append(DONE)
        return out


def _rest(logprobs: dict | None, k: int) -> dict | None:
    """Logprobs (completion or chat format) without their first ``k`` tokens."""
    if logprobs is None or not k:
        return logprobs
    if "content" in logprobs:
        return {**logprobs, "content": logprobs["content"][k:]}
    return {key: (v[k:] if isinstance(v, list) else v) for key, v in logprobs.items()}
