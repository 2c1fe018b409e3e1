"""Structured outputs end to end, in one process (``--in-process``; file mode at P = 1, 2 and 3 with the
default model): every constrained row that finished with "stop" parses and validates (jsonschema / re
/ the grammar), with greedy and seeded sampling, n/best_of, stop strings, logprobs and the prefix cache
(a shared preamble); a schema that cannot compile and one that runs out of --grammar-timeout are
error lines, the other lines are answered. The default model is close to random: valid outputs come
from the masks alone. LoRA rows and base rows, constrained, in one file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.config.cores import usable_cores
from tests.structured_cases import LABEL, check, request_lines
from tests.unit.pipeline.models.test_lora import make_adapter
from tests.utils import read_jsonl, run_local

PREAMBLE = "You are a careful assistant. You answer in exactly the format you are asked for, nothing else. "
BAD = {"prompt": "x", "max_tokens": 8, "structured_outputs": {"json": {"type": "no-such-type"}}}
SLOW = {"prompt": "x", "max_tokens": 8,  # ~3-4 s to compile on a 2-core EPYC; the limit is 1 s
        "structured_outputs": {"json": {"enum": [f"word{i}x{i * 7 % 13}" for i in range(100_000)]}}}


def lines(slow: bool) -> list[tuple[dict, str | None]]:
    out = []
    for body, kind in request_lines(free=2, max_tokens=64):
        out.append(({**body, "prompt": PREAMBLE + body["prompt"], "temperature": 0}, kind))
    for body, kind in request_lines(free=0, max_tokens=64):  # seeded sampling, n/best_of, logprobs
        out.append(({**body, "temperature": 0.9, "seed": 11, "n": 2, "best_of": 3, "logprobs": 2}, kind))
    for body, kind in request_lines(free=0, max_tokens=64, chat=True)[:4]:  # chat, as Batch API lines
        out.append(({"custom_id": f"chat-{kind}", "method": "POST", "url": "/v1/chat/completions",
                     "body": {**body, "temperature": 0}}, kind))
    # a stop string still ends the text: the output is then the grammar's prefix, never checked
    out.append(({"prompt": "Label:", "max_tokens": 40, "temperature": 0, "stop": ['",'],
                 "structured_outputs": {"json": LABEL}}, "cut"))
    out += [(BAD, "error"), (SLOW, "error")] if slow else [(BAD, "error")]
    return out


def choices_of(line: dict) -> list[dict]:
    return line["result"]["choices"] if "result" in line else line["response"]["body"]["choices"]


def text_of(choice: dict) -> str:
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_constrained_outputs_are_valid(tmp_path, stages):
    cases = lines(slow=stages == 1)
    data = tmp_path / "structured.jsonl"
    data.write_text("".join(json.dumps(body) + "\n" for body, _ in cases))
    # P = 1 on every core: no core is free for a mask thread, so masks are computed on the step (and at
    # P = 2, 3 on one thread each where the stages take every core; on more cores, on a thread)
    threads = usable_cores() if stages == 1 else 1
    args = ["--infer-data", str(data), "--output-path", str(tmp_path / "out.jsonl"), "--no-progress",
            "--num-threads", str(threads), "--grammar-timeout", "1"]
    p = run_local(args, stages)
    assert p.returncode == 0, p.stderr[-3000:]
    out = read_jsonl(tmp_path / "out.jsonl")
    assert len(out) == len(cases)
    stopped = constrained = rows = 0
    for (body, kind), line in zip(cases, out):
        rows += body.get("best_of", 1) if kind not in (None, "error") else 0
        if kind == "error":
            assert line["error"] is not None and "result" not in line, line
            continue
        assert line.get("error") is None, line["error"]
        for c in choices_of(line):
            if kind in (None, "cut"):
                continue
            constrained += 1
            assert c["finish_reason"] in ("stop", "length")
            if c["finish_reason"] == "stop":
                stopped += 1
                check(kind, text_of(c))
    errors = [line["error"]["message"] for (_, kind), line in zip(cases, out) if kind == "error"]
    assert "cannot be compiled" in errors[0]
    if stages == 1:
        # a grammar too big to compile in time: the time limit, or the library's own size limit first
        assert "did not compile within 1 s" in errors[1] or "cannot be compiled" in errors[1], errors[1]
    assert stopped >= constrained // 2, (stopped, constrained)  # the check above is not vacuous
    cut = out[[k for _, k in cases].index("cut")]
    assert choices_of(cut)[0]["finish_reason"] == "stop" and '",' not in choices_of(cut)[0]["text"]
    summary = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    s = summary["structured"]
    assert s["constrained_rows"] == rows and s["grammars_compiled"] >= 9 and s["mask_seconds"] > 0
    on_thread = threads * stages < usable_cores()
    # ahead: on the thread, or (P > 1) in the last rank's idle time between passes
    assert s["masks_on_thread"] == on_thread and (s["mask_ahead_seconds"] > 0) == (on_thread or stages > 1)


def test_constrained_rows_with_lora_adapters(make_llama, tmp_path):
    """Constrained rows of a LoRA adapter and of the base model in one file (P = 1): the mask applies
    to each row's own logits, whatever adapter computed them."""
    model = make_llama(num_hidden_layers=2)
    adapter = make_adapter(model, tmp_path / "a1", ["q_proj", "v_proj"], seed=1)
    cases = [({**body, "temperature": 0, **({"model": "a1"} if i % 2 else {})}, kind)
             for i, (body, kind) in enumerate(request_lines(free=1, max_tokens=48))]
    data = tmp_path / "lora.jsonl"
    data.write_text("".join(json.dumps(body) + "\n" for body, _ in cases))
    p = run_local(["--model-name", model, "--lora", f"a1={adapter}", "--infer-data", str(data), "--output-path",
                   str(tmp_path / "out.jsonl"), "--no-progress", "--num-threads", "1"])
    assert p.returncode == 0, p.stderr[-3000:]
    out = read_jsonl(tmp_path / "out.jsonl")
    stopped = 0
    for i, ((body, kind), line) in enumerate(zip(cases, out)):
        assert line["result"]["model"] == ("a1" if i % 2 else Path(model).name)
        c = line["result"]["choices"][0]
        if kind is not None and c["finish_reason"] == "stop":
            check(kind, c["text"])
            stopped += 1
    assert stopped >= 3
    # one thread on a host with more cores: masks computed ahead, on a thread
    s = json.loads((tmp_path / "out.jsonl.summary.json").read_text())["structured"]
    assert s["masks_on_thread"] == (usable_cores() > 1)
