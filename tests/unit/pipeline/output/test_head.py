"""The last stage's head on its own: a request's prompts may enter in any order and still come out
as one result that echoes the original request."""

import torch

from pipeline.output.head import Head
from pipeline.runtime.messages import Admission, Prefill
from pipeline.models.decoder import Segment
from tasks.requests import Params
from tests.utils import local_tokenizer, stage_chain


def test_prompts_of_one_request_admitted_in_any_order(llama_2l):
    (stage,) = stage_chain(llama_2l, [(0, 2)])
    tok = local_tokenizer()
    head = Head(stage, tok, {tok.eos_token_id}, "m", 42)
    raw = {"prompt": ["first prompt", "second"], "max_tokens": 0, "echo": True}
    params = Params(max_tokens=0, echo=True)
    ids = [tok(p)["input_ids"] for p in raw["prompt"]]
    # prompt 1 enters first (another micro-batch, say); only prompt 0's admission carries the request
    for row, i in ((0, 1), (1, 0)):
        head.admit(0, Admission(10 + i, 5, i, 2, ids[i], params, "completion", None, None, [row],
                                raw=raw if i == 0 else None), slot_rows=2)
        x = torch.tensor([ids[i]])
        h = stage(x, Segment(torch.tensor([row]), torch.zeros(1, dtype=torch.long), x.shape[1], x.shape[1],
                             fresh=True), stage.new_cache(2, 8))
        head.on_pass(0, [], None, [Prefill(10 + i, row, len(ids[i]))], h)
    ((index, line),) = head.answers.take().results
    assert index == 5 and line["request"] == raw
    assert [c["text"] for c in line["result"]["choices"]] == raw["prompt"]
